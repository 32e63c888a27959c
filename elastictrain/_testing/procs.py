"""Process helpers of the job harness: polling with a deadline, killing a process tree by pid.

Private (see :mod:`elastictrain._testing`): the tests, their fixtures and the benchmarks use these.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from elastictrain.errors import ToolError

T = TypeVar("T")

BIN_DIR = Path(sys.executable).parent
"""Where ``horovodrun`` and ``elastictrain`` live: next to this Python (the virtual environment)."""


class HarnessError(ToolError, RuntimeError):
    """The job harness could not do what it was asked (a wait timed out, a job ended early, no such worker).

    The first line is the message; a job's log tail may follow it.
    """


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` seconds pass (HarnessError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and all its descendants (found with psutil), ignoring ones already gone."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [*proc.children(recursive=True), proc]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    psutil.wait_procs(procs, timeout=10)
