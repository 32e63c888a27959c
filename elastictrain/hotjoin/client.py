"""Hot join's thin client: ``python -m elastictrain.hotjoin.client -- COMMAND...``, what horovodrun runs for a worker.

It hands COMMAND's arguments (an ``elastictrain train``), environment, working directory and standard streams to the
warm zygote of its job and host, relays signals to the forked worker and exits as the worker exits (killed by a
signal: by the same signal). With no zygote (no socket, no answer, an ``error``) it execs COMMAND: the same worker.
While that zygote warms (a live marker, no socket yet) it says so on stderr and waits for the socket, up to
:data:`~elastictrain.hotjoin.protocol.WARMING_WAIT_SECONDS` after the warm-up began; a signal that comes meanwhile
ends the wait and then acts as on a cold worker.

Standard library and :mod:`elastictrain.hotjoin.protocol` only: it must start in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

from elastictrain.hotjoin.protocol import (
    CONNECT_TIMEOUT_SECONDS,
    WARMING_POLL_SECONDS,
    WARMING_WAIT_SECONDS,
    ProtocolError,
    check_folder,
    client_socket_path,
    path_tail,
    peer_uid,
    recv_message,
    send_message,
    warming_since,
)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs the client milliseconds
if TYPE_CHECKING:
    from typing import Any

RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    """``python -m elastictrain.hotjoin.client -- COMMAND...``: run COMMAND (an ``elastictrain train``) in the
    warm zygote of this job and host if there is one, else exec it."""
    if argv[:1] != ["--"] or len(argv) < 2:
        print(
            "elastictrain zygote client: error: usage: python -m elastictrain.hotjoin.client -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    cold = argv[1:]
    path = client_socket_path(os.environ)
    relay = _Relay()  # from here on, a signal is kept until there is a worker to give it to
    if "train" in cold and path is not None:
        sock = _request(path, cold, relay)
        if sock is not None:
            return _wait_exit(sock)
    relay.restore()
    os.execvp(cold[0], cold)
    return 127  # not reached


class _Relay:
    """Signal handlers that forward to the worker once its pid is known, and hold signals until then."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        for sig in RELAYED_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def attach(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def restore(self) -> None:
        """Default dispositions again (before exec); a signal that came meanwhile acts now."""
        for sig in RELAYED_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for signum in self.pending:
            os.kill(os.getpid(), signum)


def _connect(path: Path, relay: _Relay) -> socket.socket:
    """A connection to the zygote at ``path``; while that zygote warms (no socket yet, a live marker), the socket is
    tried again every :data:`WARMING_POLL_SECONDS` until :data:`WARMING_WAIT_SECONDS` after its warm-up began."""
    said = False
    while True:
        warming = warming_since(path)  # read before the attempt: a zygote removes its marker only once it listens
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_SECONDS)
        try:
            if relay.pending:
                raise ConnectionAbortedError("a signal came while the zygote warmed")
            sock.connect(str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if warming is None or time.time() >= warming[1] + WARMING_WAIT_SECONDS:
                raise
        except BaseException:
            sock.close()
            raise
        if not said:
            print(
                f"elastictrain zygote: waiting for the warming zygote (pid {warming[0]})", file=sys.stderr, flush=True
            )
            said = True
        time.sleep(WARMING_POLL_SECONDS)


def _request(path: Path, cold: list[str], relay: _Relay) -> socket.socket | None:
    sock = None
    try:
        check_folder(path.parent)
        sock = _connect(path, relay)
        if peer_uid(sock) != os.getuid():
            raise PermissionError("the zygote socket is served by another user")
        cwd = os.getcwd()
        request = {
            "args": cold[cold.index("train") + 1 :],
            "env": dict(os.environ),
            "cwd": cwd,
            "prefix": sys.prefix,
            "path0": cold_path0(cold, cwd),
            "path": path_tail(sys.path),  # the client's Python is the cold command's
        }
        send_message(sock, request, [0, 1, 2])
        reply, _ = recv_message(sock)
    except (OSError, ProtocolError):
        if sock is not None:
            sock.close()
        return None
    pid = reply.get("pid") if reply else None
    if type(pid) is not int or pid <= 0:
        if reply and "error" in reply:
            print(f"elastictrain zygote: starting cold ({str(reply['error'])[:200]})", file=sys.stderr)
        sock.close()
        return None
    sock.settimeout(None)
    relay.attach(pid)
    return sock


def cold_path0(cold: list[str], cwd: str) -> str | None:
    """The entry that the Python which ``cold`` starts puts first on ``sys.path``: the working directory for ``-m``,
    ``""`` for ``-c``, else the script's folder (links resolved); None under PYTHONSAFEPATH (no such entry)."""
    if sys.flags.safe_path:
        return None
    args = list(cold)
    if os.path.basename(args[0]).startswith("python"):
        args = args[1:]
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
            args = args[2:] if args[0] in ("-X", "-W") else args[1:]  # options; -X and -W take a value
        if not args or args[0] == "-c":
            return ""
        if args[0] == "-m":
            return cwd
    script = args[0]
    if os.sep not in script:  # found on PATH, as execvp finds it
        for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
            candidate = os.path.join(folder or ".", script)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                script = candidate
                break
    return os.path.dirname(os.path.realpath(os.path.join(cwd, script)))


def _wait_exit(sock: socket.socket) -> int:
    """The worker's exit code; killed by a signal: die of the same signal, as the worker did."""
    try:
        reply, _ = recv_message(sock)
    except (OSError, ProtocolError):
        reply = None
    code = reply.get("exit") if reply else None
    if type(code) is not int:
        return 1  # the zygote died: so did the worker (PR_SET_PDEATHSIG)
    if code < 0:
        if -code in RELAYED_SIGNALS:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
