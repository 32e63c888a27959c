"""The asynchronous checkpointer that rank 0's training loop calls.

Lifecycle: build one :class:`Checkpointer` per job (rank 0 only), call :meth:`Checkpointer.save` at
each trigger with the committed state, ``save(..., if_busy="wait")`` for the final and the
preemption (SIGTERM) save, and :meth:`Checkpointer.close` before the process leaves.

``save`` returns after the snapshot: it copies every tensor into buffers that are allocated once and
reused (shared memory, page-locked when the state lives on a GPU) and hands the rest to a background
thread, which (re)starts the writer process when needed; the writer serialises, writes,
verifies-by-construction (SHA-256 while streaming), commits the manifest, moves ``latest`` and prunes.

At most one save is in flight, and there is a single set of buffers, so a snapshot never overwrites
buffers a writer is still reading. A ``save`` that arrives while the previous one is still writing
is **skipped** by default (counted in ``stats.skipped``, logged, reported as ``checkpoint_skipped``):
for periodic saves that is what users want, since waiting would stall training for the rest of a
disk write (the issue's invariant 5) only to produce a checkpoint a few steps newer than the one
being written; the cadence simply adapts to what the disk sustains. Saves that must not be lost (at
the end of training, on SIGTERM) pass ``if_busy="wait"``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from elastictrain.checkpoint.async_writer import (
    InlineWriter,
    ProcessWriter,
    WriteJob,
    WriterDied,
    prestart_forkserver,
)
from elastictrain.checkpoint.snapshot import SharedPool, SnapshotBuffers
from elastictrain.checkpoint.storage import CheckpointStorage
from elastictrain.logconf import get_logger


def _log() -> Any:
    """A fresh logger per call, so structlog configuration changes (and tests' capture_logs) apply."""
    return get_logger("elastictrain.checkpoint")


WriterKind = Literal["process", "thread", "sync"]
EventCallback = Callable[[str, dict[str, Any]], None]
_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_EXIT_DRAIN_SECONDS = 60.0


@dataclass(slots=True)
class CheckpointStats:
    """Counters for metrics. Read a copy through :attr:`Checkpointer.stats`."""

    saves: int = 0
    """Snapshots taken and handed to the writer."""
    succeeded: int = 0
    failures: int = 0
    """Saves that did not produce a checkpoint (snapshot error, write error, writer died), plus writer
    deaths noticed while idle."""
    skipped: int = 0
    """``save`` calls skipped because the previous save was still writing."""
    writer_restarts: int = 0
    last_step: int | None = None
    """Step of the newest checkpoint this checkpointer committed."""
    last_path: str | None = None
    last_stall_seconds: float = 0.0
    last_write_seconds: float = 0.0


@dataclass(slots=True)
class _Pending:
    job: WriteJob
    pool: SharedPool
    """The buffers ``job`` refers to; the writer must hold them."""
    events: list[Any]
    stall_seconds: float
    submitted: float


class Checkpointer:
    """Asynchronous, at-most-one-in-flight checkpoint saves to a :class:`CheckpointStorage`.

    ``writer``: ``"process"`` (default; a separate writer process), ``"thread"`` (a background
    thread in this process) or ``"sync"`` (``save`` writes before returning; for tests and tools).
    ``on_event(name, fields)`` receives ``checkpoint`` (success), ``checkpoint_failed`` and
    ``checkpoint_skipped``; with the process and thread writers it is called from the checkpointer's
    background thread, so it must be quick and thread-safe. An exception in it is logged and ignored.
    Use from one thread (the training loop); ``close`` it (or use it as a context manager).

    ``pin_memory``: page-lock the buffers when the state has CUDA tensors (``None``: yes when CUDA
    allows). ``copy_threads``: threads for the CPU snapshot memcpy (default ``min(4, cpu_count)``;
    they only run during ``save``). ``writer_nice``: niceness of the writer process, so that on a
    small machine the training loop wins the CPU. Building a process-mode checkpointer starts the
    fork server once (torch is imported there: 1-2 s, much longer on loaded cores); ``wait_for_writer``:
    wait for that here, else return at once (a worker that takes rank 0 after a reset, while every other
    worker waits for it). Either way ``save`` never waits for it: the writer process is started by the
    background thread that hands it the save.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        keep_last: int | None = 3,
        writer: WriterKind = "process",
        on_event: EventCallback | None = None,
        pin_memory: bool | None = None,
        copy_threads: int | None = None,
        writer_nice: int = 10,
        wait_for_writer: bool = True,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        if writer not in ("process", "thread", "sync"):
            raise ValueError(f"writer must be 'process', 'thread' or 'sync', got {writer!r}")
        self.storage = storage
        self.keep_last = keep_last
        self.mode: WriterKind = writer
        self._on_event = on_event
        self._buffers = SnapshotBuffers(pin_memory=pin_memory, copy_threads=copy_threads)
        self._writer: ProcessWriter | InlineWriter = (
            ProcessWriter(storage, nice=writer_nice) if writer == "process" else InlineWriter(storage)
        )
        self._stats = CheckpointStats()
        self._cond = threading.Condition()
        self._queued: _Pending | None = None
        self._pending: _Pending | None = None
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if writer == "process":
            prestart_forkserver(wait=wait_for_writer)
        _LIVE.add(self)

    # ----------------------------------------------------------------------------------- queries
    @property
    def in_flight(self) -> bool:
        """Whether a save has been handed to the writer and not yet reported."""
        with self._cond:
            return self._pending is not None

    @property
    def in_flight_step(self) -> int | None:
        """Step of the save handed to the writer and not yet reported, if any."""
        with self._cond:
            return self._pending.job.step if self._pending is not None else None

    @property
    def stats(self) -> CheckpointStats:
        with self._cond:
            return dataclasses.replace(self._stats)

    @property
    def writer_pid(self) -> int | None:
        """Pid of the writer process (``process`` mode; None until the background thread of the first save
        started it); for tests and diagnostics."""
        return self._writer.pid

    # ----------------------------------------------------------------------------------- protocol
    def save(
        self,
        state: dict[str, Any],
        *,
        step: int,
        epoch: int,
        world_size: int,
        config_hash: str,
        meta: dict[str, Any] | None = None,
        if_busy: Literal["skip", "wait"] = "skip",
    ) -> float:
        """Snapshot ``state`` now and write it in the background; return the training-thread stall (s).

        Call with the committed state at a checkpoint trigger. ``state`` is a nested dict/list/tuple
        of tensors (CPU or CUDA) and small picklable values; it may be modified as soon as this
        returns. ``meta`` (JSON-serialisable) goes into the manifest. When the previous save is still
        writing, ``if_busy="skip"`` returns at once and counts a skip; ``"wait"`` waits for it first.
        Never raises for a failed save: failures are logged, counted and reported via ``on_event``.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("Checkpointer.save() called after close()")
        if if_busy not in ("skip", "wait"):
            raise ValueError(f"if_busy must be 'skip' or 'wait', got {if_busy!r}")
        if self.in_flight:
            if if_busy == "skip":
                return self._skip(step, t0)
            self.wait()
        try:
            meta = dict(meta or {})
            json.dumps(meta)
            snapshot, events = self._buffers.snapshot(state)
            pool = self._buffers.pool
            assert pool is not None
            job = WriteJob(snapshot, step, epoch, world_size, config_hash, meta, self.keep_last)
        except Exception as e:
            stall = time.perf_counter() - t0
            self._report_failure(step, f"snapshot failed: {type(e).__name__}: {e}", stall)
            return stall
        stall = time.perf_counter() - t0
        pending = _Pending(job, pool, events, stall, time.perf_counter())
        with self._cond:
            self._stats.saves += 1
        if self.mode == "sync":
            self._execute(pending, sync_started=t0)
            return time.perf_counter() - t0
        with self._cond:
            self._pending = self._queued = pending
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._monitor, name="elastictrain-checkpoint", daemon=True)
            self._thread.start()
        return stall

    def save_and_wait(
        self,
        state: dict[str, Any],
        *,
        step: int,
        epoch: int,
        world_size: int,
        config_hash: str,
        meta: dict[str, Any] | None = None,
        attempts: int = 2,
    ) -> bool:
        """Make sure the checkpoint of ``step`` is written; True once it is, False when it could not be.

        Call at the end of training and on SIGTERM, with the last committed state. Waits for a save in
        flight (which may be this very step); writes ``step`` unless this checkpointer already wrote
        it, retrying a failed write up to ``attempts`` times in all. Never skips: the answer says
        whether ``latest`` now names ``step``'s checkpoint as far as this checkpointer knows.
        """
        self.wait()
        for _ in range(max(1, attempts)):
            if self.stats.last_step == step:
                return True
            self.save(
                state,
                step=step,
                epoch=epoch,
                world_size=world_size,
                config_hash=config_hash,
                meta=meta,
                if_busy="wait",
            )
            self.wait()
        return self.stats.last_step == step

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the in-flight save (if any) is written and reported; False on timeout.

        Call before reading the checkpoint back, and at the end of training.
        """
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drain the in-flight save, then stop the writer. Call once, before the process leaves.

        With ``timeout`` (seconds), a save still writing after it is abandoned (the writer process
        is killed and a failure reported); ``latest`` keeps naming the previous checkpoint.
        """
        if self._closed:
            return
        self._closed = True
        if not self.wait(timeout):
            _log().error("checkpoint_close_timeout", timeout_seconds=timeout, mode=self.mode)
            if self.mode != "process":
                return  # a thread cannot be killed; it is a daemon and dies with the process
            self._writer.kill()
            self.wait(30)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(30)
        self._writer.stop()
        self._buffers.close()
        _LIVE.discard(self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- internals
    def _skip(self, step: int, t0: float) -> float:
        with self._cond:
            self._stats.skipped += 1
            skipped = self._stats.skipped
            busy_step = self._pending.job.step if self._pending is not None else None
        fields = {"step": step, "in_flight_step": busy_step, "skipped": skipped}
        _log().warning("checkpoint_skipped", reason="the previous save is still writing", **fields)
        self._emit("checkpoint_skipped", fields)
        return time.perf_counter() - t0

    def _monitor(self) -> None:
        while True:
            with self._cond:
                while self._queued is None and not self._stopping:
                    self._cond.wait()
                pending, self._queued = self._queued, None
            if pending is None:
                return
            try:
                self._execute(pending)
            finally:
                with self._cond:
                    self._pending = None
                    self._cond.notify_all()

    def _execute(self, p: _Pending, sync_started: float | None = None) -> None:
        try:
            # (Re)starting the writer process is this thread's work, never the training thread's: a fork server
            # still importing torch (a rank 0 taken over after a reset) would stall every worker in the ring.
            died = self._writer.ensure(p.pool)
            if died is not None:
                with self._cond:
                    self._stats.writer_restarts += 1
                self._report_failure(None, f"{died}; restarted it", 0.0)
            for ev in p.events:
                ev.synchronize()  # device-to-host copies of CUDA tensors are complete
            result = self._writer.run(p.job)
        except WriterDied as e:
            with self._cond:
                self._stats.writer_restarts += 1
            self._report_failure(p.job.step, f"{e}; it is restarted on the next save", p.stall_seconds)
            return
        except Exception as e:
            self._report_failure(p.job.step, f"{type(e).__name__}: {e}", p.stall_seconds)
            return
        stall = p.stall_seconds if sync_started is None else time.perf_counter() - sync_started
        fields = {
            "path": result.path,
            "step": p.job.step,
            "stall_seconds": stall,
            "write_seconds": result.write_seconds,
            "total_seconds": time.perf_counter() - p.submitted,
            "bytes": result.bytes,
            "pruned": list(result.pruned),
            "ok": True,
        }
        with self._cond:
            s = self._stats
            s.succeeded += 1
            s.last_step, s.last_path = p.job.step, result.path
            s.last_stall_seconds, s.last_write_seconds = stall, result.write_seconds
        _log().info("checkpoint_saved", **fields)
        self._emit("checkpoint", fields)

    def _report_failure(self, step: int | None, error: str, stall: float) -> None:
        with self._cond:
            self._stats.failures += 1
            failures = self._stats.failures
        fields = {"step": step, "error": error, "stall_seconds": stall, "failures": failures, "ok": False}
        _log().error("checkpoint_failed", **fields)
        self._emit("checkpoint_failed", fields)

    def _emit(self, name: str, fields: dict[str, Any]) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(name, fields)
        except Exception as e:
            _log().error("checkpoint_event_callback_failed", event_name=name, error=repr(e))


@atexit.register
def _drain_at_exit() -> None:
    """A checkpointer nobody closed still gets its in-flight save finished (bounded) at exit."""
    for ckpt in list(_LIVE):
        try:
            ckpt.close(timeout=_EXIT_DRAIN_SECONDS)
        except Exception as e:  # pragma: no cover - best effort at interpreter exit
            _log().error("checkpoint_close_at_exit_failed", error=repr(e))


__all__ = ["CheckpointStats", "Checkpointer", "EventCallback", "WriterKind"]
