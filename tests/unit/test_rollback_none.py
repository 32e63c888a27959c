"""``elastic.rollback: none`` in one process: a failed step is discarded, every whole step is kept.

The step runs through the real ``train_step`` with an optimizer whose gradient allreduce fails on demand
(as Horovod's ``DistributedOptimizer.synchronize`` raises when a peer dies). Two ranks' syncs run in one
process, each over its own fake :class:`~elastictrain.engine.collective.Collective`: the root's broadcasts are
recorded, then replayed into the receiver, optionally failing midway.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from horovod.common.exceptions import HorovodInternalError
from torch import nn

from elastictrain.engine.collective import LocalCollective
from elastictrain.engine.elastic_state import ElasticTrainingState
from elastictrain.engine.policy import ScaleRamp
from elastictrain.engine.sampler import SamplerState, StepLog
from elastictrain.engine.state import CommittedState, Counters, LiveState, make_state
from elastictrain.engine.step import Precision, train_step

GLOBAL_COUNT = 8


class FlakyDistributedOptimizer:
    """What ``train_step`` uses of Horovod's ``DistributedOptimizer``; the allreduce fails while ``fail``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.fail = False

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def synchronize(self) -> None:
        if self.fail:
            raise HorovodInternalError("Horovod has been shut down: a peer died")

    def skip_synchronize(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step(self) -> None:
        self.optimizer.step()


def build(rollback: str = "none", scaler: bool = True) -> CommittedState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    amp = torch.amp.GradScaler("cpu", init_scale=256.0) if scaler else None
    st = make_state(rollback, model, opt, sched, amp, SamplerState(), Counters(), ScaleRamp(1, 1, 0, 0), StepLog(16))
    st.save()
    return st


def batches(step: int, micro: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_COUNT, 4, generator=g), torch.randint(0, 3, (GLOBAL_COUNT,), generator=g)
    size = GLOBAL_COUNT // micro
    return [(x[i : i + size], y[i : i + size]) for i in range(0, GLOBAL_COUNT, size)]


def engine_step(st: CommittedState, flaky: FlakyDistributedOptimizer, loss_fn: Any = None) -> None:
    """One step as the engine runs it: ``train_step``, then the counters, cursor and step log."""
    step = st.counters.step + 1
    kwargs = {"loss_fn": loss_fn} if loss_fn is not None else {}
    train_step(
        st.model,
        flaky,  # type: ignore[arg-type]
        st.scaler,
        batches(step),
        GLOBAL_COUNT,
        precision=Precision(None, False),
        grad_clip_norm=1.0,
        **kwargs,
    )
    st.counters.step = step
    st.counters.samples += GLOBAL_COUNT
    st.step_log.append(step, st.sampler.epoch, st.sampler.cursor, GLOBAL_COUNT)
    st.sampler.cursor += GLOBAL_COUNT
    st.scheduler.step()


def fail_step(state: ElasticTrainingState, flaky: FlakyDistributedOptimizer, loss_fn: Any = None) -> None:
    """A step whose collective fails, and the elastic loop's answer to it (``restore()`` in its except)."""
    flaky.fail = loss_fn is None
    try:
        engine_step(state.committed, flaky, loss_fn)
    except HorovodInternalError:
        state.restore()
    else:
        raise AssertionError("the step did not fail")
    finally:
        flaky.fail = False


def snapshot(st: CommittedState) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in st.model.state_dict().items()},
        "opt": copy.deepcopy(st.optimizer.state_dict()),
        "small": copy.deepcopy(st.small_state()),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["opt"]["state"].keys() == b["opt"]["state"].keys()
    for i, entry in a["opt"]["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["opt"]["state"][i][key])), (i, key)
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
    assert a["small"] == b["small"]


def training_state(st: CommittedState) -> ElasticTrainingState:
    return ElasticTrainingState(st, seed=0, stop_requested=lambda: False, collective=LocalCollective())


def loss_failing_on_second_micro_batch() -> Any:
    """A loss whose second call raises as a backward hook's allreduce does when the ring is broken."""
    calls = {"n": 0}

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise HorovodInternalError("allreduce enqueue failed: Horovod has been shut down")
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="none")

    return loss


@pytest.mark.parametrize("where", ["gradient allreduce", "mid accumulation"])
def test_a_failed_step_is_discarded_and_the_redone_step_matches_a_fault_free_run(where):
    clean = build()
    clean_opt = FlakyDistributedOptimizer(clean.optimizer)
    for _ in range(4):
        engine_step(clean, clean_opt)

    st = build()
    flaky = FlakyDistributedOptimizer(st.optimizer)
    state = training_state(st)
    for _ in range(3):
        engine_step(st, flaky)
    before = snapshot(st)
    fail_step(state, flaky, loss_failing_on_second_micro_batch() if where == "mid accumulation" else None)

    assert_same(before, snapshot(st))  # model, optimizer, scheduler, scaler, cursor, counters, step log: kept
    assert all(p.grad is None for p in st.model.parameters()), "the partial step's gradients survived"
    assert state.reached_step == 3
    engine_step(st, flaky)  # the step again: the scaler takes a fresh step, nothing of the failed one remains
    assert_same(snapshot(clean), snapshot(st))


def test_rollback_none_makes_no_copy_of_the_state_at_a_commit():
    st = build("none")
    flaky = FlakyDistributedOptimizer(st.optimizer)
    engine_step(st, flaky)
    st.save()
    assert isinstance(st, LiveState) and not st.keeps_copy
    assert st._model_snapshot.buffers == [] and st._opt_snapshot.tensors.buffers == []
    assert st.committed_small()["counters"]["step"] == 1  # the live state is the commit
    with pytest.raises(RuntimeError, match="no copy"):
        st.restore()


