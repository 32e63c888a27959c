"""The file index of an ImageFolder (its classes and samples), cached so that no worker rescans a large folder.

An ImageFolder of ImageNet's size is 1.28 M files in 1,000 class folders: listing it takes seconds on a local
disk and minutes on a network file system, and every worker that starts (at launch, and at every scale-up)
would do it again. :func:`folder_index` scans a folder once and keeps the result in
``$ELASTICTRAIN_CACHE/folder-index/`` (default ``~/.cache/elastictrain``), keyed by the folder's real path.

Contract:
- The samples are what torchvision's ``ImageFolder(root)`` finds, in its order: classes are the sorted
  subfolders of the root, samples the files with an image extension below each class folder (symlinks
  followed), sorted per folder.
- A cached index is used only while the mtime (ns) of every folder the scan visited is unchanged. Adding,
  removing or renaming a file or a folder changes its parent folder's mtime, so a changed folder is
  scanned again. (Rewriting a file in place changes no folder; the index holds names, not contents.)
  A folder changed within ``RACY_SECONDS`` of the scan is not cached at all: file systems keep mtimes at
  a coarse tick, so a file added in the same tick, after the listing, would not change the mtime again.
- The cache file is untrusted input: one that does not parse, names another root, or holds a path that is
  absolute or climbs out of the root is ignored and replaced. Writes are atomic; a cache folder that cannot
  be written costs only the cache.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from elastictrain import envnames
from elastictrain.fileio import write_atomic

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CACHE_ENV = envnames.CACHE
RACY_SECONDS = 2.0
_MEMO: dict[str, FolderIndex] = {}
"""Indexes this process has built or read, by real path (still checked against the folders' mtimes)."""
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's


@dataclass(frozen=True)
class FolderIndex:
    """``classes`` sorted; ``samples`` as ``(path relative to root, class index)``; ``dirs``: folder -> mtime_ns."""

    root: str
    classes: list[str]
    samples: list[tuple[str, int]]
    dirs: dict[str, int]

    def absolute_samples(self) -> list[tuple[str, int]]:
        return [(os.path.join(self.root, rel), label) for rel, label in self.samples]


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "elastictrain"
    )
    return Path(base) / "folder-index"


def cache_path(root: str) -> Path:
    return cache_dir() / f"{sha256(root.encode()).hexdigest()[:32]}.json"


def scan(root: str) -> FolderIndex:
    """List ``root`` as ImageFolder does, recording each visited folder's mtime before listing it."""
    root = os.path.realpath(root)
    dirs = {".": os.stat(root).st_mtime_ns}
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
    samples: list[tuple[str, int]] = []
    empty = []
    for label, name in enumerate(classes):
        listed = sorted(_walk(root, name, dirs))
        images = [os.path.join(d, f) for d, fs in listed for f in sorted(fs) if f.lower().endswith(IMG_EXTENSIONS)]
        samples.extend((path, label) for path in images)
        if not images:
            empty.append(name)
    if empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}.")
    return FolderIndex(root, classes, samples, dirs)


def _walk(root: str, top: str, dirs: dict[str, int]) -> list[tuple[str, list[str]]]:
    """``(folder relative to root, file names)`` below ``top``, symlinks followed; each folder's mtime is taken
    before it is listed, so a file added during the scan makes the recorded mtime stale, never current."""
    out: list[tuple[str, list[str]]] = []
    stack = [top]
    while stack:
        rel = stack.pop()
        path = os.path.join(root, rel)
        dirs[rel] = os.stat(path).st_mtime_ns
        files: list[str] = []
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_dir():
                    stack.append(os.path.join(rel, e.name))
                else:
                    files.append(e.name)
        out.append((rel, files))
    return out


def _safe_rel(path: Any) -> bool:
    """A relative path that stays below the root (a plain string test: an index holds a million of them)."""
    if not isinstance(path, str) or not path or path[0] == "/" or "\x00" in path:
        return False
    return ".." not in path or ".." not in path.split("/")


def _parse(root: str, raw: Any) -> FolderIndex | None:
    """The cache file's content as an index of ``root``, or None if it is not one."""
    if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION or raw.get("root") != root:
        return None
    classes, files, dirs = raw.get("classes"), raw.get("files"), raw.get("dirs")
    if not (isinstance(classes, list) and isinstance(files, list) and isinstance(dirs, dict)):
        return None
    if len(files) != len(classes) or not all(isinstance(c, str) and _safe_rel(c) and "/" not in c for c in classes):
        return None
    if not all(_safe_rel(d) or d == "." for d in dirs) or not all(type(m) is int for m in dirs.values()):
        return None
    samples: list[tuple[str, int]] = []
    for label, names in enumerate(files):
        if not isinstance(names, list) or not all(_safe_rel(n) for n in names):
            return None
        samples.extend((n, label) for n in names)
    return FolderIndex(root, classes, samples, dirs)


def _unchanged(index: FolderIndex) -> bool:
    try:
        return all(os.stat(os.path.join(index.root, d)).st_mtime_ns == m for d, m in index.dirs.items())
    except OSError:
        return False


def load_cached(root: str) -> FolderIndex | None:
    """The cached index of ``root`` (a real path) if it is valid and the folder has not changed since."""
    try:
        raw = json.loads(cache_path(root).read_bytes())
    except (OSError, ValueError):
        return None
    index = _parse(root, raw)
    return index if index is not None and _unchanged(index) else None


def store(index: FolderIndex) -> None:
    files: list[list[str]] = [[] for _ in index.classes]
    for rel, label in index.samples:
        files[label].append(rel)
    doc = {"version": FORMAT_VERSION, "root": index.root, "classes": index.classes, "files": files, "dirs": index.dirs}
    path = cache_path(index.root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(doc, separators=(",", ":")), durable=False)
    except OSError as e:
        log.debug("folder index of %s not cached: %s", index.root, e)


def folder_index(root: str | os.PathLike[str]) -> FolderIndex:
    """The index of ``root``: from the cache when the folder is unchanged, else scanned and cached."""
    real = os.path.realpath(root)
    index = _MEMO.get(real)
    if index is not None and _unchanged(index):
        return index  # e.g. indexed by the warm zygote this worker was forked from
    index = load_cached(real)
    if index is None:
        started_ns = time.time_ns()
        index = scan(real)
        if max(index.dirs.values()) < started_ns - int(RACY_SECONDS * 1e9):
            store(index)
    _MEMO[real] = index
    return index
