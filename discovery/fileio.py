"""Atomic file writes for shared folders (a run_dir on NFS, the discovery cache), standard library only.

:func:`atomic_file` writes a temp file in the target's folder and renames it over the target, so a
reader sees the old content or the new, never a part. The temp name is unpredictable
(``.<name>.tmp-<random hex>``) and created with ``O_EXCL | O_NOFOLLOW``: another user of a shared
folder can neither guess it in advance nor plant a file or symlink there that we would write through.
"""

from __future__ import annotations

import contextlib
import os

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: discover.sh imports this and counts milliseconds
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO

TEMP_MARKER = ".tmp-"


def temp_path(path: str | os.PathLike[str]) -> str:
    """``<folder>/.<name>.tmp-<16 random hex digits>`` beside ``path``."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TEMP_MARKER}{os.urandom(8).hex()}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, durable: bool = True, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file; when the block ends without error, rename it over ``path``.

    ``durable``: fsync the file before the rename and the folder after it, so the new content
    survives a crash of the machine. On error the temp file is removed and ``path`` is untouched.
    """
    path = os.fspath(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = True) -> None:
    """Replace ``path``'s content with ``data`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, durable=durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)
