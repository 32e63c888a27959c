"""Shares that follow speed (:mod:`elastictrain.engine.health.shares`): the decision as a pure function, and the
balancer's commit protocol."""

from __future__ import annotations

import pytest

from elastictrain.config import ElasticConfig
from elastictrain.engine.health.shares import (
    Balancer,
    Measurement,
    ShareDecision,
    SharePolicy,
    ShareState,
    host_shares,
    measure,
    rank_shares,
)
from elastictrain.engine.health.shares import decide as decide_measured
from elastictrain.engine.health.stragglers import Entry as WindowEntry
from elastictrain.engine.health.stragglers import HostWindow, StragglerPolicy, plan_eviction
from elastictrain.errors import ConfigError
from elastictrain.rundir.events import Event, Shares, parse_event

POLICY = SharePolicy(halflife_steps=1e-9, threshold=0.1, min_share=1, warmup_steps=1)
"""No smoothing, no warm-up: each decision sees the speeds it is given."""


def decide(
    state: ShareState,
    speeds: dict[str, float],
    hosts: list[str],
    global_batch: int,
    policy: SharePolicy,
    *,
    seen: dict[str, int] | None = None,
    steps: int = 10,
) -> ShareDecision:
    """:func:`decide_measured` over ``steps`` steps at ``speeds``, each host at share ``seen[host]`` (default 16)."""
    measured = {h: Measurement(v, steps, (seen or {}).get(h, 16)) for h, v in speeds.items()}
    return decide_measured(state, measured, hosts, global_batch, policy)


def row(samples: int, seconds: float, steps: int = 10) -> list[float]:
    """One rank's figures (FIGURES order): all the time is compute."""
    return [float(steps), seconds, 0.0, seconds * 1.2, float(samples)]


# ------------------------------------------------------------------------------------------- the pure decision
def test_shares_are_proportional_to_speed_and_sum_to_the_global_batch():
    hosts = ["a", "b", "c", "d"]
    d = decide(ShareState(), {"a": 100.0, "b": 100.0, "c": 100.0, "d": 50.0}, hosts, 70, POLICY)
    assert d.changed, d.reason
    shares = rank_shares(d.state, hosts, 70, POLICY)
    assert shares == [20, 20, 20, 10] and sum(shares) == 70


def test_a_uniform_fleet_keeps_equal_shares_through_noise():
    hosts = ["a", "b", "c"]
    state = ShareState()
    for noisy in ({"a": 100.0, "b": 104.0, "c": 97.0}, {"a": 95.0, "b": 100.0, "c": 106.0}):
        d = decide(state, noisy, hosts, 96, POLICY)
        assert not d.changed, d.reason
        state = d.state
    assert state.applied == {}, "equal shares stay equal (no weights applied)"
    assert rank_shares(state, hosts, 96, POLICY) == [32, 32, 32]


def test_hysteresis_moves_shares_only_past_the_threshold_and_never_back_and_forth():
    hosts = ["a", "b"]
    d = decide(ShareState(), {"a": 100.0, "b": 50.0}, hosts, 90, POLICY)
    assert d.changed and rank_shares(d.state, hosts, 90, POLICY) == [60, 30]
    state, history = d.state, []
    for b in (52.0, 48.0, 53.0, 47.0, 51.0):  # noise around 50: within 10% of b's fraction
        d = decide(state, {"a": 100.0, "b": b}, hosts, 90, POLICY)
        history.append(d.changed)
        state = d.state
    assert history == [False] * 5, [decide(state, {"a": 100.0, "b": 47.0}, hosts, 90, POLICY).reason]
    d = decide(state, {"a": 100.0, "b": 100.0}, hosts, 90, POLICY)  # b recovered: well past the threshold
    assert d.changed and rank_shares(d.state, hosts, 90, POLICY) == [45, 45]


def test_a_host_down_to_a_few_samples_does_not_flap_by_one_sample():
    hosts = ["a", "b", "c"]
    seen = dict.fromkeys(hosts, 40)
    d = decide(ShareState(), {"a": 1000.0, "b": 1000.0, "c": 50.0}, hosts, 42, POLICY, seen=seen)
    assert d.changed and rank_shares(d.state, hosts, 42, POLICY) == [21, 20, 1]
    for c in (75.0, 40.0, 90.0):  # +50%, -20%, +80% of c's own share, a few % of an equal one
        again = decide(d.state, {"a": 1000.0, "b": 1000.0, "c": c}, hosts, 42, POLICY, seen=seen)
        assert not again.changed, again.reason
    recovered = decide(d.state, {"a": 1000.0, "b": 1000.0, "c": 600.0}, hosts, 42, POLICY, seen=seen)
    assert recovered.changed and rank_shares(recovered.state, hosts, 42, POLICY)[2] == 10


