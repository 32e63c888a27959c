"""Pure parts of the elastic worker: the exactly-once planner, LR policies, in-place commit/rollback, the step."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from elastictrain.config import ElasticConfig, ScheduleConfig, TrainingConfig
from elastictrain.engine.policy import ScaleRamp, batch_plan, lr_scale, schedule_factor
from elastictrain.engine.sampler import ExactlyOncePlanner, SamplerState, shares
from elastictrain.engine.state import CommittedState, Counters
from elastictrain.engine.step import Precision, train_step
from elastictrain.rundir.ledger import SampleLedger, committed_samples


def test_shares_split_exactly_and_nearly_evenly():
    assert shares(10, 3) == [4, 3, 3]
    assert shares(2, 4) == [1, 1, 0, 0]
    assert sum(shares(1001, 7)) == 1001


def simulate(planner, world_sizes, per_worker, rollback_every=None, rng=None):
    """Drive the planner through world-size changes and rollbacks; return the committed ids per epoch."""
    state, committed, done = SamplerState(), SamplerState(), {}
    pending: list[list[int]] = []
    w_iter = iter(world_sizes)
    w = next(w_iter)
    steps = 0
    while state.epoch < 2:
        gb = w * per_worker
        if planner.epoch_done(state, gb):
            done.setdefault(state.epoch, []).extend(i for ids in pending for i in ids)
            pending.clear()
            state.epoch, state.cursor = state.epoch + 1, 0
            committed = SamplerState(state.epoch, 0)
            continue
        ids = []
        for r in range(w):
            ids += planner.plan(state, global_batch=gb, world_size=w, rank=r, micro_batch=per_worker).local_ids
        state.cursor += len(ids)
        pending.append(ids)
        steps += 1
        if rng is not None and rng.random() < 0.2:  # hard failure: roll back to the last commit, resize
            state = SamplerState(committed.epoch, committed.cursor)
            pending.clear()
            w = next(w_iter, w)
        elif steps % 3 == 0:  # commit, then maybe a graceful resize
            done.setdefault(state.epoch, []).extend(i for ids_ in pending for i in ids_)
            pending.clear()
            committed = SamplerState(state.epoch, state.cursor)
            w = next(w_iter, w)
    return done


@pytest.mark.parametrize("seed", range(5))
def test_planner_uses_every_sample_exactly_once_through_resizes_and_rollbacks(seed):
    planner = ExactlyOncePlanner(997, seed=seed)
    rng = random.Random(seed)
    sizes = [rng.randint(1, 5) for _ in range(40)]
    done = simulate(planner, sizes, per_worker=7, rng=rng)
    for epoch in (0, 1):
        assert sorted(done[epoch]) == list(range(997))


def test_planner_never_pads_and_the_last_step_may_be_short():
    planner = ExactlyOncePlanner(10, seed=0)
    s = SamplerState(cursor=8)
    p0 = planner.plan(s, global_batch=6, world_size=3, rank=0, micro_batch=6)
    p2 = planner.plan(s, global_batch=6, world_size=3, rank=2, micro_batch=6)
    assert p0.global_count == 2 and len(p0.local_ids) == 1 and p2.local_ids == [] and p2.micro_batches == []


def test_epoch_permutation_differs_between_epochs_but_is_reproducible():
    a, b = ExactlyOncePlanner(50, seed=1), ExactlyOncePlanner(50, seed=1)
    assert a.permutation(0) == b.permutation(0) != a.permutation(1)


def test_ledger_replay_drops_rolled_back_steps(tmp_path):
    led = SampleLedger(tmp_path, "attempt-000")
    led.record(1, 0, [0, 1])
    led.record(2, 0, [2, 3])
    led.restore(1)  # step 2 was rolled back
    led.record(2, 0, [2, 4])
    led.close()
    assert committed_samples(tmp_path) == {0: [0, 1, 2, 4]}


def test_lr_scaling_rules_and_ramp():
    el = ElasticConfig(base_world_size=2, lr_scaling="linear")
    assert lr_scale(el, 4) == 2.0
    assert lr_scale(ElasticConfig(base_world_size=4, lr_scaling="sqrt"), 16) == 2.0
    assert lr_scale(ElasticConfig(policy="global", global_batch_size=64), 8) == 1.0
    ramp = ScaleRamp(start=1.0, target=2.0, start_step=10, ramp_steps=4)
    assert [ramp.at(s) for s in (10, 12, 14, 20)] == [1.0, 1.5, 2.0, 2.0]


def test_batch_plans_per_policy():
    assert batch_plan(ElasticConfig(), 32, 2, 3).global_batch == 192
    g = batch_plan(ElasticConfig(policy="global", global_batch_size=100, micro_batch_size=16), 32, 1, 3)
    assert (g.global_batch, g.micro_batch) == (100, 16)


def test_schedule_is_measured_in_epochs_with_warmup():
    t = TrainingConfig(epochs=90)
    ms = ScheduleConfig(kind="multistep", milestones=(30, 60, 80), warmup_epochs=5)
    assert schedule_factor(ms, t, 0.0) == pytest.approx(0.1)
    assert schedule_factor(ms, t, 5.0) == 1.0
    assert schedule_factor(ms, t, 61.0) == pytest.approx(0.01)
    cos = ScheduleConfig(kind="cosine")
    assert schedule_factor(cos, TrainingConfig(epochs=2), 2.0) == pytest.approx(0.0)


def make_state(opt_cls=torch.optim.SGD):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    opt = opt_cls(model.parameters(), lr=0.1, **({"momentum": 0.9} if opt_cls is torch.optim.SGD else {}))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    st = CommittedState(model, opt, sched, scaler, SamplerState(), Counters(), ScaleRamp(1, 1, 0, 0))
    return st


def one_step(st: CommittedState) -> None:
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    st.optimizer.zero_grad()
    st.scaler.scale(nn.functional.cross_entropy(st.model(x), y)).backward()
    st.scaler.step(st.optimizer)
    st.scaler.update(st.scaler.get_scale() / 2)
    st.scheduler.step()
    st.sampler.cursor += 6
    st.counters.step += 1


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_rollback_restores_all_state_including_state_created_after_the_commit(opt_cls):
    st = make_state(opt_cls)
    st.save()  # before the first step: no optimizer state yet
    before_model = copy.deepcopy(st.model.state_dict())
    before_small = copy.deepcopy(st.small_state())
    rng_before = torch.get_rng_state()
    for _ in range(3):
        one_step(st)
    torch.rand(5)
    st.restore()
    assert all(torch.equal(a, b) for a, b in zip(before_model.values(), st.model.state_dict().values(), strict=True))
    assert len(st.optimizer.state) == 0
    assert st.small_state() == before_small
    assert torch.equal(torch.get_rng_state(), rng_before)
    # and a commit after some steps restores that point, with the optimizer buffers
    one_step(st)
    st.save()
    snap = copy.deepcopy(st.optimizer.state_dict())
    lr = st.optimizer.param_groups[0]["lr"]
    one_step(st)
    one_step(st)
    st.restore()
    restored = st.optimizer.state_dict()
    for k, v in snap["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(restored["state"][k][name])), name
    assert st.optimizer.param_groups[0]["lr"] == lr and st.counters.step == 1


def test_commit_reuses_its_buffers():
    st = make_state()
    one_step(st)
    st.save()
    ptrs = [b.data_ptr() for b in st._model_snapshot.buffers + st._opt_snapshot.tensors.buffers]
    one_step(st)
    st.save()
    assert ptrs == [b.data_ptr() for b in st._model_snapshot.buffers + st._opt_snapshot.tensors.buffers]


def test_full_state_round_trips_into_a_fresh_process_state():
    st = make_state()
    for _ in range(3):
        one_step(st)
    st.save()
    full = st.full_state()
    fresh = make_state()
    fresh.load_full_state(full)
    assert fresh.small_state() == st.small_state()
    for a, b in zip(st.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh.optimizer.state_dict()["state"].keys() == st.optimizer.state_dict()["state"].keys()


def test_uneven_and_empty_shares_give_the_global_mean_gradient():
    """Summing per-share gradients of sum-loss / global count equals one big batch's mean gradient."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    ref = copy.deepcopy(model)
    nn.functional.cross_entropy(ref(x), y).backward()
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for share in ([0, 1, 2, 3], [4, 5, 6], []):  # three workers, one with nothing
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        batches = [(x[share], y[share])] if share else []
        train_step(m, opt, None, batches, 7, precision=Precision(None, False), grad_clip_norm=None)
        for g, p in zip(grads, m.parameters(), strict=True):
            if p.grad is not None:
                g += p.grad
    for g, p in zip(grads, ref.parameters(), strict=True):
        assert torch.allclose(g, p.grad, atol=1e-6)


