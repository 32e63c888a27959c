"""The Task API: the user's model, data and loss, as one value the engine trains.

A config names a function, ``task: mypkg.lm:build``, and ``task_args`` its keyword arguments; every worker
calls ``build(**task_args)`` and gets a :class:`Task`. The engine does everything else (exactly-once data,
device moves, AMP, accumulation, gradient weighting, LR policy, commits, checkpoints, events, MLflow).

Contract of ``build``:

- it runs after ``torch.manual_seed(training.seed)`` (so ``torch.initial_seed()`` is the job's seed and the
  initial weights are the same on every worker); it builds the model on the CPU, the engine moves it;
- ``launch`` and ``config validate`` call it on the meta device (``with torch.device("meta")``) to check it
  before starting anything, falling back to the CPU when the meta device cannot run it, and then once more on
  the CPU to try the loss and metrics on two real samples (:mod:`elastictrain.engine.task_trial`); so it should not
  do slow work that a check does not need (read data lazily, in the dataset).

Sample ids for the ledger are the indices the engine asks the dataset for; datasets need not return ids.
A dataset with a ``set_epoch(epoch)`` method is told the epoch before the engine loads from it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elastictrain.config import ConfigError, JobConfig
from elastictrain.errors import one_line

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss(model, batch) -> Tensor[n]``: the per-sample losses of a batch of ``n`` samples."""
MetricsFn = Callable[[nn.Module, Any], Mapping[str, torch.Tensor]]
"""``metrics(model, batch) -> {name: Tensor[n]}``: per-sample values, averaged over the whole validation set."""


class TaskError(ConfigError):
    """A task that cannot be imported, built or used; the message is one line naming the task."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """What a task function returns. Required: ``model``, ``train_data``, ``loss``; the rest is optional."""

    model: nn.Module
    """The model to train (built on the CPU; the engine moves it to the device)."""
    train_data: Any
    """A map-style dataset: ``len(train_data)`` and ``train_data[i]`` (exactly-once needs both)."""
    loss: LossFn
    """``loss(model, batch) -> Tensor[n]``: per-sample losses. The engine sums them and divides by the step's
    global sample count, so uneven shares over workers weigh every sample the same."""
    val_data: Any = None
    """A map-style validation dataset; evaluated at every epoch's end (``val_loss`` plus the metrics)."""
    metrics: MetricsFn | None = None
    """``metrics(model, batch) -> {name: Tensor[n]}``: per-sample values, averaged exactly over the whole
    validation set across workers and logged as ``val_<name>``."""
    collate: Callable[[list[Any]], Any] | None = None
    """Samples -> batch; default ``torch.utils.data.default_collate``."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    """``optimizer(params) -> Optimizer``; default: ``training.optimizer`` with ``training.*`` settings. Its
    learning rates are those at ``elastic.base_world_size``; the engine scales them and applies the schedule."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TaskError(f"Task.model must be a torch.nn.Module, got {type(self.model).__name__}")
        for name in ("train_data", "val_data"):
            data = getattr(self, name)
            if data is None and name == "val_data":
                continue
            missing = [m for m in ("__len__", "__getitem__") if not hasattr(data, m)]
            if missing:
                raise TaskError(
                    f"Task.{name} must be a map-style dataset with __len__ and __getitem__ "
                    f"({type(data).__name__} lacks {' and '.join(missing)})"
                )
        for name in ("loss", "metrics", "collate", "optimizer"):
            fn = getattr(self, name)
            if (fn is not None or name == "loss") and not callable(fn):
                raise TaskError(f"Task.{name} must be callable, got {type(fn).__name__}")


# ---------------------------------------------------------------------------------------------- loading
def add_import_paths(config_path: str | os.PathLike[str] | None) -> None:
    """Make a task module next to the user importable: the working directory and the config file's folder go
    on ``sys.path`` (after what is there, so installed packages win)."""
    for p in (Path.cwd(), Path(config_path).resolve().parent if config_path else None):
        if p is not None and str(p) not in sys.path:
            sys.path.append(str(p))


def resolve_builder(spec: str) -> Callable[..., Any]:
    """``module:function`` -> the function; :class:`TaskError` with one line when it cannot be found."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise TaskError(f"task: must be 'module:function' (e.g. mypkg.lm:build), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise TaskError(
                f"task: cannot import module {module_name!r} (no module named {e.name!r}; "
                "is it on PYTHONPATH, the working directory or the config's folder?)"
            ) from None
        raise TaskError(f"task: importing {module_name!r} failed: {one_line(e)}") from None
    except Exception as e:
        raise TaskError(f"task: importing {module_name!r} failed: {one_line(e)}") from None
    fn = getattr(module, func_name, None)
    if fn is None:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        hint = difflib.get_close_matches(func_name, names, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise TaskError(f"task: module {module_name!r} has no function {func_name!r}{extra}")
    if not callable(fn):
        raise TaskError(f"task: {spec} is a {type(fn).__name__}, not a function")
    return fn


def _call_build(spec: str, fn: Callable[..., Any], args: Mapping[str, Any]) -> Task:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**args)
        except TypeError as e:
            params = [n for n, p in sig.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
            unknown = [k for k in args if k not in params]
            if unknown and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
                hint = difflib.get_close_matches(unknown[0], params, n=1)
                extra = f" (did you mean 'task_args.{hint[0]}'?)" if hint else ""
                raise TaskError(f"task_args.{unknown[0]}: {spec} takes no such argument{extra}") from None
            raise TaskError(f"task_args: do not fit {spec}{sig} ({e})") from None
    try:
        task = fn(**args)
    except ConfigError:
        raise
    except Exception as e:
        raise TaskError(f"task: {spec} raised {one_line(e)}") from e
    if not isinstance(task, Task):
        raise TaskError(f"task: {spec} returned {type(task).__name__}, not an elastictrain.Task")
    return task


def build_task(cfg: JobConfig) -> Task:
    """Import the config's task and build it on the CPU, after seeding torch with ``training.seed``."""
    fn = resolve_builder(cfg.task)
    torch.manual_seed(cfg.training.seed)
    return _call_build(cfg.task, fn, cfg.task_args)


def validate_task(cfg: JobConfig) -> Task:
    """Check the config's task without training: import it and build it on the meta device (no memory, no
    initialisation), or on the CPU when the meta device cannot run the task's function. Raises :class:`TaskError`."""
    fn = resolve_builder(cfg.task)
    torch.manual_seed(cfg.training.seed)
    try:
        with torch.device("meta"):
            return _call_build(cfg.task, fn, cfg.task_args)
    except TaskError as e:
        if e.__cause__ is None:  # not an exception of the user's function: the meta device is not to blame
            raise
    torch.manual_seed(cfg.training.seed)
    return _call_build(cfg.task, fn, cfg.task_args)


def describe(task: Task) -> str:
    """One line about a built task, for ``config validate``."""
    params = sum(p.numel() for p in task.model.parameters())
    parts = [f"model {type(task.model).__name__} ({params:,} parameters)"]
    parts.append(f"train_data {type(task.train_data).__name__}")
    if task.val_data is not None:
        parts.append(f"val_data {type(task.val_data).__name__}")
    return ", ".join(parts)


def check_dataset_size(task: Task) -> int:
    """``len(train_data)``, which must be at least 1 (the engine plans every epoch over it)."""
    try:
        n = len(task.train_data)
    except ConfigError:
        raise
    except Exception as e:
        raise TaskError(f"task: len(train_data) failed: {one_line(e)}") from e
    if not isinstance(n, int) or n < 1:
        raise TaskError(f"task: train_data must hold at least one sample, len() is {n!r}")
    return n
