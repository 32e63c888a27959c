"""The engine's Horovod elastic ``State``: commit and roll back in place, sync from the most advanced rank.

Over a :class:`~elastictrain.engine.state.CommittedState` (``elastic.rollback: commit``) a failure rolls back to the
last commit. Over a :class:`~elastictrain.engine.state.LiveState` (``elastic.rollback: none``) it rolls nothing back:
the partial step is discarded, and the sync takes the most advanced rank's live state, staged, so that a
failure during the sync leaves every rank a whole step.

It also records what the reset that follows needs to report (:attr:`ElasticTrainingState.failure`,
``failure_error``, ``lost_steps``); :func:`elastictrain.engine.reset.plan_reset` turns that into the reset.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

from elastictrain.engine.collective import Collective
from elastictrain.engine.gpus import check_one_rank_per_gpu
from elastictrain.engine.state import CommittedState, reseed
from elastictrain.engine.sync import receive_state
from elastictrain.horovod.private import (
    discard_pending_allreduces,
    host_messages,
    last_host_update,
    set_last_host_update,
)


class StopRequested(Exception):
    """SIGTERM reached this worker; leave after rank 0 has checkpointed the last commit."""


class ElasticTrainingState(State):
    """Horovod's ``State`` protocol (save, restore, sync, check_host_updates) over the engine's state."""

    reached_step: int | None = None
    """The step this rank had reached when a collective of the current reset failed (None: no failure)."""

    def __init__(
        self, committed: CommittedState, seed: int, stop_requested: Callable[[], bool], collective: Collective
    ) -> None:
        self.committed = committed
        self.seed = seed
        self.stop_requested = stop_requested
        self.collective = collective
        self.failure: tuple[str, float] | None = None
        """(reason, unix time) of the failure or host notice that caused the current reset."""
        self.failure_error = ""
        """First line of the error of that failure (empty for a host notice)."""
        self.lost_steps = 0
        """Steps rolled back by the current reset: the furthest step a survivor had reached, less the synced one."""
        self.last_commit_seconds = 0.0
        self.last_progress_ts = time.time()
        """End of the last completed step: a failure is timed from here (the failed step's start)."""
        self.on_failure: Callable[[], None] = lambda: None
        """Called first on a failed collective (records the failure marker; the watchdog stands down)."""
        self.on_failure_notice: Callable[[], None] = lambda: None
        """Called on a host-change interrupt (the watchdog stands down before the rendezvous)."""
        self.failure_cause: Callable[[float], str | None] = lambda since: None
        """Why a failed collective failed, when a hung peer was found since the given time (``worker_hung``)."""
        self.member: Callable[[], Any] = lambda: None
        """Who this worker is in the ring (host, slot, pid), gathered with the sync's positions."""
        self.gpu = ""
        """The GPU this rank's NCCL collectives run on (:func:`elastictrain.engine.gpus.collective_gpu`), gathered
        with the sync's positions: two ranks on one GPU stop the job at the sync."""
        self.members: list[Any] | None = None
        """Every rank's :attr:`member`, in rank order, from the last sync (None until the trainer takes them)."""
        self.marks: dict[str, float] = {}
        """When this worker passed each point of the current reset (:data:`elastictrain.engine.reset.PAUSE_MARKS`);
        the trainer takes and clears them at the start of the training function."""
        self.on_mark: Callable[[str], None] = lambda name: None
        """Called with each mark's name as this worker passes it (the heartbeat shows the reset's phase)."""
        super().__init__(
            bcast_object=lambda obj: collective.broadcast_object(obj, 0, name="state"), get_rank=collective.rank
        )

    def save(self) -> None:
        t0 = time.perf_counter()
        self.committed.save()
        self.last_commit_seconds = time.perf_counter() - t0

    def restore(self) -> None:
        """Called by the elastic loop on HorovodInternalError: a worker failed mid-step.

        When this worker was told to stop, leave now: the reset that would follow blocks in a new
        rendezvous, which may never complete when the whole job is being stopped.
        """
        if self.stop_requested():
            raise StopRequested
        self.marks.setdefault("caught", time.time())
        self.on_failure()
        self.on_mark("caught")
        if self.failure is None:
            error = sys.exc_info()[1]  # restore() runs inside the loop's `except HorovodInternalError`
            self.failure_error = str(error).strip().splitlines()[0][:300] if error and str(error).strip() else ""
            hung = self.failure_cause(self.last_progress_ts)
            if hung is not None:
                self.failure, self.failure_error = ("worker_hung", self.last_progress_ts), hung
        self.failure = self.failure or ("worker_failed", self.last_progress_ts)
        self.reached_step = max(self.reached_step or 0, self.committed.counters.step)
        discard_pending_allreduces(self.committed.optimizer)
        if self.committed.keeps_copy:
            self.committed.restore()
        else:  # the live state holds whole steps: only the failed one's gradients go
            self.committed.discard_partial_step()

    def check_host_updates(
        self, figures: Sequence[float] = (), on_figures: Callable[[list[list[float]]], None] | None = None
    ) -> None:
        """Horovod's host-update check, which also carries every rank's step ``figures`` (the same length on every
        rank): ``on_figures`` receives all ranks' rows, in rank order, before a host change is raised."""
        try:
            self._check_host_updates(figures, on_figures)
        except HostsUpdatedInterrupt as e:
            if self.stop_requested():
                raise StopRequested from None
            self.on_failure_notice()
            self.marks.setdefault("caught", time.time())
            self.on_mark("caught")
            self.failure = ("hosts_removed" if e.skip_sync else "hosts_changed", time.time())
            self.failure_error = ""
            raise

    def _check_host_updates(
        self, figures: Sequence[float], on_figures: Callable[[list[list[float]]], None] | None
    ) -> None:
        """Horovod's ``State.check_host_updates`` with one small tensor allgather instead of ``broadcast_object``
        (a pickle, then two collectives: the size, then the bytes). Same rule: rank 0's view of the newest
        notice decides for every rank, so all raise together. The other ranks' rows carry their figures."""
        prev = last = last_host_update(self)
        update = HostUpdateResult.no_update
        messages = host_messages(self)
        while not messages.empty():
            timestamp, res = messages.get()
            if timestamp > last:
                last = timestamp
                update |= res
        rows = self.collective.allgather(
            torch.tensor([[float(prev), float(last), float(update), *map(float, figures)]], dtype=torch.float64),
            name="elastictrain.host_updates",
        ).tolist()
        if on_figures is not None and figures:
            on_figures([row[3:] for row in rows])
        prev, newest, update = rows[0][0], rows[0][1], HostUpdateResult(int(rows[0][2]))
        set_last_host_update(self, newest)
        if newest > prev:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def reset(self) -> None:
        """Horovod calls this after its reset (``hvd.shutdown`` and ``hvd.init``), before the sync."""
        self.marks["reset"] = time.time()
        self.on_mark("reset")

    def sync(self) -> None:
        self.marks["sync_start"] = time.time()
        self.on_mark("sync_start")
        self._sync()
        self.marks["sync_end"] = time.time()
        self.on_mark("sync_end")

    def _sync(self) -> None:
        c, collective = self.committed, self.collective
        # The most advanced commit: the epoch-end commit adds no step, so a step tie goes to the later epoch.
        reached = c.counters.step if self.reached_step is None else self.reached_step
        positions = collective.allgather_object(
            (c.counters.step, c.sampler.epoch, reached, self.member(), self.gpu), name="sync.positions"
        )
        # before the first GPU broadcast, which NCCL would refuse (a peer that sent no GPU id names none)
        check_one_rank_per_gpu([p[4] if len(p) > 4 else "" for p in positions], [p[3] for p in positions])
        root = max(range(len(positions)), key=lambda r: (tuple(positions[r][:2]), -r))
        apply, small = receive_state(
            collective, root, {"model": c.model}, {"opt": c.optimizer}, staged=not c.keeps_copy, extra=c.small_state()
        )
        apply()
        self.members = [p[3] for p in positions]
        c.load_small_state(small)
        self.lost_steps = max(0, max(int(p[2]) for p in positions) - c.counters.step)
        self.reached_step = None
        reseed(self.seed, c.counters.step, collective.rank())
        self.save()
