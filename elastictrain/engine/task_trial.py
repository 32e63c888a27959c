"""Try a task before a job starts: its collate, loss and metrics on a batch of real samples, on the CPU.

``config validate`` and ``launch`` (through ``config validate``, before etcd, agents or horovodrun start) call
:func:`try_task` after the task has built on the meta device. It takes the first :data:`TRIAL_SAMPLES` samples
of ``train_data``, collates them with the task's ``collate`` (default: torch's), and checks the contract the
engine relies on:

- ``loss(model, batch)``, in train mode: a tensor of shape ``[n]`` for a batch of ``n``, finite, and with a
  gradient (it depends on the model's parameters: the engine calls ``backward`` on its sum);
- ``metrics(model, batch)``, in eval mode without gradients, on the first samples of ``val_data`` (of
  ``train_data`` when there is none): a mapping ``{name: tensor of shape [n]}``, finite; the loss on that
  batch too, as the validation runs it.

The model is the task's own, built for real on the CPU (``build`` called again after the same seeding), when
the meta build counted at most :data:`REAL_MODEL_MAX_PARAMETERS` parameters. A larger model runs on the meta
device: the samples are moved there and only shapes and gradients are checked (a meta tensor has no values).

Every violation raises :class:`~elastictrain.task.TaskError` with one line. :func:`time_limit` bounds it
(``config validate --trial-seconds``, which ``launch --task-trial-seconds`` sets). The trial runs where
``launch`` runs: on a cluster's launcher node, which must be able to read the first samples, and on the CPU, so
a model that only runs on a GPU needs ``--no-task-trial``.
"""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from elastictrain.config import ConfigError, JobConfig
from elastictrain.engine.step import move_to, per_sample
from elastictrain.errors import one_line
from elastictrain.task import Task, TaskError, build_task

TRIAL_SAMPLES = 2
REAL_MODEL_MAX_PARAMETERS = 100_000_000
"""Up to this many parameters (400 MB in fp32) the trial builds the model for real; above it, on the meta device."""


class TrialTimeout(TaskError):
    """The trial ran past its time limit (raised from a SIGALRM handler, through the user's code)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TrialTimeout` in the main thread when the block runs longer than ``seconds``. User code that
    catches every ``Exception`` can swallow it; the launcher's own timeout on ``config validate`` still holds."""

    def expired(_signum: int, _frame: object) -> None:
        raise TrialTimeout(
            f"task: trying the task on real samples took over {seconds:g}s (raise the limit with launch"
            " --task-trial-seconds or config validate --trial-seconds, or skip the trial with --no-task-trial or"
            " --no-trial)"
        )

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True, slots=True)
class TrialResult:
    samples: int
    device: str
    """``cpu`` (values checked) or ``meta`` (shapes only)."""
    metrics: tuple[str, ...]

    def __str__(self) -> str:
        what = "loss" + (f" and metrics {', '.join(self.metrics)}" if self.metrics else "")
        checked = "shape, finite, gradient" if self.device == "cpu" else "shape and gradient; meta device"
        return f"{what} tried on {self.samples} samples ({checked})"


def try_task(cfg: JobConfig, built: Task) -> TrialResult:
    """Run ``built``'s collate, loss and metrics on real samples (see the module's docstring); raise
    :class:`TaskError` with one line on the first violation. ``built`` is the meta-device build."""
    params = sum(p.numel() for p in built.model.parameters())
    if params <= REAL_MODEL_MAX_PARAMETERS:
        task, device = build_task(cfg), torch.device("cpu")
    else:
        task, device = built, torch.device("meta")
    model = task.model.to(device)
    if not any(p.requires_grad for p in model.parameters()):
        raise TaskError("task: the model has no parameter that requires a gradient: there is nothing to train")
    batch, n = _batch(task, "train_data", device)
    model.train()
    losses = _call(lambda: task.loss(model, batch), "loss(model, batch)", "train_data", n)
    _check(losses, "the task's loss", n, device, "train_data")
    if not losses.requires_grad:
        raise TaskError(
            "task: the loss has no gradient: it must be computed from the model's output, "
            "without torch.no_grad(), .detach() or .item()"
        )
    names: tuple[str, ...] = ()
    if task.metrics is not None or task.val_data is not None:
        source = "val_data" if task.val_data is not None else "train_data"
        vbatch, vn = _batch(task, source, device) if source == "val_data" else (batch, n)
        model.eval()
        with torch.no_grad():
            _check(_call(lambda: task.loss(model, vbatch), "loss(model, batch)", source, vn), "the task's loss",
                   vn, device, source)  # fmt: skip
            if task.metrics is not None:
                metrics = task.metrics
                values = _call(lambda: metrics(model, vbatch), "metrics(model, batch)", source, vn)
                if not isinstance(values, Mapping):
                    raise TaskError(
                        f"task: metrics must return a mapping {{name: Tensor[n]}}, got {type(values).__name__}"
                    )
                for name, value in values.items():
                    _check(value, f"the task's metric {name!r}", vn, device, source)
                names = tuple(str(k) for k in values)
    return TrialResult(samples=n, device=device.type, metrics=names)


def _batch(task: Task, source: str, device: torch.device) -> tuple[Any, int]:
    data = getattr(task, source)
    set_epoch = getattr(data, "set_epoch", None)
    if callable(set_epoch):
        _call(lambda: set_epoch(0), f"{source}.set_epoch(0)", source, None)
    try:
        n = min(TRIAL_SAMPLES, len(data))
    except ConfigError:
        raise  # already one line for the user (a dataset path that is not there)
    except Exception as e:
        raise TaskError(f"task: len({source}) failed: {one_line(e)}") from None
    if n < 1:
        raise TaskError(f"task: {source} must hold at least one sample, len() is {len(data)}")
    samples = [_call(functools.partial(data.__getitem__, i), f"{source}[{i}]", None, None) for i in range(n)]
    collate = task.collate or default_collate
    batch = _call(lambda: collate(samples), "collating", source, n)
    return move_to(batch, device), n


def _call(fn: Callable[[], Any], what: str, source: str | None, n: int | None) -> Any:
    try:
        return fn()
    except ConfigError:  # a TaskError, the trial's timeout, or the task's own one-line error: as it is
        raise
    except Exception as e:
        on = f" (on {source}[0:{n}], on the CPU)" if source is not None and n is not None else ""
        raise TaskError(f"task: {what} raised {one_line(e)}{on}") from None


def _check(values: Any, what: str, n: int, device: torch.device, source: str) -> torch.Tensor:
    try:
        per_sample(values, what, n)
    except ValueError as e:
        raise TaskError(f"task: {e}") from None
    checked = values.detach().float()
    if device.type != "meta" and not bool(torch.isfinite(checked).all()):
        kind = "nan" if bool(torch.isnan(checked).any()) else "inf"
        raise TaskError(f"task: {what} returned non-finite values ({kind}) for {source}[0:{n}] on the CPU")
    return values
