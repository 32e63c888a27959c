"""A worker waits for its gradient allreduces sleeping between polls, not in Horovod's spinning wait."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from elastictrain.engine.collective import GRADIENT_POLL_SECONDS, wait_without_spinning
from elastictrain.horovod.private import allreduces_done


class FakeDistributedOptimizer:
    """``_handles`` as Horovod's ``DistributedOptimizer`` keeps them; ``synchronize`` records when it ran."""

    def __init__(self, handles: dict[str, tuple[object, object]]) -> None:
        self._handles = handles
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("horovod synchronize")
        self._handles.clear()


def test_the_wait_sleeps_until_every_started_allreduce_is_done_then_runs_horovods_synchronize():
    pending = {7: 3}  # handle 7 is done at its 4th poll; handle 8 at once
    polls: list[int] = []

    def poll(handle: int) -> bool:
        polls.append(handle)
        pending[handle] = pending.get(handle, 0) - 1
        return pending[handle] < 0

    opt = FakeDistributedOptimizer({"w": (7, None), "b": (8, None), "not started": (None, None)})
    slept: list[float] = []
    wait_without_spinning(opt, poll, sleep=lambda s: (slept.append(s), opt.calls.append("sleep")))
    opt.synchronize()
    assert slept == [GRADIENT_POLL_SECONDS] * 3
    assert opt.calls == ["sleep", "sleep", "sleep", "horovod synchronize"]
    assert polls.count(7) == 4


def test_a_failed_allreduce_is_done_and_horovods_synchronize_raises_its_error():
    opt = FakeDistributedOptimizer({"w": (1, None)})

    def failing() -> None:
        raise RuntimeError("Horovod has been shut down")

    opt.synchronize = failing  # type: ignore[method-assign]
    wait_without_spinning(opt, lambda h: True, sleep=lambda s: pytest.fail("no wait when every handle is done"))
    with pytest.raises(RuntimeError, match="shut down"):
        opt.synchronize()


def test_an_optimizer_without_handles_has_nothing_to_wait_for():
    assert allreduces_done(object(), lambda h: False)
    assert allreduces_done(FakeDistributedOptimizer({"g": (lambda: None, None)}), lambda h: False)


def test_horovods_distributed_optimizer_steps_with_the_waiting_synchronize():
    """In a child process: ``hvd.init`` once, the engine's ``DistributedOptimizer`` with its gradient hooks, a
    backward pass that starts allreduces, then the step as ``train_step`` takes it."""
    code = textwrap.dedent(
        """
        import os
        import torch, horovod.torch as hvd
        from elastictrain.engine.collective import HorovodCollective
        hvd.init()
        model = torch.nn.Linear(3, 2)
        os.environ["HOROVOD_ELASTIC"] = "1"  # the gradient hooks, as under horovodrun (skipped at size 1)
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = HorovodCollective().distributed_optimizer(base, model.named_parameters(), "none")
        os.environ.pop("HOROVOD_ELASTIC")
        model(torch.randn(4, 3)).sum().backward()
        local = [p.grad.clone() for p in model.parameters()]
        assert opt._handles, "no allreduce was started"
        opt.synchronize()
        assert opt._handles == {}
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), local))  # a sum over one worker
        with opt.skip_synchronize():
            opt.step()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
