"""The built-in task: image classification with a small CNN or a torchvision architecture.

``task: elastictrain.tasks.image:build`` (the task of a config without ``task``). Its settings are
``task_args`` (:class:`ImageTaskArgs`); configs written before the Task API may keep them as ``model.name``,
``data.kind``, ... (``elastictrain.config.IMAGE_TASK_KEYS``). The data is synthetic (a learnable generated set)
or a torchvision ImageFolder; the loss is cross-entropy per sample; validation reports ``accuracy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from elastictrain.config import ConfigError, build_section
from elastictrain.engine.data import SeededImageFolder, SyntheticImages, image_transforms
from elastictrain.engine.models import build_model
from elastictrain.task import Task


@dataclass(kw_only=True, frozen=True, slots=True)
class ImageTaskArgs:
    model: str = "small_cnn"
    """``small_cnn`` (built in, for CPU runs) or a torchvision classification architecture (resnet18, resnet50, ...)."""
    num_classes: int = 10
    """Size of the classifier head."""
    channels_last: bool = False
    """Use the channels-last memory format (faster convolutions on GPUs with tensor cores)."""
    data: Literal["synthetic", "image_folder"] = "synthetic"
    """``synthetic``: a deterministic generated dataset; ``image_folder``: torchvision ImageFolder at ``path``."""
    path: str | None = None
    """Training images (ImageFolder layout: one sub-folder per class); required for ``image_folder``."""
    val_path: str | None = None
    """Validation images; none means no validation for ``image_folder``."""
    image_size: int = 32
    """Side of the (square) training crop in pixels."""
    num_samples: int = 2048
    """Training samples of the synthetic dataset."""
    num_val_samples: int = 512
    """Validation samples of the synthetic dataset."""
    augment: bool = True
    """Random-resized-crop and flip for training (the classic ImageNet transforms); off gives resize + center crop."""
    label_smoothing: float = 0.0
    seed: int | None = None
    """Seed of the synthetic data and of augmentation; none means the job's ``training.seed``."""

    def __post_init__(self) -> None:
        def check(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"task_args.{key}: {msg}")

        check(bool(self.model), "model", "must not be empty")
        check(self.num_classes >= 2, "num_classes", f"must be >= 2, got {self.num_classes}")
        check(self.image_size >= 8, "image_size", f"must be >= 8, got {self.image_size}")
        check(self.num_samples >= 1, "num_samples", f"must be >= 1, got {self.num_samples}")
        check(self.num_val_samples >= 0, "num_val_samples", f"must be >= 0, got {self.num_val_samples}")
        check(0.0 <= self.label_smoothing < 1.0, "label_smoothing", "must be in [0, 1)")
        if self.data == "image_folder":
            check(self.path is not None, "path", "is required when task_args.data is image_folder")


def build_datasets(args: ImageTaskArgs, seed: int) -> tuple[Any, Any]:
    """Training and validation datasets (validation may be None)."""
    if args.data == "synthetic":
        train = SyntheticImages(args.num_samples, args.num_classes, args.image_size, seed)
        val = None
        if args.num_val_samples:
            val = SyntheticImages(args.num_val_samples, args.num_classes, args.image_size, seed)
            val.seed = seed + 1_000_003  # different samples, same class templates
            val.templates = train.templates
        return train, val
    assert args.path is not None
    train_ds = SeededImageFolder(
        args.path, image_transforms(args.image_size, True, args.augment), seed, num_classes=args.num_classes
    )
    val_ds = None
    if args.val_path:
        val_ds = SeededImageFolder(
            args.val_path, image_transforms(args.image_size, False, False), seed, key="task_args.val_path"
        )
    return train_ds, val_ds


def build(**kwargs: Any) -> Task:
    """The image classification task for ``task_args`` (see :class:`ImageTaskArgs`)."""
    args: ImageTaskArgs = build_section(ImageTaskArgs, kwargs, "task_args")
    seed = torch.initial_seed() if args.seed is None else args.seed
    model = build_model(args.model, args.num_classes)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    train, val = build_datasets(args, seed)
    channels_last, smoothing = args.channels_last, args.label_smoothing

    def inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), y

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = inputs(batch)
        return F.cross_entropy(model(x).float(), y, reduction="none", label_smoothing=smoothing)

    def metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = inputs(batch)
        return {"accuracy": (model(x).argmax(1) == y).float()}

    return Task(model=model, train_data=train, val_data=val, loss=loss, metrics=metrics)
