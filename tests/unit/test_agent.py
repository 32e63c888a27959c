"""Agent cycle decisions: the pure ``decide`` with chosen times, and the agent on an in-memory store."""

from __future__ import annotations

import signal

import pytest

from discovery.agent import Action, Agent, AgentState, Observation, decide, main
from discovery.record import DRAINING, READY, HostRecord
from discovery.registry import InMemoryRegistry, set_state
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


class Harness:
    def __init__(self, **kw: object) -> None:
        self.clock = FakeClock(100.0)
        self.registry = InMemoryRegistry("job1", clock=self.clock)
        self.agent = Agent(cfg(**kw), self.registry, clock=self.clock, wall_clock=lambda: 1.7e9)

    def cycle(self, advance: float = 0.0) -> str:
        self.clock.advance(advance)
        return self.agent.run_cycle().reason

    def state(self) -> str | None:
        entry = self.registry.get("node-a")
        return entry.record.state if entry else None


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
