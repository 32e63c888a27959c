"""The one module that owns Horovod: ``hvd.init``, the elastic state, ``hvd.elastic.run``, commits and resets.

Everything else (the step, the policies, the data plan, the snapshot buffers, checkpoint files,
tracking) is plain code called from here.

Life of a worker::

    hvd.init -> build model/optimizer/scheduler/scaler -> rank 0 loads the latest checkpoint
    hvd.elastic.run(train):
        sync   state from the most advanced rank (not blindly rank 0: a new process may hold rank 0)
        train  steps; every ``commit_every_steps``: ledger, commit (in-memory), check host updates
        on HorovodInternalError: discard the partial step; rollback ``commit``: back to the last commit;
                                 rollback ``none``: keep the rest (whole steps only); re-init, sync, continue
        on HostsUpdatedInterrupt: (state already committed) re-init, sync, continue
    exit 0 only when training is complete; 143 after SIGTERM (rank 0 checkpoints the last commit first)

Size: the engine (device, task, rank-0 services, the reset bookkeeping, the loop, validation, commits) is
still one class; splitting it into parts with their collaborators passed in is issue 14 section 3, not
done yet.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import horovod
import horovod.torch as hvd
import torch
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

from discovery.fileio import write_atomic
from elastictrain import envnames
from elastictrain.checkpoint import (
    Checkpointer,
    LocalStorage,
    checkpoint_name,
    latest_manifest,
    load_latest,
    read_latest,
    rollback_latest,
)
from elastictrain.checkpoint.resume import META_KEY as RESUME_META_KEY
from elastictrain.checkpoint.resume import check_resume_inputs
from elastictrain.config import JobConfig
from elastictrain.data import load_batches
from elastictrain.events import (
    Checkpoint,
    Commit,
    Done,
    EpochEnd,
    EventSink,
    Failure,
    Metrics,
    NullEventLog,
    Reset,
    Start,
    Stopped,
    TrackingClosed,
    checkpoint_event,
    open_event_log,
)
from elastictrain.ledger import SampleLedger
from elastictrain.logconf import bind, get_logger
from elastictrain.policy import ScaleRamp, batch_plan, lr_scale, schedule_factor, training_complete
from elastictrain.progress import NullProgress, Progress, make_progress
from elastictrain.sampler import (
    ExactlyOncePlanner,
    SamplerState,
    StepLog,
    StepPlan,
    iter_plans,
    shares,
)
from elastictrain.state import CommittedState, Counters, make_state, reseed
from elastictrain.step import Precision, eval_batches, train_step
from elastictrain.task import TaskError, build_task, check_dataset_size
from elastictrain.tracking import NullTracker, Tracker, make_tracker
from elastictrain.watchdog import CollectiveWatchdog, FailureMarker, removal_pending

log = get_logger("elastictrain.worker")

EXIT_STOPPED = 143  # 128 + SIGTERM: a stopped job is not a completed one


class StopRequested(Exception):
    """SIGTERM reached this worker; leave after rank 0 has checkpointed the last commit."""


@dataclass(slots=True)
class DistContext:
    """Who this process is in the current world; refreshed after every reset. ``if rank == 0`` lives here."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    host: str = field(default_factory=socket.gethostname)

    def refresh(self) -> None:
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        self.host = os.environ.get("HOROVOD_HOSTNAME", self.host)
        bind(rank=self.rank, local_rank=self.local_rank, world_size=self.size, host=self.host)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def sync_tensors_from(root: int, tensors: dict[str, torch.Tensor]) -> None:
    """Broadcast ``tensors`` in place from ``root`` (asynchronously, then wait for all)."""
    handles = [hvd.broadcast_async_(t, root, name=f"sync.{name}") for name, t in tensors.items()]
    for h in handles:
        hvd.synchronize(h)


