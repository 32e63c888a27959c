"""One optimizer step over a worker's micro-batches. No Horovod import: the optimizer may be Horovod's
``DistributedOptimizer`` (``synchronize`` / ``skip_synchronize`` are used when present) or a plain one.

The loss of each micro-batch is a *sum* over its samples divided by the step's global sample count,
and gradients are summed across workers (``op=Sum``). The result is the exact mean gradient of the
global batch, whatever the shares: uneven, or empty on a worker that got no sample.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class Precision:
    autocast_dtype: torch.dtype | None
    use_scaler: bool

    @staticmethod
    def resolve(mode: str, device: torch.device) -> Precision:
        """fp16 on CUDA: autocast + GradScaler; fp16 on CPU falls back to bf16 autocast (no fp16 CPU kernels)."""
        if mode == "fp32":
            return Precision(None, False)
        if mode == "bf16" or device.type != "cuda":
            return Precision(torch.bfloat16, False)
        return Precision(torch.float16, True)


@dataclass(slots=True)
class StepStats:
    loss_sum: torch.Tensor
    """Sum of per-sample losses on this worker (a tensor: no host sync in the step)."""
    correct: torch.Tensor
    count: int


def _sync_ctx(optimizer: Any) -> contextlib.AbstractContextManager[Any]:
    skip = getattr(optimizer, "skip_synchronize", None)
    return skip() if skip is not None else contextlib.nullcontext()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    global_count: int,
    *,
    precision: Precision,
    grad_clip_norm: float | None,
    label_smoothing: float = 0.0,
) -> StepStats:
    device = next(model.parameters()).device
    optimizer.zero_grad()  # torch >= 2.0 sets grads to None (Horovod's wrapper takes no argument)
    if (
        micro_batches
        and hasattr(optimizer, "set_backward_passes_per_step")
        and getattr(optimizer, "backward_passes_per_step", 1) != len(micro_batches)
    ):
        optimizer.set_backward_passes_per_step(len(micro_batches))
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    count = 0
    for x, y in micro_batches:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast(
            device.type, dtype=precision.autocast_dtype or torch.float32, enabled=precision.autocast_dtype is not None
        ):
            out = model(x)
            loss = F.cross_entropy(out.float(), y, reduction="sum", label_smoothing=label_smoothing)
        scaled = loss / global_count
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += loss.detach()
        correct += (out.detach().argmax(1) == y).sum()
        count += len(y)
    # Average over workers first, then unscale and clip the *averaged* gradients, then step once.
    synchronize = getattr(optimizer, "synchronize", None)
    if synchronize is not None:
        synchronize()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if grad_clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
    with _sync_ctx(optimizer):
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return StepStats(loss_sum, correct, count)


@torch.no_grad()
def eval_batches(model: nn.Module, batches: Any, precision: Precision) -> torch.Tensor:
    """Sum of loss, correct predictions and samples over ``batches`` as one tensor ``[loss, correct, n]``."""
    device = next(model.parameters()).device
    totals = torch.zeros(3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for x, y, _ids in batches:
            x, y = x.to(device), y.to(device)
            with torch.autocast(
                device.type,
                dtype=precision.autocast_dtype or torch.float32,
                enabled=precision.autocast_dtype is not None,
            ):
                out = model(x)
            totals[0] += float(F.cross_entropy(out.float(), y, reduction="sum"))
            totals[1] += float((out.argmax(1) == y).sum())
            totals[2] += len(y)
    finally:
        model.train(was_training)
    return totals
