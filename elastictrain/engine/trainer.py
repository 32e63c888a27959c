"""The training loop of one worker: the function the elastic loop calls again after every reset.

:class:`Trainer` receives everything it works with: the config, the :class:`~elastictrain.engine.collective.Collective`
(the world), the :class:`~elastictrain.engine.build.TrainingParts` (model, optimizer, state...), rank 0's
:class:`~elastictrain.engine.services.Rank0Services` and the collective watchdog. It builds none of them
(:meth:`Trainer.build` composes the defaults), so a unit test runs it in one process over a
:class:`~elastictrain.engine.collective.LocalCollective`.

Life of a worker::

    rank 0 loads the latest checkpoint (resume)
    elastic_run(train):
        sync   state from the most advanced rank (not blindly rank 0: a new process may hold rank 0)
        train  plan_reset -> rank-0 services (open / hand over), LR ramp, start or failure event
               steps; every ``commit_every_steps``: ledger, commit, check host updates
        on HorovodInternalError: discard the partial step; rollback ``commit``: back to the last commit;
                                 rollback ``none``: keep the rest (whole steps only); reset, sync, train
        on HostsUpdatedInterrupt: (state already committed) reset, sync, train
    exit 0 only when training is complete; 143 after SIGTERM (rank 0 checkpoints the last commit first)

Size: the order of everything between two syncs, read in one place (docs/decisions.md).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from horovod.common.exceptions import HostsUpdatedInterrupt

from elastictrain import envnames
from elastictrain.cliutil import EXIT_STOPPED
from elastictrain.config import JobConfig
from elastictrain.engine.build import TrainingParts, build_parts
from elastictrain.engine.collective import Collective
from elastictrain.engine.data import load_batches
from elastictrain.engine.elastic_state import ElasticTrainingState, StopRequested
from elastictrain.engine.gpus import collective_gpu
from elastictrain.engine.health.hang import gathered_members
from elastictrain.engine.health.preemption import PreemptionWatch, jit_action
from elastictrain.engine.health.shares import Balancer, SharePolicy, ShareState
from elastictrain.engine.health.stragglers import StragglerMonitor, StragglerPolicy
from elastictrain.engine.health.watchdog import CollectiveWatchdog, NullWatchdog
from elastictrain.engine.metrics import MetricsWindow
from elastictrain.engine.policy import batch_plan, schedule_factor, schedule_finished
from elastictrain.engine.profile import StepProfile
from elastictrain.engine.reset import PendingReset, pause_parts, plan_reset
from elastictrain.engine.resume import META_KEY as RESUME_META_KEY
from elastictrain.engine.resume import resume_inputs, resume_latest
from elastictrain.engine.sampler import StepPlan, iter_plans
from elastictrain.engine.services import Rank0Services
from elastictrain.engine.step import train_step
from elastictrain.engine.tracking import make_tracker
from elastictrain.engine.validation import validate
from elastictrain.logconf import bind, get_logger
from elastictrain.rundir import layout
from elastictrain.rundir.events import (
    Checkpoint,
    Commit,
    Done,
    EpochEnd,
    Failure,
    Metrics,
    PreemptionCheckpoint,
    Reset,
    Start,
    Stopped,
    checkpoint_event,
)
from elastictrain.task import TaskError

log = get_logger("elastictrain.engine.worker")


@dataclass(slots=True)
class DistContext:
    """Who this process is in the current world; refreshed after every reset. ``if rank == 0`` lives here."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    host: str = field(default_factory=socket.gethostname)

    def refresh(self, collective: Collective) -> None:
        self.rank, self.size, self.local_rank = collective.rank(), collective.size(), collective.local_rank()
        self.host = os.environ.get("HOROVOD_HOSTNAME", self.host)
        bind(rank=self.rank, local_rank=self.local_rank, world_size=self.size, host=self.host)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


