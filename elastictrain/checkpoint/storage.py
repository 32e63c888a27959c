"""Where checkpoint files live: a small storage interface and its local/shared-filesystem implementation.

Paths given to a storage are relative, ``/``-separated keys such as ``step-00000100/state.pt``; the
storage maps them onto its own namespace (a folder, a bucket prefix). The checkpoint format
(:mod:`elastictrain.checkpoint.format`) needs only these operations, and relies on exactly one
atomicity property: a file written through :meth:`CheckpointStorage.open_write` is either absent or
complete and durable under its final name, never partial.

Two backends: :class:`LocalStorage` (a folder) and :class:`~elastictrain.checkpoint.objectstore.FsspecStorage`
(``s3://``, ``gs://``, ``az://``); :func:`elastictrain.checkpoint.location.storage_for` chooses. A backend
subclasses :class:`CheckpointStorage` and provides:

- ``open_write(path)``: a context manager yielding a binary writable file; on clean exit the object
  appears atomically and durably under ``path`` (object stores: buffer to a local temp file, then one
  PUT or a completed multipart upload, which is atomic per object); on an exception nothing appears.
- ``open_read(path)``: a binary readable file; ``FileNotFoundError`` when absent.
- ``size(path)``, ``exists(path)``, ``list_dir(prefix)`` (immediate child names, files and "folders",
  i.e. common prefixes), ``delete(path)`` (a file, or everything under a prefix; absent is fine).
- ``describe(path)``: a human-readable location for logs and events (``s3://bucket/key``).

``set_latest``/``get_latest`` are built on ``write_bytes``/``read_bytes`` of the ``latest`` key, so
they inherit the atomic write. ``latest`` is monotonic: :meth:`CheckpointStorage.set_latest` never moves it
to an older step unless told ``rollback=True``; its read-compare-replace runs under
:meth:`CheckpointStorage.latest_lock` (a backend with conditional writes uses those instead).
``local_path`` may stay ``None`` for remote backends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from elastictrain import fileio
from elastictrain.errors import CheckpointError
from elastictrain.fileio import atomic_file, fsync_dir
from elastictrain.rundir.layout import LATEST, RunDir

TEMP_MARKER = fileio.TEMP_MARKER
"""Temporary files carry this in their name; anything with it is garbage once no save is running."""

LATEST_LOCK = "latest.lock"
"""Lock file of :class:`LocalStorage` held around every change of ``latest``."""

_STEP_RE = re.compile(r"step-([0-9]{8,})")


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint at global step ``step``: ``step-00000100``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint folder name, or ``None`` when ``name`` is not one."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


class LatestIsNewer(CheckpointError, RuntimeError):
    """``set_latest`` refused to move ``latest`` back: it already names a newer step (another writer got further)."""


class CheckpointStorage(ABC):
    """Files of the checkpoint format, addressed by relative ``/``-separated keys.

    Instances must be picklable: the background writer process receives the storage it writes to.
    """

    @abstractmethod
    def open_write(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """Write ``path`` atomically: visible, complete and durable only after the block exits cleanly."""

    @abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """Open ``path`` for reading; raise ``FileNotFoundError`` when it does not exist."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size of the file ``path`` in bytes; ``FileNotFoundError`` when it does not exist."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or folder ``path`` exists."""

    @abstractmethod
    def list_dir(self, prefix: str = "") -> list[str]:
        """Sorted names (not full keys) directly under ``prefix``; empty when ``prefix`` does not exist."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove the file ``path`` or everything under the folder ``path``; absent is not an error."""

    @abstractmethod
    def describe(self, path: str = "") -> str:
        """Where ``path`` lives, for humans (logs, events)."""

    def local_path(self, path: str) -> Path | None:
        """A local filesystem path for ``path`` when the backend has one (lets loads avoid a copy)."""
        return None

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path) as f:
            f.write(data)

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def latest_lock(self) -> contextlib.AbstractContextManager[None]:
        """Held around a read-compare-replace of ``latest`` and around removing temp files next to it.

        The default holds nothing (one writer at a time); :class:`LocalStorage` takes an exclusive ``flock``.
        """
        return contextlib.nullcontext()

    def set_latest(self, name: str, *, rollback: bool = False) -> None:
        """Atomically point ``latest`` at checkpoint folder ``name``. Call only once that folder is durable.

        Monotonic: when ``latest`` names a newer step than ``name``, nothing changes and
        :class:`LatestIsNewer` is raised (a stale writer, e.g. one whose trainer died, finishing late).
        ``rollback=True`` moves it back on purpose (a resume that fell back past damaged checkpoints).
        The current pointer is untrusted input: anything but a checkpoint folder name counts as none.
        """
        step = parse_step(name)
        if step is None:
            raise ValueError(f"{name!r} is not a checkpoint folder name (step-NNNNNNNN)")
        with self.latest_lock():
            current = self.get_latest()
            current_step = parse_step(current) if current is not None else None
            if current_step is not None and step < current_step and not rollback:
                raise LatestIsNewer(
                    f"{LATEST} names {current} (step {current_step}); not moving it back to {name} (step {step})"
                )
            self.write_bytes(LATEST, (name + "\n").encode())

    def get_latest(self) -> str | None:
        """The folder name ``latest`` points at, or ``None`` when there is no (readable) pointer."""
        try:
            name = self.read_bytes(LATEST).decode().strip()
        except (OSError, ValueError):  # absent, not a file, a link out of the storage, not text
            return None
        return name or None


