"""One optimizer step over a worker's micro-batches. No Horovod import: the optimizer may be Horovod's
``DistributedOptimizer`` (``synchronize`` / ``skip_synchronize`` are used when present) or a plain one.

The task's loss gives one value per sample; the loss of each micro-batch is their *sum* divided by the step's global
sample count, and gradients are summed across workers (``op=Sum``). The result is the exact mean gradient of the global
batch, whatever the shares: uneven, or empty on a worker that got no sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
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
    count: int
    """Samples on this worker (the length of the per-sample losses)."""


LossFn = Callable[[nn.Module, Any], torch.Tensor]


def classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Per-sample cross-entropy of a ``(inputs, labels)`` batch."""
    x, y = batch
    return F.cross_entropy(model(x).float(), y, reduction="none")


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``, whatever the nesting (mappings, lists, tuples, named
    tuples, dataclasses); other values as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: move_to(v, device) for k, v in batch.items()}
        if type(batch) is not dict:
            with contextlib.suppress(TypeError):
                return type(batch)(moved)  # type: ignore[call-arg]
        return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(move_to(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch, **{f.name: move_to(getattr(batch, f.name), device) for f in dataclasses.fields(batch) if f.init}
        )
    return batch


def per_sample(values: Any, what: str, n: int | None = None) -> torch.Tensor:
    """Check that a task function returned per-sample values: a 1-D tensor (of length ``n`` when the batch's size
    is known, as in :mod:`elastictrain.engine.task_trial`)."""
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or (n is not None and values.shape[0] != n):
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        expected = f"[{n}] for a batch of {n}" if n is not None else "[n]"
        hint = " (a scalar: return the per-sample values, e.g. reduction='none', not their mean)" if shape == () else ""
        raise ValueError(
            f"{what} must return one value per sample (a 1-D tensor of shape {expected}), got {shape}{hint}"
        )
    return values


def _sync_ctx(optimizer: Any) -> contextlib.AbstractContextManager[Any]:
    skip = getattr(optimizer, "skip_synchronize", None)
    return skip() if skip is not None else contextlib.nullcontext()


def _autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(
        device.type, dtype=precision.autocast_dtype or torch.float32, enabled=precision.autocast_dtype is not None
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    micro_batches: list[Any],
    global_count: int,
    *,
    precision: Precision,
    grad_clip_norm: float | None,
    loss_fn: LossFn = classification_loss,
    grads_ready: Callable[[], None] | None = None,
) -> StepStats:
    """One optimizer step over this worker's ``micro_batches`` (batches as the collate function made them;
    ``loss_fn(model, batch)`` gives their per-sample losses). ``grads_ready`` is called once the backward passes
    are done, before the step waits for the other workers' gradients."""
    device = next(model.parameters()).device
    optimizer.zero_grad()  # torch >= 2.0 sets grads to None (Horovod's wrapper takes no argument)
    if (
        micro_batches
        and hasattr(optimizer, "set_backward_passes_per_step")
        and getattr(optimizer, "backward_passes_per_step", 1) != len(micro_batches)
    ):
        optimizer.set_backward_passes_per_step(len(micro_batches))
    loss_sum = torch.zeros((), device=device)
    count = 0
    for batch in micro_batches:
        batch = move_to(batch, device)
        with _autocast(device, precision):
            losses = per_sample(loss_fn(model, batch), "the task's loss")
            loss = losses.float().sum()
        scaled = loss / global_count
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += loss.detach()
        count += losses.shape[0]
    if grads_ready is not None:
        grads_ready()
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
    return StepStats(loss_sum, count)


@torch.no_grad()
def eval_batches(
    model: nn.Module,
    batches: Iterable[Any],
    precision: Precision,
    loss_fn: LossFn = classification_loss,
    metrics_fn: Callable[[nn.Module, Any], Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, tuple[float, int]]:
    """Sums and counts of the per-sample ``loss`` and of each metric over ``batches``: ``{name: (sum, n)}``."""
    device = next(model.parameters()).device
    totals: dict[str, tuple[float, int]] = {}

    def add(name: str, values: Any) -> None:
        v = per_sample(values, f"the task's {'loss' if name == 'loss' else 'metric ' + repr(name)}")
        s, n = totals.get(name, (0.0, 0))
        totals[name] = (s + float(v.double().sum()), n + v.shape[0])

    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            batch = move_to(batch, device)
            with _autocast(device, precision):
                add("loss", loss_fn(model, batch))
                for name, values in (metrics_fn(model, batch) if metrics_fn is not None else {}).items():
                    add(str(name), values)
    finally:
        model.train(was_training)
    return totals
