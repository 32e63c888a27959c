"""The run's event log, ``run_dir/events.jsonl``: event names, one frozen dataclass per event, writer, reader.

This module is the only place that knows the log's format (docs/events.md is generated from it by
``scripts/gen_events_doc.py``; a unit test keeps the two equal). Everything that writes or reads the log
goes through it:

- **Names**: :class:`EventKind`. **Records**: a frozen dataclass per kind (:class:`Start`, :class:`Reset`, ...),
  all with the common header ``ts``, ``step``, ``epoch``, ``world_size`` (:class:`Event`). Fields added after
  a log was written are ``None`` when it is read back, so every kind-specific field is optional.
- **Writer**: rank 0 owns an :class:`EventLog`; every other rank gets a :class:`NullEventLog` from
  :func:`open_event_log`, so the worker calls ``events.emit(Reset(...))`` without testing its rank.
  ``emit`` serialises the line on the caller's thread (:func:`encode`, microseconds) and enqueues it; a
  background thread appends it with one ``write`` of the whole line, so the training thread never waits
  on the disk. ``close`` drains the queue and fsyncs.
- **Reader**: :func:`read_events` validates each untrusted line (:func:`parse_event`) and returns typed
  events; :func:`lifecycle` and :func:`training_completed` (of a file: :func:`training_completed_in`) answer the
  questions the launcher, ``status`` and the chaos checks ask of a log.

Import-light on purpose (no torch): the launcher and ``status`` import it.

Size: the whole run-log contract (names, records, writer, reader) in one module (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import queue
import threading
import time
import types
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from elastictrain.errors import InputError
from elastictrain.logconf import get_logger
from elastictrain.rundir import layout

if TYPE_CHECKING:
    from elastictrain.rundir.outbox import Outbox

log = get_logger("elastictrain.rundir.events")


class EventKind(enum.StrEnum):
    """The ``event`` value of a line: one per dataclass below."""

    START = "start"
    FAILURE = "failure"
    RESET = "reset"
    COMMIT = "commit"
    METRICS = "metrics"
    EPOCH_END = "epoch_end"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    DONE = "done"
    TRACKING_CLOSED = "tracking_closed"
    STOPPED = "stopped"
    STRAGGLER = "straggler"
    EVICTION = "eviction"
    SHARES = "shares"
    PREEMPTION_CHECKPOINT = "preemption_checkpoint"


def _doc(text: str) -> Any:
    """A kind-specific field: optional (``None`` when an older writer left it out), documented by ``text``."""
    return field(default=None, metadata={"doc": text})


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """The header every line has. Subclasses add their fields in the order they are written."""

    KIND: ClassVar[EventKind]
    WHEN: ClassVar[str]
    step: int
    """Global optimizer steps completed."""
    epoch: int
    """0-based epoch."""
    world_size: int
    """Workers in the job when the event was written."""
    ts: float = field(default_factory=time.time)
    """Unix seconds; taken when the event is built unless given (a ``failure`` written later gives its own)."""

    @property
    def name(self) -> str:
        return self.KIND.value

    def fields(self) -> dict[str, Any]:
        """The kind-specific fields, in the order they are written."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _HEADER}

    def to_record(self) -> dict[str, Any]:
        """The JSON object of the line: ``ts``, ``event``, ``step``, ``epoch``, ``world_size``, then the fields."""
        record: dict[str, Any] = {
            "ts": self.ts,
            "event": self.KIND.value,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
        }
        record.update(self.fields())
        return record


_HEADER = ("ts", "step", "epoch", "world_size")


