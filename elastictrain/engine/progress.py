"""A tqdm progress bar on rank 0 when stderr is a terminal; nothing otherwise (logs stay clean).

The worker builds one with :func:`make_progress` and calls :meth:`Progress.update` on every step
(cheap: tqdm redraws at most ``mininterval`` times a second) with the world size, so a resize shows
at once; pass ``loss`` only on logging steps, where it is already a Python float.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, TextIO


class Progress(Protocol):
    def update(self, step: int, *, world_size: int, epoch: int | None = None, loss: float | None = None) -> None:
        """After a step: ``step`` is the global step completed (absolute, so a rollback moves it back)."""
        ...

    def close(self) -> None: ...


class NullProgress:
    """No terminal, a rank other than 0, or the bar turned off."""

    def update(self, step: int, *, world_size: int, epoch: int | None = None, loss: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class TqdmProgress:
    """The bar: position = global step, postfix = world size (and epoch, loss when given)."""

    def __init__(self, total: int | None, initial: int = 0, *, file: TextIO | None = None) -> None:
        from tqdm import tqdm

        self._bar: Any = tqdm(
            total=total, initial=initial, unit="step", dynamic_ncols=True, file=file or sys.stderr, mininterval=0.5
        )
        self._postfix: dict[str, Any] = {}

    def update(self, step: int, *, world_size: int, epoch: int | None = None, loss: float | None = None) -> None:
        postfix = dict(self._postfix, ws=world_size)
        if epoch is not None:
            postfix["epoch"] = epoch
        if loss is not None:
            postfix["loss"] = f"{loss:.4f}"
        refresh = postfix != self._postfix
        self._postfix = postfix
        if refresh:
            self._bar.set_postfix(postfix, refresh=False)
        moved_back = step < self._bar.n
        self._bar.n = step  # absolute: after a rollback the bar moves back to the restored step
        if refresh or moved_back:
            self._bar.refresh()
        else:
            self._bar.update(0)

    def close(self) -> None:
        self._bar.close()


def make_progress(
    *,
    rank: int,
    enabled: bool,
    total_steps: int | None,
    initial_step: int = 0,
    stream: TextIO | None = None,
) -> Progress:
    """A :class:`TqdmProgress` on rank 0 when ``enabled`` (``tracking.progress_bar``) and ``stream``
    (default stderr) is a terminal; a :class:`NullProgress` otherwise."""
    stream = sys.stderr if stream is None else stream
    is_tty = getattr(stream, "isatty", lambda: False)()
    if rank != 0 or not enabled or not is_tty:
        return NullProgress()
    return TqdmProgress(total_steps, initial_step, file=stream)
