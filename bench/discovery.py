"""``discovery``: wall time per ``discover.sh`` call against a live etcd with 32 hosts registered.

Starts a real etcd (free loopback ports, a temporary data dir, killed by pid at the end), registers the hosts
under one lease and times ``discover.sh`` (:func:`bench_discover`). Goal: median <= 100 ms.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.core import BenchContext, Goal, Metric, Result
from discovery.record import HostRecord
from discovery.registry import EtcdRegistry
from elastictrain import envnames
from elastictrain.commands import DISCOVER_SCRIPT
from elastictrain.launcher.etcd import EtcdServer

NAME = "discovery"
GOAL = Goal("<=", 100.0)


def run(ctx: BenchContext) -> Result:
    root = ctx.scratch("etcd")
    server = EtcdServer(root / "data", root / "etcd.log")
    ctx.progress(f"starting etcd on {server.endpoint}")
    try:
        server.start()
        calls = 30
        r = bench_discover(server.endpoint, "bench", n_hosts=32, calls=calls)
    finally:
        server.kill()
    ctx.progress(f"discover.sh: median {r['median_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms over {calls} calls")
    return Result(
        NAME,
        metrics=[Metric("discover.sh median, 32 hosts", r["median_ms"], "ms", GOAL, note=f"p95 {r['p95_ms']:.0f} ms")],
        contenders={"discover.sh": {"median": r["median_ms"], "p95": r["p95_ms"], "unit": "ms"}},
        detail=dict(r),
    )


def bench_discover(endpoint: str, job: str, n_hosts: int = 32, calls: int = 30) -> dict[str, float | int]:
    """Register ``n_hosts`` hosts under one lease, time ``calls`` runs of discover.sh, then clean up.

    Returns ``median_ms``, ``p95_ms``, ``min_ms``, ``max_ms``, ``calls`` and ``n_hosts``; raises
    ``RuntimeError`` when a call fails or does not list every host.
    """
    if n_hosts < 1 or calls < 1:
        raise ValueError(f"n_hosts and calls must be >= 1, got {n_hosts} and {calls}")
    registry = EtcdRegistry(endpoint, job)
    lease_id = registry.grant_lease(max(60, calls * 2))
    try:
        for i in range(n_hosts):
            registry.register(HostRecord(host=f"bench-{i:03d}", slots=1, addr="127.0.0.1"), lease_id)
        with tempfile.TemporaryDirectory(prefix="elastictrain-bench-") as tmp:
            env = {
                **os.environ,
                envnames.ETCD: endpoint,
                envnames.JOB: job,
                envnames.DISCOVER_CACHE: str(Path(tmp) / "cache.json"),
            }
            times_ms = []
            for _ in range(calls):
                t0 = time.perf_counter()
                proc = subprocess.run([str(DISCOVER_SCRIPT)], env=env, capture_output=True, text=True, check=False)
                times_ms.append((time.perf_counter() - t0) * 1000.0)
                if proc.returncode != 0 or len(proc.stdout.splitlines()) < n_hosts:
                    raise RuntimeError(f"discover.sh failed (exit {proc.returncode}): {proc.stderr.strip()}")
    finally:
        registry.revoke_lease(lease_id)
        registry.close()
    times_ms.sort()
    return {
        "median_ms": statistics.median(times_ms),
        "p95_ms": times_ms[min(len(times_ms) - 1, round(0.95 * (len(times_ms) - 1)))],
        "min_ms": times_ms[0],
        "max_ms": times_ms[-1],
        "calls": calls,
        "n_hosts": n_hosts,
    }
