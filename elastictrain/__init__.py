"""elastictrain: elastic, fault-tolerant PyTorch training on Horovod elastic.

The drop-in for Horovod elastic scripts (``ElasticState``, ``ElasticSampler``, ``elastic_run``) is imported on
first use, so that ``import elastictrain`` stays light (no torch, no Horovod).
"""

from typing import Any

__version__ = "0.1.0"

_DROPIN = ("ElasticState", "ElasticSampler", "elastic_run")


def __getattr__(name: str) -> Any:
    if name in _DROPIN:
        from elastictrain import dropin

        return getattr(dropin, name)
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
