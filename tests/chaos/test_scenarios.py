"""Chaos scenarios end to end: a real ``elastictrain launch`` job under faults, then every invariant.

Each scenario runs the small job of :func:`chaos.scenarios.base_config` (about 40 s on 2 cores) while
the fault is injected, and must pass the whole invariant table: completed, every sample exactly once
per epoch, final loss within tolerance of the fault-free run (run once per session, cached), latest
checkpoint verified, one MLflow run, no process left, a recovery after each fault.

The ``ci`` scenario (``kill-worker``) and the clean-up of a stale multi-node tier run in ``make test``; the
other scenarios and the multi-node tier (``node-killed``, ``node-partitioned``: network namespaces with sshd,
workers started over ssh; it skips with the reason where namespaces are not permitted) run only with
``ELASTICTRAIN_CHAOS_LONG=1`` (``make chaos``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from chaos import netns
from chaos.procs import environ
from chaos.scenarios import SCENARIOS, Result, run_scenario
from elastictrain.rundir import layout
from elastictrain.rundir.events import Event, Reset, Start, read_events
from tests.fixtures.procs import REPO, VENV_BIN

LONG = os.environ.get("ELASTICTRAIN_CHAOS_LONG") == "1"
needs_horovod = pytest.mark.skipif(not (VENV_BIN / "horovodrun").exists(), reason="horovodrun is not installed")
pytestmark = [pytest.mark.chaos, pytest.mark.integration, needs_horovod]


@pytest.fixture(scope="session")
def chaos_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One parent for every scenario of the session, so the fault-free reference runs once."""
    yield tmp_path_factory.mktemp("chaos")


def run_and_check(name: str, root: Path) -> Result:
    result = run_scenario(name, root / name, out=print)
    print(result.table)
    assert result.ok, result.table
    assert result.audit is not None and (result.audit.lost, result.audit.duplicated) == (0, 0)
    assert result.unloadable == 0
    return result


def scenario_params(ci: bool) -> list[str]:
    return [s.name for s in SCENARIOS.values() if s.ci == ci and s.name != "soak" and not s.nodes]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", scenario_params(ci=True))
def test_short_scenario_keeps_every_invariant(name: str, chaos_root: Path) -> None:
    run_and_check(name, chaos_root)


SCENARIO_ROWS = {
    "slow-worker": ("slowed host evicted (drain), no other host", "no step lost (graceful)"),
    "hang-worker": ("hung worker detected (worker_hung", "the hung worker is gone", "recovery seconds per fault"),
}
"""Rows (by the start of their name) that a scenario's table must have and pass, not merely not fail."""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not LONG, reason="chaos scenario of `make chaos` (ELASTICTRAIN_CHAOS_LONG=1)")
@pytest.mark.parametrize("name", scenario_params(ci=False))
def test_long_scenario_keeps_every_invariant(name: str, chaos_root: Path) -> None:
    result = run_and_check(name, chaos_root)
    for row in SCENARIO_ROWS.get(name, ()):
        assert any(c.name.startswith(row) and c.ok for c in result.checks), f"{row!r} did not pass\n{result.table}"


def tier_traces() -> set[str]:
    """What a multi-node tier leaves when it is not torn down: namespaces, links, state files, temp dirs and
    processes (sshd, etcd, agents) that name its temp dir."""
    out = {f"namespace {ns}" for ns in netns.existing_namespaces() if ns.startswith(netns.NAME_PREFIX)}
    out |= {f"link {link}" for link in netns.existing_links() if link.startswith(netns.NAME_PREFIX)}
    out |= {f"state {p}" for p in netns.STATE_DIR.glob("*.json")}
    out |= {f"netns etc {p}" for p in netns.NETNS_ETC.glob(f"{netns.NAME_PREFIX}*")}
    for root in (Path(tempfile.gettempdir()), netns.PRIVATE_ROOT):  # a share-nothing tier keeps its files in the latter
        out |= {f"temp dir {p}" for p in root.glob("elastictrain-netns-*")}
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any("elastictrain-netns-" in arg for arg in p.info["cmdline"] or ()):
            out.add(f"process {p.info['pid']} {' '.join(p.info['cmdline'])[:80]}")
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not LONG, reason="multi-node chaos tier: run with `make chaos` (ELASTICTRAIN_CHAOS_LONG=1)")
def test_multi_node_tier_with_namespaces_sshd_and_partitions(chaos_root: Path) -> None:
    """Three nodes (network namespaces on a link-local bridge, each with a real sshd and agent), a real etcd
    and horovodrun starting every worker over ssh; min_np 2. A whole node is SIGKILLed and boots again; a node
    is cut off the bridge for 15 s. Every invariant holds, both nodes rejoin over ssh, and nothing of the tier
    (namespace, veth, bridge, process, temp dir) is left."""
    reason = netns.preflight()
    if reason is not None:
        pytest.skip(reason)
    before = tier_traces()
    recovery = {}
    for name, fault in (("node-killed", "kill-host"), ("node-partitioned", "partition-host")):
        result = run_and_check(name, chaos_root)
        rows = {c.name: c for c in result.checks}
        assert rows["nothing of the multi-node tier left"].ok, result.table
        assert rows["node rejoined the ring after it came back"].ok, result.table
        assert rows["no process of the job left"].ok, result.table
        recs = [r for r in result.recoveries if r.action == fault]
        assert len(recs) == 1 and recs[0].recovery_seconds is not None, result.table
        assert recs[0].reset_reason in ("worker_failed", "hosts_removed"), result.table
        recovery[name] = recs[0].recovery_seconds
        # The workers ran on the nodes, started over ssh: every host in the job's events is a node address.
        job = yaml.safe_load((result.run_dir / "job.yaml").read_text())["job"]
        assert result.summary, result.table
        hosts = {h for e in _events(result.run_dir) if isinstance(e, Start | Reset) for h in e.hosts or ()}
        assert len(hosts) == 3 and all(h.startswith("169.254.") for h in hosts), hosts
        assert not [p.pid for p in psutil.process_iter() if environ(p).get("ELASTICTRAIN_JOB") == job]
    print(f"recovery seconds: {recovery}")
    assert tier_traces() <= before, f"left by the tier: {sorted(tier_traces() - before)}"


