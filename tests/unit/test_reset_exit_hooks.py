"""What a worker keeps across elastic resets: Horovod's exit hook is registered once, however many resets
(``hvd.init`` registers ``hvd.shutdown`` with ``atexit`` at every call, and every reset calls it)."""

from __future__ import annotations

import atexit
import gc
import types
from collections.abc import Iterator

import pytest

from elastictrain.engine.collective import init_horovod, reset_horovod

FAILED = "Horovod initialization failed. Please check log messages above for a more descriptive error."


class HorovodLike:
    """``horovod.torch`` as far as atexit goes: ``init`` registers the basics' ``shutdown`` at each call (as
    ``HorovodBasics.init`` does), which ``hvd.shutdown`` wraps."""

    def __init__(self, fail_every: int = 0) -> None:
        self.inits = 0
        self.fail_every = fail_every

    def basics_shutdown(self) -> None:
        pass

    def shutdown(self) -> None:
        self.basics_shutdown()

    def init(self) -> None:
        self.inits += 1
        atexit.register(self.basics_shutdown)
        if self.fail_every and self.inits % self.fail_every == 0:
            raise ValueError(FAILED)


def exit_hooks(hvd: HorovodLike) -> int:
    """Registrations of ``hvd.shutdown`` alive: atexit holds one bound method per registration (the bound methods
    are what grew by one per reset in the survivors of ``python -m chaos.resets``)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is types.MethodType and o.__self__ is hvd)


@pytest.fixture
def hvd() -> Iterator[HorovodLike]:
    h = HorovodLike(fail_every=3)
    yield h
    atexit.unregister(h.basics_shutdown)


def test_two_hundred_resets_leave_one_exit_hook_for_horovods_shutdown(hvd: HorovodLike) -> None:
    init_horovod(hvd.init, hvd.basics_shutdown)  # the worker's start
    for _ in range(200):  # each reset: shutdown, init (a failed init, every third, tried again)
        reset_horovod(hvd.shutdown, lambda: init_horovod(hvd.init, hvd.basics_shutdown))
    assert hvd.inits > 200
    assert exit_hooks(hvd) == 1


def test_a_failed_init_leaves_one_exit_hook_too(hvd: HorovodLike) -> None:
    hvd.fail_every = 1
    for _ in range(5):
        with pytest.raises(ValueError, match="initialization failed"):
            init_horovod(hvd.init, hvd.basics_shutdown)
    assert exit_hooks(hvd) == 1