@dataclass(frozen=True, kw_only=True, slots=True)
class Start(Event):
    KIND = EventKind.START
    WHEN = (
        "the job starts or resumes training (once per launch of the workers; a new rank 0 after a reset writes a"
        " `reset`, not a `start`)"
    )
    hosts: list[str] | None = field(default=None, metadata={"doc": "list of host names"})
    resumed_from_step: int | None = _doc("int or null")
    resumed_world_size: int | None = _doc(
        "the world size of the checkpoint resumed from, or null; a resume at another size is a `start`, never a `reset`"
    )
    config_hash: str | None = _doc("")
    run_id: str | None = _doc(
        "MLflow; at a job's start rank 0 waits up to `tracking.open_wait_seconds` for it, so it is null only when"
        " tracking is off, the store did not answer in time, or this process became rank 0 in a reset"
    )
    attempt: int | None = _doc("launcher relaunch count, 0 first")


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure(Event):
    KIND = EventKind.FAILURE
    WHEN = (
        "a collective failed (HorovodInternalError) or a host change was announced; one per `reset`, just before"
        " it. Written by the process that holds rank 0 after the recovery (the one that saw it may be dead), with"
        " `ts` the failure's time (the failed step's start, or when the notice arrived) and `world_size` the size"
        " before it"
    )
    reason: str | None = _doc("`worker_failed` \\| `worker_hung` \\| `hosts_removed` \\| `hosts_changed`")
    error: str | None = _doc(
        "first line of Horovod's error (for `worker_hung`: which peer, for how long, what was done); empty for a notice"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Reset(Event):
    KIND = EventKind.RESET
    WHEN = "training continues after a membership change"
    recovery_seconds: float | None = _doc("from the failure/notice to the first completed step at the new size")
    hosts: list[str] | None = field(default=None, metadata={"doc": ""})
    old_size: int | None = _doc("")
    new_size: int | None = _doc("")
    reason: str | None = _doc("as in `failure`")
    lost_steps: int | None = _doc("optimizer steps rolled back: 0 with `elastic.rollback: none`")
    detect_seconds: float | None = _doc("part of the recovery: from the failure/notice to the step being left")
    rendezvous_seconds: float | None = _doc(
        "part: Horovod's reset (hvd.shutdown + hvd.init: the driver's assignment, the rendezvous, the Gloo contexts)"
    )
    sync_seconds: float | None = _doc("part: the state sync from the most advanced rank (0 when skipped)")
    prologue_seconds: float | None = _doc("part: the training function's start (reset plan, rank-0 services)")
    first_step_seconds: float | None = _doc("part: the first step at the new size (the parts are rank 0's view)")

    def fields(self) -> dict[str, Any]:
        out = Event.fields(self)
        for part in RESET_PARTS:  # a part not measured is left out, as lines were before these fields
            if out[part] is None:
                del out[part]
        return out


RESET_PARTS = ("detect_seconds", "rendezvous_seconds", "sync_seconds", "prologue_seconds", "first_step_seconds")
"""The fields of a ``reset`` that split its ``recovery_seconds`` (:data:`elastictrain.engine.reset.PAUSE_PARTS`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Commit(Event):
    KIND = EventKind.COMMIT
    WHEN = "an in-memory commit"
    commit_seconds: float | None = _doc("")


@dataclass(frozen=True, kw_only=True, slots=True)
class Metrics(Event):
    KIND = EventKind.METRICS
    WHEN = "every `training.log_every_steps` steps"
    steps: int | None = _doc("steps in the interval")
    loss: float | None = _doc("")
    lr: float | None = _doc("")
    samples_per_sec: float | None = _doc("")
    step_seconds: float | None = _doc("mean over the interval")
    commit_seconds: float | None = _doc("the last in-memory commit's duration")
    slowest_host: str | None = _doc("the host with the highest compute-time ratio (`straggler`); null until judged")
    slowest_ratio: float | None = _doc("its median compute time per step / the other hosts' median")

    def fields(self) -> dict[str, Any]:
        out = Event.fields(self)
        if self.slowest_host is None:  # left out until a host is judged, as lines were before these fields
            del out["slowest_host"], out["slowest_ratio"]
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochEnd(Event):
    KIND = EventKind.EPOCH_END
    WHEN = "end of an epoch"
    epoch_seconds: float | None = _doc("")
    val_loss: float | None = _doc("null without validation")
    val_accuracy: float | None = _doc("null without validation")
    val_metrics: Mapping[str, float | None] = field(
        default_factory=dict,
        metadata={"doc": "the task's other validation metrics, one field each", "wire": "val_<name>"},
    )
    """Other ``val_*`` values keyed by their full field name; flattened into the line when written."""

    def fields(self) -> dict[str, Any]:
        out = {"epoch_seconds": self.epoch_seconds, "val_loss": self.val_loss, "val_accuracy": self.val_accuracy}
        out.update((k, v) for k, v in self.val_metrics.items() if k not in out)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint(Event):
    KIND = EventKind.CHECKPOINT
    WHEN = "a checkpoint became `latest`"
    path: str | None = _doc("")
    stall_seconds: float | None = _doc("training-thread stall")
    write_seconds: float | None = _doc("")
    total_seconds: float | None = _doc("from the save's start to `latest`")
    bytes: int | None = _doc("size written")
    pruned: list[str] | None = field(default=None, metadata={"doc": "older checkpoints removed"})
    ok: bool | None = _doc("true")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointFailed(Event):
    KIND = EventKind.CHECKPOINT_FAILED
    WHEN = "a save failed"
    error: str | None = _doc("")
    stall_seconds: float | None = _doc("")
    failures: int | None = _doc("count so far")
    ok: bool | None = _doc("false")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSkipped(Event):
    KIND = EventKind.CHECKPOINT_SKIPPED
    WHEN = "a save was due while the previous one was still writing; it is skipped"
    in_flight_step: int | None = _doc("step of the save still writing")
    skipped: int | None = _doc("count so far")


@dataclass(frozen=True, kw_only=True, slots=True)
class Done(Event):
    KIND = EventKind.DONE
    WHEN = "training complete"
    final_loss: float | None = _doc("")
    val_accuracy: float | None = _doc("")
    checkpointed: bool | None = _doc(
        "bool: the final checkpoint of the last commit was written; null when checkpoints are off"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackingClosed(Event):
    KIND = EventKind.TRACKING_CLOSED
    WHEN = "rank 0 closed its MLflow sender (end of the process)"
    run_id: str | None = _doc("")
    dropped: int | None = _doc("points that could not be sent: server slow or down")


@dataclass(frozen=True, kw_only=True, slots=True)
class Stopped(Event):
    KIND = EventKind.STOPPED
    WHEN = "a worker left before completion (SIGTERM)"
    signal: str | None = _doc("")
    checkpointed: bool | None = _doc("bool: the last commit was checkpointed; false when it could not be")


@dataclass(frozen=True, kw_only=True, slots=True)
class Straggler(Event):
    KIND = EventKind.STRAGGLER
    WHEN = (
        "rank 0 named a host slow (its median compute time per step >= `elastic.slow_ratio` x the other hosts' median"
        " over `elastic.window_steps`), or a host it had named is no longer slow"
    )
    host: str | None = _doc("")
    rank: int | None = _doc("the host's first rank now")
    slow: bool | None = _doc("true: named slow; false: no longer slow")
    ratio: float | None = _doc("its median compute seconds per step / the others' median")
    compute_seconds: float | None = _doc("its median compute seconds per step (step start to gradients ready)")
    others_seconds: float | None = _doc("the other hosts' median compute seconds per step")
    data_seconds: float | None = _doc("its median data-loading wait per step")
    window_steps: int | None = _doc("steps in its window when judged")


@dataclass(frozen=True, kw_only=True, slots=True)
class Eviction(Event):
    KIND = EventKind.EVICTION
    WHEN = (
        "with `elastic.stragglers: evict`, rank 0 decided about a slow host: `drain` it (through etcd, as a spot"
        " notice), or `keep` it (the job is not predicted faster without it, or it would fall below min_np). A hung"
        " peer is a `failure` with reason `worker_hung` instead"
    )
    host: str | None = _doc("")
    action: str | None = _doc("`drain` \\| `keep`")
    reason: str | None = _doc("`straggler`; for `keep`, why")
    ratio: float | None = _doc("as in `straggler`")
    samples_per_sec_now: float | None = _doc("predicted throughput at the current size, with the slow host")
    samples_per_sec_without: float | None = _doc("predicted throughput one host smaller, without it")
    min_np: int | None = _doc("")
    cooldown_seconds: float | None = _doc("how long the host stays out (doubles with each earlier eviction)")
    evictions: int | None = _doc("evictions of this host so far, this one included")
    error: str | None = _doc("why the drain could not be written to etcd, if it could not")


@dataclass(frozen=True, kw_only=True, slots=True)
class Shares(Event):
    KIND = EventKind.SHARES
    WHEN = (
        "with `elastic.stragglers: balance`, the hosts' shares of a step changed (they follow the measured speeds),"
        " written at the commit from which they apply"
    )
    global_batch: int | None = _doc("samples per step over all workers")
    shares: dict[str, int] | None = field(
        default=None, metadata={"doc": "samples per step of each host (all its workers), summing to `global_batch`"}
    )
    speeds: dict[str, float] | None = field(
        default=None, metadata={"doc": "each host's smoothed samples per second, per worker"}
    )
    reason: str | None = _doc("why they changed")


@dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionCheckpoint(Event):
    KIND = EventKind.PREEMPTION_CHECKPOINT
    WHEN = (
        "rank 0 read preemption notices in the host records that leave the job unable to go on (every host noticed,"
        " or fewer than min_np slots left) and saved the last commit before the earliest notice's end: at each commit"
        " while the notices stand, waiting for the save within 30 s of the end"
    )
    hosts: list[str] | None = field(default=None, metadata={"doc": "the hosts with a notice"})
    deadline: float | None = _doc("Unix time of the earliest notice's end")
    seconds_left: float | None = _doc("seconds until then, at this commit")
    slots_left: int | None = _doc("slots on ready hosts with no notice (fewer than min_np)")
    waited: bool | None = _doc("true: rank 0 waited for the save; false: it runs in the background")
    checkpointed: bool | None = _doc("when waited: the commit is durable (the `checkpoint` event says when otherwise)")


EVENT_TYPES: dict[EventKind, type[Event]] = {
    cls.KIND: cls
    for cls in (
        Start,
        Failure,
        Reset,
        Commit,
        Metrics,
        EpochEnd,
        Checkpoint,
        CheckpointFailed,
        CheckpointSkipped,
        Done,
        TrackingClosed,
        Stopped,
        Straggler,
        Eviction,
        Shares,
        PreemptionCheckpoint,
    )
}
"""Every event kind and its dataclass, in the order docs/events.md lists them."""

E = TypeVar("E", bound=Event)

_CHECKPOINTER_KINDS = (EventKind.CHECKPOINT, EventKind.CHECKPOINT_FAILED, EventKind.CHECKPOINT_SKIPPED)


def checkpoint_event(name: str, fields: Mapping[str, Any], *, step: int, epoch: int, world_size: int) -> Event:
    """The run-log event of a :class:`~elastictrain.checkpoint.Checkpointer` report ``on_event(name, fields)``:
    at the save's ``step`` when the report names one (else ``step``), with the fields the event defines."""
    kind = EventKind(name)
    if kind not in _CHECKPOINTER_KINDS:
        raise ValueError(f"{name!r} is not a checkpointer event ({', '.join(_CHECKPOINTER_KINDS)})")
    cls = EVENT_TYPES[kind]
    own = {f.name for f in dataclasses.fields(cls)} - set(_HEADER)
    at = fields.get("step")
    return cls(
        step=at if isinstance(at, int) else step,
        epoch=epoch,
        world_size=world_size,
        **{k: v for k, v in fields.items() if k in own},
    )


def of_kind(events: Iterable[Event], kind: type[E]) -> list[E]:
    """The events of one kind, in order: ``of_kind(events, Reset)``."""
    return [e for e in events if isinstance(e, kind)]


# ------------------------------------------------------------------------------------------------ writer
class EventSink(Protocol):
    """What the worker calls; :class:`EventLog` on rank 0, :class:`NullEventLog` elsewhere."""

    def emit(self, event: Event) -> None: ...

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


def encode(event: Event) -> bytes:
    """One line of events.jsonl (with its newline). Unknown types are written as ``str(value)``."""
    record = event.to_record()
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

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
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

    def emit(self, event: Event) -> None:
        """Record ``event`` (its ``ts`` was taken when it was built, or given for an earlier happening)."""
        line = encode(event)
        with self._cond:
            if self._closed:
                log.debug("event_after_close", event_name=event.name)
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

    def emit(self, event: Event) -> None:
        pass

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = 10.0) -> None:
        pass


