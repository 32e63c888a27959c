"""The drop-in for Horovod elastic scripts, in one process: rollback by value, sync root, exactly-once sampler.

Stock Horovod's ``TorchState`` and ``ElasticSampler`` run beside ours where the contrast is the point.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import horovod.torch.elastic.sampler as hvd_sampler_module
import pytest
import torch
from horovod.torch.elastic import ElasticSampler as HorovodElasticSampler
from horovod.torch.elastic import TorchState
from torch import nn

from elastictrain.engine import dropin
from elastictrain.engine.collective import LocalCollective
from elastictrain.engine.dropin import ElasticSampler, ElasticState
from elastictrain.errors import ConfigError


def training_objects(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(1))  # the scale tensor exists from the first scale() on
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}


def take_steps(objs: dict[str, Any], n: int) -> None:
    for _ in range(n):
        objs["optimizer"].zero_grad()
        objs["model"](torch.randn(8, 4)).pow(2).sum().backward()
        objs["optimizer"].step()
        objs["scheduler"].step()
    objs["scaler"].update(new_scale=objs["scaler"].get_scale() / 2)  # as after an overflow


def committed_view(objs: dict[str, Any]) -> dict[str, Any]:
    return {
        "weight": objs["model"].weight.detach().clone(),
        "momentum": objs["optimizer"].state[objs["model"].weight]["momentum_buffer"].clone(),
        "lr": objs["optimizer"].param_groups[0]["lr"],
        "scheduler_epoch": objs["scheduler"].last_epoch,
        "scale": objs["scaler"].get_scale(),
    }


def test_scheduler_scaler_sampler_and_counters_roll_back_with_the_model():
    objs = training_objects()
    sampler = ElasticSampler(range(100), shuffle=True, seed=3, world=lambda: (0, 2))
    state = ElasticState(objs["model"], objs["optimizer"], scheduler=objs["scheduler"], scaler=objs["scaler"],
                         sampler=sampler, epoch=0, batch=0)  # fmt: skip
    take_steps(objs, 3)
    sampler.record_batch(0, 5)
    state.epoch, state.batch = 1, 7
    state.save()
    before = committed_view(objs)
    rng_before = torch.get_rng_state()

    take_steps(objs, 3)  # steps after the commit that a failed collective throws away
    sampler.record_batch(1, 5)
    state.epoch, state.batch = 2, 9
    torch.randn(3)
    state.restore()

    after = committed_view(objs)
    assert torch.equal(after.pop("weight"), before.pop("weight"))
    assert torch.equal(after.pop("momentum"), before.pop("momentum"))
    assert after == before, "scheduler, LR and GradScaler are back at the commit"
    assert sampler.state_dict() == {"epoch": 0, "cursor": 10}
    assert (state.epoch, state.batch) == (1, 7)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_stock_torch_state_leaves_the_scheduler_and_scaler_where_the_failed_steps_took_them():
    """The contrast: the same sequence with ``hvd.elastic.TorchState`` rolls back the model only."""
    objs = training_objects()
    state = TorchState(objs["model"], objs["optimizer"], scheduler=objs["scheduler"], scaler=objs["scaler"])
    take_steps(objs, 3)
    state.save()
    committed = committed_view(objs)
    take_steps(objs, 3)
    state.restore()
    after = committed_view(objs)
    assert torch.equal(after["weight"], committed["weight"])  # the model does roll back
    assert after["scheduler_epoch"] == committed["scheduler_epoch"] + 3, "stock: the scheduler is not rolled back"
    assert after["scale"] != committed["scale"], "stock: the GradScaler is not rolled back"


def lrs_of_steps(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, n: int) -> list[float]:
    """Take ``n`` steps (optimizer, then scheduler); the LR each step used."""
    used = []
    for _ in range(n):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    return used


@pytest.mark.parametrize("state_class", [ElasticState, TorchState])
def test_steps_replayed_after_a_rollback_get_the_lrs_of_a_run_without_failure_where_stock_torch_state_does_not(
    state_class,
):
    """The port's schedule shape (LambdaLR, stepped per batch): commit after 2 steps, 3 steps fail, restore, replay.

    With ``ElasticState`` the replayed steps use the LRs the failed ones used. Stock ``TorchState`` restores the
    optimizer's param groups but keeps the scheduler by reference, so the scheduler stays 3 steps ahead and
    from the second replayed step on the LR is the advanced one.
    """
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    state = state_class(model, optimizer, scheduler=scheduler)
    lrs_of_steps(model, optimizer, scheduler, 2)
    state.save()
    failed = lrs_of_steps(model, optimizer, scheduler, 3)
    assert failed == [0.1 * 0.5**2, 0.1 * 0.5**3, 0.1 * 0.5**4]
    state.restore()
    rolled_back = scheduler.last_epoch, scheduler.get_last_lr()
    replayed = lrs_of_steps(model, optimizer, scheduler, 3)
    if state_class is ElasticState:
        assert rolled_back == (2, [0.1 * 0.5**2])
        assert replayed == failed
    else:
        assert rolled_back == (5, [0.1 * 0.5**5]), "stock: the scheduler keeps the advanced LR"
        assert replayed == [0.1 * 0.5**2, 0.1 * 0.5**6, 0.1 * 0.5**7]


def test_a_state_name_of_its_own_is_refused_with_one_line():
    with pytest.raises(ValueError, match="commits is a name of the state itself"):
        ElasticState(nn.Linear(1, 1), None, commits=3)


def test_restore_undoes_optimizer_state_created_after_the_commit():
    objs = training_objects()
    state = ElasticState(objs["model"], objs["optimizer"], scheduler=objs["scheduler"])
    take_steps(objs, 1)  # the first step creates momentum buffers
    state.restore()
    assert objs["optimizer"].state.get(objs["model"].weight, {}) == {}


class TwoRanks(LocalCollective):
    """This process is rank 0 of two; rank 1 holds one commit more."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=2)
        self.roots: set[int] = set()

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        commits, gpu = obj
        return [obj, (commits + 1, gpu)]

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        self.roots.add(root)
        return obj

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        self.roots.add(root)


