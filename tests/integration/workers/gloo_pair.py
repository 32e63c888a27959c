"""A two-rank Horovod (Gloo) worker that allreduces until a collective fails: for test_gloo_protocol_error.

Usage: python gloo_pair.py FOLDER

Each rank writes ``FOLDER/rank<r>.ready`` (its pid) after 20 allreduces, and on ``HorovodInternalError``
``FOLDER/rank<r>.error`` (the error's first line), then exits 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError


def main(folder: Path) -> int:
    hvd.init()
    rank = hvd.rank()
    steps = 0
    try:
        while True:
            hvd.allreduce(torch.ones(4), name="pair")
            steps += 1
            if steps == 20:
                (folder / f"rank{rank}.ready").write_text(str(os.getpid()))
    except HorovodInternalError as e:
        (folder / f"rank{rank}.error").write_text((str(e).strip().splitlines() or [""])[0][:300] or type(e).__name__)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
