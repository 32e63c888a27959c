"""``bench/hetero``'s pure figures on synthetic events: the ideal, the quota for a speed, when shares settled, and
which policies run. Nothing here starts a job or times anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import hetero
from elastictrain.rundir.events import Eviction, Metrics, Shares


def shares(ts: float, step: int, slow: int) -> Shares:
    return Shares(ts=ts, step=step, epoch=0, world_size=4, global_batch=64, shares={"a": 64 - slow, "vm": slow})


def test_the_ideal_is_three_hosts_at_the_uniform_pace_and_one_at_its_own_speed() -> None:
    assert hetero.ideal_rate(400.0, 0.5) == pytest.approx(350.0)
    assert hetero.ideal_rate(400.0, 0.25) == pytest.approx(325.0)
    assert hetero.ideal_rate(400.0, 1.0) == pytest.approx(400.0)


def test_a_speeds_quota_never_goes_below_the_kernels_floor() -> None:
    assert hetero.cpu_quota_for(0.5, 0.6) == pytest.approx(0.3)
    assert hetero.cpu_quota_for(0.25, 0.02) == hetero.faults.MIN_CPU_FRACTION


def test_shares_settle_at_the_first_event_after_which_the_slow_hosts_share_stays_near_its_last() -> None:
    events = [
        Metrics(ts=100.0, step=200, epoch=0, world_size=4),
        shares(90.0, 190, 16),  # before the span: not counted
        shares(105.0, 210, 12),
        shares(110.0, 220, 9),  # within 1 sample of the last (10% of 8 rounds up to 1): settled here
        shares(115.0, 230, 8),
        shares(130.0, 260, 8),
        shares(200.0, 400, 16),  # after the span
    ]
    s = hetero.share_settled(events, 100.0, 150.0, "vm")
    assert s is not None
    assert (s["start_step"], s["step"], s["steps"], s["share"], s["changes"]) == (200, 220, 20, 8, 4)
    assert s["seconds"] == pytest.approx(10.0)
    assert hetero.share_settled(events, 140.0, 150.0, "vm") is None  # nothing moved in the span
    assert hetero.share_settled(events, 100.0, 150.0, "other") is None


def test_a_share_that_swings_back_late_settles_late() -> None:
    events = [shares(101.0, 202, 8), shares(102.0, 204, 16), shares(103.0, 206, 8)]
    s = hetero.share_settled(events, 100.0, 110.0, "vm")
    assert s is not None and s["step"] == 206


def test_the_policies_are_those_the_config_accepts_and_each_job_config_names_its_own() -> None:
    names = hetero.policies()
    assert names[:2] == ["report", "evict"] and set(names) <= {"report", "evict", "balance"}
    cfg = hetero.job_config(Path("/r"), "j", "evict")
    assert cfg["elastic"]["stragglers"] == "evict" and cfg["audit"]["sample_ledger"] is True
    assert cfg["elastic"]["straggler_cooldown_seconds"] >= 3600  # a drained host stays out for the run


def test_a_phases_throughput_is_read_over_its_second_half() -> None:
    assert hetero.Phase("speed 0.5", 0.5, 100.0, 180.0).steady() == (140.0, 180.0)


def test_the_slowed_hosts_speed_is_one_over_its_median_ratio_or_the_last_decision_about_it() -> None:
    m = [
        Metrics(ts=101.0, step=1, epoch=0, world_size=4, slowest_host="vm", slowest_ratio=2.0),
        Metrics(ts=102.0, step=2, epoch=0, world_size=4, slowest_host="vm", slowest_ratio=4.0),
        Metrics(ts=103.0, step=3, epoch=0, world_size=4, slowest_host="a", slowest_ratio=1.1),  # another host
        Metrics(ts=104.0, step=4, epoch=0, world_size=4, slowest_host="vm", slowest_ratio=5.0),
    ]
    assert hetero.measured_speed(m, 100.0, 110.0, "vm") == pytest.approx(0.25)
    drained = [Eviction(ts=105.0, step=5, epoch=0, world_size=4, host="vm", action="drain", ratio=2.5)]
    assert hetero.measured_speed(drained, 100.0, 110.0, "vm") == pytest.approx(0.4)
    assert hetero.measured_speed(m, 200.0, 210.0, "vm") is None


def test_the_quota_is_a_share_of_the_core_the_worker_got_while_it_wanted_one() -> None:
    assert hetero.share_while_working((10.0, 5.0), (12.0, 7.0)) == pytest.approx(0.5)
    assert hetero.share_while_working((10.0, 5.0), (10.0, 5.0)) is None  # never ran
    assert hetero.cpu_quota_for(0.5, 0.5) == pytest.approx(0.25)


def test_own_speed_is_the_part_of_the_runnable_time_the_quota_did_not_throttle() -> None:
    assert hetero.own_speed(1.0, 1.0, 1.0) == pytest.approx(0.5)  # throttled all the time it waited
    assert hetero.own_speed(1.0, 1.0, 0.0) == pytest.approx(1.0)  # waited for busy cores only: its own pace
    assert hetero.own_speed(1.0, 0.5, 3.0) == pytest.approx(1.0 / 1.5)  # a group's sum over CPUs is capped
    assert hetero.own_speed(0.0, 0.0, 0.0) is None


def test_the_quota_moves_toward_the_target_by_damped_bounded_steps() -> None:
    assert hetero.next_quota(0.4, 1.0, 0.25) == pytest.approx(0.2)  # sqrt(0.25) = 0.5
    assert hetero.next_quota(0.1, 0.05, 0.5) == pytest.approx(0.2)  # sqrt(10) bounded to x2
    assert hetero.next_quota(0.1, 0.5, 0.5) == pytest.approx(0.1)  # on target: unchanged
    assert hetero.next_quota(0.1, None, 0.5) == pytest.approx(0.1)  # no reading (it did not run): kept
    assert hetero.next_quota(0.015, 1.0, 0.25) == hetero.faults.MIN_CPU_FRACTION
    assert hetero.next_quota(1.5, 0.01, 0.5) == 2.0
