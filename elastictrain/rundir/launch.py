"""The launcher's files in the run_dir: ``launch.lock`` (one launcher per run_dir) and ``launch.json`` (its pids).

``launch.json`` is written atomically by the running launcher and removed when it ends; ``status``,
``chaos`` and the demo read it. The lock is an exclusive ``flock`` held for the launcher's whole life.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from discovery.record import check_name
from elastictrain.launcher.errors import LaunchError
from elastictrain.rundir import layout


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
