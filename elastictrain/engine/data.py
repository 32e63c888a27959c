"""The image task's datasets (``(image, label)`` samples), with augmentation seeded per sample, and the loader.

Randomness in a sample's transform comes from ``(seed, epoch, sample_id)``, not from the process's
RNG, so a sample looks the same whichever worker loads it and however often a step is re-run after
a rollback. That keeps the ``global`` policy's maths independent of membership.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from elastictrain.config import ConfigError
from elastictrain.engine.folder_index import FolderIndex, folder_index

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
        self.templates = torch.randn(num_classes, 3, image_size, image_size, generator=g, device="cpu")
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(sample_seed(self.seed, -2, index))
        label = int(torch.randint(self.num_classes, (1,), generator=g, device="cpu"))
        noise = torch.randn(3, self.image_size, self.image_size, generator=g, device="cpu")
        return self.templates[label] + self.noise * noise, label


SampleTransform = Callable[[Any, torch.Generator], torch.Tensor]
"""A transform that draws all its randomness from the generator it is given (never from torch's global RNG)."""


class SeededImageFolder(Dataset):
    """An ImageFolder (torchvision's layout and order) whose transform draws from a generator seeded per sample.

    The generator is local to the call: loading a sample never reseeds torch's global (or any CUDA)
    generator, which ``torch.manual_seed`` would do on every sample.

    The folder is indexed on first use (``len`` or an item), not when the task is built: a launcher that checks
    the task need not see the data. The index is cached per folder, so a starting worker does not rescan it.
    """

    def __init__(
        self,
        root: str,
        transform: SampleTransform,
        seed: int,
        *,
        num_classes: int | None = None,
        key: str = "task_args.path",
    ) -> None:
        self.root = root
        self.transform = transform
        self.seed = seed
        self.epoch = 0
        self.num_classes = num_classes
        self.key = key
        self._index: FolderIndex | None = None

    @property
    def index(self) -> FolderIndex:
        """The folder's classes and samples (:mod:`elastictrain.engine.folder_index`: cached, rescanned only on
        change)."""
        if self._index is None:
            root, key = self.root, self.key
            if not Path(root).is_dir():
                raise ConfigError(f"{key}: {root} is not a directory (expected an ImageFolder: <root>/<class>/*.png)")
            try:
                index = folder_index(root)
            except OSError as e:
                raise ConfigError(f"{key}: {root} is not a usable ImageFolder ({str(e).splitlines()[0]})") from None
            n = len(index.classes)
            if self.num_classes is not None and n > self.num_classes:
                raise ConfigError(f"task_args.num_classes: {self.num_classes} is fewer than the {n} classes in {root}")
            self._index = index
        return self._index

    @property
    def classes(self) -> list[str]:
        return list(self.index.classes)

    def __len__(self) -> int:
        return len(self.index.samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.datasets.folder import default_loader

        rel, label = self.index.samples[index]
        img = default_loader(os.path.join(self.index.root, rel))
        g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, index))
        return self.transform(img, g), label


class ImageTransform:
    """The classic ImageNet transforms with their randomness drawn from a given generator.

    Training with ``augment``: random-resized-crop (scale 0.08-1, aspect ratio 3/4-4/3, as torchvision's
    ``RandomResizedCrop``) and a horizontal flip with probability 1/2; otherwise resize + center crop.
    Then ``ToTensor`` and the ImageNet normalisation.
    """

    SCALE = (0.08, 1.0)
    RATIO = (3 / 4, 4 / 3)

    def __init__(self, image_size: int, train: bool, augment: bool) -> None:
        self.image_size = image_size
        self.random = train and augment

    def crop_box(self, width: int, height: int, g: torch.Generator) -> tuple[int, int, int, int]:
        """(top, left, height, width) of a random-resized crop, drawn from ``g``."""
        area = height * width
        log_lo, log_hi = math.log(self.RATIO[0]), math.log(self.RATIO[1])
        for _ in range(10):
            u = torch.rand(2, generator=g, dtype=torch.float64).tolist()
            target_area = area * (self.SCALE[0] + (self.SCALE[1] - self.SCALE[0]) * u[0])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[1])
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,), generator=g))
                left = int(torch.randint(0, width - w + 1, (1,), generator=g))
                return top, left, h, w
        in_ratio = width / height  # fallback: the central crop of the nearest allowed aspect ratio
        if in_ratio < self.RATIO[0]:
            w, h = width, round(width / self.RATIO[0])
        elif in_ratio > self.RATIO[1]:
            h, w = height, round(height * self.RATIO[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Any, g: torch.Generator) -> torch.Tensor:
        from torchvision.transforms import functional as F

        size = self.image_size
        if self.random:
            width, height = F.get_image_size(img)
            top, left, h, w = self.crop_box(width, height, g)
            img = F.resized_crop(img, top, left, h, w, [size, size], antialias=True)
            if float(torch.rand(1, generator=g)) < 0.5:
                img = F.hflip(img)
        else:
            img = F.center_crop(F.resize(img, max(size, round(size * 256 / 224)), antialias=True), [size, size])
        return F.normalize(F.to_tensor(img), IMAGENET_MEAN, IMAGENET_STD)


def image_transforms(image_size: int, train: bool, augment: bool) -> SampleTransform:
    """The transform of :class:`SeededImageFolder`: random-resized-crop + flip to train, else resize + center crop."""
    return ImageTransform(image_size, train, augment)


def load_batches(
    dataset: Dataset,
    index_lists: Iterator[list[int]],
    loader_workers: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Iterator[Any]:
    """Load the planned index lists in order, each collated into one batch (``collate_fn``, default torch's
    ``default_collate``); with ``loader_workers`` > 0 through a prefetching DataLoader."""
    from torch.utils.data import default_collate

    collate = collate_fn or default_collate
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
    import os
    import signal
    import socket

    from elastictrain.lifeline import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
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
