"""elastictrain: elastic, fault-tolerant PyTorch training on Horovod elastic.

The public names (``Task``, and the drop-in for Horovod elastic scripts: ``ElasticState``,
``ElasticSampler``, ``elastic_run``) are imported on first use, so that ``import elastictrain`` stays
light (no torch, no Horovod) for the agent and the CLI. The drop-in's first use checks, before Horovod loads, that
the installed Horovod is the patched build (:mod:`elastictrain.horovod.build_check`).
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: discover.sh imports elastictrain.errors and counts milliseconds
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_DROPIN = ("ElasticState", "ElasticSampler", "elastic_run")

__all__ = ["Task", *_DROPIN]


def __getattr__(name: str) -> Any:
    if name == "Task":
        from elastictrain.task import Task

        return Task
    if name in _DROPIN:
        from elastictrain.horovod.build_check import check_patched_horovod

        check_patched_horovod()  # a stock wheel would run the user's script without the repairs
        from elastictrain.engine import dropin

        return getattr(dropin, name)
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
