"""Resume from the run_dir's latest verified checkpoint, refusing a config that changes what a step sees.

Rank 0 loads the checkpoint into the state (the first sync hands it to everyone). A checkpoint stores, in its
manifest's ``meta["resume_inputs"]`` (:data:`META_KEY`), the values the exactly-once plan and the saved tensors depend
on (:func:`resume_inputs`): the seed, the dataset length and ``drop_last`` (the epoch permutation), the task (which
builds the model) and the optimizer (the tensors' layout). Every rank checks them against its config
(:func:`check_resume_inputs`), so a refused resume stops the whole job with one line naming the keys instead of rank 0
alone. Everything else (learning rate, epochs, batch sizes, world size, checkpoint cadence, tracking, endpoints) may
change between runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastictrain.checkpoint import (
    checkpoint_name,
    latest_manifest,
    load_latest,
    read_latest,
    rollback_latest,
)
from elastictrain.checkpoint.location import storage_for
from elastictrain.config import ConfigError, JobConfig
from elastictrain.engine.state import CommittedState
from elastictrain.logconf import get_logger

log = get_logger("elastictrain.engine.worker")

META_KEY = "resume_inputs"
"""Key of the resume inputs in a checkpoint manifest's ``meta``."""


def resume_inputs(cfg: JobConfig, num_samples: int) -> dict[str, Any]:
    """What a resume must not change, as this config (and a dataset of ``num_samples``) has it; ``dataset_length``
    is the training set's length (``data.num_samples`` for synthetic data, the number of images for an image
    folder)."""
    return {
        "training.seed": cfg.training.seed,
        "data.drop_last": cfg.data.drop_last,
        "dataset_length": num_samples,
        "task": cfg.task,
        "training.optimizer": cfg.training.optimizer,
    }


def changed_resume_inputs(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The keys of ``current`` (:func:`resume_inputs`) that ``stored`` records with another value (in that order)."""
    return [k for k in current if k in stored and stored[k] != current[k]]


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


@dataclass(frozen=True, slots=True)
class Resumed:
    step: int
    world_size: int | None
    """World size the checkpoint was written at (None: not recorded)."""


def resume_latest(cfg: JobConfig, state: CommittedState, inputs: dict[str, Any], *, is_rank0: bool) -> Resumed | None:
    """Rank 0: load the latest verified checkpoint into ``state``; every rank: refuse (ConfigError) a checkpoint
    whose resume inputs differ from ``inputs``. None when nothing was loaded (or resume is off)."""
    if not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        return None
    storage = storage_for(cfg.checkpoint.location, cfg.run_path)
    if not is_rank0:
        manifest = latest_manifest(storage)
        if manifest is not None:
            check_resume_inputs(manifest, inputs, storage.describe(storage.get_latest() or ""))
        return None
    loaded = load_latest(storage, map_location="cpu")
    if loaded is None:
        return None
    check_resume_inputs(loaded.manifest, inputs, loaded.path)
    state.load_full_state(loaded.state)
    name = checkpoint_name(loaded.step)
    if read_latest(storage) != name:  # fell back past damaged ones: this run's timeline starts at `name`
        rollback_latest(storage, name)
    c = state.counters
    resumed = Resumed(c.step, c.world_size or None)
    # World size 0 means "no step has run in this start of the job": after the sync every rank sees that
    # this is a start (one `start` event, no `reset`), whatever size the checkpoint was written at.
    c.world_size = 0
    log.info(
        "resumed from checkpoint",
        path=str(loaded.path),
        step=c.step,
        epoch=state.sampler.epoch,
        cursor=state.sampler.cursor,
    )
    return resumed
