"""Atomic file writes for shared folders (a run_dir on NFS, the discovery cache), standard library only.

The one home of write-temp-then-replace in the project. :func:`atomic_file` (and :func:`write_atomic`)
writes a temp file in the target's folder and renames it over the target, so a reader sees the old
content or the new, never a part. :func:`atomic_path` does the same for a writer that wants a file
name (sqlite, an exporter). The temp name is unpredictable (``.<name>.tmp-[<tag>-]<random hex>``,
:data:`TEMP_MARKER` in it) and :func:`atomic_file` creates it with ``O_EXCL | O_NOFOLLOW``: another
user of a shared folder can neither guess it in advance nor plant a file or symlink there that we
would write through.

Durable by default: the file is fsynced before the rename and its folder after it, so the new content
survives a crash of the machine. ``durable=False`` (asked for explicitly, for files rewritten often
whose loss in a power cut is harmless) keeps the atomicity and skips the fsyncs.
"""

from __future__ import annotations

import contextlib
import os

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: discover.sh imports this and counts milliseconds
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO

TEMP_MARKER = ".tmp-"


def temp_path(path: str | os.PathLike[str], *, tag: str = "") -> str:
    """``<folder>/.<name>.tmp-[<tag>-]<16 random hex digits>`` beside ``path``.

    ``tag`` names the writer for readers of the folder (checkpoint temp files carry the writer's pid).
    """
    path = os.fspath(path)
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TEMP_MARKER}{tag + '-' if tag else ''}{os.urandom(8).hex()}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync the folder ``path``, so the entries created, renamed or removed in it survive a crash."""
    fd = os.open(os.fspath(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(tmp: str, path: str, *, durable: bool) -> Iterator[None]:
    """Rename ``tmp`` over ``path`` when the block ends without error (then fsync the folder if ``durable``);
    on error remove ``tmp`` and leave ``path`` alone."""
    try:
        yield
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path))


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], *, durable: bool = True, mode: int = 0o644, tag: str = ""
) -> Iterator[BinaryIO]:
    """Yield a binary file; when the block ends without error, rename it over ``path``.

    ``durable``: fsync the file before the rename and the folder after it. On error the temp file is
    removed and ``path`` is untouched. ``tag``: see :func:`temp_path`.
    """
    path = os.fspath(path)
    tmp = temp_path(path, tag=tag)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with _replacing(tmp, path, durable=durable), os.fdopen(fd, "wb") as f:
        yield f
        f.flush()
        if durable:
            os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool = True) -> Iterator[str]:
    """Yield an unused temp file name beside ``path`` for a writer that opens files by name.

    When the block ends without error the file written there replaces ``path`` (fsynced first when
    ``durable``). On error (``FileNotFoundError`` when nothing was written there) ``path`` is untouched
    and no temp file is left.
    """
    path = os.fspath(path)
    tmp = temp_path(path)
    with _replacing(tmp, path, durable=durable):
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = True) -> None:
    """Replace ``path``'s content with ``data`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, durable=durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)