def _makedirs_durable(path: Path) -> None:
    """Create ``path`` and missing parents, fsyncing each new entry's parent so the folders survive a crash."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
        fsync_dir(d.parent)


class LocalStorage(CheckpointStorage):
    """Checkpoint files under a folder on a local or shared (NFS, Lustre) filesystem.

    Atomic write: a temporary file in the same folder, ``fsync``, ``os.replace`` onto the final name,
    ``fsync`` of the folder. ``root`` is created on first write.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    @classmethod
    def for_run_dir(cls, run_dir: str | os.PathLike[str]) -> LocalStorage:
        """The storage of a job's ``run_dir``: checkpoints live in ``<run_dir>/checkpoints``."""
        return cls(RunDir.of(run_dir).checkpoints)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def _path(self, path: str, *, follow: bool = True) -> Path:
        """The file of key ``path``; ``ValueError`` when it would lie outside ``root``.

        Besides ``.``/``..`` components, a symbolic link inside ``root`` that points out of it is
        refused: the folder holding the file must resolve inside ``root``, and so must the file itself
        when ``follow`` (everything but ``delete``, which removes a link itself, never its target).
        """
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"storage key {path!r} must not contain '.' or '..' components")
        p = self.root.joinpath(*parts)
        if parts:
            root = self.root.resolve()
            for check in (p.parent, p) if follow else (p.parent,):
                if check != self.root and not check.resolve().is_relative_to(root):
                    raise ValueError(f"storage key {path!r} leads out of {self.root} through a symbolic link")
        return p

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        final = self._path(path)
        _makedirs_durable(final.parent)
        with atomic_file(final, tag=str(os.getpid())) as f:  # the writer's pid: chaos aims at it
            yield f

    @contextlib.contextmanager
    def latest_lock(self) -> Iterator[None]:
        """An exclusive ``flock`` on ``<root>/latest.lock`` (on NFS the server's byte-range lock)."""
        _makedirs_durable(self.root)
        fd = os.open(self._path(LATEST_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def open_read(self, path: str) -> BinaryIO:
        return open(self._path(path), "rb")

    def size(self, path: str) -> int:
        return self._path(path).stat().st_size

    def exists(self, path: str) -> bool:
        return self._path(path).exists()

    def list_dir(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, path: str) -> None:
        p = self._path(path, follow=False)
        if p == self.root:
            raise ValueError("refusing to delete the storage root")
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def describe(self, path: str = "") -> str:
        return str(self._path(path, follow=False))

    def local_path(self, path: str) -> Path | None:
        return self._path(path)