@pytest.mark.timeout(900)
def test_a_tier_sharing_nothing_loses_rank_0s_node_with_its_disk_and_keeps_every_invariant(chaos_root: Path) -> None:
    """The share-nothing tier (each node its own disk; checkpoints in the tier's S3 server; the workers' signals and
    records through etcd), quick: rank 0's node is SIGKILLed and its disk emptied, then it boots on an empty disk.
    Every invariant holds from what the launcher's run_dir and the store hold: the run log ends done, every sample
    once in a ledger written by two rank 0s, the latest checkpoint verifies and loads from the store."""
    reason = netns.preflight()
    if reason is not None:
        pytest.skip(reason)
    before = tier_traces()
    result = run_scenario("node-rank0-killed", chaos_root / "node-rank0-killed", quick=True, out=print)
    print(result.table)
    assert result.ok, result.table
    assert result.audit is not None and (result.audit.lost, result.audit.duplicated) == (0, 0)
    (rec,) = [r for r in result.recoveries if r.action == "kill-host"]
    assert rec.recovery_seconds is not None and rec.lost_steps == 0, result.table
    tenures = sorted(p.name for p in (result.run_dir / layout.LEDGER).iterdir())
    assert len(tenures) >= 2, f"rank 0 moved to another node: {tenures}"
    assert yaml.safe_load((result.run_dir / layout.CONFIG).read_text())["checkpoint"]["location"].startswith("s3://")
    assert tier_traces() <= before, f"left by the tier: {sorted(tier_traces() - before)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not LONG, reason="share-nothing chaos scenario of `make chaos` (ELASTICTRAIN_CHAOS_LONG=1)")
@pytest.mark.parametrize(
    "name", [s.name for s in SCENARIOS.values() if s.share_nothing and s.name != "node-rank0-killed"]
)
def test_a_share_nothing_scenario_keeps_every_invariant(name: str, chaos_root: Path) -> None:
    """Spot notices on one node and on every node (just-in-time checkpoint, new machines, a relaunch from the
    store), and the object store down for 30 s, on the share-nothing tier."""
    reason = netns.preflight()
    if reason is not None:
        pytest.skip(reason)
    run_and_check(name, chaos_root)


def _events(run_dir: Path) -> list[Event]:
    return read_events(run_dir / layout.EVENTS)


@pytest.mark.timeout(120)
def test_a_tier_whose_owner_was_killed_is_removed_by_the_next_one(tmp_path: Path) -> None:
    """A process that built a tier is SIGKILLed (its ``finally`` never runs): every namespace, link, process
    (sshd, agents, etcd) and temp dir it made is still there, and the next :func:`netns.clean_stale` removes
    exactly that tier."""
    reason = netns.preflight()
    if reason is not None:
        pytest.skip(reason)
    code = (
        "import pathlib, sys, time\n"
        "from chaos import netns\n"
        f"c = netns.Cluster(nodes=2, job='stale-owner', log_dir=pathlib.Path({str(tmp_path)!r}), out=lambda s: None)\n"
        "c.start()\n"
        "print(c.n.token, flush=True)\n"
        "time.sleep(300)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    try:
        assert owner.stdout is not None
        token = owner.stdout.readline().strip()
        assert token, "the tier did not start"
        state = json.loads((netns.STATE_DIR / f"{token}.json").read_text())
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
    names = netns.TierNames.from_json(state)
    etcd = psutil.Process(state["etcd_pid"])
    left = netns.what_is_left(names, [etcd], [Path(state["tmp"])])
    assert f"namespace {names.netns(1)}" in left and f"link {names.iface}" in left, left
    assert any(x.startswith(f"process {etcd.pid} ") for x in left), left
    assert token in netns.clean_stale()
    assert netns.what_is_left(names, [etcd], [Path(state["tmp"]), netns.STATE_DIR / f"{token}.json"]) == []
