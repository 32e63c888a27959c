"""Resume from the run_dir's latest verified checkpoint, refusing a config that changes what a step sees.

Rank 0 loads the checkpoint into the state (the first sync hands it to everyone). Every rank checks the
checkpoint's resume inputs (:mod:`elastictrain.checkpoint.resume`) against its config, so a refused resume
stops the whole job with one line instead of rank 0 alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.checkpoint import (
    LocalStorage,
    checkpoint_name,
    latest_manifest,
    load_latest,
    read_latest,
    rollback_latest,
)
from elastictrain.checkpoint.resume import check_resume_inputs
from elastictrain.config import JobConfig
from elastictrain.engine.state import CommittedState
from elastictrain.logconf import get_logger

log = get_logger("elastictrain.engine.worker")


def resume_inputs(cfg: JobConfig, num_samples: int) -> dict[str, Any]:
    """What a resume must not change, as this config (and a dataset of ``num_samples``) has it."""
    return {
        "training.seed": cfg.training.seed,
        "data.drop_last": cfg.data.drop_last,
        "dataset_length": num_samples,
        "task": cfg.task,
        "training.optimizer": cfg.training.optimizer,
    }


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
    storage = LocalStorage.for_run_dir(cfg.run_path)
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
