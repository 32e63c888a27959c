"""Agent cycle decisions: the pure ``decide`` with chosen times, and the agent on an in-memory store."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from discovery.agent import Action, Agent, AgentState, Observation, decide, main
from discovery.record import DRAINING, READY, HostRecord
from discovery.registry import InMemoryRegistry, evict, set_state
from tests.fixtures.agent import agent_config as cfg
from tests.fixtures.clock import FakeClock

# -- decide() ------------------------------------------------------------------------------------


def test_fresh_agent_registers() -> None:
    d = decide(cfg(), AgentState(), Observation(now=0.0))
    assert d.action is Action.REGISTER
    assert str(d) == "registering node-a (2 slots) as ready under a new 9s lease"


def test_registered_agent_heartbeats() -> None:
    st = AgentState(lease_id=0x10, registered=True)
    d = decide(cfg(), st, Observation(now=5.0, lease_alive=True, key_state=READY, key_lease=0x10))
    assert d.action is Action.HEARTBEAT and d.reason == "lease 10 refreshed; host ready"


def test_lost_lease_registers_again() -> None:
    st = AgentState(lease_id=None, registered=False)
    d = decide(cfg(), st, Observation(now=5.0, lease_lost=True, key_state=None))
    assert d.action is Action.REGISTER and d.reason.startswith("lease lost; registering")


def test_key_removed_while_lease_lives_means_operator_removal() -> None:
    st = AgentState(lease_id=0x10, registered=True)
    d = decide(cfg(), st, Observation(now=5.0, lease_alive=True, key_state=None))
    assert d.action is Action.REVOKE_AND_EXIT and d.exit_code == 0
    assert "removed by an operator" in d.reason


def test_sigterm_marks_draining_then_revokes_after_grace() -> None:
    st = AgentState(lease_id=0x10, registered=True, drain_requested_at=100.0)
    seen = Observation(now=100.0, lease_alive=True, key_state=READY, key_lease=0x10)
    assert decide(cfg(), st, seen).action is Action.MARK_DRAINING
    draining = Observation(now=109.9, lease_alive=True, key_state=DRAINING, key_lease=0x10)
    assert decide(cfg(), st, draining).action is Action.HEARTBEAT
    done = decide(cfg(), st, Observation(now=110.0, lease_alive=True, key_state=DRAINING, key_lease=0x10))
    assert done.action is Action.REVOKE_AND_EXIT and done.exit_code == 0
    assert done.reason == "drain grace of 10s over; revoking lease 10 and exiting"


def test_second_signal_skips_the_grace_period() -> None:
    st = AgentState(lease_id=0x10, registered=True, drain_requested_at=100.0, force_stop=True)
    d = decide(cfg(), st, Observation(now=101.0, lease_alive=True, key_state=DRAINING, key_lease=0x10))
    assert d.action is Action.REVOKE_AND_EXIT and d.reason.startswith("second signal")


def test_drain_during_an_outage_exits_0_after_grace_without_etcd() -> None:
    st = AgentState(lease_id=0x10, registered=True, drain_requested_at=100.0, unreachable_since=100.0)
    assert decide(cfg(), st, Observation(now=105.0, reachable=False, error="down")).action is Action.WAIT
    d = decide(cfg(), st, Observation(now=110.0, reachable=False, error="down"))
    assert d.action is Action.EXIT and d.exit_code == 0


def test_outage_waits_until_the_retry_deadline_then_gives_up() -> None:
    st = AgentState(unreachable_since=0.0)
    waiting = decide(cfg(), st, Observation(now=30.0, reachable=False, error="refused"))
    assert waiting.action is Action.WAIT and waiting.reason == "etcd unreachable for 30s (refused); retrying"
    gave_up = decide(cfg(), st, Observation(now=30.5, reachable=False, error="refused"))
    assert gave_up.action is Action.EXIT and gave_up.exit_code == 1
    assert "retry deadline of 30s" in gave_up.reason


def test_a_foreign_key_blocks_registration_until_the_deadline() -> None:
    st = AgentState(blocked_since=0.0)
    obs = Observation(now=9.0, key_state=READY, key_lease=0x99, key_pid=7)
    waiting = decide(cfg(), st, obs)
    assert waiting.action is Action.WAIT and "pid 7" in waiting.reason
    d = decide(cfg(), st, Observation(now=31.0, key_state=READY, key_lease=0x99, key_pid=7))
    assert d.action is Action.EXIT and d.exit_code == 1


# -- readmission after an eviction's cool-down (decide) ------------------------------------------------

EVICTED = AgentState(lease_id=0x10, registered=True, wanted_state=DRAINING, drain_reason="straggler",
                     drain_until=1000.0, evictions=2)  # fmt: skip
COOLED = Observation(now=50.0, wall_time=1000.0, lease_alive=True, key_state=DRAINING, key_lease=0x10,
                     key_drain_reason="straggler", key_drain_until=1000.0, key_evictions=2)  # fmt: skip


def test_an_evicted_host_is_readmitted_once_the_wall_clock_reaches_drain_until() -> None:
    d = decide(cfg(), EVICTED, COOLED)
    assert d.action is Action.READMIT and d.exit_code is None
    assert d.reason == "cool-down of the straggler eviction over; marking host ready (evictions: 2)"
    later = replace(COOLED, now=0.0, wall_time=5000.0)  # the monotonic clock plays no part
    assert decide(cfg(), EVICTED, later).action is Action.READMIT


@pytest.mark.parametrize(
    ("st", "obs", "action"),
    [
        (EVICTED, replace(COOLED, wall_time=999.9), Action.HEARTBEAT),  # cool-down not over
        (EVICTED, replace(COOLED, key_drain_until=0.0, key_drain_reason=""), Action.HEARTBEAT),  # an operator's drain
        (EVICTED, replace(COOLED, key_state=READY), Action.HEARTBEAT),  # already ready (an operator undrained it)
        (EVICTED, replace(COOLED, key_lease=0x99), Action.WAIT),  # not our key
        (EVICTED, replace(COOLED, lease_alive=False), Action.WAIT),  # our lease is not alive
        (EVICTED, replace(COOLED, reachable=False), Action.WAIT),  # etcd unreachable
        (EVICTED, replace(COOLED, cordon="node node-a is cordoned"), Action.HEARTBEAT),  # the node is cordoned
        (replace(EVICTED, drain_requested_at=45.0), COOLED, Action.HEARTBEAT),  # SIGTERM: draining to leave
    ],
    ids=["before-drain-until", "untimed-drain", "ready", "foreign-key", "lease-dead", "unreachable", "cordoned",
         "sigterm"],
)  # fmt: skip
def test_no_readmission_unless_every_condition_holds(st: AgentState, obs: Observation, action: Action) -> None:
    assert decide(cfg(), st, obs).action is action


def test_a_heartbeat_on_an_evicted_host_says_until_when() -> None:
    d = decide(cfg(), EVICTED, replace(COOLED, wall_time=999.0))
    assert d.reason == "lease 10 refreshed; host draining (straggler eviction until 1970-01-01T00:16:40Z)"


def test_a_lost_lease_registers_again_with_the_eviction() -> None:
    st = replace(EVICTED, lease_id=None, registered=False)
    d = decide(cfg(), st, Observation(now=5.0, wall_time=900.0, lease_lost=True))
    assert d.action is Action.REGISTER
    assert d.reason == (
        "lease lost; registering node-a (2 slots) as draining (straggler eviction until 1970-01-01T00:16:40Z) "
        "under a new 9s lease"
    )


# -- timing rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(ttl_seconds=1), "--ttl must be >= 2"),
        (dict(heartbeat_seconds=4.0), "--heartbeat must be > 0 and <= ttl/3"),
        (dict(heartbeat_seconds=0.0), "--heartbeat must be > 0"),
        (dict(request_timeout_seconds=3.5), "heartbeat \\+ 2\\*request_timeout = 10s must be <= ttl = 9s"),
        (dict(drain_grace_seconds=-1.0), "--drain-grace must be >= 0"),
        (dict(retry_deadline_seconds=5.0), "--retry-deadline must be >= ttl"),
        (dict(host="a:b"), "invalid host name"),
    ],
)
def test_timing_rules_are_validated(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--job", "j"], "the following arguments are required: --etcd"),
        (["--etcd", "http://127.0.0.1:1", "--job", "j", "--ttl", "6", "--heartbeat", "5"], "--heartbeat must be"),
        (["--etcd", "http://127.0.0.1:1", "--job", "j", "--slots", "zero"], "positive integer or 'auto'"),
        (["--etcd", "ftp://127.0.0.1:1", "--job", "j"], "invalid etcd endpoint"),
        (["--etcd", "https://u:pw@127.0.0.1:1", "--job", "j"], "credentials do not belong"),
        (["--etcd", "https://127.0.0.1:1", "--job", "j", "--cert", "/nonexistent"], "--cert and --key go together"),
    ],
)
def test_cli_misuse_exits_2_with_one_line(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("elastictrain agent: error: ")
    assert match in err


# -- the agent against an in-memory store ------------------------------------------------------------


WALL = 1.7e9
"""Unix time of the harness's start; its wall clock moves with its monotonic one."""


