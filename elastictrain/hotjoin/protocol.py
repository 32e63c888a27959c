"""Hot join's protocol, shared by both ends: where a zygote listens, its warming marker, the framing and the request.

One AF_UNIX stream connection per worker; each message is a 4-byte big-endian length and JSON. The client sends
``{"args": [...], "env": {...}, "cwd": "...", "prefix": "...", "path0": "...", "path": [...]}`` (``args``: what
follows ``train``; ``prefix``: its ``sys.prefix``; ``path0`` and ``path``: the cold command's first ``sys.path``
entry, or null, and the entries after it) with its fds 0, 1 and 2 attached (SCM_RIGHTS); :func:`valid_request` is
what the zygote accepts. The zygote answers ``{"pid": N}`` and later ``{"exit": code}`` (negative: killed by that
signal), or ``{"error": "..."}`` instead of the pid.

Standard library and elastictrain's import-light core only: the client imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from discovery.wire import DEFAULT_PREFIX, host_key
from elastictrain import envnames
from elastictrain.errors import ElastictrainError

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs the client milliseconds
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

DIR_ENV = envnames.ZYGOTE_DIR
MAX_MESSAGE = 1 << 20
CONNECT_TIMEOUT_SECONDS = 5.0
"""How long a client waits to connect, and then for the answer to its request."""
ANSWER_SECONDS = 4.0
"""How long after it accepted a connection the zygote answers it (a pid or an error) or drops it: less than
:data:`CONNECT_TIMEOUT_SECONDS`, so that a client never waits on a connection the zygote gave up."""
WARMING_WAIT_SECONDS = 20.0
"""How long after a warm-up began a client still waits for that zygote instead of starting its worker cold (a
warm-up takes 3-4 s of CPU here; one that takes much longer is stuck, or its agent gave up on it)."""
WARMING_POLL_SECONDS = 0.05
READY_LINE = "zygote ready"
CHECKER_NAME = "zygote-check"
"""The name (``/proc/<pid>/comm``) of the zygote's checker process: a child of the zygote that is not a worker."""


class ProtocolError(ElastictrainError):
    """A peer sent something that is not a message of this protocol."""


def socket_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or f"/tmp/elastictrain-zygote-{os.getuid()}")


def check_folder(folder: Path) -> None:
    """``folder`` must be a real directory (not a link) owned by us with mode 0700: anyone else who could
    place the socket could read every client's environment and streams, or answer for the zygote."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{folder} must be a directory owned by uid {os.getuid()} with mode 0700")


def peer_uid(sock: socket.socket) -> int:
    return int(struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1])


def socket_path(job: str, host: str, etcd: str = "", prefix: str = "") -> Path:
    """Where the zygote of ``job`` on ``host`` listens, for the job whose agent registers the host in the etcd at
    ``etcd`` (comma-separated endpoints) under ``prefix`` (default ``/elastictrain``): two jobs of one name and host
    with their own etcd never share a zygote. Short: AF_UNIX paths have a 107-byte limit."""
    endpoints = ",".join(sorted({e.strip().rstrip("/") for e in etcd.split(",")} - {""}))
    registration = f"{endpoints}\n{host_key(prefix or DEFAULT_PREFIX, job, host)}"  # names hold no newline
    return socket_dir() / f"{hashlib.sha256(registration.encode()).hexdigest()[:20]}.sock"


def client_socket_path(env: Mapping[str, str]) -> Path | None:
    """The socket of the zygote that serves a worker whose environment is ``env`` (horovodrun's: the job, the host
    and the etcd of its agents); None when ``env`` names no job or host."""
    job, host = env.get(envnames.JOB, ""), env.get("HOROVOD_HOSTNAME", "")
    if not (job and host):
        return None
    return socket_path(job, host, env.get(envnames.ETCD, ""), env.get(envnames.ETCD_PREFIX, ""))


def warming_path(path: Path) -> Path:
    """The marker a zygote keeps beside its socket's ``path`` while it warms."""
    return path.with_name(f"{path.stem}.warming")


