"""World-size policies: how the global batch and the learning rate follow the number of workers.

Pure functions of the config, the world size and the training progress; no Horovod here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastictrain.config import ElasticConfig, ScheduleConfig, TrainingConfig


@dataclass(frozen=True, slots=True)
class BatchPlan:
    global_batch: int
    """Samples per optimizer step over all workers."""
    micro_batch: int
    """Largest forward/backward pass on one worker."""


def batch_plan(elastic: ElasticConfig, per_worker_batch: int, grad_accumulation: int, world_size: int) -> BatchPlan:
    """``per_worker``: world x per-worker batch x accumulation; ``global``: the fixed global batch."""
    if elastic.policy == "global":
        assert elastic.global_batch_size is not None
        return BatchPlan(elastic.global_batch_size, elastic.micro_batch_size)
    return BatchPlan(world_size * per_worker_batch * grad_accumulation, per_worker_batch)


def lr_scale(elastic: ElasticConfig, world_size: int) -> float:
    """LR multiplier at ``world_size`` relative to ``elastic.base_world_size`` (1 under ``global``)."""
    if elastic.policy == "global" or elastic.lr_scaling == "none":
        return 1.0
    ratio = world_size / elastic.base_world_size
    return ratio if elastic.lr_scaling == "linear" else math.sqrt(ratio)


@dataclass(slots=True)
class ScaleRamp:
    """The LR multiplier over steps after a resize: linear from ``start`` to ``target`` over ``ramp_steps``."""

    start: float
    target: float
    start_step: int
    ramp_steps: int

    def at(self, step: int) -> float:
        if self.ramp_steps <= 0 or step >= self.start_step + self.ramp_steps:
            return self.target
        frac = max(0.0, (step - self.start_step) / self.ramp_steps)
        return self.start + (self.target - self.start) * frac

    def state_dict(self) -> dict[str, float | int]:
        return {
            "start": self.start,
            "target": self.target,
            "start_step": self.start_step,
            "ramp_steps": self.ramp_steps,
        }

    def load_state_dict(self, d: dict[str, float | int]) -> None:
        self.start, self.target = float(d["start"]), float(d["target"])
        self.start_step, self.ramp_steps = int(d["start_step"]), int(d["ramp_steps"])


def schedule_factor(sched: ScheduleConfig, training: TrainingConfig, progress_epochs: float) -> float:
    """LR factor at a point of training measured in epochs (``epoch + cursor / num_samples``).

    Measured in epochs rather than steps, so the schedule does not shift when the number of steps per
    epoch changes with the world size.
    """
    p = max(0.0, progress_epochs)
    if sched.warmup_epochs > 0 and p < sched.warmup_epochs:
        return 0.1 + 0.9 * p / sched.warmup_epochs
    if sched.kind == "constant":
        return 1.0
    if sched.kind == "multistep":
        return sched.gamma ** sum(1 for m in sched.milestones if p >= m)
    span = max(1e-9, training.epochs - sched.warmup_epochs)
    t = min(1.0, (p - sched.warmup_epochs) / span)
    return sched.min_lr_ratio + (1 - sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def schedule_finished(t: TrainingConfig, epoch: int, step: int) -> bool:
    """Whether a run standing at ``epoch`` (epochs finished) and ``step`` has nothing left to train."""
    return epoch >= t.epochs or (t.max_steps is not None and step >= t.max_steps)