class Harness:
    def __init__(self, **kw: object) -> None:
        self.clock = FakeClock(100.0)
        self.registry = InMemoryRegistry("job1", clock=self.clock)
        self.agent = Agent(cfg(**kw), self.registry, clock=self.clock, wall_clock=self.wall)

    def wall(self) -> float:
        return WALL + self.clock.now - 100.0

    def cycle(self, advance: float = 0.0) -> str:
        self.clock.advance(advance)
        return self.agent.run_cycle().reason

    def state(self) -> str | None:
        entry = self.registry.get("node-a")
        return entry.record.state if entry else None

    def record(self) -> HostRecord:
        entry = self.registry.get("node-a")
        assert entry is not None
        return entry.record


def test_agent_registers_heartbeats_and_keeps_its_host_past_the_ttl() -> None:
    h = Harness()
    assert h.cycle().startswith("registering node-a")
    for _ in range(10):
        assert h.cycle(3.0).endswith("refreshed; host ready")
    assert h.state() == READY


def test_agent_drains_on_sigterm_and_revokes_after_grace() -> None:
    h = Harness()
    h.cycle()
    h.agent.signals.handler(signal.SIGTERM, None)
    assert h.cycle().startswith("drain requested; marking host draining")
    assert h.state() == DRAINING
    assert h.agent.next_wait() == 3.0
    h.cycle(3.0)
    h.cycle(3.0)
    h.cycle(3.0)
    assert h.agent.next_wait() == pytest.approx(1.0)
    assert h.agent.run_cycle().action is Action.HEARTBEAT
    assert h.cycle(1.0) == f"drain grace of 10s over; revoking lease {0x1000:x} and exiting"
    assert h.agent.exit_code == 0 and h.state() is None


