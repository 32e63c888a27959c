"""Build a worker's training objects from the config and its task: the device, the model, the distributed
optimizer, the LR scheduler, the GradScaler, the data plan and the state that commits them all.

The world is only read (``local_rank`` picks the GPU, ``local_size`` shares the CPU cores) and the optimizer
is wrapped by the :class:`~elastictrain.engine.collective.Collective`; nothing here runs a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from elastictrain.config import ConfigError, JobConfig
from elastictrain.engine.collective import Collective
from elastictrain.engine.health.shares import ShareState
from elastictrain.engine.policy import ScaleRamp, schedule_factor
from elastictrain.engine.sampler import ExactlyOncePlanner, SamplerState, StepLog
from elastictrain.engine.state import CommittedState, Counters, make_state
from elastictrain.engine.step import Precision
from elastictrain.task import Task, TaskError, build_task, check_dataset_size


@dataclass(slots=True)
class TrainingParts:
    """What a worker trains with. ``state`` commits ``model``, ``optimizer``, ``scheduler``, ``scaler`` and the
    counters, sampler position, LR ramp and step log it holds (``state.counters``, ``state.sampler``...)."""

    task: Task
    device: torch.device
    precision: Precision
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    planner: ExactlyOncePlanner
    state: CommittedState
    group_lrs: list[float]
    """Each parameter group's LR at ``elastic.base_world_size``, before world-size scaling and schedule."""


def build_parts(cfg: JobConfig, collective: Collective) -> TrainingParts:
    t = cfg.training
    device = pick_device(cfg.device, collective)
    task = build_task(cfg)  # seeded with t.seed: the same initial weights everywhere (then synced anyway)
    model = task.model.to(device)
    planner = ExactlyOncePlanner(check_dataset_size(task), t.seed, cfg.data.drop_last)
    sampler = SamplerState()
    base = base_optimizer(cfg, task, model)
    group_lrs = [float(g["lr"]) for g in base.param_groups]
    optimizer = collective.distributed_optimizer(base, model.named_parameters(), cfg.compression.gradients)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lr_lambda=lambda _: schedule_factor(t.schedule, t, sampler.epoch + sampler.cursor / planner.num_samples),
    )
    precision = Precision.resolve(cfg.precision.mode, device)
    scaler = torch.amp.GradScaler("cuda") if precision.use_scaler else None
    # With the audit on, the last steps' plans travel with the committed state (see StepLog).
    step_log = StepLog(maxlen=4 * cfg.elastic.commit_every_steps + 8 if cfg.audit.sample_ledger else 0)
    state = make_state(
        cfg.elastic.rollback,
        model,
        optimizer,
        scheduler,
        scaler,
        sampler,
        Counters(),
        ScaleRamp(1.0, 1.0, 0, 0),
        step_log,
        ShareState() if cfg.elastic.stragglers == "balance" else None,
    )
    return TrainingParts(task, device, precision, model, optimizer, scheduler, scaler, planner, state, group_lrs)


def pick_device(want: str, collective: Collective) -> torch.device:
    """``cuda`` (the GPU of this local rank), or the CPU with the cores shared among this machine's workers."""
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but no CUDA device is available")
        torch.cuda.set_device(collective.local_rank() % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    # Logical hosts on one machine each have local_size 1, so the launcher sets OMP_NUM_THREADS for them.
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(
        int(threads)
        if threads and threads.isdigit() and int(threads) > 0
        else max(1, (os.cpu_count() or 1) // max(1, collective.local_size()))
    )
    return torch.device("cpu")


def base_optimizer(cfg: JobConfig, task: Task, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The task's optimizer, or the one ``training.*`` describes (before the collective wraps it)."""
    t = cfg.training
    if task.optimizer is not None:
        opt = task.optimizer(model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise TaskError(f"task: Task.optimizer returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt
    if t.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=t.base_lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=t.base_lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=t.nesterov
    )
