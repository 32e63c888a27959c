"""A child process that dies with its parent: the parent-death signal (Linux ``prctl``) and a parent check.

``PR_SET_PDEATHSIG`` makes the kernel signal a process when the thread that forked it exits (SIGKILL and
OOM of the parent included). It is per thread of the parent and can be armed only after the fork, so a
parent that died before the ``prctl`` is missed: callers check the parent too (``os.getppid()`` changed).
No-op where ``prctl`` does not exist.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

PR_SET_PDEATHSIG = 1

_LIBC: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        # Loaded at import, before any fork: a ``preexec_fn`` may call prctl but must not dlopen.
        _LIBC = ctypes.CDLL(None, use_errno=True)


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits; False where unsupported.

    Safe in a ``preexec_fn`` (between fork and exec): it only calls ``prctl``.
    """
    if _LIBC is None:
        return False
    try:
        return int(_LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except AttributeError:
        return False