def test_smoothing_has_a_half_life_in_steps_and_the_warm_up_steps_are_forgotten():
    policy = SharePolicy(halflife_steps=10, threshold=0.1, warmup_steps=20)
    hosts = ["a", "b"]
    SEEN = {"a": 30, "b": 30}
    first = decide(ShareState(), {"a": 100.0, "b": 20.0}, hosts, 60, policy, seen=SEEN)  # 10 steps: warming up
    assert not first.changed and "waiting for measurements" in first.reason
    second = decide(first.state, {"a": 100.0, "b": 60.0}, hosts, 60, policy, seen=SEEN)
    assert second.state.speeds == {"a": 100.0, "b": 60.0}, "the warm-up's slower first steps are not averaged in"
    assert second.changed and rank_shares(second.state, hosts, 60, policy) == [38, 22]
    third = decide(second.state, {"a": 100.0, "b": 20.0}, hosts, 60, policy, seen=SEEN)  # one half-life at 20
    assert third.state.speeds == {"a": 100.0, "b": 40.0}
    assert third.changed and rank_shares(third.state, hosts, 60, policy) == [43, 17]
    fewer = decide(
        second.state, {"a": 100.0, "b": 20.0}, hosts, 60, policy, seen=SEEN, steps=2
    )  # a short interval: less
    assert fewer.state.speeds["b"] > 50.0


def test_a_capped_host_gives_what_it_cannot_hold_to_the_others():
    hosts = ["fast", "mid", "slow"]
    seen = dict.fromkeys(hosts, 20)  # measured at equal shares: at most 40 each
    state = decide(ShareState(), {"fast": 400.0, "mid": 100.0, "slow": 100.0}, hosts, 60, POLICY, seen=seen).state
    assert rank_shares(state, hosts, 60, POLICY) == [40, 10, 10]
    capped = SharePolicy(halflife_steps=1e-9, threshold=0.1, warmup_steps=1, max_share=25)
    assert rank_shares(state, hosts, 60, capped) == [25, 18, 17]
    measured = rank_shares(state, hosts, 60, POLICY, caps={"fast": 30})
    assert measured == [30, 15, 15] and sum(measured) == 60


def test_a_share_at_most_doubles_the_largest_share_its_host_was_measured_at():
    hosts = ["a", "b", "c"]
    seen = {"a": 10, "b": 10, "c": 10}
    d = decide(ShareState(), {"a": 1000.0, "b": 100.0, "c": 100.0}, hosts, 30, POLICY, seen=seen)
    assert d.state.largest == seen
    assert rank_shares(d.state, hosts, 30, POLICY) == [20, 5, 5], "a's speed is not trusted beyond 2 x 10"
    d = decide(d.state, {"a": 1000.0, "b": 100.0, "c": 100.0}, hosts, 30, POLICY, seen={"a": 20, "b": 5, "c": 5})
    assert d.state.largest == {"a": 20, "b": 10, "c": 10}
    assert rank_shares(d.state, hosts, 30, POLICY) == [25, 3, 2]


def test_caps_that_cannot_hold_the_batch_are_dropped_rather_than_losing_samples():
    hosts = ["a", "b"]
    tight = SharePolicy(warmup_steps=1, max_share=10)
    assert sum(rank_shares(ShareState(), hosts, 30, tight)) == 30


def test_a_share_may_be_zero_for_a_host_capped_at_zero_and_every_other_host_keeps_the_floor():
    hosts = ["a", "b", "c"]
    state = decide(ShareState(), {"a": 1000.0, "b": 1000.0, "c": 1.0}, hosts, 40, POLICY).state
    shares = rank_shares(state, hosts, 40, POLICY)
    assert shares[2] == 1, "a very slow host keeps min_share, so it stays measured"
    assert rank_shares(state, hosts, 40, POLICY, caps={"c": 0})[2] == 0
    zero_floor = SharePolicy(halflife_steps=1e-9, warmup_steps=1, min_share=0)
    assert rank_shares(state, hosts, 40, zero_floor) == [20, 20, 0]


def test_a_membership_change_re_splits_over_the_new_world():
    hosts = ["a", "b", "c"]
    state = decide(ShareState(), {"a": 100.0, "b": 100.0, "c": 50.0}, hosts, 50, POLICY).state
    assert rank_shares(state, hosts, 50, POLICY) == [20, 20, 10]
    # c left, d joined (unmeasured): d gets the mean weight, c's weight is not used
    assert rank_shares(state, ["a", "b", "d"], 50, POLICY) == [17, 17, 16]
    after = decide(state, {"a": 100.0, "b": 100.0}, ["a", "b", "d"], 50, POLICY)
    assert "c" not in after.state.speeds and "c" not in after.state.applied
    assert not after.changed and "waiting for measurements of d" in after.reason
    # two slots on one host: each worker of the host has the host's per-worker share
    two = rank_shares(state, ["a", "a", "c"], 50, POLICY)
    assert two == [20, 20, 10] and host_shares(["a", "a", "c"], two) == {"a": 40, "c": 10}


