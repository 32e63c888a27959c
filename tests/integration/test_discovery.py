"""Discovery against a real etcd: the agent daemon, discover.sh and the hosts CLI as processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from discovery.record import HostRecord
from discovery.registry import BelowMinNp, EtcdRegistry, evict, set_state
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.procs import REPO, VENV_BIN, ProcessGroup, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

DISCOVER_SH = REPO / "discovery" / "discover.sh"
ELASTICTRAIN = str(VENV_BIN / "elastictrain")
JOB = "itest"
TTL = 3


def start_agent(procs: ProcessGroup, etcd: EtcdServer, host: str, *extra: str, log: Path) -> subprocess.Popen:
    """An agent whose every decision (each heartbeat too) is a JSON line in ``log``: see :func:`decisions`."""
    args = [ELASTICTRAIN, "agent", "--etcd", etcd.endpoint, "--job", JOB, "--host", host, "--slots", "1",
            "--ttl", str(TTL), "--heartbeat", "0.5", "--request-timeout", "0.5", *extra]  # fmt: skip
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
           "ELASTICTRAIN_LOG_LEVEL": "debug", "ELASTICTRAIN_LOG_FORMAT": "json"}  # fmt: skip
    with log.open("ab") as f:
        return procs.start(args, stdout=subprocess.DEVNULL, stderr=f, env=env)


def decisions(log: Path, containing: str) -> list[str]:
    """The agent's logged decisions (its cycle's sentences) that contain ``containing``, oldest first."""
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line).get("event", "")
            if isinstance(event, str) and containing in event:
                out.append(event)
    return out


def seconds_unreachable(log: Path) -> int:
    """The longest etcd outage the agent has reported so far (``etcd unreachable for Ns``), in seconds."""
    found = [re.search(r"etcd unreachable for (\d+)s", e) for e in decisions(log, "etcd unreachable for")]
    return max((int(m.group(1)) for m in found if m), default=0)


def discover(etcd_endpoint: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "ELASTICTRAIN_ETCD": etcd_endpoint, "ELASTICTRAIN_JOB": JOB,
                "ELASTICTRAIN_DISCOVER_CACHE": str(cache), "ELASTICTRAIN_DISCOVER_TIMEOUT": "0.5", **env}  # fmt: skip
    return subprocess.run([str(DISCOVER_SH)], env=full_env, capture_output=True, text=True, timeout=10, check=False)


def hosts(etcd: EtcdServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ELASTICTRAIN, "hosts", "--etcd", etcd.endpoint, "--job", JOB, *args],
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip


def states(etcd: EtcdServer) -> dict[str, str]:
    with EtcdRegistry(etcd.endpoint, JOB, timeout_seconds=1.0) as registry:
        return {e.record.host: e.record.state for e in registry.list_hosts().entries}


def lease_of(etcd: EtcdServer, host: str) -> int | None:
    with EtcdRegistry(etcd.endpoint, JOB, timeout_seconds=1.0) as registry:
        entry = registry.get(host)
    return entry.lease_id if entry else None


def test_agent_host_appears_and_disappears_within_ttl_after_sigkill(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    agent = start_agent(procs, etcd_server, "node-a", log=tmp_path / "agent.log")
    wait_until(lambda: states(etcd_server) == {"node-a": "ready"}, 15, what="node-a registered")
    out = discover(etcd_server.endpoint, tmp_path / "cache.json")
    assert (out.returncode, out.stdout) == (0, "node-a:1\n"), out.stderr
    listed = hosts(etcd_server, "list")
    assert listed.returncode == 0 and listed.stdout.split()[:9] == [
        "HOST", "SLOTS", "STATE", "AGE", "PID", "ADDR", "node-a", "1", "ready"]  # fmt: skip

    agent.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: states(etcd_server) == {}, TTL + 2, what="node-a gone after its lease expired")
    assert time.monotonic() - killed_at <= TTL + 1.5


def test_sigterm_drains_at_once_and_the_host_is_gone_after_grace(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    agent = start_agent(procs, etcd_server, "node-a", "--drain-grace", "3", log=tmp_path / "agent.log")
    wait_until(lambda: states(etcd_server) == {"node-a": "ready"}, 15, what="node-a registered")
    agent.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_until(lambda: states(etcd_server) == {"node-a": "draining"}, 1.0, what="node-a draining at once")
    assert discover(etcd_server.endpoint, tmp_path / "cache.json").stdout == "", "draining hosts are not listed"
    wait_until(lambda: states(etcd_server) == {}, 6, what="node-a gone after the grace period")
    assert time.monotonic() - sent >= 2.9
    assert agent.wait(timeout=10) == 0


def test_agent_registers_again_after_etcd_restarts(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    start_agent(procs, etcd_server, "node-a", log=log)
    wait_until(lambda: states(etcd_server) == {"node-a": "ready"}, 15, what="node-a registered")
    first_lease = lease_of(etcd_server, "node-a")

    etcd_server.stop()  # same data dir: etcd keeps the lease and the agent resumes its heartbeats
    wait_until(lambda: seconds_unreachable(log) >= TTL, 30, what="the agent cut off from etcd for a whole TTL")
    etcd_server.start()
    wait_until(lambda: states(etcd_server) == {"node-a": "ready"}, 10, what="node-a listed after the restart")

    etcd_server.stop()  # an empty data dir: the lease is gone and the agent must register again
    etcd_server.start(wipe=True)
    wait_until(lambda: states(etcd_server) == {"node-a": "ready"}, 10, what="node-a registered on a fresh etcd")
    second_lease = lease_of(etcd_server, "node-a")
    assert second_lease not in (first_lease, None)
    # the new lease is kept alive past one TTL: heartbeats on it, TTL + 0.5 s worth of them at 0.5 s each
    refreshed = f"lease {second_lease:x} refreshed"
    wait_until(lambda: len(decisions(log, refreshed)) >= 2 * TTL + 1, 30, what="heartbeats over a whole TTL")
    assert states(etcd_server) == {"node-a": "ready"} and lease_of(etcd_server, "node-a") == second_lease


def test_discover_serves_the_cache_during_an_outage_then_fails(etcd_server: EtcdServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    with EtcdRegistry(etcd_server.endpoint, JOB) as registry:
        lease = registry.grant_lease(60)
        registry.register(HostRecord(host="node-b", slots=2, addr="127.0.0.1"), lease)
        registry.register(HostRecord(host="node-a", slots=1, addr="127.0.0.1"), lease)
    assert discover(etcd_server.endpoint, cache).stdout == "node-a:1\nnode-b:2\n"

    etcd_server.pause()  # a frozen etcd: connections hang rather than fail
    try:
        out = discover(etcd_server.endpoint, cache, ELASTICTRAIN_DISCOVER_STALENESS="2")
        assert (out.returncode, out.stdout) == (0, "node-a:1\nnode-b:2\n")
        assert "serving membership cached" in out.stderr
        wait_until(lambda: discover(etcd_server.endpoint, cache, ELASTICTRAIN_DISCOVER_STALENESS="2").returncode == 1,
                   5, interval=0.5, what="discover.sh to fail once the cache is stale")  # fmt: skip
        out = discover(etcd_server.endpoint, cache, ELASTICTRAIN_DISCOVER_STALENESS="2")
        assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1 and "old" in out.stderr
    finally:
        etcd_server.resume()
    assert discover(etcd_server.endpoint, cache).returncode == 0


def test_garbage_value_is_skipped_with_a_warning(etcd_server: EtcdServer, tmp_path: Path) -> None:
    import asyncio

    import aetcd

    async def put_garbage() -> None:
        host, port = etcd_server.endpoint.removeprefix("http://").split(":")
        async with aetcd.Client(host=host, port=int(port)) as client:
            await client.put(f"/elastictrain/{JOB}/hosts/junk".encode(), b"\x00not json")
            await client.put(f"/elastictrain/{JOB}/hosts/ok".encode(), b'{"slots": 3, "state": "ready"}')

    asyncio.run(put_garbage())
    out = discover(etcd_server.endpoint, tmp_path / "cache.json")
    assert (out.returncode, out.stdout) == (0, "ok:3\n")
    assert "skipping malformed value at '/elastictrain/itest/hosts/junk'" in out.stderr
    listed = hosts(etcd_server, "list")
    assert listed.returncode == 0 and "ok" in listed.stdout and "junk" in listed.stderr


def test_operator_drains_undrains_and_removes_a_host(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    agent = start_agent(procs, etcd_server, "node-a", log=log)
    wait_until(lambda: states(etcd_server) == {"node-a": "ready"}, 15, what="node-a registered")
    assert hosts(etcd_server, "drain", "node-a").stdout == "node-a: ready -> draining\n"
    # a few heartbeats that saw the operator's state, and the agent kept it
    wait_until(lambda: len(decisions(log, "refreshed; host draining")) >= 3, 30, what="heartbeats on the drained host")
    assert states(etcd_server) == {"node-a": "draining"}
    assert hosts(etcd_server, "undrain", "node-a").stdout == "node-a: draining -> ready\n"
    missing = hosts(etcd_server, "drain", "node-x")
    assert (
        missing.returncode == 2
        and missing.stderr.strip() == "elastictrain hosts: error: no host 'node-x' in job 'itest'"
    )
    assert hosts(etcd_server, "remove", "node-a").returncode == 0
    assert agent.wait(timeout=10) == 0, "the agent exits when its host is removed"
    assert states(etcd_server) == {}


def test_an_evicted_host_leaves_discovery_at_once_and_its_agent_readmits_it_after_the_cooldown(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    log, cache = tmp_path / "agent.log", tmp_path / "cache.json"
    start_agent(procs, etcd_server, "node-a", log=log)
    wait_until(lambda: states(etcd_server) == {"node-a": "ready"}, 15, what="node-a registered")
    assert discover(etcd_server.endpoint, cache).stdout == "node-a:1\n"
    lease = lease_of(etcd_server, "node-a")

    with EtcdRegistry(etcd_server.endpoint, JOB, timeout_seconds=1.0) as registry:  # what rank 0 does
        evicted = evict(registry, "node-a", reason="straggler", cooldown_seconds=3, now=time.time(), min_np=0)
        again = evict(registry, "node-a", reason="straggler", cooldown_seconds=3, now=time.time(), min_np=0)
        assert again == evicted
    assert (evicted.state, evicted.drain_reason, evicted.evictions) == ("draining", "straggler", 1)
    out = discover(etcd_server.endpoint, cache)
    assert (out.returncode, out.stdout) == (0, ""), "discover.sh stops listing the host at once"
    listed = hosts(etcd_server, "list")
    assert listed.returncode == 0 and "draining (straggler, readmit in " in listed.stdout, listed.stdout

    wait_until(lambda: discover(etcd_server.endpoint, cache).stdout == "node-a:1\n", 3 + 5, interval=0.2,
               what="node-a listed again after its 3 s cool-down")  # fmt: skip
    assert time.time() >= evicted.drain_until, "not readmitted before the cool-down was over"
    with EtcdRegistry(etcd_server.endpoint, JOB, timeout_seconds=1.0) as registry:
        entry = registry.get("node-a")
    assert entry is not None and entry.lease_id == lease, "the eviction and the readmission kept the lease"
    r = entry.record
    assert (r.state, r.drain_reason, r.drain_until, r.evictions) == ("ready", "", 0.0, 1)
    assert decisions(log, "cool-down of the straggler eviction over; marking host ready (evictions: 1)")


def test_an_eviction_that_would_leave_fewer_ready_slots_than_min_np_is_refused_by_etcd(
    etcd_server: EtcdServer,
) -> None:
    """3 hosts x 1 slot, min_np 2, node-c draining on a spot notice: evicting node-a is refused and writes nothing;
    with node-c back, the conditional write over the three keys goes through."""
    with EtcdRegistry(etcd_server.endpoint, JOB, timeout_seconds=1.0) as registry:
        lease = registry.grant_lease(30)
        for host in ("node-a", "node-b", "node-c"):
            assert registry.register(HostRecord(host=host, slots=1, addr="127.0.0.1"), lease)
        set_state(registry, "node-c", "draining")
        with pytest.raises(BelowMinNp, match="would leave 1 ready slot < min_np 2"):
            evict(registry, "node-a", reason="straggler", cooldown_seconds=30, now=time.time(), min_np=2)
        assert states(etcd_server) == {"node-a": "ready", "node-b": "ready", "node-c": "draining"}
        set_state(registry, "node-c", "ready")
        evicted = evict(registry, "node-a", reason="straggler", cooldown_seconds=30, now=time.time(), min_np=2)
        assert (evicted.state, evicted.evictions) == ("draining", 1)
        assert states(etcd_server) == {"node-a": "draining", "node-b": "ready", "node-c": "ready"}
        registry.revoke_lease(lease)


def test_an_eviction_among_200_ready_hosts_fits_etcds_txn_limit(etcd_server: EtcdServer) -> None:
    """etcd refuses a Txn of more than 128 operations: the eviction's write is conditional on the hosts the floor
    needs, not on every ready host."""
    with EtcdRegistry(etcd_server.endpoint, JOB, timeout_seconds=5.0) as registry:
        lease = registry.grant_lease(60)
        for i in range(200):
            assert registry.register(HostRecord(host=f"node-{i:03d}", slots=1, addr="127.0.0.1"), lease)
        evicted = evict(registry, "node-007", reason="hung", cooldown_seconds=30, now=time.time(), min_np=150)
        assert evicted.state == "draining"
        registry.revoke_lease(lease)


def test_agent_gives_up_with_one_line_when_etcd_is_unreachable_at_startup(tmp_path: Path) -> None:
    from tests.fixtures.procs import free_port

    proc = subprocess.run(
        [ELASTICTRAIN, "agent", "--etcd", f"http://127.0.0.1:{free_port()}", "--job", JOB, "--host", "node-a",
         "--ttl", "3", "--heartbeat", "1", "--request-timeout", "0.5", "--retry-deadline", "3"],
        capture_output=True, text=True, timeout=30, check=False,
        env={**os.environ, "ELASTICTRAIN_LOG_LEVEL": "error"},
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastictrain agent: error: etcd unreachable for"), proc.stderr


def test_bad_timing_flags_exit_2_with_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elastictrain.cli", "agent", "--etcd", "http://127.0.0.1:1", "--job", JOB,
         "--ttl", "3", "--heartbeat", "2"],
        capture_output=True, text=True, timeout=30, check=False, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "elastictrain agent: error: --heartbeat must be > 0 and <= ttl/3 = 1s so that two missed heartbeats "
        "do not expire the lease, got 2"
    ]


def put_raw(etcd: EtcdServer, pairs: dict[bytes, bytes]) -> None:
    import asyncio

    import aetcd

    async def put() -> None:
        host, port = etcd.endpoint.removeprefix("http://").split(":")
        async with aetcd.Client(host=host, port=int(port)) as client:
            for key, value in pairs.items():
                await client.put(key, value)

    asyncio.run(put())


def test_hostile_values_in_etcd_are_skipped_and_never_reach_the_terminal(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    prefix = f"/elastictrain/{JOB}/hosts/".encode()
    put_raw(etcd_server, {
        prefix + b"ok": b'{"slots": 2, "addr": "10.0.0.1", "state": "ready", "registered_at": 1700000000}',
        prefix + b"OK": b'{"slots": 1, "addr": "10.0.0.1", "state": "ready"}',  # the same machine as "ok"
        prefix + b"nan": b'{"slots": 1, "addr": "10.0.0.2", "registered_at": NaN}',
        prefix + b"inf": b'{"slots": 1, "addr": "10.0.0.3", "registered_at": Infinity}',
        prefix + b"ansi": b'{"slots": 1, "addr": "\\u001b[2J\\u001b]0;pwned\\u0007"}',
        prefix + b"huge": b'{"slots": 100000000000000000000000, "addr": "10.0.0.4"}',
        prefix + b"x\ndiscover: fake line": b'{"slots": 1, "addr": "10.0.0.5"}',
    })  # fmt: skip
    out = discover(etcd_server.endpoint, tmp_path / "cache.json")
    assert (out.returncode, out.stdout) == (0, "OK:1\n"), out.stderr
    warnings = out.stderr.splitlines()
    assert len(warnings) == 6 and all(
        w.startswith("discover: warning: skipping ") and w.isprintable() for w in warnings
    )
    listed = hosts(etcd_server, "list")
    assert listed.returncode == 0, listed.stderr
    rows = listed.stdout.splitlines()
    assert [r.split()[0] for r in rows] == ["HOST", "OK"], listed.stdout
    assert "100000000000000000000000" not in listed.stdout and "\x1b" not in listed.stdout + listed.stderr
    assert len(listed.stderr.splitlines()) == 6 and "Traceback" not in listed.stderr


def test_a_poisoned_cache_is_not_served_when_etcd_is_down(etcd_server: EtcdServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    with EtcdRegistry(etcd_server.endpoint, JOB) as registry:
        registry.register(HostRecord(host="node-a", slots=1, addr="127.0.0.1"), registry.grant_lease(60))
    assert discover(etcd_server.endpoint, cache).stdout == "node-a:1\n"
    data = json.loads(cache.read_text())
    data["hosts"].append("x;touch /tmp/PWNED;:1")
    cache.write_text(json.dumps(data))
    etcd_server.stop()
    out = discover(etcd_server.endpoint, cache)
    assert (out.returncode, out.stdout) == (0, "node-a:1\n")
    assert "skipping invalid cached host line 'x;touch /tmp/PWNED;:1'" in out.stderr
