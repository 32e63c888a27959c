"""The straggler decisions as pure functions, and rank 0's monitor over chosen figures (no processes)."""

from __future__ import annotations

import random
import threading

import pytest

from elastictrain.config import ElasticConfig
from elastictrain.engine.health.stragglers import (
    Entry,
    Figures,
    HostWindow,
    StragglerMonitor,
    StragglerPolicy,
    judge,
    plan_eviction,
    weighted_median,
)
from elastictrain.rundir.events import Eviction, Metrics, Straggler
from elastictrain.rundir.report import format_slowest, straggler_summary

POLICY = StragglerPolicy(mode="evict", slow_ratio=1.3, window_steps=100, cooldown_seconds=300, min_np=2)
HOSTS = ["a", "b", "c", "d"]


def window(per_sample: float, steps: int = 100, samples: float = 16, step_seconds: float | None = None) -> HostWindow:
    w = HostWindow(POLICY.window_steps)
    for _ in range(steps // 10):
        w.add(Entry(10, per_sample, 0.0, step_seconds or per_sample * samples * 1.1, samples))
    return w


def test_weighted_median_weights_values_by_steps() -> None:
    assert weighted_median([(1.0, 1), (5.0, 3)]) == 5.0
    assert weighted_median([(1.0, 2), (5.0, 2)]) == 1.0
    assert weighted_median([]) != weighted_median([])  # nan


def test_a_host_half_again_as_slow_is_judged_slow_and_the_others_are_not() -> None:
    windows = {h: window(1.0) for h in HOSTS[:3]} | {"d": window(1.5)}
    judged = judge(windows, POLICY)
    assert judged["d"].ratio == pytest.approx(1.5)
    assert judged["d"].compute_seconds == pytest.approx(1.5 * 16)
    assert all(judged[h].ratio < 1.3 for h in HOSTS[:3])


def test_nobody_is_judged_before_the_window_is_filled_or_without_another_host() -> None:
    assert judge({"a": window(1.0), "d": window(9.0, steps=90)}, POLICY) == {}
    assert judge({"d": window(9.0)}, POLICY) == {}


def test_a_noisy_fault_free_window_names_nobody() -> None:
    rng = random.Random(7)
    windows = {}
    for h in HOSTS:
        w = HostWindow(100)
        for _ in range(10):
            w.add(Entry(10, 1.0 * rng.uniform(0.8, 1.25), 0.0, 20.0, 16))
        windows[h] = w
    assert all(j.ratio < POLICY.slow_ratio for j in judge(windows, POLICY).values())


def test_the_window_keeps_its_last_steps_only() -> None:
    w = window(1.0)
    for _ in range(6):
        w.add(Entry(10, 2.0, 0.0, 1.0, 16))
    assert w.steps == 100 and w.median("compute_per_sample") == 2.0


def test_drain_when_the_job_is_predicted_faster_without_the_slow_host() -> None:
    windows = {h: window(1.0, step_seconds=1.5 * 16 + 1) for h in HOSTS[:3]} | {
        "d": window(1.5, step_seconds=1.5 * 16 + 1)
    }
    plan = plan_eviction(windows, "d", POLICY, global_batch=None, per_worker_batch=16)
    assert plan.action == "drain" and plan.samples_per_sec_without > plan.samples_per_sec_now
    plan = plan_eviction(windows, "d", POLICY, global_batch=64, per_worker_batch=16)
    assert plan.action == "drain", "a fixed global batch: 3 workers at 1.0 beat 4 waiting for 1.5"


def test_a_slow_worker_slows_the_whole_step_not_only_its_compute() -> None:
    """Stopped half the time, a worker is slow in its part of the allreduce too: the step (here 4x its compute)
    shrinks in proportion when it leaves. Measured on the 2-core VM: kept at ratio 5.5 when the rest of the step was
    taken for a fixed overhead."""
    windows = {h: window(1.0, step_seconds=4 * 1.5 * 16) for h in HOSTS[:3]} | {
        "d": window(1.5, step_seconds=4 * 1.5 * 16)
    }
    plan = plan_eviction(windows, "d", POLICY, global_batch=None, per_worker_batch=16)
    assert plan.action == "drain"
    assert plan.samples_per_sec_now == pytest.approx(64 / (4 * 1.5 * 16))
    assert plan.samples_per_sec_without == pytest.approx(48 / (4 * 16))


def test_keep_when_the_slowdown_costs_less_than_a_worker_brings() -> None:
    windows = {h: window(1.0, step_seconds=1.2 * 16 + 1) for h in HOSTS[:3]} | {
        "d": window(1.2, step_seconds=1.2 * 16 + 1)
    }
    plan = plan_eviction(windows, "d", POLICY, global_batch=None, per_worker_batch=16)
    assert plan.action == "keep" and "not predicted faster" in plan.reason


def test_never_below_min_np() -> None:
    windows = {h: window(1.0) for h in HOSTS[:3]} | {"d": window(3.0)}
    plan = plan_eviction(windows, "d", StragglerPolicy(mode="evict", min_np=4), global_batch=None, per_worker_batch=16)
    assert plan.action == "keep" and "min_np" in plan.reason


def test_the_cooldown_doubles_with_each_earlier_eviction() -> None:
    assert [POLICY.cooldown(k) for k in (0, 1, 2)] == [300, 600, 1200]
    assert POLICY.cooldown(50) == 300 * 64


def test_the_policy_takes_the_launchers_min_np_when_it_is_larger() -> None:
    policy = StragglerPolicy.from_config(ElasticConfig(min_np=2), {"ELASTICTRAIN_MIN_NP": "3"})
    assert (policy.mode, policy.min_np, policy.slow_ratio, policy.window_steps) == ("report", 3, 1.3, 100)
    assert StragglerPolicy.from_config(ElasticConfig(min_np=2), {"ELASTICTRAIN_MIN_NP": "x"}).min_np == 2


def test_rows_that_are_not_figures_are_refused() -> None:
    assert Figures.from_row([10, 1.0, 0.1, 2.0, 160]) == Figures(10, 1.0, 0.1, 2.0, 160)
    assert Figures.from_row([0, 1.0, 0.1, 2.0, 160]) is None
    assert Figures.from_row([10, float("nan"), 0.1, 2.0, 160]) is None
    assert Figures.from_row([10, -1.0, 0.1, 2.0, 160]) is None
    assert Figures.from_row([10, 1.0]) is None


class FakeEvictor:
    def __init__(self) -> None:
        self.evictions: dict[str, int] = {}
        self.calls: list[tuple[str, str, float]] = []
        self.done = threading.Event()

    def evict(self, host, reason, cooldown):
        earlier = self.evictions.get(host, 0)
        self.evictions[host] = earlier + 1
        self.calls.append((host, reason, cooldown(earlier)))
        self.done.set()
        return earlier + 1, cooldown(earlier)


def rows(compute: dict[str, float], steps: int = 10, samples: int = 16) -> list[list[float]]:
    slowest = max(compute.values())
    return [
        [steps, c * samples * steps, 0.0, slowest * samples * steps * 1.05, samples * steps] for c in compute.values()
    ]


def feed(monitor: StragglerMonitor, compute: dict[str, float], step: int) -> None:
    monitor.observe(
        rows(compute), list(compute), is_rank0=True, step=step, epoch=0, global_batch=None, per_worker_batch=16
    )


def test_the_monitor_names_a_host_slowed_mid_run_within_the_window_and_drains_it_once() -> None:
    emitted: list = []
    evictor = FakeEvictor()
    monitor = StragglerMonitor(POLICY, emit=emitted.append, evictor=evictor)
    step = 0
    for _ in range(20):
        step += 10
        feed(monitor, {h: 1.0 for h in HOSTS}, step)
    assert not emitted and monitor.slowest() is not None and monitor.slowest().ratio == pytest.approx(1.0)
    slowed_at = step
    while not any(isinstance(e, Straggler) for e in emitted):
        step += 10
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.5}, step)
        assert step - slowed_at <= 100, "not named within 100 steps of the slowdown"
    named = next(e for e in emitted if isinstance(e, Straggler))
    assert (named.host, named.slow, named.rank) == ("d", True, 3) and named.ratio == pytest.approx(1.5)
    assert evictor.done.wait(5)
    for t in monitor.threads:
        t.join(5)
    drain = next(e for e in emitted if isinstance(e, Eviction))
    assert (drain.host, drain.action, drain.evictions, drain.cooldown_seconds) == ("d", "drain", 1, 300)
    assert drain.samples_per_sec_without > drain.samples_per_sec_now
    for _ in range(5):  # still slow before it leaves: no second decision
        step += 10
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.5}, step)
    assert len(evictor.calls) == 1
    step += 10
    feed(monitor, {h: 1.0 for h in HOSTS[:3]}, step)  # drained: it left the world
    assert "d" not in monitor.windows