def test_a_measurement_takes_the_slowest_rank_of_a_host_and_skips_unusable_rows():
    rows = [row(100, 1.0), row(100, 2.0), row(0, 1.0), [float("nan")] * 5, row(10, 0.0)]
    hosts = ["a", "a", "b", "c", "d"]
    assert measure(rows, hosts) == {"a": Measurement(50.0, 10, 10)}
    assert measure(rows[:2], hosts) == {}, "rows and hosts must match"


def test_a_loaded_state_is_validated():
    s = ShareState()
    s.load_state_dict({"speeds": {"a": 1.5, "b": -1, "c": float("inf"), 3: 2.0}, "applied": "junk", "steps": None})
    assert s.speeds == {"a": 1.5} and s.applied == {} and s.steps == {}
    s.load_state_dict(None)
    assert s == ShareState()
    roundtrip = ShareState({"a": 2.0}, {"a": 3}, {"a": 2.0})
    t = ShareState()
    t.load_state_dict(roundtrip.state_dict())
    assert t == roundtrip


def test_config_values_are_checked():
    assert ElasticConfig(stragglers="balance").stragglers == "balance"
    assert SharePolicy.from_config(ElasticConfig(share_max_per_worker=8)).max_share == 8
    for bad in ({"share_halflife_steps": 0.0}, {"share_threshold": -0.1}, {"share_min_per_worker": -1}):
        with pytest.raises(ConfigError, match=r"elastic\.share_"):
            ElasticConfig(**bad)
    with pytest.raises(ConfigError, match=r"elastic\.share_max_per_worker"):
        ElasticConfig(share_min_per_worker=4, share_max_per_worker=2)


# ------------------------------------------------------------------------------------------- the commit protocol
def test_the_balancer_applies_a_decision_at_the_next_commit_and_a_sync_drops_it():
    emitted: list[Event] = []
    b = Balancer(POLICY, ShareState(), emitted.append)
    hosts = ["a", "b"]
    assert b.weights(hosts, 60) is None, "equal shares until something is applied"
    b.observe([row(100, 1.0), row(100, 4.0)], hosts, 60)  # a: 100/s, b: 25/s
    assert b.state.applied == {}, "nothing changes before the next commit"
    assert b.apply_pending(step=20, epoch=0, rank_hosts=hosts)
    assert b.weights(hosts, 60) == [48.0, 12.0] and b.version == 1
    (event,) = emitted
    assert isinstance(event, Shares) and event.shares == {"a": 48, "b": 12} and event.global_batch == 60
    assert parse_event(event.to_record()) == event
    b.observe([row(100, 1.0), row(100, 1.0)], hosts, 60)
    b.discard_pending()  # a reset: not every rank may have made that decision
    assert not b.apply_pending(step=30, epoch=0, rank_hosts=hosts)
    assert b.weights(hosts, 60) == [48.0, 12.0]


def test_report_and_evict_jobs_plan_equal_shares():
    b = Balancer(None, ShareState(), lambda e: None)
    b.observe([row(100, 1.0), row(100, 4.0)], ["a", "b"], 60)
    assert not b.apply_pending(step=10, epoch=0, rank_hosts=["a", "b"])
    assert b.weights(["a", "b"], 60) is None


# ------------------------------------------------------------------------------------------- drains under balance
def window(per_sample: float, samples_per_step: float, step_seconds: float) -> HostWindow:
    w = HostWindow(window_steps=10)
    w.add(WindowEntry(10, per_sample, 0.0, step_seconds, samples_per_step))
    return w


def test_balance_keeps_a_host_that_pays_for_itself_and_drains_one_whose_smallest_share_holds_the_others_back():
    balance = StragglerPolicy(mode="balance", min_np=1, min_share=4)
    evict = StragglerPolicy(mode="evict", min_np=1)
    # 4 hosts, 64 samples; d at half speed with balanced shares (18, 18, 18, 10): worth keeping
    half = {h: window(0.01, 18, 0.2) for h in "abc"} | {"d": window(0.02, 10, 0.2)}
    assert plan_eviction(half, "d", balance, global_batch=64, per_worker_batch=16).action == "keep"
    # at 1/40 of the speed its share is the floor (4 samples), which takes longer than the others' whole share
    crawl = {h: window(0.01, 20, 0.2) for h in "abc"} | {"d": window(0.4, 4, 1.6)}
    plan = plan_eviction(crawl, "d", balance, global_batch=64, per_worker_batch=16)
    assert plan.action == "drain" and plan.samples_per_sec_without > plan.samples_per_sec_now
    # evict (equal shares) would have drained the half-speed host
    equal = {h: window(0.01, 16, 0.32) for h in "abc"} | {"d": window(0.02, 16, 0.32)}
    assert plan_eviction(equal, "d", evict, global_batch=64, per_worker_batch=16).action == "drain"


