"""A tiny Horovod elastic worker for tests: one allreduce per step, rank 0 records the world size.

Usage: python elastic_recorder.py RECORD_FILE STOP_FILE

Each committed step appends ``{"step", "size", "host", "pid"}`` to RECORD_FILE (rank 0 only, one
``write`` per line). When STOP_FILE exists, every rank agrees (an allreduce) and returns, so
horovodrun exits 0.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import horovod.torch as hvd
import torch
from horovod.common.elastic import ObjectState

STEP_SECONDS = 0.2


def main(record_file: str, stop_file: str) -> int:
    hvd.init()
    state = ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, step=0)

    @hvd.elastic.run
    def train(state: ObjectState) -> None:
        while True:
            flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
            if hvd.allreduce(flag, op=hvd.Max, name="stop").item() > 0:
                return
            if hvd.rank() == 0:
                line = json.dumps({"step": state.step, "size": hvd.size(), "host": socket.gethostname(),
                                   "pid": os.getpid()})  # fmt: skip
                with open(record_file, "a") as f:
                    f.write(line + "\n")
            state.step += 1
            time.sleep(STEP_SECONDS)
            state.commit()

    train(state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
