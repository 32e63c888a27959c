"""The multi-node chaos tier's pure parts: names, addresses, configs and commands (no namespace is made)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from chaos import invariants as inv
from chaos import netns, scenarios
from chaos.jobs import LaunchedJob
from chaos.scenarios import SCENARIOS, base_config
from elastictrain.commands import agent_command
from elastictrain.config import DiscoveryConfig
from elastictrain.errors import ScenarioError
from elastictrain.launcher.processes import ssh_runs_train
from elastictrain.rundir.events import Event, parse_event


def names(nodes: int = 3, octet: int = 77) -> netns.TierNames:
    return netns.TierNames("a1b2c", octet, nodes)


def test_the_bridge_and_every_nodes_interface_share_one_name_and_all_names_fit_ifnamsiz() -> None:
    n = names(nodes=netns.MAX_NODES)
    assert n.iface == "etna1b2c"
    links = [n.iface, *(n.veth(i) for i in range(n.nodes)), *(n.peer(i) for i in range(n.nodes))]
    assert max(len(x) for x in links) <= netns.IFNAMSIZ
    assert len(set(links)) == len(links), "veths, peers and the bridge never share a name in the root namespace"
    assert len({n.netns(i) for i in range(n.nodes)}) == n.nodes
    assert n.links()[-1] == n.iface, "veths are deleted before the bridge"


def test_addresses_are_link_local_and_map_back_to_their_node() -> None:
    n = names()
    assert n.subnet == "169.254.77.0/24" == netns.SUBNET
    assert n.bridge_address == "169.254.77.1"
    assert [n.address(i) for i in range(3)] == ["169.254.77.10", "169.254.77.11", "169.254.77.12"]
    assert [n.node_of(n.address(i)) for i in range(3)] == [0, 1, 2]
    for host in ("169.254.77.13", "169.254.77.1", "169.254.78.10", "localhost", "169.254.77.x"):
        assert n.node_of(host) is None
    with pytest.raises(ValueError):
        n.address(3)


@pytest.mark.parametrize(
    ("token", "octet", "nodes"),
    [("A1B2C", 77, 3), ("a1b2", 77, 3), ("a1b2c", 169, 3), ("a1b2c", 63, 3), ("a1b2c", 77, 0), ("a1b2c", 77, 100)],
)
def test_names_refuse_tokens_subnets_and_sizes_outside_the_tier(token: str, octet: int, nodes: int) -> None:
    with pytest.raises(ValueError):
        netns.TierNames(token, octet, nodes)


def test_new_names_are_random_and_round_trip_through_the_state_file() -> None:
    a, b = netns.TierNames.new(3), netns.TierNames.new(3)
    assert a.token != b.token or a == b  # 20 random bits: a clash is possible but astronomically rare
    assert netns.TierNames.from_json(a.to_json()) == a


def test_the_subnet_is_77_unless_taken_and_never_near_the_metadata_address() -> None:
    assert netns.choose_octet(set()) == 77
    assert netns.choose_octet({77}) == 64
    assert netns.choose_octet({77, 64, 65}) == 66
    assert all(64 <= o <= 127 for o in netns.OCTETS) and 169 not in netns.OCTETS
    with pytest.raises(netns.TierUnavailable):
        netns.choose_octet(set(netns.OCTETS))


def test_sshd_listens_on_the_nodes_address_only_with_key_login_and_keepalives(tmp_path) -> None:
    text = netns.sshd_config(
        address="169.254.77.11", port=22, host_key=tmp_path / "hk", authorized_keys=tmp_path / "ak"
    )
    lines = text.splitlines()
    assert "ListenAddress 169.254.77.11" in lines and sum(x.startswith("ListenAddress") for x in lines) == 1
    assert f"AuthorizedKeysFile {tmp_path / 'ak'}" in lines and f"HostKey {tmp_path / 'hk'}" in lines
    assert "PasswordAuthentication no" in lines and "PermitRootLogin prohibit-password" in lines
    assert "ClientAliveInterval 2" in lines and "ClientAliveCountMax 3" in lines


def test_the_ssh_client_reaches_only_the_tiers_subnet_and_gives_up_on_a_dead_link(tmp_path) -> None:
    text = netns.ssh_config(names=names(octet=80), identity=tmp_path / "id")
    blocks = text.split("Host ")[1:]
    assert blocks[0].startswith("169.254.80.*")
    assert "UserKnownHostsFile /dev/null" in blocks[0] and "BatchMode yes" in blocks[0]
    assert f"IdentityFile {tmp_path / 'id'}" in blocks[0]
    assert "ServerAliveInterval 2" in blocks[0] and "ServerAliveCountMax 3" in blocks[0]  # ~6 s to notice
    assert blocks[1].startswith("* !169.254.80.*") and "ProxyCommand /bin/false" in blocks[1]
    assert "~" not in text and ".ssh" not in text


def test_the_ssh_wrapper_runs_the_real_client_with_the_tiers_config(tmp_path) -> None:
    script = netns.ssh_wrapper("/usr/bin/ssh", tmp_path / "my config")
    assert script.startswith("#!/bin/sh\n")
    assert f"exec /usr/bin/ssh -F '{tmp_path / 'my config'}' \"$@\"" in script


def test_each_node_resolves_its_own_hostname_to_its_own_address() -> None:
    n = names()
    hosts = netns.etc_hosts(n, 2)
    assert f"169.254.77.12 {n.netns(2)}" in hosts.splitlines()
    assert n.netns(0) not in hosts


def test_a_node_process_boots_in_its_namespace_under_its_hostname_and_keeps_argvs_pid() -> None:
    n = names()
    cmd = netns.boot_command(n, 1, ["/usr/sbin/sshd", "-D"])
    assert cmd[:4] == ["ip", "netns", "exec", n.netns(1)]
    assert cmd[4:6] == ["unshare", "--uts"]
    assert "exec" in cmd[8] and cmd[9] == n.netns(1) and cmd[-2:] == ["/usr/sbin/sshd", "-D"]


def test_launch_flags_use_the_tiers_etcd_and_pass_the_shared_interface_name_to_horovodrun() -> None:
    flags = netns.launch_flags(etcd="http://169.254.77.1:2379", job="j", iface="etna1b2c")
    assert flags[:4] == ("--etcd", "http://169.254.77.1:2379", "--job", "j")
    assert flags[4:] == ("--", "--network-interfaces", "etna1b2c"), "horovodrun flags come after --, last"


def test_tier_processes_do_not_inherit_a_jobs_or_horovods_environment() -> None:
    env = {"PATH": "/bin", "ELASTICTRAIN_JOB": "x", "ELASTICTRAIN_LAUNCH_ID": "y", "HOROVOD_RANK": "0", "HOME": "/r"}
    assert netns.clean_env(env) == {"PATH": "/bin", "HOME": "/r"}


def test_the_agent_command_is_one_function_for_the_launcher_and_the_tier() -> None:
    d = DiscoveryConfig(ttl_seconds=3, heartbeat_seconds=0.5)
    cmd = agent_command(d, etcd="http://169.254.77.1:2379", job="j", host="169.254.77.10", drain_grace_seconds=2)
    assert cmd[cmd.index("--host") + 1] == "169.254.77.10"
    assert cmd[cmd.index("--ttl") + 1] == "3" and cmd[cmd.index("--heartbeat") + 1] == "0.5"
    assert cmd[cmd.index("--drain-grace") + 1] == "2" and cmd[cmd.index("--prefix") + 1] == "/elastictrain"


def test_the_launcher_counts_horovodruns_ssh_to_a_worker_as_a_live_worker() -> None:
    remote = "cd /w > /dev/null 2>&1 ; env A=1 /v/bin/elastictrain train --config /r/job.yaml"
    assert ssh_runs_train(["/usr/bin/ssh", "-F", "/t/cfg", "-o", "X=no", "169.254.77.10", remote])
    assert not ssh_runs_train(["/usr/bin/ssh", "169.254.77.10", "true"])
    assert not ssh_runs_train(["/bin/sh", "-c", f"ssh 169.254.77.10 '{remote}'"])
    assert not ssh_runs_train([])


@pytest.mark.parametrize("reason", ["hosts_removed", "worker_failed"])
def test_a_partition_is_matched_with_the_reset_that_drops_the_node_not_a_grow_back(reason: str) -> None:
    """A cut node leaves discovery (hosts_removed) or its peers fail first (worker_failed); a grow-back of an
    earlier fault that lands in the same window is not the partition's recovery."""
    cut = [{"ts": 10, "action": "partition-host", "host": "169.254.77.11", "seconds": 15}]
    events = [
        ev(11, "reset", reason="hosts_added", recovery_seconds=0.5),
        ev(14, "reset", reason=reason, recovery_seconds=3.0, lost_steps=2),
    ]
    [rec] = inv.recoveries(cut, events)
    assert (rec.reset_reason, rec.recovery_seconds, rec.seconds_to_reset, rec.lost_steps) == (reason, 3.0, 4.0, 2)
    [grow_back_only] = inv.recoveries(cut, events[:1])
    assert grow_back_only.reset_reason == "hosts_added", "with nothing better, the first reset after the fault"