def discard_pending_allreduces(optimizer: Any) -> None:
    """Forget the gradient allreduces of the step that failed, as Horovod's ``load_state_dict`` does.

    The rollback restores tensors in place, so without this the DistributedOptimizer keeps the failed
    step's handles and the retried step's ``zero_grad()`` raises "called after loss.backward() but before
    optimizer.step()". Gradients are dropped too (the step is redone from the commit).
    """
    if hasattr(optimizer, "_handles"):
        optimizer._handles = {}
        optimizer._synchronized = False
        optimizer._should_synchronize = True
        for p in optimizer._allreduce_delay:
            optimizer._allreduce_delay[p] = optimizer.backward_passes_per_step
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _control_ports(tracking_uri: str | None = None) -> tuple[set[int], set[int]]:
    """Ports of Horovod's control plane in this worker (notification service, rendezvous server): never aborted."""
    from horovod.common.elastic import notification_manager

    local: set[int] = set()
    service = getattr(notification_manager, "_service", None)
    if service is not None:
        for addrs in service.addresses().values():
            local.update(int(port) for _ip, port in addrs)
    ports = (os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT"), _tracking_port(tracking_uri))
    remote = {int(p) for p in ports if p}
    return local, remote


def _tracking_port(tracking_uri: str | None) -> int | None:
    """Port of an HTTP MLflow tracking server (its keep-alive connections are not Gloo's)."""
    from urllib.parse import urlparse

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return None
    return parsed.port or (443 if parsed.scheme == "https" else 80)


def sync_modules_and_optimizers(
    root: int, modules: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """Make every rank's modules and optimizers equal to ``root``'s, in place (a collective: every rank calls it).

    Tensors are overwritten as they arrive: a failure midway leaves a mix, which a rollback to the last
    commit repairs. Without a commit to go back to, use :func:`receive_modules_and_optimizers` staged.
    """
    receive_modules_and_optimizers(root, modules, optimizers, staged=False)()


def receive_modules_and_optimizers(
    root: int, modules: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer], *, staged: bool
) -> Callable[[], None]:
    """Receive ``root``'s modules and optimizers (a collective: every rank calls it); returns ``apply()``.

    Optimizer state layout (which params have which buffers) comes from the root first, so a rank that has
    not stepped yet allocates the buffers; then every tensor is broadcast, then the param-group
    hyper-parameters. Keys name the objects in the broadcasts, identically on every rank.

    Call ``apply()`` (local, cannot fail) once every collective of the sync has completed. ``staged``: a
    receiving rank takes the tensors into new buffers and changes nothing of its own until ``apply()``, so a
    collective that fails midway leaves it as it was, a whole step (rollback ``none``: there is no commit
    to repair a mix). Costs one more copy of the state on receivers, during the sync only. Not staged: the
    tensors are overwritten in place as they arrive, and ``apply()`` sets the param groups.
    """
    receiving = staged and hvd.rank() != root
    tensors: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # staged: (live tensor, received buffer)
    for prefix, module in modules.items():
        for name, t in module.state_dict(keep_vars=True).items():
            live = t.detach()
            tensors[f"{prefix}.{name}"] = buf = torch.empty_like(live) if receiving else live
            if receiving:
                copies.append((live, buf))
    new_states: list[tuple[torch.optim.Optimizer, dict[torch.Tensor, dict[str, Any]]]] = []
    for prefix, opt in optimizers.items():
        params = [p for g in opt.param_groups for p in g["params"]]
        layout = hvd.broadcast_object(
            {
                i: {
                    k: (tuple(v.shape), v.dtype, v.device.type == "cpu")
                    if isinstance(v, torch.Tensor)
                    else ("value", v)
                    for k, v in opt.state.get(p, {}).items()
                }
                for i, p in enumerate(params)
            },
            root_rank=root,
            name=f"sync.{prefix}_layout",
        )
        states: dict[torch.Tensor, dict[str, Any]] = {}
        for i, entries in layout.items():
            p = params[i]
            if not entries:
                continue
            live = opt.state.get(p, {})
            st = states[p] = {} if receiving else opt.state.setdefault(p, {})
            for key, spec in entries.items():
                if spec[0] == "value":
                    st[key] = spec[1]
                    continue
                shape, dtype, on_cpu = spec  # where the root keeps it: AdamW's step on the CPU, the rest by the param
                cur, device = live.get(key), torch.device("cpu") if on_cpu else p.device
                if receiving or not (
                    isinstance(cur, torch.Tensor)
                    and (tuple(cur.shape), cur.dtype, cur.device) == (shape, dtype, device)
                ):
                    st[key] = cur = torch.zeros(shape, dtype=dtype, device=device)
                tensors[f"{prefix}.{i}.{key}"] = cur
        if receiving:
            new_states.append((opt, states))
        else:
            for i, p in enumerate(params):
                if not layout.get(i):
                    opt.state.pop(p, None)
    sync_tensors_from(root, tensors)
    groups = {
        prefix: hvd.broadcast_object(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            root_rank=root,
            name=f"sync.{prefix}_groups",
        )
        for prefix, opt in optimizers.items()
    }

    def apply() -> None:
        if copies:
            with torch.no_grad():
                torch._foreach_copy_([live for live, _ in copies], [buf for _, buf in copies])
        for opt, states in new_states:
            for p in [p for g in opt.param_groups for p in g["params"]]:
                if p in states:
                    opt.state[p] = states[p]
                else:
                    opt.state.pop(p, None)
        for prefix, opt in optimizers.items():
            for g, saved in zip(opt.param_groups, groups[prefix], strict=True):
                g.update(saved)

    return apply


def arm_watchdog(
    state: State, marker: FailureMarker, host: Callable[[], str], tracking_uri: str | None = None
) -> CollectiveWatchdog:
    """Start the collective watchdog of this worker and hook it to ``state`` (the engine's and the drop-in's).

    ``state`` must call ``on_failure()`` first in its ``restore()`` (a failed collective: the watchdog stands
    down and the failure is recorded in ``marker`` for the other workers) and may call ``on_failure_notice()``
    on a host-change interrupt. The caller marks steps (``step_started``/``step_finished``) and calls
    ``snapshot_ring()`` after each rendezvous, and ``stop()`` at the end.
    """
    watchdog: CollectiveWatchdog

    def on_failure() -> None:
        watchdog.ring_failed()
        marker.record(host())

    state.on_failure = on_failure
    state.on_failure_notice = lambda: watchdog.idle()
    watchdog = CollectiveWatchdog(
        marker,
        host_removed=lambda: removal_pending(state._host_messages),
        excluded_ports=lambda: _control_ports(tracking_uri),
    ).start()
    return watchdog


class ElasticTrainingState(State):
    """Horovod elastic state over :class:`CommittedState`: commit/rollback in place, sync from the best rank.

    Over a :class:`LiveState` (``elastic.rollback: none``) a failure rolls nothing back: the partial step is
    discarded, and the sync takes the most advanced rank's live state (staged, so that a failure during
    the sync leaves every rank a whole step).
    """

    _last_updated_timestamp: float
    """Newest host-change notice acted on (Horovod's ``State`` sets it to 0)."""
    reached_step: int | None = None
    """The step this rank had reached when a collective of the current reset failed (None: no failure)."""

    def __init__(self, committed: CommittedState, seed: int, stop_requested: Callable[[], bool]) -> None:
        self.committed = committed
        self.seed = seed
        self.stop_requested = stop_requested
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
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)

    def save(self) -> None:
        t0 = time.perf_counter()
        self.committed.save()
        self.last_commit_seconds = time.perf_counter() - t0

    def restore(self) -> None:
        """Called by ``hvd.elastic.run`` on HorovodInternalError: a worker failed mid-step.

        When this worker was told to stop, leave now: the reset that would follow blocks in a new
        rendezvous, which may never complete when the whole job is being stopped.
        """
        if self.stop_requested():
            raise StopRequested
        self.on_failure()
        if self.failure is None:
            error = sys.exc_info()[1]  # restore() runs inside Horovod's `except HorovodInternalError`
            self.failure_error = str(error).strip().splitlines()[0][:300] if error and str(error).strip() else ""
        self.failure = self.failure or ("worker_failed", self.last_progress_ts)
        self.reached_step = max(self.reached_step or 0, self.committed.counters.step)
        discard_pending_allreduces(self.committed.optimizer)
        if self.committed.keeps_copy:
            self.committed.restore()
        else:  # the live state holds whole steps: only the failed one's gradients go
            self.committed.discard_partial_step()

    def check_host_updates(self) -> None:
        try:
            self._check_host_updates()
        except HostsUpdatedInterrupt as e:
            if self.stop_requested():
                raise StopRequested from None
            self.on_failure_notice()
            self.failure = ("hosts_removed" if e.skip_sync else "hosts_changed", time.time())
            self.failure_error = ""
            raise

    def _check_host_updates(self) -> None:
        """Horovod's ``State.check_host_updates`` with one small tensor broadcast instead of ``broadcast_object``
        (a pickle, then two collectives: the size, then the bytes). Same rule: rank 0's view of the newest
        notice decides for every rank, so all raise together."""
        prev = last = float(self._last_updated_timestamp)
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, res = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= res
        agreed = hvd.broadcast(
            torch.tensor([float(prev), float(last), float(update)], dtype=torch.float64),
            root_rank=0,
            name="elastictrain.host_updates",
        ).tolist()
        prev, self._last_updated_timestamp, update = agreed[0], agreed[1], HostUpdateResult(int(agreed[2]))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def sync(self) -> None:
        c = self.committed
        # The most advanced commit: the epoch-end commit adds no step, so a step tie goes to the later epoch.
        reached = c.counters.step if self.reached_step is None else self.reached_step
        positions = hvd.allgather_object((c.counters.step, c.sampler.epoch, reached))
        root = max(range(len(positions)), key=lambda r: (tuple(positions[r][:2]), -r))
        apply = receive_modules_and_optimizers(root, {"model": c.model}, {"opt": c.optimizer}, staged=not c.keeps_copy)
        small = hvd.broadcast_object(c.small_state(), root_rank=root, name="sync.small")
        apply()
        c.load_small_state(small)
        self.lost_steps = max(0, max(int(p[2]) for p in positions) - c.counters.step)
        self.reached_step = None
        reseed(self.seed, c.counters.step, hvd.rank())
        self.save()


