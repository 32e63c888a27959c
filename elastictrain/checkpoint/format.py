"""The on-storage checkpoint format: write, prune, verify, load (with fallback to the previous good one).
The manifest and ``latest`` are read (and checked) by :mod:`~elastictrain.checkpoint.manifest`, which needs no torch.

Layout under a :class:`~elastictrain.checkpoint.storage.CheckpointStorage` (``<run_dir>/checkpoints``)::

    step-00000100/state.pt        torch.save of the whole state dict
    step-00000100/manifest.json   step, epoch, world_size, config_hash, created_at, files{name: sha256, bytes}, meta
    step-00000200/...
    latest                        "step-00000200": the newest complete, verified checkpoint

Commit protocol (a crash at any instant leaves ``latest`` naming a complete checkpoint):

1. the state file is written atomically under a name no manifest refers to yet (``state.pt``, or
   ``state-<token>.pt`` when the same step is saved again), its SHA-256 computed while it streams out;
2. ``manifest.json`` is written atomically: this is the commit point of the folder;
3. ``latest`` is replaced atomically, only after the manifest is durable, and only forward: it never
   names an older step than before (:meth:`~elastictrain.checkpoint.storage.CheckpointStorage.set_latest`),
   except through :func:`rollback_latest`;
4. older checkpoints beyond ``keep_last`` are pruned (never the one ``latest`` names, never one above it),
   together with folders at or below ``latest`` that never got a manifest, temporary files and state files
   no manifest names.

One writer per storage at a time is the rule (rank 0's checkpointer). A stale writer (its trainer died
while it was saving) cannot move ``latest`` back nor prune what a newer writer wrote: ``latest`` only moves
forward and pruning never touches anything above it. A writer may also pass a ``fence`` that stops it
before either step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, BinaryIO

import torch

from elastictrain.checkpoint.manifest import MANIFEST, CheckpointDamaged, read_latest, read_manifest
from elastictrain.checkpoint.storage import (
    LATEST,
    TEMP_MARKER,
    CheckpointStorage,
    checkpoint_name,
    parse_step,
)
from elastictrain.errors import one_line
from elastictrain.logconf import get_logger


def _log() -> Any:
    """A fresh logger per call, so structlog configuration changes (and tests' capture_logs) apply."""
    return get_logger("elastictrain.checkpoint")


FORMAT_VERSION = 1
STATE_FILE = "state.pt"
_HASH_CHUNK = 8 << 20


def list_checkpoints(storage: CheckpointStorage) -> list[tuple[int, str]]:
    """``(step, folder name)`` of every checkpoint folder, complete or not, oldest first."""
    found = [(s, n) for n in storage.list_dir("") if (s := parse_step(n)) is not None]
    return sorted(found)


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What :func:`write_checkpoint` wrote."""

    name: str
    """Folder name, e.g. ``step-00000100``."""
    path: str
    """Human-readable location of the folder (``storage.describe``)."""
    bytes: int
    """Size of the state file."""
    write_seconds: float
    """Serialise + write + fsync + manifest + ``latest`` (pruning excluded)."""
    pruned: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """A verified checkpoint, as returned by :func:`load_latest`."""

    step: int
    epoch: int
    world_size: int
    state: Any
    """The state dict exactly as it was passed to ``save`` (tensors on ``map_location``)."""
    manifest: dict[str, Any]
    path: str
    """Human-readable location of the checkpoint folder."""
    skipped: tuple[str, ...] = field(default=())
    """``"<folder>: <why>"`` for each newer checkpoint that was damaged and skipped."""


class _HashingWriter:
    """A write-only file wrapper that counts bytes and computes SHA-256 as data streams through."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        n = self._f.write(data)
        self.bytes += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()


def write_checkpoint(
    storage: CheckpointStorage,
    state: Any,
    *,
    step: int,
    epoch: int,
    world_size: int,
    config_hash: str,
    meta: dict[str, Any] | None = None,
    keep_last: int | None = None,
    fence: Callable[[], None] | None = None,
) -> WriteResult:
    """Write ``state`` as the checkpoint of ``step`` following the commit protocol, then prune.

    Synchronous; the async checkpointer runs this in its background writer. Raises on any failure,
    leaving ``latest`` untouched; :class:`~elastictrain.checkpoint.storage.LatestIsNewer` when ``latest``
    already names a newer step (nothing is pruned then). ``fence()`` is called right before ``latest``
    moves and again right before pruning; it raises to stop a writer that must no longer touch either.
    """
    start = time.perf_counter()
    name = checkpoint_name(step)
    state_file = STATE_FILE
    if storage.exists(f"{name}/{state_file}"):  # the same step saved again: never overwrite what a manifest names
        state_file = f"state-{secrets.token_hex(4)}.pt"
    with storage.open_write(f"{name}/{state_file}") as f:
        hw = _HashingWriter(f)
        torch.save(state, hw)  # type: ignore[arg-type]
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": epoch,
        "world_size": world_size,
        "config_hash": config_hash,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "torch_version": torch.__version__,
        "state_file": state_file,
        "files": {state_file: {"sha256": hw.sha256.hexdigest(), "bytes": hw.bytes}},
        "meta": meta or {},
    }
    storage.write_bytes(f"{name}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
    if fence is not None:
        fence()
    storage.set_latest(name)
    write_seconds = time.perf_counter() - start
    pruned: tuple[str, ...] = ()
    if fence is not None:
        fence()
    try:
        pruned = tuple(prune(storage, keep_last))
    except Exception as e:  # the checkpoint itself is committed; a failed clean-up is only worth a warning
        _log().warning("checkpoint_prune_failed", error=repr(e), path=storage.describe())
    return WriteResult(name, storage.describe(name), hw.bytes, write_seconds, pruned)


def verify_checkpoint(storage: CheckpointStorage, name: str) -> dict[str, Any]:
    """Check every file of ``name`` against its manifest (size, then SHA-256); return the manifest.

    Raises :class:`CheckpointDamaged` naming the first file that is missing, truncated or altered.
    """
    manifest = read_manifest(storage, name)
    for fname, expect in manifest["files"].items():
        key = f"{name}/{fname}"
        try:
            size = storage.size(key)
        except FileNotFoundError:
            raise CheckpointDamaged(f"{name}: {fname} is missing") from None
        except ValueError as e:  # the storage refused the key (a link out of the checkpoints)
            raise CheckpointDamaged(f"{name}: {fname} is not readable here ({e})") from None
        if size != expect["bytes"]:
            raise CheckpointDamaged(f"{name}: {fname} has {size} bytes, manifest says {expect['bytes']}")
        h = hashlib.sha256()
        with storage.open_read(key) as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        if h.hexdigest() != expect["sha256"]:
            raise CheckpointDamaged(f"{name}: {fname} SHA-256 does not match the manifest (corrupted)")
    return manifest


def load_checkpoint(storage: CheckpointStorage, name: str, map_location: Any = "cpu") -> LoadedCheckpoint:
    """Verify and load checkpoint folder ``name``; :class:`CheckpointDamaged` when it fails verification.

    The state file is loaded with ``torch.load(weights_only=True)``: tensors, containers and plain
    values only, never arbitrary objects, so a planted file cannot run code. A file ``torch.load``
    rejects counts as damaged; an I/O error (other than a missing file) propagates.
    """
    manifest = verify_checkpoint(storage, name)
    key = f"{name}/{manifest['state_file']}"
    try:
        local = storage.local_path(key)
        if local is not None:
            state = torch.load(local, map_location=map_location, weights_only=True)
        else:
            with storage.open_read(key) as f:
                state = torch.load(f, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointDamaged(f"{name}: {manifest['state_file']} is missing") from None
    except OSError:
        raise
    except Exception as e:  # UnpicklingError (a forbidden global), a zip or format error, ...
        raise CheckpointDamaged(
            f"{name}: torch.load(weights_only=True) rejects {manifest['state_file']} ({one_line(e)})"
        ) from None
    return LoadedCheckpoint(
        step=int(manifest["step"]),
        epoch=int(manifest["epoch"]),
        world_size=int(manifest["world_size"]),
        state=state,
        manifest=manifest,
        path=storage.describe(name),
    )


def load_latest(storage: CheckpointStorage, map_location: Any = "cpu") -> LoadedCheckpoint | None:
    """Load the newest verified checkpoint, or ``None`` when the storage holds none.

    Tries the folder ``latest`` names first, then every other checkpoint folder, newest step first.
    Each damaged one (missing or malformed manifest, missing/truncated file, SHA-256 mismatch, a file
    ``torch.load(weights_only=True)`` rejects, a link out of the checkpoints) is skipped with a
    ``checkpoint_damaged_falling_back`` warning that names it, why, and what is tried next; the reasons
    are also in ``LoadedCheckpoint.skipped``. A ``latest`` that is not a checkpoint folder name is
    ignored with a ``checkpoint_latest_invalid`` warning.
    """
    latest = read_latest(storage)
    others = [n for _, n in reversed(list_checkpoints(storage)) if n != latest]
    candidates = ([latest] if latest else []) + others
    skipped: list[str] = []
    for i, name in enumerate(candidates):
        try:
            loaded = load_checkpoint(storage, name, map_location)
        except CheckpointDamaged as e:
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            _log().warning(
                "checkpoint_damaged_falling_back",
                message=f"checkpoint {name} is damaged ({e}); falling back to "
                + (f"the previous checkpoint {nxt}" if nxt else "nothing: no older checkpoint"),
                damaged=name,
                reason=str(e),
                fallback=nxt,
                path=storage.describe(name),
            )
            skipped.append(str(e))
            continue
        if skipped:
            _log().warning("checkpoint_loaded_fallback", loaded=name, skipped=skipped, path=loaded.path)
            return LoadedCheckpoint(
                loaded.step,
                loaded.epoch,
                loaded.world_size,
                loaded.state,
                loaded.manifest,
                loaded.path,
                tuple(skipped),
            )
        return loaded
    if skipped:
        _log().error("checkpoint_none_usable", skipped=skipped, path=storage.describe())
    return None


def _has_manifest(storage: CheckpointStorage, name: str) -> bool:
    try:
        return storage.exists(f"{name}/{MANIFEST}")
    except ValueError:  # the storage refuses the folder (a link out of it): garbage
        return False


def prune(storage: CheckpointStorage, keep_last: int | None) -> list[str]:
    """Delete what is no longer needed; return the deleted checkpoint folder names.

    Keeps the folder ``latest`` names and the newest ``keep_last`` complete checkpoints (those with a
    manifest) at or below its step (``keep_last=None`` keeps all complete ones). Deletes older complete
    checkpoints, folders below ``latest`` without a manifest, temporary files next to ``latest`` (under
    :meth:`~elastictrain.checkpoint.storage.CheckpointStorage.latest_lock`, so never one being renamed)
    and state files no manifest names. Never deletes a folder above ``latest``: that is a newer save of
    another writer, still in flight or about to move ``latest``. Without a ``latest`` it deletes nothing.
    An abandoned timeline above ``latest`` goes only through :func:`rollback_latest`.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    latest = read_latest(storage)
    latest_step = parse_step(latest) if latest else None
    if latest is None or latest_step is None:
        return []
    found = [(s, n) for s, n in list_checkpoints(storage) if s <= latest_step]
    complete = [(s, n) for s, n in found if _has_manifest(storage, n)]
    newest = complete[::-1] if keep_last is None else complete[::-1][:keep_last]
    keep = {n for _, n in newest} | {latest}
    deleted = []
    for _, name in found:
        if name not in keep:
            storage.delete(name)
            deleted.append(name)
    with storage.latest_lock():
        for entry in storage.list_dir(""):
            if TEMP_MARKER in entry and entry != LATEST:
                storage.delete(entry)
    for name in keep:
        try:
            listed = set(read_manifest(storage, name)["files"])
        except CheckpointDamaged:
            continue  # leave a damaged folder as it is: a human may want to look at it
        for entry in storage.list_dir(name):
            if entry != MANIFEST and entry not in listed:
                with contextlib.suppress(FileNotFoundError):
                    storage.delete(f"{name}/{entry}")
    return deleted


def rollback_latest(storage: CheckpointStorage, name: str) -> list[str]:
    """Point ``latest`` back at checkpoint ``name`` on purpose and delete every checkpoint folder above it.

    The one way ``latest`` moves to an older step: call it when the run resumes from ``name`` although
    ``latest`` names a newer one (those were damaged and skipped), so the new timeline can move ``latest``
    forward from ``name``. Returns the deleted folder names (the abandoned timeline).
    """
    step = parse_step(name)
    if step is None:
        raise ValueError(f"{name!r} is not a checkpoint folder name")
    before = read_latest(storage)
    storage.set_latest(name, rollback=True)
    abandoned = [n for s, n in list_checkpoints(storage) if s > step]
    for n in abandoned:
        storage.delete(n)
    _log().warning(
        "checkpoint_rolled_back",
        message=f"{LATEST} moved back from {before} to {name}; deleted the abandoned newer checkpoints {abandoned}",
        latest=name,
        previous=before,
        deleted=abandoned,
        path=storage.describe(),
    )
    return abandoned
