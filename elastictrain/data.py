"""Datasets that return ``(image, label, sample_id)``, with augmentation seeded per sample.

Randomness in a sample's transform comes from ``(seed, epoch, sample_id)``, not from the process's
RNG, so a sample looks the same whichever worker loads it and however often a step is re-run after
a rollback. That keeps the ``global`` policy's maths independent of membership.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from elastictrain.config import ConfigError, DataConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed for one sample's randomness in one epoch (SplitMix64-style mixing)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + sample_id * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    return x & (2**63 - 1)


class SyntheticImages(Dataset):
    """A deterministic, learnable image set: each class is a fixed random template plus per-sample noise.

    Sample ``i`` is generated from ``(seed, i)`` alone, so it is identical on every worker and rerun.
    """

    def __init__(self, num_samples: int, num_classes: int, image_size: int, seed: int, noise: float = 0.8) -> None:
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.image_size = image_size
        self.seed = seed
        self.noise = noise
        g = torch.Generator().manual_seed(sample_seed(seed, -1, 0))
        self.templates = torch.randn(num_classes, 3, image_size, image_size, generator=g)
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        g = torch.Generator().manual_seed(sample_seed(self.seed, -2, index))
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        x = self.templates[label] + self.noise * torch.randn(3, self.image_size, self.image_size, generator=g)
        return x, label, index


class SeededImageFolder(Dataset):
    """torchvision ``ImageFolder`` whose transforms draw from a per-(epoch, sample) seed."""

    def __init__(self, root: str, transform: Callable[[Any], torch.Tensor], seed: int) -> None:
        from torchvision.datasets import ImageFolder

        if not Path(root).is_dir():
            raise ConfigError(f"data.path: {root} is not a directory (expected an ImageFolder: <root>/<class>/*.png)")
        try:
            self.inner = ImageFolder(root)
        except (FileNotFoundError, RuntimeError) as e:
            raise ConfigError(f"data.path: {root} is not a usable ImageFolder ({str(e).splitlines()[0]})") from None
        self.transform = transform
        self.seed = seed
        self.epoch = 0
        self.classes = self.inner.classes

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        img, label = self.inner[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, self.epoch, index))
            x = self.transform(img)
        return x, int(label), index


def image_transforms(image_size: int, train: bool, augment: bool) -> Callable[[Any], torch.Tensor]:
    """The classic ImageNet transforms: random-resized-crop + flip for training, resize + center crop else."""
    from torchvision import transforms as T

    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if train and augment:
        return T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    resize = max(image_size, round(image_size * 256 / 224))
    return T.Compose([T.Resize(resize), T.CenterCrop(image_size), T.ToTensor(), normalize])


def build_datasets(cfg: DataConfig, num_classes: int, seed: int) -> tuple[Dataset, Dataset | None]:
    """Training and validation datasets for ``cfg`` (validation may be None)."""
    if cfg.kind == "synthetic":
        train = SyntheticImages(cfg.num_samples, num_classes, cfg.image_size, seed)
        val = None
        if cfg.num_val_samples:
            val = SyntheticImages(cfg.num_val_samples, num_classes, cfg.image_size, seed)
            val.seed = seed + 1_000_003  # different samples, same class templates
            val.templates = train.templates
        return train, val
    assert cfg.path is not None
    train_ds = SeededImageFolder(cfg.path, image_transforms(cfg.image_size, True, cfg.augment), seed)
    val_ds = None
    if cfg.val_path:
        val_ds = SeededImageFolder(cfg.val_path, image_transforms(cfg.image_size, False, False), seed)
    if len(train_ds.classes) > num_classes:
        raise ConfigError(
            f"model.num_classes: {num_classes} is fewer than the {len(train_ds.classes)} classes in {cfg.path}"
        )
    return train_ds, val_ds


def collate(samples: Sequence[tuple[torch.Tensor, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xs, ys, ids = zip(*samples, strict=True)
    return torch.stack(xs), torch.tensor(ys, dtype=torch.long), torch.tensor(ids, dtype=torch.long)


def load_batches(
    dataset: Dataset, index_lists: Iterator[list[int]], loader_workers: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Load the planned index lists in order; with ``loader_workers`` > 0 through a prefetching DataLoader."""
    if loader_workers == 0:
        for idx in index_lists:
            yield collate([dataset[i] for i in idx])
        return
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset,
        batch_sampler=index_lists,
        num_workers=loader_workers,
        collate_fn=collate,
        persistent_workers=False,
        prefetch_factor=2,
        worker_init_fn=detach_loader_worker,
    )
    yield from loader


def detach_loader_worker(worker_id: int) -> None:
    """In a forked loader worker: die with the trainer, and close the trainer's inherited TCP sockets.

    A worker process that outlives a SIGKILLed trainer, or merely holds copies of its Gloo sockets, keeps
    those connections open: the trainer's peers then see no close and wait in a receive. Closing a copy here
    leaves the trainer's own descriptor, and its connection, untouched.
    """
    import contextlib
    import ctypes
    import os
    import signal
    import socket

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the trainer died before the signal was armed
        os._exit(0)
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            s = socket.socket(fileno=int(name))
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                s.close()
            else:
                s.detach()


def write_digits_image_folder(root: str | Path, scale: int = 4, test_fraction: float = 0.2, seed: int = 0) -> dict:
    """Write scikit-learn's 8x8 handwritten digits as PNG files: ``root/train/<digit>/*.png`` and ``root/val/``.

    Returns counts. Idempotent: an existing complete folder (marked by ``root/.complete``) is kept.
    """
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    root = Path(root)
    marker = root / ".complete"
    digits = load_digits()
    n = len(digits.target)
    if marker.exists():
        return {"train": int(marker.read_text().split()[0]), "val": int(marker.read_text().split()[1])}
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    n_val = int(n * test_fraction)
    split = {int(i): ("val" if k < n_val else "train") for k, i in enumerate(order)}
    for i in range(n):
        img = (digits.images[i] / 16.0 * 255).astype("uint8")
        img = np.kron(img, np.ones((scale, scale), dtype="uint8"))
        d = root / split[i] / str(int(digits.target[i]))
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img, mode="L").convert("RGB").save(d / f"{i:05d}.png")
    marker.write_text(f"{n - n_val} {n_val}\n")
    return {"train": n - n_val, "val": n_val}