def test_a_new_rank0_rewrites_committed_steps_that_the_dead_rank0_never_recorded(tmp_path):
    """Peers committed steps 4-6 but rank 0 died before writing them; the synced step log fills the gap."""
    from elastictrain.engine.sampler import StepLog

    planner = ExactlyOncePlanner(12, seed=0)
    perm = planner.permutation(0)
    log = StepLog(maxlen=8)
    for step in range(1, 7):
        log.append(step, 0, (step - 1) * 2, 2)
    old = SampleLedger(tmp_path, "1-old")
    for step, epoch, start, count in log.entries[:3]:  # the old rank 0 wrote steps 1-3, then died
        old.record(step, epoch, perm[start : start + count])
    old.record(7, 0, perm[12:12])  # and a step 7 that was never committed anywhere
    old.close()
    synced = StepLog(maxlen=8)
    synced.load_state_dict(log.state_dict())  # what the new rank 0 received in the sync (committed at step 6)
    new = SampleLedger(tmp_path, "2-new")
    new.restore(6)
    for step, epoch, start, count in synced.entries:
        new.record(step, epoch, perm[start : start + count])
    new.close()
    assert committed_samples(tmp_path) == {0: perm[:12]}


def test_step_log_keeps_only_its_last_entries_and_is_off_at_maxlen_zero():
    from elastictrain.engine.sampler import StepLog

    log = StepLog(maxlen=3)
    for s in range(10):
        log.append(s, 0, s, 1)
    assert [e[0] for e in log.entries] == [7, 8, 9]
    off = StepLog()
    off.append(1, 0, 0, 1)
    assert off.state_dict() == []