def test_sync_takes_the_state_of_the_rank_with_the_most_commits():
    fake = TwoRanks()
    objs = training_objects()
    state = ElasticState(objs["model"], objs["optimizer"], scheduler=objs["scheduler"], epoch=2)
    state._collective = fake
    commits = state.commits
    state.sync()
    assert fake.roots == {1}, f"synced from ranks {sorted(fake.roots)}, not rank 1"
    assert state.commits == commits + 1, "the synced state is committed"


# ------------------------------------------------------------------------------------------ the sampler
def run_ranks(sampler_state: dict, world: int, n: int, batch: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` steps of every rank of a world of ``world``: the ids of each step over all ranks."""
    samplers = []
    for r in range(world):
        s = ElasticSampler(range(n), shuffle=True, seed=seed, world=lambda r=r: (r, world))
        s.load_state_dict(sampler_state)
        samplers.append(s)
    iters = [iter(list(s)) for s in samplers]
    out = []
    for _ in range(steps):
        ids = [i for it in iters for i in [next(it, None) for _ in range(batch)] if i is not None]
        if not ids:
            break
        for s in samplers:
            s.record_batch(0, batch)
        out.append(ids)
        sampler_state.update(samplers[0].state_dict())
    return out


@pytest.mark.parametrize("seed", range(4))
def test_every_sample_once_per_epoch_through_resizes_and_rollbacks(seed):
    rng = random.Random(seed)
    n, batch = 203, 4
    committed = {"epoch": 0, "cursor": 0}
    done: list[int] = []
    while committed["epoch"] == 0:
        world = rng.randint(1, 4)
        live = dict(committed)
        steps = run_ranks(live, world, n, batch, rng.randint(1, 6), seed)
        if rng.random() < 0.3:
            continue  # a failure before the commit: the steps are thrown away, the cursor rolls back
        done += [i for ids in steps for i in ids]
        committed = live
        if committed["cursor"] >= n:
            committed = {"epoch": 1, "cursor": 0}
    assert sorted(done) == list(range(n)), "every sample exactly once"


def test_nothing_is_padded_and_shares_differ_by_at_most_one():
    shares = [list(ElasticSampler(range(10), world=lambda r=r: (r, 3))) for r in range(3)]
    assert [len(s) for s in shares] == [4, 3, 3]
    assert sorted(i for s in shares for i in s) == list(range(10))


def test_shuffle_off_keeps_the_dataset_order_and_each_epoch_shuffles_differently():
    assert list(ElasticSampler(range(6), shuffle=False, world=lambda: (1, 2))) == [1, 3, 5]
    s = ElasticSampler(range(50), seed=1, world=lambda: (0, 1))
    first = list(s)
    s.set_epoch(1)
    assert sorted(first) == sorted(s) and first != list(s)


def test_a_graceful_removal_without_sync_still_covers_the_rest_of_the_epoch_once(monkeypatch):
    """Horovod #3399: after a graceful removal Horovod skips the sync, so its sampler keeps the old split."""
    n, batch = 60, 5
    world = {"size": 3}

    # Ours: three ranks take two steps, rank 2's host is drained, the two others go on without a sync.
    state = {"epoch": 0, "cursor": 0}
    before = run_ranks(state, 3, n, batch, 2, seed=0)
    after = run_ranks(state, 2, n, batch, 100, seed=0)
    ours = [i for ids in before + after for i in ids]
    assert sorted(ours) == list(range(n))

    # Stock: the survivors' samplers were split for three ranks; nobody re-splits them.
    monkeypatch.setattr(hvd_sampler_module, "size", lambda: world["size"])
    ranks = {"r": 0}
    monkeypatch.setattr(hvd_sampler_module, "rank", lambda: ranks["r"])
    stock = []
    for r in range(3):
        ranks["r"] = r
        stock.append(HorovodElasticSampler(range(n), shuffle=True, seed=0))
    iters = [iter(list(s)) for s in stock]
    seen = [i for it in iters for _ in range(2 * batch) for i in [next(it)]]  # two steps at size 3
    seen += [i for it in iters[:2] for i in it]  # the two survivors finish their stale shares
    assert sorted(set(seen)) != list(range(n)), "stock Horovod loses the removed rank's samples"


class _Watchdog:
    def idle(self) -> None:
        pass

    snapshot_ring = step_started = stop = idle


@pytest.mark.parametrize("run_dir", [False, True])
def test_the_temp_failure_marker_folder_is_removed_when_training_returns(monkeypatch, tmp_path, run_dir):
    monkeypatch.setattr(dropin.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", "4242")
    if run_dir:
        monkeypatch.setenv("ELASTICTRAIN_RUN_DIR", str(tmp_path / "run"))
    else:
        monkeypatch.delenv("ELASTICTRAIN_RUN_DIR", raising=False)
    monkeypatch.setattr(dropin, "horovod_elastic_run", lambda func: func)
    monkeypatch.setattr(dropin, "arm_watchdog", lambda *a, **k: _Watchdog())
    folder = dropin._signals_folder()
    folder.mkdir(parents=True)

    class State:
        watchdog = None

    assert dropin.elastic_run(lambda state: 7)(State()) == 7
    assert folder.exists() == run_dir


class _FakeDistributedOptimizer(torch.optim.SGD):
    """What :class:`ElasticState` sees of Horovod's ``DistributedOptimizer``: ``_handles`` and ``synchronize``."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1)
        self._handles = {"w": (7, None)}
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_horovod_distributed_optimizer_waits_for_its_allreduces_asleep_once_however_many_states_hold_it(
    monkeypatch,
):
    polls: list[int] = []
    monkeypatch.setattr(dropin.hvd, "poll", lambda h: polls.append(h) or len(polls) >= 3)
    model = nn.Linear(2, 1)
    opt = _FakeDistributedOptimizer(model.parameters())
    ElasticState(model, opt)
    ElasticState(model, opt)  # a second state over the same optimizer does not wrap it again
    opt.synchronize()
    assert polls == [7, 7, 7]  # polled (sleeping between polls) until done, then Horovod's own synchronize once
    assert opt.synchronized == 1


def test_a_plain_optimizer_is_left_as_it_is():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ElasticState(model, opt)
    assert "synchronize" not in vars(opt) and not hasattr(opt, "_elastictrain_waits_asleep")


class TwoRanksOnOneGpu(LocalCollective):
    """Rank 0 of two under NCCL; the peer names the same GPU: the sync must stop before any broadcast."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=2)
        self.nccl = True
        self.broadcasts = 0

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        commits, _gpu = obj
        return [(commits, "GPU-same"), (commits + 1, "GPU-same")]

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        self.broadcasts += 1
        return obj

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        self.broadcasts += 1


def test_the_sync_stops_with_one_line_before_any_broadcast_when_two_ranks_share_a_gpu():
    fake = TwoRanksOnOneGpu()
    objs = training_objects()
    state = ElasticState(objs["model"], objs["optimizer"])
    state._collective = fake
    with pytest.raises(ConfigError, match=r"^rank 0 and rank 1 share GPU GPU-same: NCCL runs one rank per GPU"):
        state.sync()
    assert fake.broadcasts == 0