def ev(ts: float, event: str, **fields: object) -> Event:
    return parse_event({"ts": ts, "event": event, "step": int(ts), "epoch": 0, "world_size": 3, **fields})


def test_a_node_counts_as_rejoined_only_in_a_reset_after_it_came_back() -> None:
    a, b = "169.254.77.10", "169.254.77.12"
    killed = [{"ts": 10, "action": "kill-host", "host": b}, {"ts": 20, "action": "host-returns", "host": b}]
    before = ev(15, "reset", hosts=[a], world_size=1)
    assert inv.check_rejoined(killed, [before, ev(25, "reset", hosts=[a, b])]).ok
    assert not inv.check_rejoined(killed, [before, ev(19, "reset", hosts=[a, b])]).ok, "before it returned"
    assert not inv.check_rejoined(killed, [before, ev(25, "metrics")]).ok
    cut = [
        {"ts": 10, "action": "partition-host", "host": b, "seconds": 15},
        {"ts": 25, "action": "partition-host", "phase": "end", "host": b},
    ]
    assert not inv.check_rejoined(cut, [ev(12, "reset", hosts=[a, b])]).ok
    assert inv.check_rejoined(cut, [ev(30, "reset", hosts=[a, b])]).ok
    assert not inv.check_rejoined([], []).ok, "no node came back: the scenario did not do its job"


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s.nodes])
def test_a_multi_node_scenario_survives_one_lost_node_and_refuses_the_local_tier(name: str, tmp_path: Path) -> None:
    s = SCENARIOS[name]
    elastic = s.cfg(False)["elastic"]
    # a node killed or cut off leaves nodes - 1 workers: still at least min_np, and below max_np so it can grow back
    assert elastic["min_np"] <= s.nodes - 1 < elastic["max_np"] <= s.nodes
    with pytest.raises(ScenarioError, match="needs the multi-node tier"):
        s.inject(LaunchedJob(tmp_path, {"job": "j", **base_config()}), False)