def test_agent_registers_again_after_etcd_lost_its_data() -> None:
    h = Harness()
    h.cycle()
    h.registry.lose_everything()
    assert h.cycle(3.0).startswith("lease lost; registering node-a"), "new lease, new key"
    assert h.state() == READY


def test_agent_rides_out_an_outage_and_registers_again_when_the_lease_expired() -> None:
    h = Harness()
    h.cycle()
    h.registry.available = False
    for _ in range(5):
        assert h.cycle(3.0).startswith("etcd unreachable")
    h.registry.available = True
    assert h.cycle(3.0).startswith("lease lost; registering node-a")
    assert h.state() == READY


def test_agent_keeps_an_operator_drain_when_it_registers_again() -> None:
    h = Harness()
    h.cycle()
    set_state(h.registry, "node-a", DRAINING)
    assert h.cycle(3.0).endswith("host draining")
    h.registry.lose_everything()
    assert "as draining" in h.cycle(3.0)
    assert h.state() == DRAINING


def test_agent_waits_for_a_stale_key_of_a_previous_agent_to_expire() -> None:
    h = Harness()
    stale_lease = h.registry.grant_lease(9)
    h.registry.register(HostRecord(host="node-a", slots=2, addr="x", pid=7), stale_lease)
    assert "held by lease" in h.cycle()
    assert "held by lease" in h.cycle(3.0)
    assert h.cycle(6.0).startswith("registering node-a"), "the stale lease expired after its 9s TTL"


def test_agent_exits_when_an_operator_removes_its_host() -> None:
    h = Harness()
    h.cycle()
    h.registry.delete("node-a")
    assert "removed by an operator" in h.cycle(3.0)
    assert h.agent.exit_code == 0


def test_agent_gives_up_when_etcd_never_answers_at_startup() -> None:
    h = Harness()
    h.registry.available = False
    h.agent.sleep = h.clock.advance
    assert h.agent.run() == 1
    assert h.agent.last_decision is not None and "past the retry deadline" in h.agent.last_decision.reason


# -- evictions: the agent readmits its host ----------------------------------------------------------


