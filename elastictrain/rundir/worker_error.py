"""Why a worker failed, as a typed record the launcher reads: ``run_dir/errors/<host>-<slot>-<pid>.json``.

A worker whose training raised (the user's loss, a bad batch, a resume that does not fit the config), rather
than losing a peer (Horovod recovers from that), writes one :class:`WorkerError` before it exits: the host and
slot horovodrun gave it, its rank, pid, launch id and attempt, the time, the exception's type and the first
line of its message. When horovodrun fails, the launcher reads the records of its own launch and attempt
(:func:`read_worker_errors`) and ends with ``elastictrain launch: worker <host>[<slot>] failed: <type>:
<message>`` for the earliest, so the cause is the last line a user sees, not Horovod's traceback.

The files are untrusted input (any process that can write the run_dir can write them): every field is
validated on reading and a file that is not a valid record is skipped. Writes are atomic
(:func:`elastictrain.fileio.write_atomic`). Standard library only: the launcher imports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from discovery.record import check_name
from elastictrain import envnames
from elastictrain.errors import one_line
from elastictrain.fileio import write_atomic
from elastictrain.rundir import layout

if TYPE_CHECKING:
    from elastictrain.rundir.outbox import Outbox

MAX_RECORD_BYTES = 16 << 10
MAX_TEXT = 500


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerError:
    host: str
    """``HOROVOD_HOSTNAME``: the host as horovodrun names it."""
    slot: int
    """``HOROVOD_LOCAL_RANK``: the slot on that host."""
    rank: int | None
    """``HOROVOD_RANK`` at the worker's start (ranks change at resets)."""
    pid: int
    launch_id: str
    attempt: int
    ts: float
    type: str
    """The exception's class name."""
    message: str
    """The first line of its message (may be empty)."""

    def line(self) -> str:
        """``worker <host>[<slot>] failed: <type>: <message>``."""
        cause = f"{self.type}: {self.message}" if self.message else self.type
        return f"worker {self.host}[{self.slot}] failed: {cause}"

    @classmethod
    def from_exception(cls, e: BaseException, env: Mapping[str, str] | None = None) -> WorkerError:
        env = os.environ if env is None else env
        text = one_line(e, MAX_TEXT)
        host = env.get("HOROVOD_HOSTNAME") or os.uname().nodename
        try:
            check_name("host", host)
        except ValueError:
            host = "unknown-host"  # the record names a file: never a path or an unreadable name
        return cls(
            host=host,
            slot=max(0, _int(env.get("HOROVOD_LOCAL_RANK"), 0) or 0),
            rank=_int(env.get("HOROVOD_RANK"), None),
            pid=os.getpid(),
            launch_id=env.get(envnames.LAUNCH_ID, ""),
            attempt=max(0, _int(env.get(envnames.ATTEMPT), 0) or 0),
            ts=time.time(),
            type=type(e).__name__,
            message="".join(c if c.isprintable() else " " for c in text.partition(": ")[2]),
        )

    @classmethod
    def parse(cls, record: object) -> WorkerError:
        """A record read back; :class:`ValueError` naming the first field that is not what it must be."""
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        types: dict[str, type | tuple[type, ...]] = {"host": str, "slot": int, "rank": (int, type(None)), "pid": int,
                 "launch_id": str, "attempt": int, "ts": float, "type": str, "message": str}  # fmt: skip
        values: dict[str, Any] = {}
        for name, kind in types.items():
            value = record.get(name)
            if kind is float and type(value) is int:
                value = float(value)
            if type(value) is bool or not isinstance(value, kind):
                raise ValueError(f"{name}: {type(value).__name__} is not allowed")
            values[name] = value
        check_name("host", values["host"])
        if values["slot"] < 0 or values["pid"] <= 0 or values["attempt"] < 0 or not math.isfinite(values["ts"]):
            raise ValueError("slot, pid, attempt or ts out of range")
        if not values["type"].isidentifier():
            raise ValueError("type is not an exception class name")
        for name in ("type", "message", "launch_id"):
            if len(values[name]) > MAX_TEXT or not values[name].isprintable():
                raise ValueError(f"{name}: too long or not printable")
        return cls(**values)


def _int(value: str | None, default: int | None) -> int | None:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


OUTBOX_FLUSH_SECONDS = 3.0
"""How long a failing worker waits for its record to reach etcd (``elastic.outputs: etcd``) before it exits."""


def record_worker_error(run_dir: str | os.PathLike[str], e: BaseException, outbox: Outbox | None = None) -> Path | None:
    """Write the record of ``e`` for this worker (through ``outbox`` to the launcher's run_dir when given); the
    record's run_dir path, or None (and nothing raised) when it cannot be written: a failing worker must exit with
    its own error, not one about the run_dir."""
    err = WorkerError.from_exception(e)
    name = f"{layout.WORKER_ERRORS}/{err.host}-{err.slot}-{err.pid}.json"
    data = json.dumps(dataclasses.asdict(err)) + "\n"
    path = Path(run_dir) / name
    try:
        if outbox is not None:
            outbox.append(name, data.encode())
            return path if outbox.flush(OUTBOX_FLUSH_SECONDS) else None
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data, durable=False)
    except (OSError, ValueError):
        return None
    return path


def read_worker_errors(run_dir: str | os.PathLike[str], *, launch_id: str, attempt: int) -> list[WorkerError]:
    """The valid records of one launch's attempt, earliest first (a malformed or foreign file is skipped)."""
    folder = Path(run_dir) / layout.WORKER_ERRORS
    out: list[WorkerError] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_RECORD_BYTES + 1)
            if len(data) > MAX_RECORD_BYTES:
                continue
            err = WorkerError.parse(json.loads(data))
        except (OSError, ValueError, RecursionError):  # RecursionError: deeply nested JSON
            continue
        if err.launch_id == launch_id and err.attempt == attempt:
            out.append(err)
    return sorted(out, key=lambda e: e.ts)


HOROVOD_RECOVERABLE = frozenset({"HorovodInternalError", "HostsUpdatedInterrupt"})
"""Exceptions of a lost peer or a host change, which Horovod recovers from: a cause only when nothing else is."""


def first_cause(errors: list[WorkerError]) -> WorkerError | None:
    """The record that names the cause: the earliest exception of the worker's own code, else the earliest."""
    own = [e for e in errors if e.type not in HOROVOD_RECOVERABLE]
    return min(own or errors, key=lambda e: e.ts, default=None)