def test_the_scenarios_that_ci_runs_need_no_multi_node_tier() -> None:
    ci = [s for s in SCENARIOS.values() if s.ci]
    assert ci and all(scenarios._tier_unavailable(s) is None for s in ci)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="mount namespaces need root")
@pytest.mark.parametrize("code_under_tmp", [False, True], ids=["code-elsewhere", "code-under-tmp"])
def test_a_share_nothing_node_has_its_own_tmp_cache_and_run_dir_and_reads_the_code_only(
    tmp_path: Path, request: pytest.FixtureRequest, code_under_tmp: bool
) -> None:
    """The mounts of a share-nothing node, run for real in a mount namespace of their own: what the node writes
    to /tmp, its cache and the run_dir lands on its own disk; the code is read-only (also a checkout under /tmp,
    as a CI worktree may be); the tier's disks are hidden."""
    # The tier's own files live outside /tmp (netns.PRIVATE_ROOT): a node's /tmp is its disk's. The run_dir and home
    # here are under /tmp, as a pytest run_dir is: the node makes them on its own /tmp.
    root = Path(tempfile.mkdtemp(prefix="elastictrain-netns-test-", dir=netns.PRIVATE_ROOT))
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    disk, hidden = root / "disks" / "n0", root / "disks"
    code = tmp_path / "code" if code_under_tmp else root / "code"
    run_dir, home = tmp_path / "run", tmp_path / "home"
    for d in (disk / "tmp", disk / "cache", disk / "run", code, run_dir, home):
        d.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("the launcher's\n")
    (code / "train.py").write_text("code\n")
    marker = f"elastictrain-node-{os.getpid()}"
    mounts = netns.node_mounts(disk=disk, code=code, run_dir=run_dir, home=home, hidden=hidden, stage=root / "stage")
    probe = (
        f"echo node > /tmp/{marker} && echo node > {run_dir}/events.jsonl && echo c > {home}/.cache/c"
        f' && test "$(cat {code}/train.py)" = code && ! (echo x > {code}/train.py) 2>/dev/null'
        f" && test ! -e {disk} && echo ok"
    )
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join([*mounts, probe])],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert not Path(f"/tmp/{marker}").exists(), "the node's /tmp is its own"
    assert (disk / "tmp" / marker).read_text() == "node\n"
    assert (run_dir / "events.jsonl").read_text() == "the launcher's\n", "the launcher's run_dir is untouched"
    assert (disk / "run" / "events.jsonl").read_text() == "node\n" and (disk / "cache" / "c").exists()
    assert (code / "train.py").read_text() == "code\n"


def test_a_share_nothing_references_trains_the_same_job_with_its_records_kept_locally() -> None:
    cfg = scenarios.SCENARIOS["node-rank0-killed"].cfg(False)
    assert cfg["elastic"]["outputs"] == "etcd" and cfg["checkpoint"]["location"].startswith("s3://")
    local = scenarios.same_training(cfg)
    assert "outputs" not in local["elastic"] and "signals" not in local["elastic"]
    assert "location" not in local["checkpoint"] and cfg["elastic"]["outputs"] == "etcd", "the original is unchanged"
    assert {k: v for k, v in local["elastic"].items()} == {
        k: v for k, v in cfg["elastic"].items() if k not in ("outputs", "signals")
    }
