"""The run's event log: ``run_dir/events.jsonl``, one JSON object per line (format: docs/events.md).

Rank 0 owns an :class:`EventLog`; every other rank gets a :class:`NullEventLog` from
:func:`open_event_log`, so the worker calls ``events.emit(...)`` without testing its rank.

``emit`` serialises the line on the caller's thread (microseconds) and enqueues it; a background
thread appends it with one ``write`` of the whole line, so the training thread never waits on the
disk. ``close`` drains the queue and fsyncs. :func:`read_events` reads the file back for ``status``,
``report`` and the chaos invariants.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from elastictrain.logconf import get_logger

EVENTS_FILE = "events.jsonl"

log = get_logger("elastictrain.events")


class EventSink(Protocol):
    """What the worker calls; :class:`EventLog` on rank 0, :class:`NullEventLog` elsewhere."""

    def emit(
        self, event: str, *, step: int, epoch: int, world_size: int, ts: float | None = None, **fields: Any
    ) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = 10.0) -> None: ...


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null (nested lists and dicts included)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_finite(v) for v in value]
    return value


def encode_event(event: str, *, ts: float, step: int, epoch: int, world_size: int, fields: dict[str, Any]) -> bytes:
    """One line of events.jsonl (with its newline). Unknown types are written as ``str(value)``."""
    record: dict[str, Any] = {"ts": ts, "event": event, "step": step, "epoch": epoch, "world_size": world_size}
    for key, value in fields.items():
        if key in record:
            raise ValueError(f"event field {key!r} is reserved (ts, event, step, epoch, world_size)")
        record[key] = value
    try:
        text = json.dumps(record, allow_nan=False, separators=(",", ":"), default=str)
    except ValueError:  # a NaN or inf somewhere (a diverged loss): write null instead
        text = json.dumps(_finite(record), allow_nan=False, separators=(",", ":"), default=str)
    return (text + "\n").encode()


_STOP = object()


class EventLog:
    """Appends events to ``path`` from a background thread.

    Call :meth:`emit` from the training thread whenever something happens; it returns at once. Call
    :meth:`close` once when the worker leaves (success or error); it writes what is queued and fsyncs.
    A write error (disk full, a vanished share) is logged once and counted in ``write_errors``; the
    training never sees it.
    """

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False
        self.write_errors = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._terminate_partial_line()
        self._thread = threading.Thread(target=self._run, name="elastictrain-events", daemon=True)
        self._thread.start()
        # A worker that dies through an exception without close() still gets its queued lines written
        # (finalize runs at interpreter exit, while the daemon thread is still alive).
        self._finalizer = weakref.finalize(self, _close_at_exit, weakref.ref(self))

    def _terminate_partial_line(self) -> None:
        """A previous process killed on a network file system may have left half a line: end it."""
        try:
            size = os.fstat(self._fd).st_size
            if size == 0:
                return
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                last = f.read(1)
            if last != b"\n":
                os.write(self._fd, b"\n")
        except OSError as e:  # pragma: no cover - unreadable file; appending still works
            log.warning("events_check_failed", path=str(self.path), error=str(e))

    def emit(
        self, event: str, *, step: int, epoch: int, world_size: int, ts: float | None = None, **fields: Any
    ) -> None:
        """Record ``event`` now (``ts`` is taken here, not when the line is written; pass ``ts`` for an event
        that happened earlier, such as a failure written by the rank 0 that recovered from it)."""
        when = self._clock() if ts is None else ts
        line = encode_event(event, ts=when, step=step, epoch=epoch, world_size=world_size, fields=fields)
        with self._cond:
            if self._closed:
                log.debug("event_after_close", event_name=event)
                return
            self._pending += 1
        self._queue.put(line)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every line emitted so far is written; False if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout=timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Write what is queued, fsync and stop the thread. Safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("events_close_timed_out", path=str(self.path), pending=self._pending)
            return
        with contextlib.suppress(OSError):
            os.fsync(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._finalizer.detach()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self._write(item)
            with self._cond:
                self._pending -= 1
                if self._pending == 0:
                    self._cond.notify_all()

    def _write(self, line: bytes) -> None:
        try:
            view = memoryview(line)
            while view:  # one write in practice; a short write (rare) is completed, never interleaved
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as e:
            self.write_errors += 1
            if self.write_errors == 1:
                log.warning("events_write_failed", path=str(self.path), error=str(e))


def _close_at_exit(ref: weakref.ref[EventLog]) -> None:
    ev = ref()
    if ev is not None:
        ev.close(timeout=5.0)


class NullEventLog:
    """The event log of ranks other than 0: every call does nothing."""

    def emit(
        self, event: str, *, step: int, epoch: int, world_size: int, ts: float | None = None, **fields: Any
    ) -> None:
        pass

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = 10.0) -> None:
        pass


def open_event_log(run_dir: str | os.PathLike[str], rank: int) -> EventLog | NullEventLog:
    """``EventLog(run_dir/events.jsonl)`` on rank 0, a :class:`NullEventLog` on every other rank."""
    return EventLog(Path(run_dir) / EVENTS_FILE) if rank == 0 else NullEventLog()


def event_problem(record: object) -> str | None:
    """Why a parsed line is not a usable event, or None: ``event`` a string, ``ts`` a finite number,
    and ``step``, ``epoch`` and ``world_size`` integers where present (the fields every reader uses)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if not isinstance(record.get("event"), str):
        return "event must be a string"
    ts = record.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        return f"ts must be a finite number, got {ascii(ts)[:40]}"
    for key in ("step", "epoch", "world_size"):
        value = record.get(key)
        if key in record and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{key} must be an integer, got {ascii(value)[:40]}"
    return None


def read_events(
    path: str | os.PathLike[str], on_skip: Callable[[int, str], None] | None = None
) -> list[dict[str, Any]]:
    """Every well-formed event of ``path`` in file order.

    A line that does not parse (the final line of a writer that was killed mid-write, or a line an
    old writer left half-written before a relaunch) is skipped; one that is not the last is also
    reported. A line that parses but has fields of the wrong type (:func:`event_problem`) is skipped
    and always reported. ``on_skip(line_number, reason)`` receives each report (default: a
    structlog warning). Raises ``FileNotFoundError`` when the file does not exist.
    """
    if on_skip is None:

        def on_skip(line: int, reason: str) -> None:
            log.warning("events_malformed_line", path=str(path), line=line, reason=reason)

    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    events: list[dict[str, Any]] = []
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            if i != last:
                on_skip(i + 1, "not JSON")
            continue
        problem = event_problem(record)
        if problem is not None:
            on_skip(i + 1, problem)
            continue
        events.append(record)
    return events
