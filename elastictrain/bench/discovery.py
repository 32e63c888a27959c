"""``discovery``: wall time per ``discover.sh`` call against a live etcd with 32 hosts registered.

Starts a real etcd (free loopback ports, a temporary data dir, killed by pid at the end) and calls
:func:`discovery.bench.bench_discover`. Goal: median <= 100 ms.
"""

from __future__ import annotations

from elastictrain.bench.core import BenchContext, Goal, Metric, Result
from elastictrain.launcher.etcd import EtcdServer

NAME = "discovery"
GOAL = Goal("<=", 100.0)


def run(ctx: BenchContext) -> Result:
    from discovery.bench import bench_discover

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
