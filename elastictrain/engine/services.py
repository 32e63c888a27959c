"""Rank 0's services, opened when a process takes rank 0 and closed when it hands rank 0 over or ends.

The event log, the MLflow tracker, the checkpointer, the sample ledger and the progress bar. While closed
they are null versions that do nothing, so every rank calls them the same way. Ranks move: after hosts
leave and come back, rank 0 can be another process; the old one closes its services (what it queued still
goes out; the MLflow run stays open for the new rank 0, which opens the same run), so that two processes
never write events, checkpoints or ledger files for the same steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from elastictrain.checkpoint import Checkpointer
from elastictrain.checkpoint.location import storage_for
from elastictrain.config import JobConfig
from elastictrain.engine.health.hang import gloo_timeout_seconds
from elastictrain.engine.progress import NullProgress, Progress, make_progress
from elastictrain.engine.sampler import ExactlyOncePlanner, StepLog
from elastictrain.engine.tracking import NullTracker, Tracker, make_tracker
from elastictrain.fileio import write_atomic
from elastictrain.logconf import get_logger
from elastictrain.rundir import layout
from elastictrain.rundir.events import EventSink, NullEventLog, TrackingClosed, open_event_log
from elastictrain.rundir.ledger import SampleLedger
from elastictrain.rundir.outbox import Outbox, open_outbox

log = get_logger("elastictrain.engine.worker")


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


class Rank0Services:
    """Closed at first; :meth:`open` and :meth:`close` are explicit and idempotent."""

    def __init__(
        self,
        cfg: JobConfig,
        planner: ExactlyOncePlanner,
        on_checkpoint_event: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self.cfg = cfg
        self.planner = planner
        self.on_checkpoint_event = on_checkpoint_event
        self.versions = {"torch": torch.__version__, "horovod": _version("horovod")}
        """Software versions set as tags of the MLflow run."""
        self.is_open = False
        self.events: EventSink = NullEventLog()
        self.tracker: Tracker = NullTracker()
        self.checkpointer: Checkpointer | None = None
        self.ledger: SampleLedger | None = None
        self.outbox: Outbox | None = None
        """What rank 0 writes for the launcher goes through it when the workers share no disk (``elastic.outputs``)."""
        self.progress: Progress = NullProgress()
        self.ledger_written = -1
        """Highest step this process (as rank 0) has written to the ledger."""
        self._early_tracker: Tracker | None = None

    def prepare(self, tracker: Tracker) -> None:
        """Adopt a tracker started before this process took rank 0 (see ``Trainer.build``): the MLflow run opens
        (import, store, run) while the parts are built, and :meth:`open` uses it instead of starting one."""
        self._early_tracker = tracker

    def open(self, *, step: int, total_steps: int | None, wait_for_tracking: bool) -> None:
        """Take rank 0's services over at ``step``. ``wait_for_tracking``: at the job's start, wait a little for
        the MLflow run to open and for the checkpoint writer's fork server (never after a reset: a new rank 0
        must not hold the recovery up)."""
        if self.is_open:
            return
        cfg = self.cfg
        self.is_open = True
        self.outbox = open_outbox(cfg.elastic.outputs)  # elastic.outputs: None = the run_dir's files
        self.events = open_event_log(cfg.run_path, 0, self.outbox)
        self.tracker, self._early_tracker = self._early_tracker or make_tracker(cfg, 0), None
        if cfg.checkpoint.enabled:
            self.checkpointer = Checkpointer(
                storage_for(cfg.checkpoint.location, cfg.run_path),
                keep_last=cfg.checkpoint.keep_last,
                writer=cfg.checkpoint.writer,
                on_event=self.on_checkpoint_event,
                # At a start the others wait anyway; after a reset, every other worker waits for this one.
                wait_for_writer=wait_for_tracking,
            )
        if cfg.audit.sample_ledger:
            # The ledger numbers its files in the order in which processes held rank 0 (not by a clock).
            self.ledger = SampleLedger(
                cfg.run_path / layout.LEDGER,
                f"{os.getpid()}",
                num_samples=self.planner.num_samples,
                drop_last=cfg.data.drop_last,
                outbox=self.outbox,
            )
            self.ledger_written = -1
        self.progress = make_progress(
            rank=0, enabled=cfg.tracking.progress_bar, total_steps=total_steps, initial_step=step
        )
        self.tracker.log_params(cfg.flat())
        config_file = cfg.run_path / layout.CONFIG  # the resolved config, next to the run and in MLflow
        config_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(config_file, cfg.to_yaml(), durable=False)
        if self.outbox is not None:
            self.outbox.append(layout.CONFIG, cfg.to_yaml().encode())
        self.tracker.log_artifact(config_file)
        self.tracker.set_tags({"elastictrain.job": cfg.job, **self.versions})
        wait = cfg.tracking.open_wait_seconds
        gloo_timeout = gloo_timeout_seconds()
        if gloo_timeout is not None:  # the other ranks wait in a collective meanwhile
            wait = min(wait, gloo_timeout / 2)
        if cfg.tracking.mlflow and wait > 0 and wait_for_tracking:
            t0 = time.perf_counter()
            run_id = self.tracker.wait_started(wait)
            if run_id is None:
                log.warning("tracking run not open yet; training starts, points wait in the queue", waited_seconds=wait)
            else:
                log.info("tracking run open", run_id=run_id, waited_seconds=round(time.perf_counter() - t0, 3))

    def write_ledger(self, step_log: StepLog) -> None:
        """Record the steps of ``step_log`` not yet written, *before* they are committed (no-op while closed)."""
        if self.ledger is None:
            return
        for step, epoch, start, count in step_log.entries or []:
            if step > self.ledger_written:
                self.ledger.record(step, epoch, self.planner.permutation(epoch)[start : start + count])
                self.ledger_written = step
        self.ledger.flush()

    def restore_ledger(self, step: int, step_log: StepLog) -> None:
        """After a sync at ``step``: steps after it were rolled back; steps up to it that a dead rank 0 never
        wrote are in the synced step log, so write them again (replay is idempotent)."""
        if self.ledger is None:
            return
        self.ledger.restore(step)
        self.ledger_written = -1
        self.write_ledger(step_log)

    def hand_over(self) -> None:
        """Rank 0 is now another process: close what is open, leaving the MLflow run open for the new rank 0."""
        if self.is_open:
            log.info("rank 0 moved to another worker; closing this worker's rank-0 services")
        self._close(status=None, checkpoint_timeout=60, final=None)

    def close(self, status: str, *, step: int, epoch: int, world_size: int) -> None:
        """The end of the worker: close the MLflow run with ``status`` and write ``tracking_closed`` last."""
        final = lambda: TrackingClosed(  # noqa: E731 - built after the tracker closed (its final counts)
            step=step, epoch=epoch, world_size=world_size, run_id=self.tracker.run_id, dropped=self.tracker.dropped
        )
        self._close(status=status, checkpoint_timeout=None, final=final)

    def _close(
        self, *, status: str | None, checkpoint_timeout: float | None, final: Callable[[], TrackingClosed] | None
    ) -> None:
        if self._early_tracker is not None:  # it never became rank 0's: the run stays open for the one that is
            self._early_tracker.close(status=None)
            self._early_tracker = None
        if not self.is_open:
            return
        self.is_open = False
        self.progress.close()
        self.progress = NullProgress()
        if self.checkpointer is not None:
            self.checkpointer.close(timeout=checkpoint_timeout)
            self.checkpointer = None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        self.tracker.close(status=status)
        if final is not None:
            if self.tracker.dropped:
                log.warning("tracking points dropped", dropped=self.tracker.dropped)
            self.events.emit(final())
        self.tracker = NullTracker()
        self.events.close()
        self.events = NullEventLog()