def _start_time(pid: int) -> int | None:
    """The start time of the live process ``pid`` (clock ticks since boot), or None: gone, or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()  # the name may hold anything
        return None if fields[0] in (b"Z", b"X", b"x") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def mark_warming(path: Path) -> str | None:
    """Write this process's warming marker for the socket ``path`` (atomically) and return what it holds; None when
    it could not be written (clients then start cold while we warm, as without a marker)."""
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_folder(folder)
    started = _start_time(os.getpid())
    if started is None:
        return None
    mark = f"{os.getpid()} {started} {time.time():.3f}"
    tmp = folder / f".{path.stem}.{os.getpid()}.tmp"
    try:
        tmp.write_text(mark)
        os.replace(tmp, warming_path(path))
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return None
    return mark


def unmark_warming(path: Path, mark: str | None) -> None:
    """Remove the warming marker of ``path`` if it is still the one this process wrote (``mark``)."""
    with contextlib.suppress(OSError):
        if mark is not None and warming_path(path).read_text() == mark:
            warming_path(path).unlink()


def warming_since(path: Path) -> tuple[int, float] | None:
    """(pid, Unix time its warm-up began) of the zygote warming for the socket ``path``: its marker (untrusted) names
    a live process with that start time; else None."""
    try:
        with warming_path(path).open("rb") as f:
            pid_, started_, since_ = f.read(96).split()
        pid, started, since = int(pid_), int(started_), float(since_)
    except (OSError, ValueError):
        return None
    return (pid, since) if pid > 0 and _start_time(pid) == started and math.isfinite(since) else None


def send_message(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    frame = struct.pack(">I", len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:  # an empty send to a peer that already answered and closed fails with EPIPE
        sock.sendall(frame)


def recv_message(sock: socket.socket, *, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it; ``(None, [])`` on a clean end of stream. Every fd received is
    closed again when the message fails (a timeout, a malformed body)."""
    fds: list[int] = []
    try:
        return _recv_message(sock, max_fds, fds)
    except BaseException:
        close_all(fds)
        raise


def _recv_message(sock: socket.socket, max_fds: int, fds: list[int]) -> tuple[dict[str, Any] | None, list[int]]:
    buf = b""
    while len(buf) < 4:
        if max_fds and not fds:
            chunk, got, _, _ = socket.recv_fds(sock, 4 - len(buf), max_fds)
            fds += got
        else:
            chunk = sock.recv(4 - len(buf))
        if not chunk:
            if buf or fds:
                close_all(fds)
                raise ProtocolError("connection closed inside a message")
            return None, []
        buf += chunk
    size = missing(bytearray(buf))
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            close_all(fds)
            raise ProtocolError("connection closed inside a message")
        body += chunk
    return decode(body), fds


def missing(frame: bytearray) -> int:
    """How many more bytes the message that ``frame`` begins needs (0: it is complete)."""
    if len(frame) < 4:
        return 4 - len(frame)
    (size,) = struct.unpack(">I", frame[:4])
    if size > MAX_MESSAGE:
        raise ProtocolError(f"message of {size} bytes")
    return 4 + size - len(frame)


def decode(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError):
        raise ProtocolError("message is not JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError("message is not an object")
    return msg


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def path_tail(path: list[str]) -> list[str]:
    """``sys.path`` without the entry Python puts first for the script, module or command it runs."""
    return list(path if sys.flags.safe_path else path[1:])


def valid_request(msg: dict[str, Any] | None, fds: list[int]) -> dict[str, Any]:
    if msg is None:
        raise ProtocolError("no request")
    args, env, cwd = msg.get("args"), msg.get("env"), msg.get("cwd")
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ProtocolError("args must be a list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ProtocolError("env must map strings to strings")
    if not isinstance(cwd, str) or not os.path.isabs(cwd):
        raise ProtocolError("cwd must be an absolute path")
    if len(fds) != 3:
        raise ProtocolError(f"expected fds 0, 1 and 2, got {len(fds)}")
    prefix, path0, path = msg.get("prefix"), msg.get("path0"), msg.get("path")
    if not (
        isinstance(prefix, str)
        and (path0 is None or isinstance(path0, str))
        and isinstance(path, list)
        and all(isinstance(p, str) for p in path)
    ):
        raise ProtocolError("prefix, path0 and path must name the client's Python (a client of another version?)")
    return {"args": args, "env": env, "cwd": cwd, "prefix": prefix, "path0": path0, "path": path}
