"""Checkpoints that are never corrupt: async snapshot + background write, atomic commit, verified load.

No Horovod here: the worker calls this as plain code.

    storage = storage_for(cfg.checkpoint.location, run_dir)  # run_dir/checkpoints, a path, or s3://, gs://, az://
    resumed = load_latest(storage)                       # None on a fresh run
    ckpt = Checkpointer(storage, keep_last=3, on_event=events.emit)
    stall_s = ckpt.save(state, step=..., epoch=..., world_size=..., config_hash=...)
    ckpt.save(state, ..., if_busy="wait"); ckpt.close()  # at the end / on SIGTERM

The names below are imported on first use, so that the torch-free modules (``storage``, ``manifest``) stay
torch-free when imported through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastictrain.checkpoint.checkpointer import Checkpointer, CheckpointStats, EventCallback, WriterKind
    from elastictrain.checkpoint.format import (
        LoadedCheckpoint,
        WriteResult,
        list_checkpoints,
        load_checkpoint,
        load_latest,
        prune,
        rollback_latest,
        verify_checkpoint,
        write_checkpoint,
    )
    from elastictrain.checkpoint.location import storage_for, storage_for_run_dir
    from elastictrain.checkpoint.manifest import CheckpointDamaged, latest_manifest, read_latest
    from elastictrain.checkpoint.objectstore import FsspecStorage
    from elastictrain.checkpoint.storage import CheckpointStorage, LatestIsNewer, LocalStorage, checkpoint_name

_HOMES = {
    "checkpointer": ("Checkpointer", "CheckpointStats", "EventCallback", "WriterKind"),
    "format": (
        "LoadedCheckpoint",
        "WriteResult",
        "list_checkpoints",
        "load_checkpoint",
        "load_latest",
        "prune",
        "rollback_latest",
        "verify_checkpoint",
        "write_checkpoint",
    ),
    "location": ("storage_for", "storage_for_run_dir"),
    "manifest": ("CheckpointDamaged", "latest_manifest", "read_latest"),
    "objectstore": ("FsspecStorage",),
    "storage": ("CheckpointStorage", "LatestIsNewer", "LocalStorage", "checkpoint_name"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "CheckpointDamaged",
    "CheckpointStats",
    "CheckpointStorage",
    "Checkpointer",
    "EventCallback",
    "FsspecStorage",
    "LatestIsNewer",
    "LoadedCheckpoint",
    "LocalStorage",
    "WriteResult",
    "WriterKind",
    "checkpoint_name",
    "latest_manifest",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "prune",
    "read_latest",
    "rollback_latest",
    "storage_for",
    "storage_for_run_dir",
    "verify_checkpoint",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