def test_a_kept_host_is_planned_again_when_its_slowdown_worsens() -> None:
    emitted: list = []
    evictor = FakeEvictor()
    monitor = StragglerMonitor(POLICY, emit=emitted.append, evictor=evictor)
    for step in range(10, 110, 10):
        feed(monitor, {h: 1.0 for h in HOSTS}, step)
    for step in range(110, 300, 10):
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.31}, step)
    assert [e.action for e in emitted if isinstance(e, Eviction)] == ["keep"]
    for step in range(300, 500, 10):
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.5}, step)
    for t in monitor.threads:
        t.join(5)
    assert [e.action for e in emitted if isinstance(e, Eviction)] == ["keep", "drain"]
    assert len(evictor.calls) == 1


def test_report_names_but_never_drains_and_a_recovered_host_is_cleared() -> None:
    emitted: list = []
    evictor = FakeEvictor()
    monitor = StragglerMonitor(StragglerPolicy(mode="report", window_steps=40), emit=emitted.append, evictor=evictor)
    for step in range(10, 110, 10):
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 2.0}, step)
    for step in range(110, 300, 10):
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0}, step)
    kinds = [(type(e).__name__, e.host, getattr(e, "slow", None)) for e in emitted]
    assert kinds == [("Straggler", "c", True), ("Straggler", "c", False)]
    assert not evictor.calls