class OutboxEventLog:
    """The event log of rank 0 when the workers share no disk with the launcher: each line goes to the process's
    :class:`~elastictrain.rundir.outbox.Outbox` (whose thread puts it in etcd; :meth:`emit` returns at once), and
    the launcher's collector appends it to its ``events.jsonl``."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self._closed = False

    def emit(self, event: Event) -> None:
        if self._closed:
            log.debug("event_after_close", event_name=event.name)
            return
        self.outbox.append(layout.EVENTS, encode(event))

    def flush(self, timeout: float | None = None) -> bool:
        return self.outbox.flush(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Wait (at most ``timeout``) until every line is in etcd; the outbox itself stays open for the others."""
        self._closed = True
        if not self.outbox.flush(timeout):
            log.warning("events_close_timed_out", transport="etcd")


def open_event_log(
    run_dir: str | os.PathLike[str], rank: int, outbox: Outbox | None = None
) -> EventLog | OutboxEventLog | NullEventLog:
    """Rank 0's event log (``run_dir/events.jsonl``, or through ``outbox`` when given); a :class:`NullEventLog` on
    every other rank."""
    if rank != 0:
        return NullEventLog()
    return OutboxEventLog(outbox) if outbox is not None else EventLog(Path(run_dir) / layout.EVENTS)


