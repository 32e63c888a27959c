"""fp16 with a GradScaler: a worker whose first step after a load or a sync has an empty share still steps.

``GradScaler.load_state_dict`` records the scale but creates the ``_scale``/``_growth_tracker`` tensors only at
the first ``scale()``. A worker with no sample in its first step never calls ``scale()``; it still takes part in
the allreduce (Horovod's ``synchronize`` gives every parameter the summed gradient) and then ``unscale_``
asserted. Reproduced on the CPU: ``torch.amp.GradScaler("cpu")`` is an enabled scaler running the same
``GradScaler`` code as on CUDA (``load_state_dict``, the lazy tensors, the ``unscale_`` check); only the device
of its tensors differs, and the tests check that they land on the model's device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from elastictrain.engine.collective import LocalCollective
from elastictrain.engine.dropin import ElasticState
from elastictrain.engine.policy import ScaleRamp
from elastictrain.engine.sampler import SamplerState
from elastictrain.engine.state import CommittedState, Counters
from elastictrain.engine.step import Precision, train_step

SCALE = 512.0
FP16_SCALER = Precision(torch.float16, True)


class AllreducedOptimizer:
    """The part of Horovod's ``DistributedOptimizer`` an empty share meets: ``synchronize()`` gives every
    parameter the gradient summed over the other workers (here ``SCALE * 1``, as scaled by them)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.inner = torch.optim.SGD(model.parameters(), lr=0.5)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def synchronize(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.full_like(p, SCALE)

    def step(self) -> None:
        self.inner.step()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.inner.load_state_dict(d)


def trained_scaler_state() -> dict[str, Any]:
    """The state dict of a scaler that has scaled and updated (as the most advanced rank's)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    scaler.scale(torch.ones(()))
    scaler._growth_tracker.fill_(3)  # type: ignore[union-attr]
    return scaler.state_dict()


def fresh() -> tuple[nn.Module, AllreducedOptimizer, torch.amp.GradScaler]:
    model = nn.Linear(3, 2)
    return model, AllreducedOptimizer(model), torch.amp.GradScaler("cpu", growth_interval=1000)


def step_with_an_empty_share(model: nn.Module, opt: Any, scaler: torch.amp.GradScaler) -> None:
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, opt, scaler, [], global_count=8, precision=FP16_SCALER, grad_clip_norm=1e9)
    assert stats.count == 0
    for p, b in zip(model.parameters(), before, strict=True):  # unscaled by the loaded scale: SCALE / SCALE = 1
        assert torch.allclose(p.detach(), b - 0.5), "the step used the loaded scale"


def assert_ready_on(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    assert scaler._scale is not None and scaler._growth_tracker is not None
    assert scaler._scale.device == device and scaler._growth_tracker.device == device


def committed(model: nn.Module, opt: Any, scaler: Any) -> CommittedState:
    sched = torch.optim.lr_scheduler.LambdaLR(opt.inner, lambda _: 1.0)
    return CommittedState(model, opt, sched, scaler, SamplerState(), Counters(step=4), ScaleRamp(1, 1, 0, 0))


def test_an_engine_worker_synced_into_an_empty_first_step_unscales_with_the_synced_scale():
    model, opt, scaler = fresh()
    state = committed(model, opt, scaler)
    small = state.small_state()
    small["scaler"] = trained_scaler_state()
    state.load_small_state(small)  # what ElasticTrainingState.sync does with the root's small state
    assert scaler.get_scale() == SCALE and int(scaler._growth_tracker) == 3  # type: ignore[arg-type]
    step_with_an_empty_share(model, opt, scaler)
    assert_ready_on(scaler, next(model.parameters()).device)


def test_an_engine_worker_resumed_from_a_checkpoint_steps_an_empty_share():
    src_model, src_opt, _ = fresh()
    src = committed(src_model, src_opt, torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000))
    src.scaler.scale(torch.ones(()))
    src.save()
    checkpoint = src.full_state()
    model, opt, scaler = fresh()
    committed(model, opt, scaler).load_full_state(checkpoint)
    step_with_an_empty_share(model, opt, scaler)
    assert_ready_on(scaler, next(model.parameters()).device)


def test_an_engine_worker_rolled_back_before_its_first_scale_steps_an_empty_share():
    model, opt, _ = fresh()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    state = committed(model, opt, scaler)
    state.save()
    state.restore()
    step_with_an_empty_share(model, opt, scaler)
    assert_ready_on(scaler, next(model.parameters()).device)


class RootIsRankOne(LocalCollective):
    """This process is rank 0 of two; rank 1 holds one commit more, so it is the root of the sync."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=2)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        commits, gpu = obj
        return [obj, (commits + 1, gpu)]

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        if name == "sync.meta":  # the root's layouts, param groups and the drop-in's small state
            small = obj["extra"]
            obj = {**obj, "extra": {**small, "stateful": {**small["stateful"], "scaler": trained_scaler_state()}}}
        return obj


@pytest.mark.parametrize("load", ["sync", "restore"])
def test_a_drop_in_worker_steps_an_empty_share_after_a_sync_or_a_rollback(load):
    model, opt, scaler = fresh()
    state = ElasticState(model, opt.inner, scaler=scaler)
    state._collective = RootIsRankOne()
    if load == "sync":
        state.sync()
        assert scaler.get_scale() == SCALE
    else:
        scaler.load_state_dict(trained_scaler_state())  # as a script that resumes would, then commits
        state.save()
        state.restore()
    step_with_an_empty_share(model, opt, scaler)
    assert_ready_on(scaler, next(model.parameters()).device)