class Trainer:
    """One worker's loop over its collaborators (see the module docstring)."""

    def __init__(
        self,
        cfg: JobConfig,
        collective: Collective,
        parts: TrainingParts,
        services: Rank0Services | None = None,
        watchdog: CollectiveWatchdog | NullWatchdog | None = None,
    ) -> None:
        self.cfg = cfg
        self.collective = collective
        self.parts = parts
        self.ctx = DistContext()
        self.ctx.refresh(collective)
        self.committed = parts.state
        self.counters, self.sampler, self.ramp = parts.state.counters, parts.state.sampler, parts.state.ramp
        self.step_log = parts.state.step_log
        self.optimizer, self.planner = parts.optimizer, parts.planner
        self.stop_requested = False
        self.state = ElasticTrainingState(self.committed, cfg.training.seed, lambda: self.stop_requested, collective)
        self.state.member = self.member
        self.state.gpu = collective_gpu(parts.device, collective.nccl_built())
        self.services = services or Rank0Services(cfg, parts.planner, self._on_checkpoint_event)
        self.watchdog: CollectiveWatchdog | NullWatchdog = watchdog or NullWatchdog()
        self.config_hash = cfg.digest()
        self.attempt = int(os.environ.get(envnames.ATTEMPT, "0"))
        self.resumed_from: int | None = None
        self.checkpointed_step = -1
        """Step of the checkpoint this process resumed from (durable already: never written again)."""
        self.resumed_world_size: int | None = None
        """World size recorded in the checkpoint this process resumed from (rank 0)."""
        self.pending_reset: PendingReset | None = None
        """The reset to report after the first step it allows (see :mod:`elastictrain.engine.reset`)."""
        self.pause_marks: dict[str, float] = {}
        """This worker's marks of the reset being reported (taken from the state's at the training function's start)."""
        self.hosts: list[str] = []
        self.rank_hosts: list[str] = []
        """The host of each rank of the current world."""
        self.straggler_policy = StragglerPolicy.from_config(cfg.elastic, os.environ)
        self.profile = StepProfile(parts.device, enabled=cfg.elastic.stragglers != "off")
        self.stragglers = StragglerMonitor(self.straggler_policy, emit=lambda e: self.services.events.emit(e))
        """Every host's window of step figures (every rank keeps them: a new rank 0 has the history); the
        evictor is set by the composition when ``elastic.stragglers`` is ``evict`` or ``balance``."""
        shares = parts.state.shares
        self.balancer = Balancer(
            SharePolicy.from_config(cfg.elastic) if isinstance(shares, ShareState) else None,
            shares if isinstance(shares, ShareState) else ShareState(),
            emit=lambda e: self.services.events.emit(e),
        )
        """Each host's share of a step (``elastic.stragglers: balance``; its state is part of the committed state)."""
        self.last_loss: float | None = None
        self.last_val_accuracy: float | None = None
        self.metrics = MetricsWindow(parts.device)
        self.preemption: PreemptionWatch | None = None
        """Rank 0's reader of the hosts' preemption notices (set by the composition when the worker has etcd): a
        just-in-time checkpoint at each commit while the notices leave the job unable to go on."""

    @classmethod
    def build(cls, cfg: JobConfig, collective: Collective) -> Trainer:
        """The default composition: parts built from the config, rank-0 services, no watchdog (arm one after)."""
        DistContext().refresh(collective)  # the build's log lines carry the rank and host too
        # Rank 0 at the start opens the MLflow run (seconds: import, a new store's schema) while the parts are
        # built, the checkpoint is loaded and the state synced, instead of after, while every rank waits.
        early = make_tracker(cfg, 0) if collective.rank() == 0 else None
        try:
            trainer = cls(cfg, collective, build_parts(cfg, collective))
        except BaseException:
            if early is not None:
                early.close(status="FAILED")
            raise
        if early is not None:
            trainer.services.prepare(early)
        return trainer

    # ------------------------------------------------------------------------------------ LR
    def _apply_lr(self) -> None:
        """LR = base_lr x world-size scale (ramped) x schedule; the scheduler's base LRs follow the scale."""
        t, scheduler = self.cfg.training, self.parts.scheduler
        scale = self.ramp.at(self.counters.step)
        scheduler.base_lrs = [lr * scale for lr in self.parts.group_lrs]
        factor = schedule_factor(t.schedule, t, self.sampler.epoch + self.sampler.cursor / self.planner.num_samples)
        for g, base in zip(self.optimizer.param_groups, scheduler.base_lrs, strict=True):
            g["lr"] = base * factor
        scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]  # what get_last_lr() returns

    # ------------------------------------------------------------------------------------ resume
    def resume_inputs(self) -> dict[str, Any]:
        return resume_inputs(self.cfg, self.planner.num_samples)

    def resume_from_checkpoint(self) -> None:
        """Rank 0 loads the latest verified checkpoint (see :mod:`elastictrain.engine.resume`)."""
        resumed = resume_latest(self.cfg, self.committed, self.resume_inputs(), is_rank0=self.ctx.is_rank0)
        if resumed is None:
            return
        self.resumed_from = self.checkpointed_step = resumed.step
        self.resumed_world_size = resumed.world_size
        if schedule_finished(self.cfg.training, self.sampler.epoch, self.counters.step):
            log.info("run already complete; nothing to train", step=self.counters.step, epoch=self.sampler.epoch)

    # ------------------------------------------------------------------------------------ after a sync
    def member(self) -> tuple[str, int, int]:
        """This worker in the ring: (host, slot, pid); every rank gathers them after each rendezvous (the ring)."""
        return (os.environ.get("HOROVOD_HOSTNAME", self.ctx.host), self.collective.local_rank(), os.getpid())

    def _after_sync(self) -> None:
        """Start of ``train`` after a (re)start: the reset plan, rank-0 services, LR, start or failure event."""
        self.ctx.refresh(self.collective)
        c, cfg, state = self.counters, self.cfg, self.state
        bind(job=cfg.job, step=c.step)
        plan = plan_reset(
            step=c.step,
            committed_size=c.world_size,
            new_size=self.ctx.size,
            ramp=self.ramp,
            failure=state.failure,
            lost_steps=state.lost_steps,
            elastic=cfg.elastic,
            now=time.time(),
        )
        if self.ctx.is_rank0:
            self.services.open(
                step=c.step,
                total_steps=self._total_steps_estimate(),
                # a start (fresh or resumed) waits a little for MLflow; a reset, or a worker joining a job
                # that has trained past its start, must not hold the recovery up
                wait_for_tracking=state.failure is None and c.step == (self.resumed_from or 0),
            )
        else:
            self.services.hand_over()
        if plan.ramp is not None:
            self.ramp.load_state_dict(plan.ramp.state_dict())
            c.world_size = self.ctx.size
            # Part of the committed state at once: a rollback before the next commit must not bring back
            # the size before this reset (a 2 -> 1 shrink right after a 3 -> 2 reset is not 3 -> 1).
            state.save()
        self.pending_reset = r = plan.reset
        self.pause_marks, state.marks = state.marks, {}
        if r is not None:
            self.services.events.emit(  # by whoever holds rank 0 now (the one that saw it may be dead), at its time
                Failure(
                    step=c.step,
                    epoch=self.sampler.epoch,
                    world_size=r.old_size,
                    ts=r.failure_ts,
                    reason=r.reason,
                    error=state.failure_error,
                )
            )
        state.failure, state.failure_error, state.lost_steps = None, "", 0
        self.services.restore_ledger(c.step, self.step_log)
        self._apply_lr()
        self.metrics.start()
        self.profile.discard()
        self.balancer.discard_pending()
        members, state.members = state.members, None  # gathered with the sync's positions when it ran
        if members is None:  # Horovod skips the sync when hosts were only removed
            members = self.collective.allgather_object(self.member(), name="hosts")
        self.rank_hosts = [str(m[0]) for m in members]
        self.hosts = sorted(set(self.rank_hosts))
        ring = gathered_members(members)
        if ring is not None:
            self.watchdog.set_members(self.ctx.rank, ring)
        if plan.starting:  # once per start of the job (fresh or resumed); a new rank 0 after a reset is a `reset`
            self.services.events.emit(
                Start(
                    step=c.step,
                    epoch=self.sampler.epoch,
                    world_size=self.ctx.size,
                    hosts=self.hosts,
                    resumed_from_step=self.resumed_from,
                    resumed_world_size=self.resumed_world_size,
                    config_hash=self.config_hash,
                    run_id=self.services.tracker.run_id,
                    attempt=self.attempt,
                )
            )
        if self.balancer.uneven:  # the shares, re-split over this world (after the start event)
            self.balancer.announce(
                step=c.step,
                epoch=self.sampler.epoch,
                rank_hosts=self.rank_hosts,
                global_batch=self._global_batch(),
                reason="start" if plan.starting else "the world changed",
            )
        log.info(
            "training",
            step=c.step,
            epoch=self.sampler.epoch,
            cursor=self.sampler.cursor,
            lr=self.optimizer.param_groups[0]["lr"],
        )
        self.pause_marks["prologue_end"] = time.time()

    def _emit_reset(self) -> None:
        r, self.pending_reset = self.pending_reset, None
        assert r is not None
        now = time.time()
        recovery = max(0.0, now - r.failure_ts)
        parts = pause_parts(r.failure_ts, self.pause_marks, now)
        self.counters.resets += 1
        hosts = self.hosts  # gathered by every rank in _after_sync: no collective on only some ranks
        self.services.events.emit(
            Reset(
                step=self.counters.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                recovery_seconds=round(recovery, 3),
                hosts=hosts,
                old_size=r.old_size,
                new_size=r.new_size,
                reason=r.reason,
                lost_steps=r.lost_steps,
                detect_seconds=parts["detect"],
                rendezvous_seconds=parts["rendezvous"],
                sync_seconds=parts["sync"],
                prologue_seconds=parts["prologue"],
                first_step_seconds=parts["first_step"],
            )
        )
        self.services.tracker.log_metrics({"recovery_seconds": recovery}, step=self.counters.step)
        self.services.tracker.set_tags({"hosts": ",".join(hosts)})
        log.info(
            "reset complete",
            recovery_seconds=round(recovery, 3),
            old_size=r.old_size,
            new_size=r.new_size,
            reason=r.reason,
            lost_steps=r.lost_steps,
        )

    # ------------------------------------------------------------------------------------ the loop
    def train(self, state: ElasticTrainingState) -> None:
        """The function the elastic loop calls (again after every reset)."""
        self.watchdog.idle()
        self.watchdog.snapshot_ring()
        state.last_progress_ts = time.time()
        self._after_sync()
        cfg, t = self.cfg, self.cfg.training
        while True:
            if self.stop_requested:
                raise StopRequested
            # Checked before anything runs: a reset or a resume may land exactly on the final commit.
            if schedule_finished(t, self.sampler.epoch, self.counters.step):
                break
            plan_b = batch_plan(cfg.elastic, cfg.data.batch_size, t.grad_accumulation, self.ctx.size)
            if self.planner.epoch_done(self.sampler, plan_b.global_batch):
                self._end_epoch(state)
                continue
            self._run_epoch_part(state, plan_b.global_batch, plan_b.micro_batch)
        self._finish(state)

    def _run_epoch_part(self, state: ElasticTrainingState, global_batch: int, micro_batch: int) -> None:
        """Steps until the epoch ends, max_steps, a stop, or new shares; the plans are fixed for this world size and
        these shares."""
        cfg, c, t, task = self.cfg, self.counters, self.cfg.training, self.parts.task
        shares_version = self.balancer.version
        # Lazily: planning a whole ImageNet epoch up front took 0.5 s of every reset's recovery. The loader's copy
        # runs ahead of the loop's by its prefetch depth only.
        plans, ahead = itertools.tee(
            iter_plans(
                self.planner,
                self.sampler,
                global_batch=global_batch,
                world_size=self.ctx.size,
                rank=self.ctx.rank,
                micro_batch=micro_batch,
                weights=self.balancer.weights(self.rank_hosts, global_batch),
            )
        )
        train_set = task.train_data
        if hasattr(train_set, "set_epoch"):
            train_set.set_epoch(self.sampler.epoch)
        loaded = load_batches(
            train_set, (mb for p in ahead for mb in p.micro_batches), cfg.data.loader_workers, task.collate
        )
        for plan in plans:
            if self.stop_requested or (t.max_steps is not None and c.step >= t.max_steps):
                return
            t0 = time.perf_counter()
            self.watchdog.step_started()  # the whole iteration: step, metrics, commit all hold collectives
            self.profile.step_started()
            micro = self._micro_batches(plan, loaded)
            self.profile.data_ready()
            stats = train_step(
                self.parts.model,
                self.optimizer,
                self.parts.scaler,
                micro,
                plan.global_count,
                precision=self.parts.precision,
                grad_clip_norm=t.grad_clip_norm,
                loss_fn=task.loss,
                grads_ready=self._grads_ready,
            )
            if stats.count != len(plan.local_ids):
                raise TaskError(
                    f"task: the loss returned {stats.count} values for {len(plan.local_ids)} samples "
                    "(it must return one per sample)"
                )
            state.last_progress_ts = time.time()
            c.step += 1
            c.samples += plan.global_count
            self.sampler.cursor += plan.global_count
            self.step_log.append(c.step, plan.epoch, plan.start, plan.global_count)
            self._apply_lr()
            self.metrics.add(stats.loss_sum, stats.count, time.perf_counter() - t0)
            self.profile.step_finished(stats.count)
            if self.pending_reset is not None:
                self._emit_reset()
            self.services.progress.update(c.step, world_size=self.ctx.size, epoch=self.sampler.epoch)
            if c.step % t.log_every_steps == 0:
                self._log_metrics()
            ckpt_due = (
                cfg.checkpoint.enabled
                and cfg.checkpoint.every_steps is not None
                and c.step % cfg.checkpoint.every_steps == 0
            )
            if c.step % cfg.elastic.commit_every_steps == 0 or ckpt_due:
                self._commit(state, checkpoint=ckpt_due)
            self.watchdog.step_finished()
            if self.balancer.version != shares_version:
                return  # planned again with the new shares

    def _grads_ready(self) -> None:
        self.profile.grads_ready()
        self.watchdog.grads_ready()

    def _micro_batches(self, plan: StepPlan, loaded: Any) -> list[Any]:
        """The plan's micro-batches from the loader, which yields one batch per planned micro-batch, in order
        (so a batch's samples are exactly the planned ids)."""
        return [next(loaded) for _ in plan.micro_batches]

    # ------------------------------------------------------------------------------------ metrics
    def _log_metrics(self) -> None:
        c, services = self.counters, self.services
        window = self.metrics.reduce(self.collective)  # a collective: every rank logs at the same steps
        values = {
            "loss": window["loss"],
            "lr": self.optimizer.param_groups[0]["lr"],
            "world_size": self.ctx.size,
            "samples_per_sec": window["samples_per_sec"],
            "step_seconds": window["step_seconds"],
            "commit_seconds": self.state.last_commit_seconds,
        }
        slowest = self.stragglers.slowest() if self.ctx.is_rank0 else None
        services.events.emit(
            Metrics(
                step=c.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                steps=int(window["steps"]),
                loss=values["loss"],
                lr=values["lr"],
                samples_per_sec=values["samples_per_sec"],
                step_seconds=values["step_seconds"],
                commit_seconds=values["commit_seconds"],
                slowest_host=slowest.host if slowest else None,
                slowest_ratio=round(slowest.ratio, 4) if slowest else None,
            )
        )
        services.tracker.log_metrics(values, step=c.step)
        self.last_loss = values["loss"]
        if self.ctx.is_rank0:
            log.info("metrics", step=c.step, **{k: round(v, 5) for k, v in values.items()})
        services.progress.update(c.step, world_size=self.ctx.size, epoch=self.sampler.epoch, loss=values["loss"])

    def _global_batch(self) -> int:
        t = self.cfg.training
        return batch_plan(self.cfg.elastic, self.cfg.data.batch_size, t.grad_accumulation, self.ctx.size).global_batch

    def _total_steps_estimate(self) -> int | None:
        t = self.cfg.training
        gb = batch_plan(self.cfg.elastic, self.cfg.data.batch_size, t.grad_accumulation, self.ctx.size).global_batch
        total = math.ceil(self.planner.num_samples / gb) * t.epochs
        return min(total, t.max_steps) if t.max_steps else total

    # ------------------------------------------------------------------------------------ commits, checkpoints
    def _commit(self, state: ElasticTrainingState, checkpoint: bool = False) -> None:
        """Ledger (rank 0), in-memory commit, optional checkpoint, then the host-update check (may raise)."""
        self.services.write_ledger(self.step_log)
        self.balancer.apply_pending(step=self.counters.step, epoch=self.sampler.epoch, rank_hosts=self.rank_hosts)
        state.save()
        self.services.events.emit(
            Commit(
                step=self.counters.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                commit_seconds=round(state.last_commit_seconds, 6),
            )
        )
        if checkpoint:
            self.checkpoint(wait=False)
        self._preemption_checkpoint()
        figures = self.profile.take() if self.profile.enabled else []
        try:
            state.check_host_updates(figures, self._on_step_figures)
        except HostsUpdatedInterrupt as e:
            # Noticed hosts drained: read the notices now, before the reset's rendezvous may wait for hosts that
            # never come (the state is committed: this commit is the last one). Only when hosts left (skip_sync:
            # removals alone) or notices were already seen: a scale-up costs no etcd read here.
            watch = self.preemption
            if watch is not None and self.ctx.is_rank0 and (e.skip_sync or watch.plan is not None):
                watch.refresh()
                self._preemption_checkpoint()
            raise

    def _preemption_checkpoint(self) -> None:
        """Rank 0, at a commit: the just-in-time checkpoint of the commit when the preemption notices leave the job
        unable to go on (:mod:`elastictrain.engine.health.preemption`)."""
        watch, ckpt = self.preemption, self.services.checkpointer
        if watch is None or ckpt is None or not self.ctx.is_rank0:
            return
        plan, step = watch.plan, self.counters.step
        action = jit_action(
            plan,
            now=watch.clock(),
            committed_step=step,
            durable_step=ckpt.stats.last_step if step != self.checkpointed_step else step,
            in_flight_step=ckpt.in_flight_step,
            near_seconds=watch.near_seconds,
        )
        if plan is None or action is None:
            return
        ok = self.checkpoint(wait=action.wait)
        if not action.wait and ckpt.in_flight_step != step and ckpt.stats.last_step != step:
            return  # the writer was busy with an earlier step: the next commit saves a newer one
        self.services.events.emit(
            PreemptionCheckpoint(
                step=step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                hosts=list(plan.noticed),
                deadline=plan.deadline,
                seconds_left=round(action.seconds_left, 3),
                slots_left=plan.slots_left,
                waited=action.wait,
                checkpointed=ok if action.wait else None,
            )
        )

    def _on_step_figures(self, rows: list[list[float]]) -> None:
        """Every rank's figures of this commit (see :mod:`elastictrain.engine.health.stragglers`)."""
        e = self.cfg.elastic
        self.stragglers.observe(
            rows,
            self.rank_hosts,
            is_rank0=self.ctx.is_rank0,
            step=self.counters.step,
            epoch=self.sampler.epoch,
            global_batch=e.global_batch_size if e.policy == "global" else None,
            per_worker_batch=self.cfg.data.batch_size * self.cfg.training.grad_accumulation,
        )
        self.balancer.observe(rows, self.rank_hosts, self._global_batch())

    def checkpoint(self, wait: bool) -> bool:
        """Rank 0: checkpoint the *committed* state, labelled with the committed step (not the live one).

        Periodic (``wait=False``): skipped while the writer is busy; returns False. Final and SIGTERM
        (``wait=True``): returns whether the committed step is now durably checkpointed.
        """
        committed = self.committed.committed_small()
        step, sampler = committed["counters"]["step"], committed["sampler"]
        ckpt = self.services.checkpointer
        if ckpt is None:
            return False
        if step in (self.checkpointed_step, ckpt.stats.last_step):  # loaded at resume, or written
            return True
        args: dict[str, Any] = {
            "step": step,
            "epoch": sampler["epoch"],
            "world_size": self.ctx.size,
            "config_hash": self.config_hash,
            "meta": {
                "run_id": self.services.tracker.run_id,
                "cursor": sampler["cursor"],
                "config": self.cfg.to_dict(),
                RESUME_META_KEY: self.resume_inputs(),
            },
        }
        if wait:
            return ckpt.save_and_wait(self.committed.full_state(), **args)
        if ckpt.in_flight_step != step:
            ckpt.save(self.committed.full_state(), **args, if_busy="skip")
        return False

    def _on_checkpoint_event(self, name: str, fields: dict[str, Any]) -> None:
        event = checkpoint_event(
            name, fields, step=self.counters.step, epoch=self.sampler.epoch, world_size=self.ctx.size
        )
        self.services.events.emit(event)
        if isinstance(event, Checkpoint):
            self.services.tracker.log_metrics({"checkpoint_stall_seconds": event.stall_seconds or 0.0}, step=event.step)

    # ------------------------------------------------------------------------------------ epochs, the end
    def _end_epoch(self, state: ElasticTrainingState) -> None:
        self.watchdog.step_started()
        try:
            self._end_epoch_inner(state)
        finally:
            self.watchdog.idle()

    def _end_epoch_inner(self, state: ElasticTrainingState) -> None:
        cfg, t0 = self.cfg, time.perf_counter()
        p = self.parts
        val = validate(
            p.task, p.model, p.precision, self.collective, batch_size=cfg.data.batch_size, watchdog=self.watchdog
        )
        val_loss, val_acc = val.get("val_loss"), val.get("val_accuracy")
        epoch = self.sampler.epoch
        self.services.events.emit(
            EpochEnd(
                step=self.counters.step,
                epoch=epoch,
                world_size=self.ctx.size,
                epoch_seconds=round(time.perf_counter() - t0, 3),
                val_loss=val_loss,
                val_accuracy=val_acc,
                val_metrics=val,
            )
        )
        if val:
            self.services.tracker.log_metrics(val, step=self.counters.step)
            log.info("epoch end", epoch=epoch, **{k: round(v, 4) for k, v in val.items()})
        self.last_val_accuracy = val_acc
        self.sampler.epoch += 1
        self.sampler.cursor = 0
        self._apply_lr()
        every = cfg.checkpoint.every_epochs
        self._commit(state, checkpoint=cfg.checkpoint.enabled and every is not None and self.sampler.epoch % every == 0)

    def _finish(self, state: ElasticTrainingState) -> None:
        if self.metrics.steps:
            self._log_metrics()
        self.services.write_ledger(self.step_log)
        state.save()
        checkpointed = None
        if self.cfg.checkpoint.enabled and self.ctx.is_rank0:
            checkpointed = self.checkpoint(wait=True)
            if not checkpointed:
                log.error("the final checkpoint could not be written", step=self.counters.step)
        self.services.events.emit(
            Done(
                step=self.counters.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                final_loss=self.last_loss,
                val_accuracy=self.last_val_accuracy,
                checkpointed=checkpointed,
            )
        )

    def publish_report(self) -> None:
        """Rank 0, after training: the timeline PNG and summary into run_dir and MLflow (never fails the job). Not with
        ``elastic.outputs: etcd``: the run log is in the launcher's run_dir (``elastictrain report`` there)."""
        if not self.ctx.is_rank0 or self.services.outbox is not None:
            return
        try:
            from elastictrain.rundir.report import report

            self.services.events.flush(timeout=10)
            summary = report(self.cfg.run_path)
            self.services.tracker.log_artifact(summary["png"])
            self.services.tracker.log_artifact(self.cfg.run_path / layout.REPORT_JSON)
        except Exception as e:  # a report is a convenience; the trained model is what counts
            log.warning("could not write the run report", error=str(e).splitlines()[0] if str(e) else repr(e))

    # ------------------------------------------------------------------------------------ stop / close
    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def checkpoint_last_commit(self) -> bool:
        """After SIGTERM: rank 0 writes the last committed state and waits for it.

        With rollback ``none`` that is the live state (the last completed step), so the ledger records its
        steps first, as at any commit.
        """
        if not self.ctx.is_rank0 or self.services.checkpointer is None:
            return False
        if not self.committed.keeps_copy:
            self.services.write_ledger(self.step_log)
        return self.checkpoint(wait=True)

    def close(self, status: str) -> None:
        self.watchdog.stop()
        if self.preemption is not None:
            self.preemption.stop()
        self.services.close(status, step=self.counters.step, epoch=self.sampler.epoch, world_size=self.ctx.size)


def run_trainer(trainer: Trainer) -> int:
    """Run one worker to completion: 0 when training completed, 143 when stopped (``trainer.on_sigterm``)."""
    status = "FAILED"
    try:
        trainer.resume_from_checkpoint()
        trainer.collective.elastic_run(trainer.train)(trainer.state)
        status = "FINISHED"
        log.info("training complete", step=trainer.counters.step)
        trainer.publish_report()
        return 0
    except StopRequested:
        ok = trainer.checkpoint_last_commit()
        trainer.services.events.emit(
            Stopped(
                step=trainer.counters.step,
                epoch=trainer.sampler.epoch,
                world_size=trainer.ctx.size,
                signal="SIGTERM",
                checkpointed=ok,
            )
        )
        log.warning("stopped by SIGTERM", step=trainer.counters.step, checkpointed=ok)
        status = "KILLED"
        return EXIT_STOPPED
    finally:
        trainer.close(status)