# ------------------------------------------------------------------------------------------------ reader
class EventError(InputError):
    """A parsed line that is not a usable event; the message says why (one line)."""


def _conforms(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits a field's annotation (int is never bool; float accepts int; finite only)."""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, arg) for arg in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin in (dict, Mapping):
        _, item = typing.get_args(tp)
        return isinstance(value, dict) and all(_conforms(v, item) for v in value.values())
    if isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, tp)


_HINTS: dict[type[Event], dict[str, Any]] = {
    cls: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)} for cls in EVENT_TYPES.values()
}


def parse_event(record: object) -> Event:
    """The typed event of one parsed line; raises :class:`EventError` naming the first problem.

    Checked: a JSON object whose ``event`` is a known kind, ``ts`` a finite number, ``step``, ``epoch``,
    ``world_size`` integers, and every kind-specific field of its documented type or null. Keys the kind
    does not define are ignored (a newer writer's additions); ``val_*`` keys of an ``epoch_end`` are its
    ``val_metrics``.
    """
    if not isinstance(record, dict):
        raise EventError("not a JSON object")
    name = record.get("event")
    if not isinstance(name, str):
        raise EventError("event must be a string")
    try:
        cls = EVENT_TYPES[EventKind(name)]
    except ValueError:
        raise EventError(f"unknown event {ascii(name)[:40]}") from None
    ts = record.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise EventError(f"ts must be a finite number, got {ascii(ts)[:40]}")
    values: dict[str, Any] = {"ts": float(ts)}
    for key in ("step", "epoch", "world_size"):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise EventError(f"{key} must be an integer, got {ascii(value)[:40]}")
        values[key] = value
    hints = _HINTS[cls]
    for key, tp in hints.items():
        if key in values or key not in record:
            continue
        value = record[key]
        if not _conforms(value, tp):
            raise EventError(f"{name}.{key} has the wrong type: {ascii(value)[:40]}")
        values[key] = float(value) if tp == float | None and isinstance(value, int) else value
    if cls is EpochEnd:
        extra = {k: v for k, v in record.items() if k.startswith("val_") and k not in hints}
        if not _conforms(extra, hints["val_metrics"]):
            raise EventError(f"{name}: a val_* field is not a number")
        values["val_metrics"] = extra
    return cls(**values)


