"""elastictrain's contender in the peer benchmark: the shared task (:mod:`task`) as an ``elastictrain.Task``.

A config names it as ``task: elastictrain_task:build`` (this folder on ``PYTHONPATH``), and the job runs as
``elastictrain launch`` runs it (hot join, ``elastic.rollback: none``). The engine owns the loop, so the step
log is written from the task's own parts: the loss marks a step's start and the indices it trains on, and
the optimizer (SGD, with a ``steplog_step`` counter in its param group that the engine commits, syncs and
rolls back with the rest of the optimizer state) writes the line after each step.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from steplog import StepLogWriter
from task import IndexedImages, build_model, build_optimizer, steplog_dir, writer_name
from torch import nn

from elastictrain import Task

_writer: StepLogWriter | None = None
_ids: list[int] = []
_epoch = 0


def _log() -> StepLogWriter:
    global _writer
    if _writer is None:
        _writer = StepLogWriter(steplog_dir(), writer_name(os.environ.get("HOROVOD_HOSTNAME", socket.gethostname())))
    return _writer


class _Data(IndexedImages):
    def set_epoch(self, epoch: int) -> None:
        global _epoch
        _epoch = epoch


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """One call per step here (no accumulation: a micro-batch is the whole per-worker batch), so each call starts a
    step afresh: a step that a peer's death aborted after its loss leaves neither its ids nor its start behind."""
    x, y, idx = batch
    log = _log()
    log.t0 = None
    _ids[:] = [int(i) for i in idx]
    log.started(_ids, _epoch)
    return F.cross_entropy(model(x), y, reduction="none")


class StepLoggingSGD(torch.optim.SGD):
    """SGD that writes a step-log line after every step (its counter lives in ``param_groups[0]``)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        import horovod.torch as hvd

        self.param_groups[0]["steplog_step"] = int(self.param_groups[0].get("steplog_step", 0)) + 1
        _log().ended(step=self.param_groups[0]["steplog_step"], epoch=_epoch, world=hvd.size(), ids=_ids)
        _ids.clear()
        return out


def _optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    base = build_optimizer(params)
    opt = StepLoggingSGD(base.param_groups)
    opt.param_groups[0]["steplog_step"] = 0
    return opt


def build() -> Task:
    return Task(model=build_model(), train_data=_Data(), loss=_loss, optimizer=_optimizer)
