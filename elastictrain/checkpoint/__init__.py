"""Checkpoints that are never corrupt: async snapshot + background write, atomic commit, verified load.

No Horovod here: the worker calls this as plain code.

    storage = LocalStorage.for_run_dir(run_dir)
    resumed = load_latest(storage)                       # None on a fresh run
    ckpt = Checkpointer(storage, keep_last=3, on_event=events.emit)
    stall_s = ckpt.save(state, step=..., epoch=..., world_size=..., config_hash=...)
    ckpt.save(state, ..., if_busy="wait"); ckpt.close()  # at the end / on SIGTERM
"""

from elastictrain.checkpoint.checkpointer import Checkpointer, CheckpointStats, EventCallback, WriterKind
from elastictrain.checkpoint.format import (
    CheckpointDamaged,
    LoadedCheckpoint,
    WriteResult,
    checkpoint_name,
    latest_manifest,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    prune,
    read_latest,
    rollback_latest,
    verify_checkpoint,
    write_checkpoint,
)
from elastictrain.checkpoint.storage import CheckpointStorage, LatestIsNewer, LocalStorage

__all__ = [
    "CheckpointDamaged",
    "CheckpointStats",
    "CheckpointStorage",
    "Checkpointer",
    "EventCallback",
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
    "verify_checkpoint",
    "write_checkpoint",
]