def event_problem(record: object) -> str | None:
    """Why a parsed line is not a usable event (:func:`parse_event`), or None."""
    try:
        parse_event(record)
    except EventError as e:
        return str(e)
    return None


def parse_events(lines: Iterable[bytes], on_skip: Callable[[int, str], None], *, first_line: int = 1) -> list[Event]:
    """The events of complete lines (no torn tail), reporting each unusable one as ``on_skip(line, reason)``."""
    events: list[Event] = []
    for i, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            continue
        try:
            events.append(parse_event(json.loads(raw)))
        except (ValueError, UnicodeDecodeError) as e:
            on_skip(i, str(e) if isinstance(e, EventError) else "not JSON")
    return events


def read_events(path: str | os.PathLike[str], on_skip: Callable[[int, str], None] | None = None) -> list[Event]:
    """Every well-formed event of ``path`` in file order.

    A line that does not parse (the final line of a writer that was killed mid-write, or a line an
    old writer left half-written before a relaunch) is skipped; one that is not the last is also
    reported. A line that parses but is not a usable event (:func:`parse_event`) is skipped and always
    reported. ``on_skip(line_number, reason)`` receives each report (default: a structlog warning).
    Raises ``FileNotFoundError`` when the file does not exist.
    """
    if on_skip is None:

        def on_skip(line: int, reason: str) -> None:
            log.warning("events_malformed_line", path=str(path), line=line, reason=reason)

    lines = Path(path).read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    events = parse_events(lines[:-1], on_skip)
    if lines:  # the last line may be a torn write in progress: skipped silently when it is not JSON
        report = on_skip

        def tail_skip(line: int, reason: str) -> None:
            if reason != "not JSON":
                report(line, reason)

        events += parse_events(lines[-1:], tail_skip, first_line=len(lines))
    return events


