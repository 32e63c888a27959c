"""elastictrain: elastic, fault-tolerant PyTorch training on Horovod elastic."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `elastictrain agent` and the CLI's start never import torch.
    if name == "Task":
        from elastictrain.task import Task

        return Task
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
