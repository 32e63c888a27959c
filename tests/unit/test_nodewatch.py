"""A cordoned Kubernetes node drains its host: reading the node, the agent's decision, the agent on a fake node."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from discovery.agent import Action, Agent, AgentState, Observation, decide, main
from discovery.nodewatch import NodeWatch, NodeWatchError, in_cluster, node_drain_reason
from discovery.record import DRAINING, READY
from discovery.registry import InMemoryRegistry, set_state
from tests.fixtures.agent import agent_config as cfg
from tests.fixtures.clock import FakeClock

CORDONED = "node is cordoned (spec.unschedulable)"

# -- node_drain_reason() ---------------------------------------------------------------------------


def test_a_schedulable_node_is_not_drained() -> None:
    assert node_drain_reason({"spec": {}}) is None
    assert node_drain_reason({"spec": {"unschedulable": False, "taints": [{"key": "nvidia.com/gpu"}]}}) is None


def test_a_cordoned_or_scaled_down_node_is_drained() -> None:
    assert node_drain_reason({"spec": {"unschedulable": True}}) == CORDONED
    taint = {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}
    assert (
        node_drain_reason({"spec": {"taints": [taint]}})
        == "node is tainted ToBeDeletedByClusterAutoscaler (scale-down)"
    )


def test_a_node_object_without_a_spec_is_an_error_not_a_schedulable_node() -> None:
    with pytest.raises(NodeWatchError, match="no spec"):
        node_drain_reason({"kind": "Status"})


# -- NodeWatch against a fake API server ------------------------------------------------------------


def watch(tmp_path: Path, answer: Any) -> tuple[NodeWatch, list[urllib.request.Request]]:
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    sent: list[urllib.request.Request] = []

    def fetch(req: urllib.request.Request, timeout: float) -> bytes:
        sent.append(req)
        if isinstance(answer, Exception):
            raise answer
        return json.dumps(answer).encode()

    return NodeWatch(node="gpu-1", api_url="https://10.0.0.1:443", token_file=str(token), fetch=fetch), sent


def test_node_watch_gets_its_node_with_the_service_account_token(tmp_path: Path) -> None:
    w, sent = watch(tmp_path, {"spec": {"unschedulable": True}})
    assert w.drain_reason() == CORDONED
    (req,) = sent
    assert req.full_url == "https://10.0.0.1:443/api/v1/nodes/gpu-1"
    assert req.get_header("Authorization") == "Bearer tok-1"


def test_node_watch_names_the_missing_rbac_on_403(tmp_path: Path) -> None:
    forbidden = urllib.error.HTTPError("https://x", 403, "Forbidden", None, None)  # type: ignore[arg-type]
    w, _ = watch(tmp_path, forbidden)
    with pytest.raises(NodeWatchError, match=r"HTTP 403 .*rbac\.yaml"):
        w.drain_reason()


def test_in_cluster_outside_a_pod_is_refused_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster("gpu-1", env={}, sa_dir=str(tmp_path))
    with pytest.raises(ValueError, match="token is not readable"):
        in_cluster(
            "gpu-1", env={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}, sa_dir=str(tmp_path)
        )
    (tmp_path / "token").write_text("t")
    (tmp_path / "ca.crt").write_text("not a certificate")
    pod = {"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"}
    with pytest.raises(ValueError, match="invalid"):
        in_cluster("../x", env=pod, sa_dir=str(tmp_path))
    with pytest.raises(ValueError, match="cannot load the service account CA"):
        in_cluster("gpu-1", env=pod, sa_dir=str(tmp_path))


def test_in_cluster_builds_the_watch_from_the_pods_environment(tmp_path: Path) -> None:
    from tests.fixtures.tls import make_pki

    pki = make_pki(tmp_path / "pki")
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_bytes(pki.ca.read_bytes())
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    w = in_cluster("gpu-1", env=env, sa_dir=str(tmp_path), timeout_seconds=1.5)
    assert (w.node, w.api_url, w.token_file, w.timeout_seconds) == (
        "gpu-1", "https://[fd00::1]:443", str(tmp_path / "token"), 1.5
    )  # fmt: skip


def test_agent_cli_with_drain_when_cordoned_outside_a_pod_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--etcd", "http://127.0.0.1:1", "--job", "j", "--host", "n", "--drain-when-cordoned", "n"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "KUBERNETES_SERVICE_HOST" in err


def test_a_node_read_adds_to_the_cycle_so_the_timing_rule_counts_it() -> None:
    cfg(drain_when_cordoned="gpu-1")  # 3 + 3*1 <= 9
    with pytest.raises(ValueError, match=r"heartbeat \+ 3\*request_timeout = 10\.5s must be <= ttl = 9s"):
        cfg(drain_when_cordoned="gpu-1", request_timeout_seconds=2.5)


# -- decide() with a cordon -------------------------------------------------------------------------


def test_a_cordon_drains_a_ready_host_and_an_uncordon_makes_it_ready() -> None:
    st = AgentState(lease_id=0x10, registered=True)
    d = decide(cfg(), st, Observation(now=5.0, lease_alive=True, key_state=READY, key_lease=0x10, cordon=CORDONED))
    assert d.action is Action.DRAIN_CORDONED and d.exit_code is None
    assert d.reason == f"{CORDONED}; marking host draining until it is uncordoned"
    st.cordon_drained = True
    still = Observation(now=8.0, lease_alive=True, key_state=DRAINING, key_lease=0x10, cordon=CORDONED)
    assert decide(cfg(), st, still).action is Action.HEARTBEAT, "drained once; the lease is kept"
    back = decide(cfg(), st, Observation(now=11.0, lease_alive=True, key_state=DRAINING, key_lease=0x10))
    assert back.action is Action.READY_UNCORDONED


def test_an_uncordon_leaves_an_operator_drain_alone() -> None:
    st = AgentState(lease_id=0x10, registered=True, wanted_state=DRAINING)  # drained by `hosts drain`, not a cordon
    d = decide(cfg(), st, Observation(now=5.0, lease_alive=True, key_state=DRAINING, key_lease=0x10))
    assert d.action is Action.HEARTBEAT


def test_a_cordoned_node_registers_as_draining() -> None:
    d = decide(cfg(), AgentState(), Observation(now=0.0, cordon=CORDONED))
    assert d.action is Action.REGISTER
    assert d.reason == f"{CORDONED}; registering node-a (2 slots) as draining under a new 9s lease"


def test_sigterm_during_a_cordon_still_revokes_after_the_grace() -> None:
    st = AgentState(lease_id=0x10, registered=True, drain_requested_at=100.0, cordon_drained=True)
    obs = Observation(now=110.0, lease_alive=True, key_state=DRAINING, key_lease=0x10, cordon=CORDONED)
    assert decide(cfg(), st, obs).action is Action.REVOKE_AND_EXIT


# -- the agent with a fake node ----------------------------------------------------------------------


class FakeNode:
    def __init__(self) -> None:
        self.reason: str | None = None
        self.error: str | None = None

    def drain_reason(self) -> str | None:
        if self.error:
            raise NodeWatchError(self.error)
        return self.reason


def harness() -> tuple[Agent, InMemoryRegistry, FakeClock, FakeNode]:
    clock = FakeClock(100.0)
    registry = InMemoryRegistry("job1", clock=clock)
    node = FakeNode()
    agent = Agent(
        cfg(drain_when_cordoned="node-a"),
        registry,
        clock=clock,
        wall_clock=lambda: 1.7e9,
        node_watch=node,
    )
    return agent, registry, clock, node


def state(registry: InMemoryRegistry) -> str | None:
    entry = registry.get("node-a")
    return entry.record.state if entry else None


def test_kubectl_drain_drains_the_host_without_a_signal_and_uncordon_brings_it_back() -> None:
    agent, registry, clock, node = harness()
    agent.run_cycle()
    assert state(registry) == READY
    node.reason = CORDONED  # kubectl drain: cordon first, then evict every pod but this DaemonSet's
    clock.advance(3.0)
    assert agent.run_cycle().action is Action.DRAIN_CORDONED
    assert state(registry) == DRAINING and agent.exit_code is None
    node.error = "GET node node-a: timed out"  # the API server is away: the last answer holds
    for _ in range(3):
        clock.advance(3.0)
        assert agent.run_cycle().action is Action.HEARTBEAT
    assert state(registry) == DRAINING
    node.error, node.reason = None, None  # kubectl uncordon
    clock.advance(3.0)
    assert agent.run_cycle().action is Action.READY_UNCORDONED
    assert state(registry) == READY
    clock.advance(3.0)
    assert agent.run_cycle().action is Action.HEARTBEAT and state(registry) == READY


def test_an_operator_drain_made_before_a_cordon_outlives_the_uncordon() -> None:
    agent, registry, clock, node = harness()
    agent.run_cycle()
    set_state(registry, "node-a", DRAINING)  # `hosts drain` before any cordon
    clock.advance(3.0)
    agent.run_cycle()
    node.reason = CORDONED
    clock.advance(3.0)
    assert agent.run_cycle().action is Action.HEARTBEAT, "already draining: nothing to do"
    node.reason = None
    clock.advance(3.0)
    assert agent.run_cycle().action is Action.HEARTBEAT
    assert state(registry) == DRAINING, "the uncordon does not undo a drain the cordon did not make"


def test_a_host_that_registers_again_on_a_cordoned_node_stays_draining() -> None:
    agent, registry, clock, node = harness()
    node.reason = CORDONED
    assert agent.run_cycle().reason.startswith(CORDONED)
    assert state(registry) == DRAINING
    registry.lose_everything()
    clock.advance(3.0)
    agent.run_cycle()
    assert state(registry) == DRAINING
    node.reason = None
    clock.advance(3.0)
    assert agent.run_cycle().action is Action.READY_UNCORDONED and state(registry) == READY
