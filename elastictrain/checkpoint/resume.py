"""What a resume must not change: the inputs that decide which samples each step sees.

A checkpoint stores, in its manifest's ``meta["resume_inputs"]``, the values the exactly-once plan and
the saved tensors depend on: the seed and the dataset length and ``drop_last`` (the epoch permutation),
the task (which builds the model) and the optimizer (the tensors' layout). A resume under a config that
changes any of them would silently repeat or skip samples (or fail deep in ``load_state_dict``), so
:func:`check_resume_inputs` refuses it with one line naming the keys. Everything else (learning rate,
epochs, batch sizes, world size, checkpoint cadence, tracking, endpoints) may change between runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastictrain.config import ConfigError

META_KEY = "resume_inputs"
"""Key of the resume inputs in a checkpoint manifest's ``meta``."""

RESUME_KEYS = (
    "training.seed",
    "data.drop_last",
    "dataset_length",
    "task",
    "training.optimizer",
)
"""The keys a resume must keep; ``dataset_length`` is the training set's length (``data.num_samples``
for synthetic data, the number of images for an image folder)."""


def changed_resume_inputs(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The keys of :data:`RESUME_KEYS` both sides record with different values (in that order)."""
    return [k for k in RESUME_KEYS if k in stored and k in current and stored[k] != current[k]]


def check_resume_inputs(manifest: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Raise :class:`ConfigError` (one line) when ``current`` changes a resume input of the checkpoint.

    ``manifest`` is the checkpoint's manifest; ``where`` names it for the message. A checkpoint without
    recorded inputs (written before they were stored) is accepted.
    """
    meta = manifest.get("meta")
    stored = meta.get(META_KEY) if isinstance(meta, Mapping) else None
    if not isinstance(stored, Mapping):
        return
    changed = changed_resume_inputs(stored, current)
    if not changed:
        return
    was = ", ".join(f"{k}={stored[k]!r}" for k in changed)
    now = ", ".join(f"{k}={current[k]!r}" for k in changed)
    raise ConfigError(
        f"cannot resume from {where}: it was trained with {was} and this config has {now}; these decide "
        "which samples each step sees, so keep them, or start a new run_dir, or set checkpoint.resume=false"
    )
