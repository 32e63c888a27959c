"""Reading a checkpoint's manifest and the ``latest`` pointer, checked as untrusted input; no torch.

The one reader of both: :mod:`elastictrain.checkpoint.format` (write, verify, load) and the operator's tools
(``status``, the launcher's "already complete" check) use it. A manifest is ``<name>/manifest.json`` in a
:class:`~elastictrain.checkpoint.storage.CheckpointStorage`; ``latest`` must name a ``step-NNNNNNNN`` folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from elastictrain.checkpoint.storage import LATEST, CheckpointStorage, parse_step
from elastictrain.errors import CheckpointError
from elastictrain.logconf import get_logger

MANIFEST = "manifest.json"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class CheckpointDamaged(CheckpointError):
    """A checkpoint folder is incomplete or does not match its manifest (the message says how)."""


def _plain_file_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and "/" not in value and value not in (".", "..")


def _count(value: Any, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum


def read_manifest(storage: CheckpointStorage, name: str) -> dict[str, Any]:
    """The manifest of checkpoint ``name``, checked field by field; :class:`CheckpointDamaged` otherwise.

    The manifest is untrusted input (anyone who can write the run_dir can write it): it must be a JSON
    object whose ``step`` is the folder's, whose ``epoch``/``world_size`` are counts, and whose ``files``
    map plain file names (no ``/``) to ``{"sha256": 64 hex digits, "bytes": int >= 0}``, ``state_file``
    among them.
    """
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointDamaged(f"{name}: no {MANIFEST} (incomplete save)") from None
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"{name}: {MANIFEST} cannot be read ({e})") from None
    try:
        manifest = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointDamaged(f"{name}: {MANIFEST} is not JSON ({e})") from None
    problem = _manifest_problem(manifest, parse_step(name))
    if problem is not None:
        raise CheckpointDamaged(f"{name}: {MANIFEST} is malformed ({problem})")
    return manifest


def _manifest_problem(manifest: Any, folder_step: int | None) -> str | None:
    """What is wrong with a parsed manifest, or None when every field the loader relies on is sound."""
    if not isinstance(manifest, dict):
        return f"not an object but {type(manifest).__name__}"
    if not _count(manifest.get("step")) or manifest["step"] != folder_step:
        return f"step {manifest.get('step')!r} is not the folder's step {folder_step}"
    if not _count(manifest.get("epoch")):
        return f"epoch {manifest.get('epoch')!r} is not a count"
    if not _count(manifest.get("world_size"), 1):
        return f"world_size {manifest.get('world_size')!r} is not a positive count"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "files is not a non-empty object"
    for fname, entry in files.items():
        if not _plain_file_name(fname) or fname == MANIFEST:
            return f"files names {fname!r}, not a plain file name"
        if (
            not isinstance(entry, dict)
            or not _count(entry.get("bytes"))
            or not isinstance(entry.get("sha256"), str)
            or not _SHA256_RE.fullmatch(entry["sha256"])
        ):
            return f"files[{fname!r}] is not {{sha256: 64 hex digits, bytes: count}}"
    if not _plain_file_name(manifest.get("state_file")) or manifest["state_file"] not in files:
        return f"state_file {manifest.get('state_file')!r} is not one of files"
    return None


def read_latest(storage: CheckpointStorage, on_invalid: Callable[[str], None] | None = None) -> str | None:
    """The checkpoint folder ``latest`` names; ``None`` when absent, or when not a folder name.

    ``latest`` is untrusted input: anything but a ``step-NNNNNNNN`` name (a path, ``..``) is ignored, and said
    (one line) to ``on_invalid``, by default as a warning in the log.
    """
    latest = storage.get_latest()
    if latest is not None and parse_step(latest) is None:
        message = f"{LATEST} names {latest[:200]!r}, not a checkpoint folder; ignoring it"
        if on_invalid is not None:
            on_invalid(message)
        else:
            get_logger("elastictrain.checkpoint").warning(
                "checkpoint_latest_invalid", message=message, latest=latest[:200], path=storage.describe(LATEST)
            )
        return None
    return latest


def latest_manifest(storage: CheckpointStorage) -> dict[str, Any] | None:
    """The manifest of the checkpoint ``latest`` names, or ``None`` (no pointer, or unreadable); cheap."""
    latest = read_latest(storage)
    if latest is None:
        return None
    try:
        return read_manifest(storage, latest)
    except CheckpointDamaged:
        return None
