"""The one task every contender of the peer benchmark trains: model, data, batch, optimizer, LR and seed.

torch only (no elastictrain, no Horovod, no torchft), so each contender's script imports it from its own
environment. The model is elastictrain's default small CNN (three conv blocks with GroupNorm, a linear head);
the data are synthetic 32x32 images, each sample generated from ``(SEED, index)`` alone, and a sample is
``(image, label, index)`` so that every script can write the indices it trained on to the common step log.
"""

from __future__ import annotations

import os

import torch
from torch import nn

SEED = 42
BATCH_PER_WORKER = 32
LR = 0.05
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
NUM_CLASSES = 10
IMAGE_SIZE = 32
NUM_SAMPLES = 15_360
"""Divisible by 32 x 12, so every world size from 1 to 4 splits an epoch without padding."""
CHECKPOINT_EVERY_STEPS = 10
"""The checkpoint interval of the contenders that checkpoint (torchrun's and TorchFT's scripts), as a Horovod
commit interval of 10."""


class SmallCNN(nn.Module):
    """Three conv blocks with GroupNorm and a linear head (as ``elastictrain.engine.models.SmallCNN``)."""

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU())

        self.features = nn.Sequential(
            block(3, width),
            nn.MaxPool2d(2),
            block(width, 2 * width),
            nn.MaxPool2d(2),
            block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class IndexedImages(torch.utils.data.Dataset):
    """Class templates plus per-sample noise; ``ds[i] == (image, label, i)``, the same on every worker."""

    def __init__(self, num_samples: int = NUM_SAMPLES, seed: int = SEED) -> None:
        self.num_samples = num_samples
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(NUM_CLASSES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        label = int(torch.randint(NUM_CLASSES, (1,), generator=g))
        return self.templates[label] + 0.8 * torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=g), label, int(index)


def build_model() -> nn.Module:
    """The model, with the same initial weights in every process."""
    torch.manual_seed(SEED)
    return SmallCNN()


def build_optimizer(params: object) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)  # type: ignore[arg-type]


def set_threads() -> None:
    """One process per logical host shares this machine's cores: ``OMP_NUM_THREADS`` (set by the bench)."""
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)


def save_checkpoint(path: str, state: dict) -> None:
    """``torch.save`` atomically: a temporary file beside ``path``, then ``os.replace``."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict | None:
    """The checkpoint at ``path`` (tensors and plain values only), or None when there is none yet."""
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: a checkpoint must hold a dict, found {type(state).__name__}")
    return state


def steplog_dir() -> str:
    """Where this process writes its step log (``PEERS_STEPLOG``, set by the bench)."""
    return os.environ["PEERS_STEPLOG"]


def writer_name(host: str) -> str:
    return f"{host}-{os.getpid()}"
