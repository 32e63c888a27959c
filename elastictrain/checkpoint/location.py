"""Where a job's checkpoints live: the one place a :class:`CheckpointStorage` is chosen from ``checkpoint.location``.

A location is empty (``<run_dir>/checkpoints``, the default), a local or shared path, or an object-store URL
``s3://bucket[/prefix]``, ``gs://`` (``gcs://``), ``az://`` (``abfs://``, ``abfss://``) served through fsspec
by :class:`~elastictrain.checkpoint.objectstore.FsspecStorage`. :func:`location_problem` checks a location
without importing anything heavy (config load calls it); :func:`storage_for` builds the storage;
:func:`storage_for_run_dir` reads the location a run recorded in its ``config.yaml`` (untrusted input).
A URL never carries credentials (``user:secret@`` is refused): they come from each cloud's own chain.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from elastictrain.checkpoint.objectstore import FsspecStorage, ObjectLocation
from elastictrain.rundir.layout import RunDir

if TYPE_CHECKING:
    from elastictrain.checkpoint.storage import CheckpointStorage

OBJECT_STORE_PACKAGES: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}
"""Scheme -> (the fsspec package that serves it, the elastictrain extra that installs it)."""

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,61}[a-z0-9]")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._\-=+]+")
_MAX_LOCATION = 1024
_MAX_CONFIG_BYTES = 1 << 20


def _scheme(location: str) -> str | None:
    m = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*)://", location)
    return m.group(1).lower() if m else None


def parse_object_location(location: str) -> ObjectLocation:
    """The parts of an object-store URL; ``ValueError`` with one line naming what is wrong."""
    if len(location) > _MAX_LOCATION:
        raise ValueError(f"is {len(location)} characters long (at most {_MAX_LOCATION})")
    scheme = _scheme(location)
    if scheme is None or scheme not in OBJECT_STORE_PACKAGES:
        known = ", ".join(f"{s}://" for s in OBJECT_STORE_PACKAGES)
        raise ValueError(f"scheme {(scheme or '')[:20]!r}:// is not supported (use a local path or one of {known})")
    parts = urlsplit(location)
    if "@" in parts.netloc or parts.password is not None:
        raise ValueError(
            f"{scheme}:// URL carries credentials: give them through the cloud's credential chain "
            "(environment, profile, instance role), never in the config"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{parts.scheme}://{parts.netloc}{parts.path}: no '?' query or '#' fragment allowed")
    bucket = parts.netloc
    if not _BUCKET_RE.fullmatch(bucket):
        raise ValueError(f"{bucket!r} is not a bucket/container name (3-63 of a-z, 0-9, '.', '-', '_')")
    segments = [s for s in parts.path.split("/") if s]
    for s in segments:
        if s in (".", "..") or not _SEGMENT_RE.fullmatch(s):
            raise ValueError(f"prefix segment {s!r} is not allowed (letters, digits and ._-=+ only; no '.' or '..')")
    return ObjectLocation(scheme, bucket, "/".join(segments))


def location_problem(location: str) -> str | None:
    """What is wrong with ``location`` (one line, without the key's name), or None. Cheap: imports nothing.

    An object-store URL needs its fsspec package installed (``pip install 'elastictrain[s3]'`` and so on).
    """
    if not location or _scheme(location) is None:
        if "\x00" in location:
            return "a local path must not contain NUL"
        return None
    try:
        loc = parse_object_location(location)
    except ValueError as e:
        return str(e)
    package, extra = OBJECT_STORE_PACKAGES[loc.scheme]
    if importlib.util.find_spec(package) is None:
        return f"{loc.scheme}:// needs the {package} package: pip install 'elastictrain[{extra}]'"
    return None


def storage_for(location: str | None, run_dir: str | os.PathLike[str]) -> CheckpointStorage:
    """The storage of ``checkpoint.location`` (empty/None: ``<run_dir>/checkpoints``); ValueError if it is bad."""
    from elastictrain.checkpoint.storage import LocalStorage

    if not location:
        return LocalStorage(RunDir.of(run_dir).checkpoints)
    if _scheme(location) is None:
        return LocalStorage(Path(run_dir) / location)  # a relative path is under the run_dir, wherever one runs
    problem = location_problem(location)
    if problem is not None:
        raise ValueError(f"checkpoint.location: {problem}")
    return FsspecStorage(parse_object_location(location))


def recorded_location(run_dir: str | os.PathLike[str]) -> str | None:
    """``checkpoint.location`` as the run recorded it in ``<run_dir>/config.yaml``; None when absent or unset.

    The file is untrusted: bounded in size, the value must be a string; ValueError (one line) otherwise.
    """
    path = RunDir.of(run_dir).config
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes; not a config this run wrote")
    import yaml

    try:
        doc: Any = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    ck = doc.get("checkpoint") if isinstance(doc, dict) else None
    value = ck.get("location") if isinstance(ck, dict) else None
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"{path}: checkpoint.location is {type(value).__name__}, not a string")
    return value


def storage_for_run_dir(run_dir: str | os.PathLike[str], location: str | None = None) -> CheckpointStorage:
    """The storage of an existing run: ``location`` when given, else the one its ``config.yaml`` names, else
    ``<run_dir>/checkpoints``. For the tools (status, export, audit) and the launcher. ValueError when bad."""
    return storage_for(location if location else recorded_location(run_dir), run_dir)