# ------------------------------------------------------------------------------------------- status and report
def test_status_and_the_report_show_each_hosts_share_from_the_last_shares_event():
    from elastictrain.rundir.report import format_shares, shares_summary

    def shares_at(step: int, split: dict[str, int]) -> Shares:
        return Shares(step=step, epoch=0, world_size=3, global_batch=48, shares=split, speeds={}, reason="r")

    assert shares_summary([]) is None and format_shares(None) == "equal"
    summary = shares_summary([shares_at(10, {"a": 16, "b": 16, "c": 16}), shares_at(40, {"a": 20, "b": 20, "c": 8})])
    assert summary is not None and summary["shares"] == {"a": 20, "b": 20, "c": 8}
    assert format_shares(summary) == "a 20, b 20, c 8 of 48 (step 40)"


# ------------------------------------------------------------------------------------ part of the committed state
def committed_state(shares: ShareState):
    import torch
    from torch import nn

    from elastictrain.engine.policy import ScaleRamp
    from elastictrain.engine.sampler import SamplerState, StepLog
    from elastictrain.engine.state import Counters, make_state

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    args = (SamplerState(), Counters(), ScaleRamp(1, 1, 0, 0), StepLog(0), shares)
    return make_state("commit", model, opt, sched, None, *args)


def test_a_rollback_and_a_resume_bring_back_the_shares_of_the_commit_they_return_to():
    hosts = ["a", "b"]
    shares = ShareState()
    b = Balancer(POLICY, shares, lambda e: None)
    st = committed_state(shares)
    b.observe([row(100, 1.0), row(100, 4.0)], hosts, 60)
    b.apply_pending(step=10, epoch=0, rank_hosts=hosts)
    st.save()  # the commit at which they apply
    at_commit = b.weights(hosts, 60)
    assert at_commit == [48.0, 12.0]
    b.observe([row(100, 1.0), row(100, 1.0)], hosts, 60)
    b.apply_pending(step=20, epoch=0, rank_hosts=hosts)  # applied, then a failure before the commit's save
    assert b.weights(hosts, 60) == [30.0, 30.0]
    st.restore()
    assert b.weights(hosts, 60) == at_commit, "a rollback replays the split of the steps it replays"
    checkpoint = st.full_state()
    fresh = ShareState()
    committed_state(fresh).load_full_state(checkpoint)
    assert fresh == shares and Balancer(POLICY, fresh, lambda e: None).weights(hosts, 60) == at_commit
    without = committed_state(ShareState())
    without.load_full_state({k: v for k, v in checkpoint.items() if k != "shares"})  # written before balancing
    assert without.shares == ShareState()


def test_the_live_view_shows_the_last_shares():
    from elastictrain.tools.live_view import fold, status_line, view

    s = fold([Shares(step=5, epoch=0, world_size=2, global_batch=32, shares={"b": 12, "a": 20}, speeds={}, reason="")])
    assert s.shares == (("a", 20), ("b", 12))
    v = view(s, now=0.0, epochs=None, max_steps=None)
    assert v["shares"] == {"a": 20, "b": 12} and "shares a 20/b 12" in status_line(v)
    assert view(fold([]), now=0.0, epochs=None, max_steps=None)["shares"] is None


def test_a_kept_decision_that_raises_a_hosts_cap_changes_the_split_and_the_planner_plans_again():
    """The caps follow the largest share a host was measured at; when a kept decision raises one, the split the
    planner uses changes, so the change is applied like any other (version, event), never silently."""
    hosts = ["a", "b", "c"]
    state = ShareState({"a": 100.0, "b": 100.0, "c": 10.0}, {h: 10 for h in hosts}, {"a": 1.0, "b": 1.0, "c": 0.1})
    state.largest = {"a": 5, "b": 16, "c": 2}
    events: list[Event] = []
    balancer = Balancer(POLICY, state, events.append)
    assert balancer.weights(hosts, 30) == [10.0, 18.0, 2.0], "a is capped at twice its largest share"
    kept = ShareState(dict(state.speeds), dict(state.steps), dict(state.applied), {"a": 7, "b": 16, "c": 2})
    balancer.pending = (ShareDecision(kept, False, "shares kept"), 30)
    assert balancer.apply_pending(step=10, epoch=0, rank_hosts=hosts) is True
    assert balancer.version == 1 and balancer.weights(hosts, 30) == [14.0, 15.0, 1.0]
    assert [e.name for e in events] == ["shares"]
    balancer.pending = (ShareDecision(kept, False, "shares kept"), 30)
    assert balancer.apply_pending(step=20, epoch=0, rank_hosts=hosts) is False and balancer.version == 1