# ------------------------------------------------------------------------------------------------ queries
class Lifecycle(enum.StrEnum):
    """Where a job stands by its log: the last ``start``/``done``/``stopped`` decides."""

    NOT_STARTED = "not_started"
    """No event at all."""
    RUNNING = "running"
    """The last lifecycle event is a ``start`` (or none yet): running, or crashed without a word."""
    DONE = "done"
    STOPPED = "stopped"


_LIFECYCLE = {EventKind.START: Lifecycle.RUNNING, EventKind.DONE: Lifecycle.DONE, EventKind.STOPPED: Lifecycle.STOPPED}


def lifecycle(events: Sequence[Event]) -> Lifecycle:
    """The job's state by its log; events after the last lifecycle event (``tracking_closed``,
    a ``failure`` with its ``reset``) do not change it."""
    if not events:
        return Lifecycle.NOT_STARTED
    for e in reversed(events):
        if e.KIND in _LIFECYCLE:
            return _LIFECYCLE[e.KIND]
    return Lifecycle.RUNNING


def training_completed(events: Sequence[Event]) -> bool:
    """Whether the log says training completed: its last lifecycle event is ``done``."""
    return lifecycle(events) is Lifecycle.DONE


def training_completed_in(events_path: Path) -> bool:
    """:func:`training_completed` of the run log at ``events_path``; False when it cannot be read."""
    try:
        return training_completed(read_events(events_path, on_skip=lambda line, reason: None))
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ docs
def markdown_table() -> str:
    """The event table of docs/events.md, built from the dataclasses (``scripts/gen_events_doc.py``)."""
    rows = ["| event | when | fields |", "|---|---|---|"]
    for kind, cls in EVENT_TYPES.items():
        parts = []
        for f in dataclasses.fields(cls):
            if f.name in _HEADER:
                continue
            doc = f.metadata.get("doc", "")
            parts.append(f"`{f.metadata.get('wire', f.name)}`" + (f" ({doc})" if doc else ""))
        rows.append(f"| `{kind.value}` | {cls.WHEN} | {', '.join(parts)} |")
    return "\n".join(rows) + "\n"
