"""A checkpoint storage whose state-file writes wait for a gate file: a save held mid-write, on purpose.

Picklable and importable by the checkpoint writer process (it receives the storage it writes to).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from elastictrain.checkpoint.storage import LocalStorage


class GatedStorage(LocalStorage):
    """``LocalStorage`` that, when writing a state file, touches ``<gate>.writing`` and waits (up to
    ``hold_seconds``) until ``gate`` exists before the file is committed."""

    def __init__(self, root: str | Path, gate: str | Path, hold_seconds: float = 120.0) -> None:
        super().__init__(root)
        self.gate = Path(gate)
        self.hold_seconds = hold_seconds

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with super().open_write(path) as f:
            yield f
            if path.rsplit("/", 1)[-1].startswith("state"):
                self.gate.with_name(self.gate.name + ".writing").touch()
                deadline = time.monotonic() + self.hold_seconds
                while not self.gate.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