def test_a_checkpoint_of_the_live_state_resumes_in_either_mode():
    st = build("none")
    flaky = FlakyDistributedOptimizer(st.optimizer)
    for _ in range(3):
        engine_step(st, flaky)
    full = copy.deepcopy(st.full_state())
    engine_step(st, flaky)  # the live objects move on; the checkpointer copied them at save()
    for mode in ("none", "commit"):
        fresh = build(mode)
        fresh.load_full_state(full)
        assert fresh.counters.step == 3 and fresh.sampler.cursor == 3 * GLOBAL_COUNT
        assert fresh.step_log.entries == [(s, 0, (s - 1) * GLOBAL_COUNT, GLOBAL_COUNT) for s in (1, 2, 3)]
        for k, v in full["model"].items():
            assert torch.equal(fresh.model.state_dict()[k], v), k
        if mode == "none":
            assert fresh._model_snapshot.buffers == [], "a resume kept a copy of the checkpoint"


# ------------------------------------------------------------------------------------- two ranks, one process
class RootCollective(LocalCollective):
    """The world as the sync's root (rank 1) sees it; records what it broadcasts, by name."""

    def __init__(self, peer_position: tuple[int, ...]) -> None:
        super().__init__(rank=1, size=2)
        self.peer_position = peer_position
        self.sent: dict[str, Any] = {}

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return [self.peer_position, obj]

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        assert root == 1
        self.sent[name] = copy.deepcopy(obj)
        return obj

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        assert root == 1
        for name, tensor in tensors.items():
            self.sent[name] = tensor.clone()


class ReceiverCollective(LocalCollective):
    """The world as rank 0 sees the same sync: the root's broadcasts arrive; the ``fail_after``-th one fails."""

    def __init__(self, root: RootCollective, root_position: tuple[int, ...], fail_after: int | None = None) -> None:
        super().__init__(rank=0, size=2)
        self.root, self.root_position, self.fail_after = root, root_position, fail_after
        self.received = 0

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return [obj, self.root_position]

    def _arrive(self) -> None:
        if self.fail_after is not None and self.received >= self.fail_after:
            raise HorovodInternalError("broadcast failed: the root died mid-sync")
        self.received += 1

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        self._arrive()
        return copy.deepcopy(self.root.sent[name])

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        for name, tensor in tensors.items():
            self._arrive()
            tensor.copy_(self.root.sent[name])


class EchoCollective(LocalCollective):
    """Rank 0 of two, the root of the sync (a tie goes to the lowest rank): the broadcasts change nothing."""

    def __init__(self, peer_position: tuple[int, ...]) -> None:
        super().__init__(rank=0, size=2)
        self.peer_position = peer_position

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return [obj, self.peer_position]


def two_ranks(rollback: str) -> tuple[ElasticTrainingState, ElasticTrainingState]:
    """Rank 0 failed step 4 (its allreduce broke); rank 1 completed it (a ring can finish on some ranks)."""
    behind, ahead = build(rollback), build(rollback)
    states = training_state(behind), training_state(ahead)
    for st, state in zip((behind, ahead), states, strict=True):
        flaky = FlakyDistributedOptimizer(st.optimizer)
        for _ in range(3):
            engine_step(st, flaky)
            if st.counters.step == 2:
                state.save()  # rollback commit: the last commit is at step 2
        if st is ahead:
            engine_step(st, flaky)
        fail_step(state, flaky)
    return states


def run_sync(receiver: ElasticTrainingState, root: ElasticTrainingState, **kw: Any) -> None:
    """The root's half of the sync, then the receiver's, replayed from what the root sent."""
    positions = [position(receiver), position(root)]
    root.collective = sender = RootCollective(positions[0])
    root.sync()
    receiver.collective = ReceiverCollective(sender, positions[1], **kw)
    receiver.sync()


def position(state: ElasticTrainingState) -> tuple[int, int, int, object]:
    c = state.committed
    reached = c.counters.step if state.reached_step is None else state.reached_step
    return c.counters.step, c.sampler.epoch, reached, state.member()


def test_the_sync_hands_the_step_a_survivor_completed_to_the_one_that_failed_it():
    behind, ahead = two_ranks("none")
    assert (behind.committed.counters.step, ahead.committed.counters.step) == (3, 4)
    run_sync(behind, ahead)
    assert_same(snapshot(ahead.committed), snapshot(behind.committed))
    assert behind.committed.counters.step == 4
    assert behind.lost_steps == ahead.lost_steps == 0
    assert behind.reached_step is None


def test_rollback_commit_counts_the_steps_the_furthest_survivor_loses():
    behind, ahead = two_ranks("commit")
    assert (behind.committed.counters.step, ahead.committed.counters.step) == (2, 2)  # both back at the commit
    assert (behind.reached_step, ahead.reached_step) == (3, 4)
    behind.collective = EchoCollective(position(ahead))
    behind.sync()
    assert behind.lost_steps == 2  # rank 1 had completed step 4; the job goes on from step 2


@pytest.mark.parametrize("fail_after", [0, 1, 3, 6])  # the first: the broadcast of the layouts and small state
def test_a_sync_that_fails_midway_leaves_the_receiver_a_whole_step(fail_after):
    behind, ahead = two_ranks("none")
    before = snapshot(behind.committed)
    with pytest.raises(HorovodInternalError):
        run_sync(behind, ahead, fail_after=fail_after)
    assert_same(before, snapshot(behind.committed))
    # The elastic loop then restores and syncs again; the kept state is still step 3, not a mix.
    behind.restore()
    assert behind.reached_step == 3
    assert_same(before, snapshot(behind.committed))