class ElasticTrainer:
    """Builds the training objects once and runs :meth:`train` under ``hvd.elastic.run``."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.ctx = DistContext()
        self.ctx.refresh()
        self.device = self._device()
        t = cfg.training
        self.task = build_task(cfg)  # seeded with t.seed: the same initial weights everywhere (then synced anyway)
        self.model = self.task.model.to(self.device)
        self.train_set, self.val_set = self.task.train_data, self.task.val_data
        self.planner = ExactlyOncePlanner(check_dataset_size(self.task), t.seed, cfg.data.drop_last)
        self.sampler = SamplerState()
        self.precision = Precision.resolve(cfg.precision.mode, self.device)
        base = self._base_optimizer()
        self._group_lrs = [float(g["lr"]) for g in base.param_groups]
        """Each parameter group's LR at ``elastic.base_world_size``, before world-size scaling and schedule."""
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[cfg.compression.gradients]
        self.optimizer = hvd.DistributedOptimizer(
            base,
            named_parameters=self.model.named_parameters(),
            compression=compression,
            op=hvd.Sum,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=lambda _: self._schedule())
        self.scaler = torch.amp.GradScaler("cuda") if self.precision.use_scaler else None
        self.counters = Counters()
        self.ramp = ScaleRamp(1.0, 1.0, 0, 0)
        # With the audit on, the last steps' plans travel with the committed state (see StepLog).
        self.step_log = StepLog(maxlen=4 * cfg.elastic.commit_every_steps + 8 if cfg.audit.sample_ledger else 0)
        self.committed = make_state(
            cfg.elastic.rollback,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.sampler,
            self.counters,
            self.ramp,
            self.step_log,
        )
        self.state = ElasticTrainingState(self.committed, t.seed, lambda: self.stop_requested)
        self.config_hash = cfg.digest()
        self.stop_requested = False
        # Rank-0 services, created when this process first holds rank 0.
        self.events: EventSink = NullEventLog()
        self.tracker: Tracker = NullTracker()
        self.checkpointer: Checkpointer | None = None
        self.ledger: SampleLedger | None = None
        self.progress: Progress = NullProgress()
        self._ledger_written = -1
        """Highest step this process (as rank 0) has written to the ledger."""
        self._pending_reset: dict[str, Any] | None = None
        self._metrics = self._zero_metrics()
        self._last_log = (time.perf_counter(), 0)
        self.resumed_from: int | None = None
        self._checkpointed_step = -1
        """Step of the checkpoint this process resumed from (durable already: never written again)."""
        self.resumed_world_size: int | None = None
        """World size recorded in the checkpoint this process resumed from (rank 0)."""
        self._holds_rank0 = False
        """This process runs rank 0's services (events, tracker, checkpointer, ledger, progress)."""
        self._last_loss: float | None = None
        self._hosts: list[str] = []
        self.watchdog = arm_watchdog(
            self.state,
            FailureMarker(cfg.run_path / ".elastic" / "collective-failure"),
            host=lambda: self.ctx.host,
            tracking_uri=cfg.tracking.tracking_uri,
        )
        self.attempt = int(os.environ.get(envnames.ATTEMPT, "0"))

    # ------------------------------------------------------------------------------------ building
    def _device(self) -> torch.device:
        want = self.cfg.device
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                from elastictrain.config import ConfigError

                raise ConfigError("device: cuda requested but no CUDA device is available")
            torch.cuda.set_device(self.ctx.local_rank % torch.cuda.device_count())
            return torch.device("cuda", torch.cuda.current_device())
        # Share the cores between the workers on this machine instead of oversubscribing them. Logical hosts
        # on one machine each have local_size 1, so the launcher sets OMP_NUM_THREADS for them.
        threads = os.environ.get("OMP_NUM_THREADS")
        torch.set_num_threads(
            int(threads)
            if threads and threads.isdigit() and int(threads) > 0
            else max(1, (os.cpu_count() or 1) // max(1, hvd.local_size()))
        )
        return torch.device("cpu")

    def _base_optimizer(self) -> torch.optim.Optimizer:
        t = self.cfg.training
        if self.task.optimizer is not None:
            opt = self.task.optimizer(self.model.parameters())
            if not isinstance(opt, torch.optim.Optimizer):
                raise TaskError(f"task: Task.optimizer returned {type(opt).__name__}, not a torch.optim.Optimizer")
            return opt
        if t.optimizer == "adamw":
            return torch.optim.AdamW(self.model.parameters(), lr=t.base_lr, weight_decay=t.weight_decay)
        return torch.optim.SGD(
            self.model.parameters(), lr=t.base_lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=t.nesterov
        )

    def _schedule(self) -> float:
        progress = self.sampler.epoch + self.sampler.cursor / self.planner.num_samples
        return schedule_factor(self.cfg.training.schedule, self.cfg.training, progress)

    def _apply_lr(self) -> None:
        """LR = base_lr x world-size scale (ramped) x schedule; the scheduler's base LRs follow the scale."""
        scale = self.ramp.at(self.counters.step)
        self.scheduler.base_lrs = [lr * scale for lr in self._group_lrs]
        factor = self._schedule()
        for g, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            g["lr"] = base * factor
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------------------------ rank 0
    def _become_rank0(self) -> None:
        """Open rank 0's services when this process has just become rank 0; close them when it no longer is."""
        cfg = self.cfg
        if self._holds_rank0 == self.ctx.is_rank0:
            return
        if not self.ctx.is_rank0:
            self._leave_rank0()
            return
        self._holds_rank0 = True
        self.events = open_event_log(cfg.run_path, 0)
        self.tracker = make_tracker(cfg, 0)
        if cfg.checkpoint.enabled:
            self.checkpointer = Checkpointer(
                LocalStorage.for_run_dir(cfg.run_path),
                keep_last=cfg.checkpoint.keep_last,
                writer=cfg.checkpoint.writer,
                on_event=self._on_checkpoint_event,
            )
        if cfg.audit.sample_ledger:
            # The ledger numbers its files in the order in which processes held rank 0 (not by a clock).
            self.ledger = SampleLedger(
                cfg.run_path / "ledger",
                f"{os.getpid()}",
                num_samples=self.planner.num_samples,
                drop_last=cfg.data.drop_last,
            )
        total = self._total_steps_estimate()
        self.progress = make_progress(
            rank=0, enabled=cfg.tracking.progress_bar, total_steps=total, initial_step=self.counters.step
        )
        self.tracker.log_params(cfg.flat())
        config_file = cfg.run_path / "config.yaml"  # the resolved config, next to the run and in MLflow
        config_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(config_file, cfg.to_yaml(), durable=False)
        self.tracker.log_artifact(config_file)
        self.tracker.set_tags(
            {
                "elastictrain.job": cfg.job,
                "horovod": horovod.__version__,
                "torch": torch.__version__,
            }
        )
        wait = cfg.tracking.open_wait_seconds
        gloo_timeout = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "")
        if gloo_timeout.isdigit() and int(gloo_timeout) > 0:  # the other ranks wait in a collective meanwhile
            wait = min(wait, int(gloo_timeout) / 2)
        if cfg.tracking.mlflow and wait > 0 and self._job_starting():
            t0 = time.perf_counter()
            run_id = self.tracker.wait_started(wait)
            if run_id is None:
                log.warning("tracking run not open yet; training starts, points wait in the queue", waited_seconds=wait)
            else:
                log.info("tracking run open", run_id=run_id, waited_seconds=round(time.perf_counter() - t0, 3))

    def _job_starting(self) -> bool:
        """Whether the job is starting (fresh or resumed from a checkpoint) rather than resetting.

        After a failure or a host change, rank 0's services open without waiting: a new rank 0 must not hold
        the recovery up. A worker joining a job that has trained past its start also counts as a reset.
        """
        return self.state.failure is None and self.counters.step == (self.resumed_from or 0)

    def _leave_rank0(self) -> None:
        """Ranks were reassigned and rank 0 is now another process (hosts left and came back): hand over.

        What this process queued still goes out (events, MLflow points, a checkpoint being written); the MLflow
        run stays open for the new rank 0, which has opened the same run. Without this, two processes would
        write events, checkpoints and ledger files for the same steps.
        """
        log.info("rank 0 moved to another worker; closing this worker's rank-0 services")
        self._holds_rank0 = False
        self.progress.close()
        self.progress = NullProgress()
        if self.checkpointer is not None:
            self.checkpointer.close(timeout=60)
            self.checkpointer = None
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        self.tracker.close(status=None)
        self.tracker = NullTracker()
        self.events.close()
        self.events = NullEventLog()

    def _on_checkpoint_event(self, name: str, fields: dict[str, Any]) -> None:
        event = checkpoint_event(
            name, fields, step=self.counters.step, epoch=self.sampler.epoch, world_size=self.ctx.size
        )
        self.events.emit(event)
        if isinstance(event, Checkpoint):
            self.tracker.log_metrics({"checkpoint_stall_seconds": event.stall_seconds or 0.0}, step=event.step)

    def _total_steps_estimate(self) -> int | None:
        t = self.cfg.training
        gb = batch_plan(self.cfg.elastic, self.cfg.data.batch_size, t.grad_accumulation, self.ctx.size).global_batch
        per_epoch = math.ceil(self.planner.num_samples / gb)
        total = per_epoch * t.epochs
        return min(total, t.max_steps) if t.max_steps else total

    # ------------------------------------------------------------------------------------ resume
    def resume_inputs(self) -> dict[str, Any]:
        """What a resume must not change (see :mod:`elastictrain.checkpoint.resume`), as this config has it."""
        cfg = self.cfg
        return {
            "training.seed": cfg.training.seed,
            "data.drop_last": cfg.data.drop_last,
            "dataset_length": self.planner.num_samples,
            "task": cfg.task,
            "training.optimizer": cfg.training.optimizer,
        }

    def resume_from_checkpoint(self) -> None:
        """Rank 0 loads the latest verified checkpoint; the first sync hands it to everyone.

        Every rank refuses (ConfigError) a resume whose config changes the checkpoint's resume inputs,
        so the whole job stops with one line instead of rank 0 alone.
        """
        if not (self.cfg.checkpoint.enabled and self.cfg.checkpoint.resume):
            return
        storage = LocalStorage.for_run_dir(self.cfg.run_path)
        if not self.ctx.is_rank0:
            manifest = latest_manifest(storage)
            if manifest is not None:
                check_resume_inputs(manifest, self.resume_inputs(), storage.describe(storage.get_latest() or ""))
            return
        loaded = load_latest(storage, map_location="cpu")
        if loaded is None:
            return
        check_resume_inputs(loaded.manifest, self.resume_inputs(), loaded.path)
        self.committed.load_full_state(loaded.state)
        name = checkpoint_name(loaded.step)
        if read_latest(storage) != name:  # fell back past damaged ones: this run's timeline starts at `name`
            rollback_latest(storage, name)
        self.resumed_from = self._checkpointed_step = self.counters.step
        # World size 0 means "no step has run in this start of the job": after the sync every rank sees that
        # this is a start (one `start` event, no `reset`), whatever size the checkpoint was written at.
        self.resumed_world_size, self.counters.world_size = self.counters.world_size or None, 0
        if self._training_complete():
            log.info("run already complete; nothing to train", step=self.counters.step, epoch=self.sampler.epoch)
        log.info(
            "resumed from checkpoint",
            path=str(loaded.path),
            step=self.counters.step,
            epoch=self.sampler.epoch,
            cursor=self.sampler.cursor,
        )

    # ------------------------------------------------------------------------------------ the loop
    def _zero_metrics(self) -> dict[str, Any]:
        return {
            # On the training device: summed every step without a host sync, read only on logging steps.
            "loss": torch.zeros((), dtype=torch.float64, device=self.device),
            "count": 0,
            "steps": 0,
            "step_seconds": 0.0,
        }

    def _after_sync(self) -> None:
        """Start of ``train`` after a (re)start: resize handling, LR, rank-0 services, ledger marker."""
        self.ctx.refresh()
        c, cfg = self.counters, self.cfg
        bind(job=cfg.job, step=c.step)
        self._become_rank0()
        new_size = self.ctx.size
        starting = c.world_size == 0  # synced: no step has run at any size since the job (re)started
        if c.world_size != new_size:
            old = c.world_size
            current = self.ramp.at(c.step) if old else lr_scale(cfg.elastic, new_size)
            self.ramp.start, self.ramp.target = current, lr_scale(cfg.elastic, new_size)
            self.ramp.start_step, self.ramp.ramp_steps = c.step, (cfg.elastic.lr_ramp_steps if old else 0)
            if old:
                reason, ts = self.state.failure or ("hosts_changed", time.time())
                self._pending_reset = {"old_size": old, "new_size": new_size, "reason": reason, "failure_ts": ts}
            c.world_size = new_size
            # Part of the committed state at once: a rollback before the next commit must not bring back
            # the size before this reset (a 2 -> 1 shrink right after a 3 -> 2 reset is not 3 -> 1).
            self.state.save()
        elif self.state.failure is not None:
            reason, ts = self.state.failure
            self._pending_reset = {"old_size": new_size, "new_size": new_size, "reason": reason, "failure_ts": ts}
        if self._pending_reset is not None:
            self._pending_reset["lost_steps"] = self.state.lost_steps
            self.events.emit(  # by whoever holds rank 0 now (the one that saw it may be dead), at its time
                Failure(
                    step=c.step,
                    epoch=self.sampler.epoch,
                    world_size=self._pending_reset["old_size"],
                    ts=self._pending_reset["failure_ts"],
                    reason=self._pending_reset["reason"],
                    error=self.state.failure_error,
                )
            )
        self.state.failure = None
        self.state.failure_error = ""
        self.state.lost_steps = 0
        if self.ledger is not None:
            # Steps after the commit were rolled back; steps up to it that a dead rank 0 never wrote are
            # in the synced step log: write them again (replay is idempotent).
            self.ledger.restore(c.step)
            self._ledger_written = -1
            self._write_ledger()
        self._apply_lr()
        self._metrics = self._zero_metrics()
        self._last_log = (time.perf_counter(), c.step)
        hosts = self._hosts = sorted(set(hvd.allgather_object(self.ctx.host)))  # a collective: every rank
        if starting:  # once per start of the job (fresh or resumed); a new rank 0 after a reset is a `reset`
            self.events.emit(
                Start(
                    step=c.step,
                    epoch=self.sampler.epoch,
                    world_size=new_size,
                    hosts=hosts,
                    resumed_from_step=self.resumed_from,
                    resumed_world_size=self.resumed_world_size,
                    config_hash=self.config_hash,
                    run_id=self.tracker.run_id,
                    attempt=self.attempt,
                )
            )
        log.info(
            "training",
            step=c.step,
            epoch=self.sampler.epoch,
            cursor=self.sampler.cursor,
            lr=self.optimizer.param_groups[0]["lr"],
        )

    def train(self, state: ElasticTrainingState) -> None:
        """The function ``hvd.elastic.run`` calls (again after every reset)."""
        self.watchdog.idle()
        self.watchdog.snapshot_ring()
        state.last_progress_ts = time.time()
        self._after_sync()
        cfg, t = self.cfg, self.cfg.training
        while True:
            if self.stop_requested:
                raise StopRequested
            # Checked before anything runs: a reset or a resume may land exactly on the final commit.
            if self._training_complete():
                break
            plan_b = batch_plan(cfg.elastic, cfg.data.batch_size, t.grad_accumulation, self.ctx.size)
            if self.planner.epoch_done(self.sampler, plan_b.global_batch):
                self._end_epoch(state)
                continue
            self._run_epoch_part(state, plan_b.global_batch, plan_b.micro_batch)
        self._finish(state)

    def _training_complete(self) -> bool:
        """Every epoch trained, or ``max_steps`` reached (by the committed position the loop stands at)."""
        return training_complete(self.cfg.training, self.sampler.epoch, self.counters.step)

    def _run_epoch_part(self, state: ElasticTrainingState, global_batch: int, micro_batch: int) -> None:
        """Steps until the epoch ends, max_steps, or a stop; the plans are fixed for this world size."""
        cfg, c, t = self.cfg, self.counters, self.cfg.training
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
            )
        )
        if hasattr(self.train_set, "set_epoch"):
            self.train_set.set_epoch(self.sampler.epoch)
        loaded = load_batches(
            self.train_set, (mb for p in ahead for mb in p.micro_batches), cfg.data.loader_workers, self.task.collate
        )
        for plan in plans:
            if self.stop_requested or (t.max_steps is not None and c.step >= t.max_steps):
                return
            t0 = time.perf_counter()
            self.watchdog.step_started()  # the whole iteration: step, metrics, commit all hold collectives
            micro = self._micro_batches(plan, loaded)
            stats = train_step(
                self.model,
                self.optimizer,
                self.scaler,
                micro,
                plan.global_count,
                precision=self.precision,
                grad_clip_norm=t.grad_clip_norm,
                loss_fn=self.task.loss,
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
            m = self._metrics
            m["loss"] += stats.loss_sum.double()
            m["count"] += stats.count
            m["steps"] += 1
            m["step_seconds"] += time.perf_counter() - t0
            if self._pending_reset is not None:
                self._emit_reset()
            self.progress.update(c.step, world_size=self.ctx.size, epoch=self.sampler.epoch)
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

    def _micro_batches(self, plan: StepPlan, loaded: Any) -> list[Any]:
        """The plan's micro-batches from the loader, which yields one batch per planned micro-batch, in order
        (so a batch's samples are exactly the planned ids)."""
        return [next(loaded) for _ in plan.micro_batches]

    def _emit_reset(self) -> None:
        r, self._pending_reset = self._pending_reset, None
        assert r is not None
        recovery = max(0.0, time.time() - r.pop("failure_ts"))
        self.counters.resets += 1
        hosts = self._hosts  # gathered by every rank in _after_sync: no collective on only some ranks
        self.events.emit(
            Reset(
                step=self.counters.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                recovery_seconds=round(recovery, 3),
                hosts=hosts,
                **r,
            )
        )
        self.tracker.log_metrics({"recovery_seconds": recovery}, step=self.counters.step)
        self.tracker.set_tags({"hosts": ",".join(hosts)})
        log.info("reset complete", recovery_seconds=round(recovery, 3), **r)

    def _log_metrics(self) -> None:
        m, c = self._metrics, self.counters
        local = torch.tensor([float(m["loss"]), float(m["count"])], dtype=torch.float64)
        total = hvd.allreduce(local, op=hvd.Sum, name="metrics").tolist()
        now = time.perf_counter()
        t_last, s_last = self._last_log
        steps = max(1, m["steps"])
        values = {
            "loss": total[0] / max(1.0, total[1]),
            "lr": self.optimizer.param_groups[0]["lr"],
            "world_size": self.ctx.size,
            "samples_per_sec": total[1] / max(1e-9, now - t_last),
            "step_seconds": m["step_seconds"] / steps,
            "commit_seconds": self.state.last_commit_seconds,
        }
        self.events.emit(
            Metrics(
                step=c.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                steps=m["steps"],
                loss=values["loss"],
                lr=values["lr"],
                samples_per_sec=values["samples_per_sec"],
                step_seconds=values["step_seconds"],
                commit_seconds=values["commit_seconds"],
            )
        )
        self.tracker.log_metrics(values, step=c.step)
        self._last_loss = values["loss"]
        if self.ctx.is_rank0:
            log.info("metrics", step=c.step, **{k: round(v, 5) for k, v in values.items()})
        self.progress.update(c.step, world_size=self.ctx.size, epoch=self.sampler.epoch, loss=values["loss"])
        self._metrics = self._zero_metrics()
        self._last_log = (now, s_last + steps)

    def _write_ledger(self) -> None:
        """Rank 0: record the steps of the step log not yet written, *before* they are committed."""
        if self.ledger is None:
            return
        for step, epoch, start, count in self.step_log.entries or []:
            if step > self._ledger_written:
                self.ledger.record(step, epoch, self.planner.permutation(epoch)[start : start + count])
                self._ledger_written = step
        self.ledger.flush()

    def _commit(self, state: ElasticTrainingState, checkpoint: bool = False) -> None:
        """Ledger (rank 0), in-memory commit, optional checkpoint, then the host-update check (may raise)."""
        c = self.counters
        self._write_ledger()
        state.save()
        self.events.emit(
            Commit(
                step=c.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                commit_seconds=round(state.last_commit_seconds, 6),
            )
        )
        if checkpoint:
            self._checkpoint()
        state.check_host_updates()

    def _checkpoint(self, wait: bool = False) -> bool:
        """Checkpoint the *committed* state, labelled with the committed step (not the live one).

        Periodic (``wait=False``): skipped while the writer is busy; returns False. Final and SIGTERM
        (``wait=True``): returns whether the committed step is now durably checkpointed.
        """
        committed = self.committed.committed_small()
        step, sampler = committed["counters"]["step"], committed["sampler"]
        ckpt = self.checkpointer
        if ckpt is None:
            return False
        if step in (self._checkpointed_step, ckpt.stats.last_step):  # loaded at resume, or written
            return True
        args: dict[str, Any] = {
            "step": step,
            "epoch": sampler["epoch"],
            "world_size": self.ctx.size,
            "config_hash": self.config_hash,
            "meta": {
                "run_id": self.tracker.run_id,
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

    def _end_epoch(self, state: ElasticTrainingState) -> None:
        self.watchdog.step_started()
        try:
            self._end_epoch_inner(state)
        finally:
            self.watchdog.idle()

    def _end_epoch_inner(self, state: ElasticTrainingState) -> None:
        cfg, t0 = self.cfg, time.perf_counter()
        val: dict[str, float] = {}
        if self.val_set is not None and len(self.val_set):
            n = len(self.val_set)
            sizes = shares(n, self.ctx.size)
            start = sum(sizes[: self.ctx.rank])
            ids = list(range(start, start + sizes[self.ctx.rank]))
            chunks = [ids[i : i + cfg.data.batch_size] for i in range(0, len(ids), cfg.data.batch_size)]
            batches = load_batches(self.val_set, iter(chunks), 0, self.task.collate)
            with self.watchdog.paused():  # local forward passes, minutes on ImageNet: not a step
                local = eval_batches(self.model, batches, self.precision, self.task.loss, self.task.metrics)
            # Sums and counts by name from every rank (a rank with no share knows no names): exact means.
            totals: dict[str, list[float]] = {}
            for part in hvd.allgather_object(local, name="val_metrics"):
                for name, (total, count) in part.items():
                    acc = totals.setdefault(name, [0.0, 0])
                    acc[0] += total
                    acc[1] += count
            val = {f"val_{k}": s / c for k, (s, c) in totals.items() if c}
        val_loss, val_acc = val.get("val_loss"), val.get("val_accuracy")
        epoch = self.sampler.epoch
        self.events.emit(
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
            self.tracker.log_metrics(val, step=self.counters.step)
            log.info("epoch end", epoch=epoch, **{k: round(v, 4) for k, v in val.items()})
        self.last_val_accuracy = val_acc
        self.sampler.epoch += 1
        self.sampler.cursor = 0
        self._apply_lr()
        every = cfg.checkpoint.every_epochs
        self._commit(state, checkpoint=cfg.checkpoint.enabled and every is not None and self.sampler.epoch % every == 0)

    def _finish(self, state: ElasticTrainingState) -> None:
        if self._metrics["steps"]:
            self._log_metrics()
        self._write_ledger()
        state.save()
        checkpointed = None
        if self.cfg.checkpoint.enabled and self.ctx.is_rank0:
            checkpointed = self._checkpoint(wait=True)
            if not checkpointed:
                log.error("the final checkpoint could not be written", step=self.counters.step)
        self.events.emit(
            Done(
                step=self.counters.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                final_loss=self._last_loss,
                val_accuracy=getattr(self, "last_val_accuracy", None),
                checkpointed=checkpointed,
            )
        )

    def publish_report(self) -> None:
        """Rank 0, after training: the timeline PNG and summary into run_dir and MLflow (never fails the job)."""
        if not self.ctx.is_rank0:
            return
        try:
            from elastictrain.report import report

            self.events.flush(timeout=10)
            summary = report(self.cfg.run_path)
            self.tracker.log_artifact(summary["png"])
            self.tracker.log_artifact(self.cfg.run_path / "report.json")
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
        if not self.ctx.is_rank0 or self.checkpointer is None:
            return False
        if not self.committed.keeps_copy:
            self._write_ledger()
        return self._checkpoint(wait=True)

    def close(self, status: str) -> None:
        self.watchdog.stop()
        self.progress.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.ledger is not None:
            self.ledger.close()
        self.tracker.close(status=status)
        if self.tracker.dropped:
            log.warning("tracking points dropped", dropped=self.tracker.dropped)
        self.events.emit(
            TrackingClosed(
                step=self.counters.step,
                epoch=self.sampler.epoch,
                world_size=self.ctx.size,
                run_id=self.tracker.run_id,
                dropped=self.tracker.dropped,
            )
        )
        self.events.close()


def run(cfg: JobConfig) -> int:
    """Run one worker to completion: 0 when training completed, 143 when stopped by SIGTERM."""
    hvd.init()
    trainer = ElasticTrainer(cfg)
    signal.signal(signal.SIGTERM, trainer.on_sigterm)
    status = "FAILED"
    try:
        trainer.resume_from_checkpoint()
        hvd.elastic.run(trainer.train)(trainer.state)
        status = "FINISHED"
        log.info("training complete", step=trainer.counters.step)
        trainer.publish_report()
        return 0
    except StopRequested:
        ok = trainer.checkpoint_last_commit()
        trainer.events.emit(
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
