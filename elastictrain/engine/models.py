"""Models by name: a small built-in CNN for CPU runs, or any torchvision classification architecture."""

from __future__ import annotations

import torch
from torch import nn

from elastictrain.config import ConfigError


class SmallCNN(nn.Module):
    """Three conv blocks with GroupNorm and a linear head.

    GroupNorm, not BatchNorm: its output for a sample does not depend on the other samples of the
    micro-batch, so under the ``global`` policy the maths is independent of how a step is split over
    workers (BatchNorm statistics are per micro-batch and would differ).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.GroupNorm(8, cout),
                nn.ReLU(inplace=True),
            )

        self.features = nn.Sequential(
            block(in_channels, width),
            nn.MaxPool2d(2),
            block(width, 2 * width),
            nn.MaxPool2d(2),
            block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def build_model(name: str, num_classes: int, *, key: str = "task_args.model") -> nn.Module:
    """Build the model called ``name`` (weights are initialised from the global torch RNG); ``key`` names the
    setting in a bad-name error."""
    if name == "small_cnn":
        return SmallCNN(num_classes)
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        import difflib

        hint = difflib.get_close_matches(name, [*names, "small_cnn"], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{key}: unknown architecture {name!r}{extra}")
    model: nn.Module = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    return model
