"""The pure parts of the share-nothing chaos scenarios (``chaos/scenarios.py``: notice-one-node, notice-every-node,
store-down; ``chaos/netns.py``'s AWS notice): registration, the notice's answer, and the checks on a run's events."""

from __future__ import annotations

import calendar
import time
from typing import Any

from chaos import scenarios
from chaos.invariants import FAULT_ACTIONS, RESET_EXPECTED
from chaos.netns import aws_notice
from discovery.notice import parse_aws_instance_action
from elastictrain.rundir.events import Checkpoint, Commit, Event, PreemptionCheckpoint, Start

T0 = 1_800_000_000.0


def test_the_scenarios_are_registered_on_the_share_nothing_tier_with_their_options() -> None:
    one, every, store = (scenarios.SCENARIOS[n] for n in ("notice-one-node", "notice-every-node", "store-down"))
    for s in (one, every, store):
        assert (s.nodes, s.share_nothing, s.ci) == (scenarios.MULTI_NODE_NODES, True, False)
        assert s.cfg(True)["checkpoint"]["location"].startswith("s3://")
    assert one.preemption_notice and every.preemption_notice and not store.preemption_notice
    assert one.graceful and "preemption-notice" in one.must_reset
    assert not store.rejoin and not store.expect_reset and not every.rejoin
    assert {"preemption-notice", "store-down"} <= FAULT_ACTIONS
    assert "preemption-notice" not in RESET_EXPECTED, "notices on every node are followed by a relaunch, not a reset"


def test_the_tiers_aws_notice_is_what_the_agents_parser_reads_at_that_time() -> None:
    body = aws_notice(T0 + 120.4)
    assert body["action"] == "terminate"
    notice = parse_aws_instance_action(str(body).replace("'", '"').encode())
    assert notice.token == "aws-spot-terminate" and notice.time == float(int(T0 + 120))
    assert calendar.timegm(time.strptime(body["time"], "%Y-%m-%dT%H:%M:%SZ")) == int(T0 + 120)


def commit(step: int, ts: float) -> Commit:
    return Commit(step=step, epoch=0, world_size=3, ts=ts, commit_seconds=0.0)


def saved(step: int, ts: float) -> Checkpoint:
    return Checkpoint(step=step, epoch=0, world_size=3, ts=ts)


def jit(step: int, ts: float) -> PreemptionCheckpoint:
    return PreemptionCheckpoint(step=step, epoch=0, world_size=3, ts=ts, deadline=T0 + 30, waited=True)


HOSTS = [f"169.254.77.{i}" for i in (10, 11, 12)]


def start(ts: float, resumed: int | None, hosts: list[str] = HOSTS) -> Start:
    return Start(step=resumed or 0, epoch=0, world_size=len(hosts), ts=ts, resumed_from_step=resumed, hosts=hosts)


CHAOS: list[dict[str, Any]] = [
    *({"ts": T0, "action": "preemption-notice", "host": h, "notice_time": T0 + 30} for h in HOSTS),
    {"ts": T0 + 5, "action": "kill-host", "host": HOSTS[0]},
    *({"ts": T0 + 10, "action": "host-returns", "host": h} for h in HOSTS),
]


def test_jit_checkpointed_is_the_checkpoint_of_the_last_commit_written_for_a_notice() -> None:
    events: list[Event] = [commit(40, T0 - 2), saved(40, T0 - 1), commit(45, T0 + 1)]
    assert scenarios.jit_checkpointed(events) is None, "a periodic checkpoint of an older commit"
    events += [jit(45, T0 + 1.2), saved(45, T0 + 1.5)]
    found = scenarios.jit_checkpointed(events)
    assert found is not None and found.step == 45
    assert scenarios.jit_checkpointed([*events, commit(50, T0 + 2)]) is None, "a newer commit is not saved yet"


def test_check_jit_resume_passes_when_the_relaunch_resumes_from_the_last_commit_saved_in_time() -> None:
    events = [commit(45, T0 + 1), jit(45, T0 + 1.2), saved(45, T0 + 1.5), start(T0 + 20, 45)]
    check = scenarios.check_jit_resume(CHAOS, events)
    assert check.ok is True and check.value == 1.5, check.detail


def test_check_jit_resume_fails_on_a_lost_commit_a_late_save_or_no_save() -> None:
    lost = [commit(45, T0 + 1), jit(45, T0 + 1.2), saved(45, T0 + 1.5), commit(50, T0 + 3), start(T0 + 20, 45)]
    assert scenarios.check_jit_resume(CHAOS, lost).ok is False
    late_chaos = [{**f, "notice_time": T0 + 1} if f["action"] == "preemption-notice" else f for f in CHAOS]
    late = [commit(45, T0 + 1), jit(45, T0 + 1.2), saved(45, T0 + 1.5), start(T0 + 20, 45)]
    assert scenarios.check_jit_resume(late_chaos, late).ok is False
    periodic = [commit(45, T0 + 1), saved(45, T0 + 1.5), start(T0 + 20, 45)]
    assert scenarios.check_jit_resume(CHAOS, periodic).ok is False
    assert scenarios.check_jit_resume(CHAOS, [commit(45, T0 + 1), jit(45, T0 + 1.2), saved(45, T0 + 1.5)]).ok is False
    without_a_new_machine = [commit(45, T0 + 1), jit(45, T0 + 1.2), saved(45, T0 + 1.5), start(T0 + 20, 45, HOSTS[:2])]
    check = scenarios.check_jit_resume(CHAOS, without_a_new_machine)
    assert check.ok is False and HOSTS[2] in check.detail


def test_checkpoints_resumed_after_an_outage_only_with_a_newer_step_saved_after_its_end() -> None:
    chaos = [{"ts": T0, "action": "store-down"}, {"ts": T0 + 30, "action": "store-down", "phase": "end"}]
    before = [commit(10, T0 - 1), saved(10, T0 + 10)]
    assert scenarios.check_checkpointed_after(chaos, before, "store-down").ok is False
    held = [commit(10, T0 - 1), saved(10, T0 + 30.1)]  # the save in flight when the store stopped, finished late
    assert scenarios.check_checkpointed_after(chaos, held, "store-down").ok is False
    check = scenarios.check_checkpointed_after(chaos, [*held, saved(490, T0 + 30.6)], "store-down")
    assert check.ok is True and "step 490" in check.detail
    assert scenarios.check_checkpointed_after(chaos[:1], [saved(490, T0 + 33)], "store-down").ok is False
