"""progress: a bar with the world size on rank 0 at a terminal, nothing in logs or on other ranks."""

from __future__ import annotations

import io

from elastictrain.engine.progress import NullProgress, TqdmProgress, make_progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rank_0_at_a_terminal_gets_a_bar_showing_the_world_size() -> None:
    stream = Tty()
    bar = make_progress(rank=0, enabled=True, total_steps=100, stream=stream)
    assert isinstance(bar, TqdmProgress)
    bar.update(10, world_size=4, epoch=0)
    bar.update(20, world_size=2, loss=0.5)
    bar.update(15, world_size=2)  # rolled back
    bar.close()
    text = stream.getvalue()
    assert "ws=4" in text and "ws=2" in text and "loss=0.5000" in text and "15/100" in text


def test_no_bar_in_logs_on_other_ranks_or_when_turned_off() -> None:
    assert isinstance(make_progress(rank=0, enabled=True, total_steps=10, stream=io.StringIO()), NullProgress)
    assert isinstance(make_progress(rank=1, enabled=True, total_steps=10, stream=Tty()), NullProgress)
    assert isinstance(make_progress(rank=0, enabled=False, total_steps=10, stream=Tty()), NullProgress)
    null = NullProgress()
    null.update(1, world_size=1)
    null.close()