def test_ledger_files_replay_in_the_order_rank0_was_held_even_when_the_later_host_clock_is_behind(tmp_path):
    """Rank 0 moved to a host whose clock is 1 s behind: its file must still be replayed last."""
    first = SampleLedger(tmp_path, "2000000000-11")  # names as the old scheme made them: <ns>-<pid>
    first.restore(0)
    for step in (1, 2, 3):
        first.record(step, 0, [step * 10])
    first.close()
    second = SampleLedger(tmp_path, "1000000000-22")  # the next rank 0, on the slower clock
    second.restore(2)  # step 3 was rolled back
    second.record(3, 0, [33])
    second.close()
    assert committed_samples(tmp_path) == {0: [10, 20, 33]}
    from elastictrain.rundir.ledger import ledger_files

    assert ledger_files(tmp_path) == [first.path, second.path]


def test_a_relaunch_from_an_older_checkpoint_replays_after_the_tenure_it_follows(tmp_path):
    """A (from 0) dies; B takes over at commit 18 and writes 19-21; the job is preempted and C resumes from
    the checkpoint of step 12. Ordering the files by their first step (0, 12, 18) would replay B last."""
    a = SampleLedger(tmp_path, "a")
    a.restore(0)
    for step in range(1, 21):
        a.record(step, 0, [step])
    a.close()
    b = SampleLedger(tmp_path, "b")
    b.restore(18)
    for step in (19, 20, 21):
        b.record(step, 0, [100 + step])
    b.close()
    c = SampleLedger(tmp_path, "c")
    c.restore(12)
    for step in range(13, 16):
        c.record(step, 0, [200 + step])
    c.close()
    assert committed_samples(tmp_path) == {0: [*range(1, 13), 213, 214, 215]}
