"""Process helpers for the benchmarks: free loopback ports, polling with a deadline, killing a tree by pid."""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

BIN_DIR = Path(sys.executable).parent
"""Where ``horovodrun`` and ``elastictrain`` live: next to this Python (the virtual environment)."""


class BenchError(RuntimeError):
    """A benchmark could not run as planned (a job ended early, an event never came). One line for the user."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on ``host`` (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` seconds pass (BenchError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
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