def test_only_rank0_writes_events_but_every_rank_keeps_the_windows() -> None:
    emitted: list = []
    monitor = StragglerMonitor(POLICY, emit=emitted.append)
    for step in range(10, 200, 10):
        monitor.observe(
            rows({"a": 1.0, "b": 1.0, "c": 2.0}),
            ["a", "b", "c"],
            is_rank0=False,
            step=step,
            epoch=0,
            global_batch=None,
            per_worker_batch=16,
        )
    assert not emitted and monitor.slowest().host == "c"


def test_an_evictor_failure_is_an_eviction_event_with_the_error() -> None:
    class Down:
        def evict(self, host, reason, cooldown):
            raise RuntimeError("etcd unreachable\nmore")

    emitted: list = []
    monitor = StragglerMonitor(POLICY, emit=emitted.append, evictor=Down())
    for step in range(10, 200, 10):
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}, step)
    for t in monitor.threads:
        t.join(5)
    ev = [e for e in emitted if isinstance(e, Eviction)]
    assert len(ev) == 1 and ev[0].error == "etcd unreachable" and ev[0].evictions is None


def test_status_and_report_lines_name_the_slowest_host_and_what_was_decided() -> None:
    events = [
        Metrics(step=10, epoch=0, world_size=4, slowest_host="d", slowest_ratio=1.52),
        Straggler(step=60, epoch=0, world_size=4, host="d", rank=3, slow=True, ratio=1.5),
        Eviction(step=60, epoch=0, world_size=4, host="d", action="drain", reason="straggler"),
    ]
    summary = straggler_summary(events)
    assert summary["named"] == ["d"] and len(summary["decisions"]) == 2
    assert format_slowest(summary) == "d 1.52x (named slow; drain at step 60)"
    assert format_slowest(straggler_summary([])) == "-"


def test_a_host_already_drained_is_not_counted_when_the_next_slow_host_is_planned() -> None:
    """3 hosts x 1 slot, min_np 2: c is drained as a straggler and, before the ring resets without it, a turns slow.
    Draining a too would leave one worker (b): it is kept."""
    emitted: list = []
    evictor = FakeEvictor()
    monitor = StragglerMonitor(POLICY, emit=emitted.append, evictor=evictor)
    for step in range(10, 210, 10):
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 2.0}, step)
    for t in monitor.threads:
        t.join(5)
    assert evictor.calls == [("c", "straggler", 300)]
    for step in range(210, 410, 10):  # c still in the ring: its drain is in flight
        feed(monitor, {"a": 5.0, "b": 1.0, "c": 2.0}, step)
    for t in monitor.threads:
        t.join(5)
    assert evictor.calls == [("c", "straggler", 300)], "a was drained too: the world falls to 1 < min_np 2"
    kept = [e for e in emitted if isinstance(e, Eviction) and e.host == "a"]
    assert len(kept) == 1 and kept[0].action == "keep" and "min_np" in kept[0].reason


def test_never_below_min_np_counting_only_hosts_that_are_not_leaving() -> None:
    windows = {h: window(1.0) for h in HOSTS[:2]} | {"c": window(1.0), "d": window(3.0)}
    plan = plan_eviction(windows, "d", POLICY, global_batch=None, per_worker_batch=16, leaving={"b", "c"})
    assert plan.action == "keep" and "would leave 1 < min_np 2" in plan.reason


def test_an_eviction_the_registry_refuses_below_min_np_is_a_keep_not_an_error() -> None:
    from discovery.registry import BelowMinNp

    class Guarded:
        def evict(self, host, reason, cooldown):
            raise BelowMinNp("evicting host 'd' would leave 1 ready slot < min_np 2")

    emitted: list = []
    monitor = StragglerMonitor(POLICY, emit=emitted.append, evictor=Guarded())
    for step in range(10, 200, 10):
        feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}, step)
    for t in monitor.threads:
        t.join(5)
    (ev,) = [e for e in emitted if isinstance(e, Eviction)]
    assert (ev.action, ev.error) == ("keep", None) and "min_np 2" in ev.reason
    feed(monitor, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}, 200)  # the next commit takes the refusal in
    assert monitor.decided["d"][0] == "keep" and not monitor.refused, "a refused drain is not a host leaving"
