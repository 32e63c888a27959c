"""The launcher's files in the run_dir: ``launch.lock`` (one launcher per run_dir) and ``launch.json`` (its pids).

``launch.json`` is written atomically by the running launcher and removed when it ends; ``status``,
``report``, ``chaos`` and the demo read it (:func:`checked_state`: a ``running`` log whose launcher's processes are
all gone reads ``stopped (no live process)``). The lock is an exclusive ``flock`` held for the launcher's whole life.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import psutil

from discovery.record import check_name
from elastictrain.errors import LaunchError
from elastictrain.rundir import layout
from elastictrain.rundir.events import Lifecycle


class RunDirLock:
    """The exclusive ``flock`` on ``run_dir/launch.lock`` that makes one launcher the only driver of a run_dir.

    The lock belongs to the open file, which the launcher keeps until it exits (children never inherit it:
    the descriptor is close-on-exec), so it ends with the launcher however that ends, SIGKILL included.

    On a local filesystem this is exact. On NFS, Linux implements ``flock`` with the server's byte-range
    locks (NLM for NFSv3, the protocol's own locks for NFSv4), so two launchers on two machines exclude
    each other as long as the mount has locking (not ``nolock`` or ``local_lock=flock|all``, which keep
    locks on one client). When the launcher's machine dies or is cut off from the server, the server
    frees the lock only after the client's lease runs out (NFSv4: about 90 s) or its lock manager
    recovers; a launcher cut off longer than that may have lost its lock without knowing.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: Path) -> RunDirLock:
        """Take the lock (creating run_dir and the lock file if needed); :class:`LaunchError` naming the
        holder when another launcher has it. Nothing else in run_dir is read or written."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / layout.LAUNCH_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LaunchError(f"run_dir {run_dir}: cannot lock {path.name}: {e.strerror}") from None
            raise LaunchError(
                f"run_dir {run_dir} is driven by a live launcher ({_describe_holder(holder)}); "
                "stop it first or use another run_dir"
            ) from None
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}) + "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the file ends the flock
            self.fd = -1


def _describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {int(info['pid'])} on {check_name('host', info['host'])}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


# -- the read side: is the launcher that wrote launch.json still alive?

NO_LIVE_PROCESS = "stopped (no live process)"


def _launch_pids(state: dict[str, Any]) -> list[int]:
    raw: list[Any] = [state.get("pid"), state.get("etcd_pid"), state.get("horovodrun_pid")]
    agents = state.get("agents")
    if isinstance(agents, dict):
        raw += list(agents.values())
    return [p for p in raw if isinstance(p, int) and not isinstance(p, bool) and p > 0]


def _alive_as_recorded(pid: int, created: Any) -> bool:
    """``pid`` runs and was created when launch.json says (so it is not a reused pid); zombies are dead."""
    if not isinstance(created, int | float) or isinstance(created, bool):
        return False
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - float(created)) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def launch_liveness(run_dir: Path) -> tuple[bool | None, str]:
    """(live, why) from ``run_dir/launch.json``: live None when it cannot be told from this host."""
    path = run_dir / layout.LAUNCH_STATE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"unknown: no {layout.LAUNCH_STATE}"
    except (OSError, ValueError) as e:
        return None, f"unknown: {layout.LAUNCH_STATE} unreadable ({type(e).__name__})"
    if not isinstance(state, dict):
        return None, f"unknown: {layout.LAUNCH_STATE} is not an object"
    host, created = state.get("host"), state.get("create_times")
    if not isinstance(host, str) or not isinstance(created, dict):
        return None, f"unknown: {layout.LAUNCH_STATE} has no host/create_times"
    if host != socket.gethostname():
        return None, f"unknown: {layout.LAUNCH_STATE} was written on host {host}; its pids are not checked here"
    pids = _launch_pids(state)
    live = [p for p in pids if _alive_as_recorded(p, created.get(str(p)))]
    if live:
        return True, f"live: pid {', '.join(map(str, live))} on {host}"
    return False, f"no live process: pids {', '.join(map(str, pids)) or '-'} in {layout.LAUNCH_STATE} are gone"


def checked_state(state: str, run_dir: Path) -> tuple[str, bool | None, str | None]:
    """(state, live, liveness): a ``running`` state checked against ``launch.json`` (:func:`launch_liveness`);
    ``stopped (no live process)`` when none of its processes is alive. Other states are returned as they are."""
    if state != Lifecycle.RUNNING:
        return state, None, None
    live, why = launch_liveness(run_dir)
    return (NO_LIVE_PROCESS if live is False else state), live, why