def test_agent_readmits_its_evicted_host_after_the_cooldown_and_keeps_the_count() -> None:
    h = Harness()
    h.cycle()
    for n in (1, 2):
        evicted = evict(h.registry, "node-a", reason="straggler", cooldown_seconds=10, now=h.wall(), min_np=0)
        assert (evicted.evictions, evicted.drain_until) == (n, h.wall() + 10)
        assert h.agent.run_cycle().reason.startswith(
            f"lease {0x1000:x} refreshed; host draining (straggler eviction until"
        )
        assert h.agent.state.wanted_state == DRAINING, "the agent follows the eviction"
        assert h.cycle(3.0).startswith(f"lease {0x1000:x} refreshed; host draining (straggler")
        assert h.cycle(6.0).startswith(f"lease {0x1000:x} refreshed; host draining"), "9 s of 10: not yet"
        assert h.cycle(1.0) == f"cool-down of the straggler eviction over; marking host ready (evictions: {n})"
        r = h.record()
        assert (r.state, r.drain_reason, r.drain_until, r.evictions) == (READY, "", 0.0, n)
        assert h.agent.state.wanted_state == READY
        assert h.cycle(3.0).endswith("refreshed; host ready")
        h.clock.advance(3.0)


def test_agent_never_readmits_an_operator_drain() -> None:
    h = Harness()
    h.cycle()
    set_state(h.registry, "node-a", DRAINING)
    for _ in range(20):
        assert h.cycle(3.0).endswith("refreshed; host draining")
    assert h.state() == DRAINING


def test_an_operator_undrain_during_the_cooldown_readmits_at_once_and_keeps_the_count() -> None:
    h = Harness()
    h.cycle()
    evict(h.registry, "node-a", reason="hung", cooldown_seconds=600, now=h.wall(), min_np=0)
    h.cycle(3.0)
    set_state(h.registry, "node-a", READY)
    assert h.cycle(3.0).endswith("refreshed; host ready")
    assert (h.record().evictions, h.agent.state.wanted_state) == (1, READY)


def test_a_readmission_rereads_the_key_and_leaves_a_drain_written_since_alone() -> None:
    h = Harness()
    h.cycle()
    evict(h.registry, "node-a", reason="straggler", cooldown_seconds=3, now=h.wall(), min_np=0)
    h.clock.advance(3.0)
    obs = h.agent.observe()
    decision = decide(h.agent.cfg, h.agent.state, obs)
    assert decision.action is Action.READMIT
    set_state(h.registry, "node-a", DRAINING)  # an operator drains it between the cycle's read and its write
    h.agent.apply(decision)
    assert h.state() == DRAINING and not h.record().evicted
    assert h.cycle(3.0).endswith("refreshed; host draining")


def test_agent_keeps_the_eviction_when_it_registers_under_a_new_lease() -> None:
    h = Harness()
    h.cycle()
    evict(h.registry, "node-a", reason="straggler", cooldown_seconds=20, now=h.wall(), min_np=0)
    h.cycle(3.0)
    h.registry.lose_everything()  # etcd lost its data: the agent registers again
    assert h.cycle(3.0).startswith("lease lost; registering node-a (2 slots) as draining (straggler eviction until")
    r = h.record()
    assert (r.state, r.drain_reason, r.drain_until, r.evictions) == (DRAINING, "straggler", WALL + 20, 1)
    reasons = [h.cycle(3.0) for _ in range(5)]  # wall clock at +21 s in the last one
    assert reasons[-2].endswith("Z)") and reasons[-1].startswith("cool-down of the straggler eviction over")
    assert (h.record().state, h.record().evictions) == (READY, 1)


def test_agent_draining_on_sigterm_never_readmits_its_evicted_host() -> None:
    h = Harness()
    h.cycle()
    evict(h.registry, "node-a", reason="straggler", cooldown_seconds=3, now=h.wall(), min_np=0)
    h.agent.signals.handler(signal.SIGTERM, None)
    for _ in range(3):
        assert h.agent.run_cycle().action is not Action.READMIT
        assert h.state() == DRAINING
        h.clock.advance(3.0)
    assert h.cycle(1.0).startswith("drain grace of 10s over") and h.state() is None


class FakeNode:
    """A Kubernetes node as ``--drain-when-cordoned`` reads it: ``reason`` is None while it is schedulable."""

    reason: str | None = None

    def drain_reason(self) -> str | None:
        return self.reason


def test_a_cordon_holds_the_readmission_until_the_node_is_uncordoned() -> None:
    h = Harness(drain_when_cordoned="node-a")
    h.agent.node_watch = node = FakeNode()
    h.cycle()
    evict(h.registry, "node-a", reason="hung", cooldown_seconds=3, now=h.wall(), min_np=0)
    node.reason = "node node-a is cordoned"
    for _ in range(3):
        assert h.agent.run_cycle().action is Action.HEARTBEAT
        h.clock.advance(3.0)
    assert h.state() == DRAINING
    node.reason = None
    assert h.agent.run_cycle().action is Action.READMIT and h.state() == READY
