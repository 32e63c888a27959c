"""Validation at an epoch end: every rank evaluates a share of the validation set; exact means over all of it."""

from __future__ import annotations

import torch

from elastictrain.engine.collective import Collective
from elastictrain.engine.data import load_batches
from elastictrain.engine.health.watchdog import CollectiveWatchdog, NullWatchdog
from elastictrain.engine.sampler import shares
from elastictrain.engine.step import Precision, eval_batches
from elastictrain.task import Task


def validate(
    task: Task,
    model: torch.nn.Module,
    precision: Precision,
    collective: Collective,
    *,
    batch_size: int,
    watchdog: CollectiveWatchdog | NullWatchdog,
) -> dict[str, float]:
    """``{"val_loss": ..., "val_<metric>": ...}``: means of the task's loss and metrics over the whole validation
    set (a collective: every rank calls it). Empty without validation data."""
    val_set = task.val_data
    if val_set is None or not len(val_set):
        return {}
    rank, size = collective.rank(), collective.size()
    sizes = shares(len(val_set), size)
    start = sum(sizes[:rank])
    ids = list(range(start, start + sizes[rank]))
    chunks = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
    batches = load_batches(val_set, iter(chunks), 0, task.collate)
    with watchdog.paused():  # local forward passes, minutes on ImageNet: not a step
        local = eval_batches(model, batches, precision, task.loss, task.metrics)
    # Sums and counts by name from every rank (a rank with no share knows no names): exact means.
    totals: dict[str, list[float]] = {}
    for part in collective.allgather_object(local, name="val_metrics"):
        for name, (total, count) in part.items():
            acc = totals.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += count
    return {f"val_{k}": s / n for k, (s, n) in totals.items() if n}
