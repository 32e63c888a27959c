"""The exactly-once planner with uneven shares (:func:`elastictrain.engine.sampler.allocate`, ``weights``): every id
once per epoch across new shares, a rollback and a resize."""

from __future__ import annotations

import random

from elastictrain.engine.sampler import ExactlyOncePlanner, SamplerState, allocate, iter_plans, shares


def test_equal_weights_split_a_step_as_the_planner_always_has():
    for count in range(0, 40):
        for world in range(1, 7):
            assert allocate(count, [1.0] * world) == shares(count, world)
            assert allocate(count, [2.5] * world, floor=0) == shares(count, world)


def test_a_split_always_sums_to_the_count_and_keeps_floors_and_caps_when_they_can_hold():
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 6)
        total = rng.randint(0, 120)
        weights = [rng.choice([0.0, rng.uniform(0.01, 10)]) for _ in range(n)]
        floor = rng.randint(0, 4)
        caps = [rng.choice([None, rng.randint(0, 50)]) for _ in range(n)]
        out = allocate(total, weights, floor=floor, caps=caps)
        assert sum(out) == total and min(out) >= 0, (total, weights, floor, caps, out)
        limits = [total if c is None else c for c in caps]
        feasible = (
            sum(min(floor, c) for c in limits)
            <= total
            <= sum(limits[i] if weights[i] else min(floor, limits[i]) for i in range(n))
        )
        if feasible and any(weights):
            assert all(out[i] <= limits[i] for i in range(n)), (total, weights, caps, out)
            assert all(out[i] >= min(floor, limits[i]) for i in range(n)), (total, weights, floor, out)


def test_a_split_is_proportional_to_within_one_sample():
    out = allocate(100, [3.0, 1.0, 1.0])
    assert out == [60, 20, 20]
    out = allocate(101, [1.0, 2.0, 4.0])
    assert sum(out) == 101 and all(abs(o - 101 * w / 7) < 1 for o, w in zip(out, [1, 2, 4], strict=True))


def plan_all(planner, state, weights, world, gb=24):
    """Every rank's ids of the next step under ``weights``."""
    return [
        planner.plan(state, global_batch=gb, world_size=world, rank=r, micro_batch=5, weights=weights)
        for r in range(world)
    ]


def test_uneven_shares_use_every_id_exactly_once_across_new_shares_a_rollback_and_a_resize():
    planner = ExactlyOncePlanner(num_samples=500, seed=3)
    state = SamplerState()
    used: list[int] = []
    committed = SamplerState()
    weights_of = {3: [12.0, 8.0, 4.0], 2: [16.0, 8.0], 4: [9.0, 9.0, 5.0, 1.0]}
    world, step = 3, 0
    while not planner.epoch_done(state, 24):
        step += 1
        plans = plan_all(planner, state, weights_of[world], world)
        sizes = [len(p.local_ids) for p in plans]
        assert sum(sizes) == plans[0].global_count
        if plans[0].global_count == 24:
            assert sizes == [int(w) for w in weights_of[world]], "a full step's shares are the weights"
        if step == 7:  # a failure mid-step: roll back to the last commit, drop what the steps after it used
            used = used[: committed.cursor]
            state = SamplerState(committed.epoch, committed.cursor)
            world = 2  # and resume at another size, with other shares
            continue
        for p in plans:
            assert all(len(m) <= 5 for m in p.micro_batches) and sum(map(len, p.micro_batches)) == len(p.local_ids)
            used.extend(p.local_ids)
        state.cursor += plans[0].global_count
        if step % 3 == 0:
            committed = SamplerState(state.epoch, state.cursor)
        if step == 12:
            world = 4
    assert sorted(used) == list(range(500)), "every id exactly once"


def test_iter_plans_follow_the_weights_and_a_rank_with_a_zero_share_gets_nothing():
    planner = ExactlyOncePlanner(num_samples=50, seed=0)
    plans = list(
        iter_plans(planner, SamplerState(), global_batch=20, world_size=2, rank=1, micro_batch=4, weights=[20.0, 0.0])
    )
    assert plans and all(p.local_ids == [] and p.micro_batches == [] for p in plans)
    first = list(
        iter_plans(planner, SamplerState(), global_batch=20, world_size=2, rank=0, micro_batch=4, weights=[20.0, 0.0])
    )
    assert sorted(i for p in first for i in p.local_ids) == list(range(50))
