"""``signals``: what the workers' signals cost in etcd (:mod:`elastictrain.engine.health.etcd_signals`).

Starts a real etcd (free loopback ports, a temporary data dir, killed by pid at the end) and runs ``workers``
:class:`~elastictrain.engine.health.etcd_signals.EtcdSignals` in this process, each beating once a second as a
worker's watchdog does, for two phases: *training* (beats only, as between hangs) and *judging* (every worker also
asks for the ring's beats every 0.1 s, as an overdue step's watchdog does). Reported: the cost of ``write_beat`` for
the caller (the training side; the file transport's in the same run), the round trip of a beat's Put on the signals
thread, and etcd operations per second per worker in each phase (goal: <= 10).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench.core import BenchContext, Goal, Metric, Result
from discovery.kv import EtcdKeyValue
from elastictrain.engine.health.etcd_signals import EtcdSignals, signals_prefix
from elastictrain.engine.health.signals import WAITING, Beat, FileSignals, Member
from elastictrain.launcher.etcd import EtcdServer

NAME = "signals"
OPS_GOAL = Goal("<=", 10.0)
JOB = "bench-signals"


class TimedStore(EtcdKeyValue):
    """The etcd store, timing each Put of a heartbeat."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.put_seconds: list[float] = []

    def put(self, key: str, value: bytes, lease_id: int = 0) -> None:
        t0 = time.perf_counter()
        super().put(key, value, lease_id)
        if "/beats/" in key:
            self.put_seconds.append(time.perf_counter() - t0)


def run(ctx: BenchContext) -> Result:
    workers, seconds = (4, 10.0) if ctx.quick else (8, 30.0)
    root = ctx.scratch("etcd")
    server = EtcdServer(root / "data", root / "etcd.log")
    ctx.progress(f"starting etcd on {server.endpoint}; {workers} workers beating for 2 x {seconds:g} s")
    try:
        server.start()
        r = bench_signals(server.endpoint, workers=workers, seconds=seconds, folder=ctx.scratch("files"))
    finally:
        server.kill()
    ctx.progress(
        f"write_beat {r['write_beat_us_median']:.1f} us (files {r['files_write_beat_us_median']:.1f} us); "
        f"Put {r['put_ms_median']:.2f} ms; ops/s/worker {r['ops_per_s_training']:.2f} training, "
        f"{r['ops_per_s_judging']:.2f} judging"
    )
    return Result(
        NAME,
        metrics=[
            Metric("write_beat for the caller (etcd)", r["write_beat_us_median"], "us", note="median"),
            Metric("write_beat for the caller (files)", r["files_write_beat_us_median"], "us", note="median"),
            Metric("a beat's Put on the signals thread", r["put_ms_median"], "ms", note=f"p95 {r['put_ms_p95']:.2f}"),
            Metric("etcd ops/s per worker, training", r["ops_per_s_training"], "ops/s", OPS_GOAL),
            Metric("etcd ops/s per worker, judging", r["ops_per_s_judging"], "ops/s", OPS_GOAL),
        ],
        detail=dict(r),
    )


def _beat(host: str, ts: float) -> Beat:
    return Beat(pid=os.getpid(), host=host, slot=0, boot_id="b", created=1.0, ts=ts, phase=WAITING, since=ts, steps=1)


def bench_signals(endpoint: str, *, workers: int, seconds: float, folder: Path) -> dict[str, Any]:
    """Run ``workers`` EtcdSignals against ``endpoint`` for ``seconds`` beating, then ``seconds`` beating and judging;
    also time FileSignals' ``write_beat`` in ``folder``. Returns the figures named in the module."""
    members = [Member(i, f"w{i}", 0, os.getpid()) for i in range(workers)]
    stores = [TimedStore(endpoint, JOB, timeout_seconds=2.0) for _ in range(workers)]
    sigs = [EtcdSignals(s, signals_prefix("/elastictrain", JOB)).start() for s in stores]
    files = FileSignals.in_folder(folder)
    caller: list[float] = []
    file_caller: list[float] = []
    ops: dict[str, float] = {}
    try:
        for phase in ("training", "judging"):
            before = sum(sum(v for k, v in s.ops.items() if k != "errors") for s in sigs)
            stop = threading.Event()
            judges = [
                threading.Thread(target=_judge, args=(s, members, stop), daemon=True)
                for s in (sigs if phase == "judging" else [])
            ]
            for t in judges:
                t.start()
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                now = time.time()
                for i, s in enumerate(sigs):
                    t0 = time.perf_counter()
                    s.write_beat(_beat(f"w{i}", now))
                    caller.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    files.write_beat(_beat(f"w{i}", now))
                    file_caller.append(time.perf_counter() - t0)
                time.sleep(1.0)  # pacing: a worker beats once a second
            stop.set()
            for t in judges:
                t.join(5)
            after = sum(sum(v for k, v in s.ops.items() if k != "errors") for s in sigs)
            ops[phase] = (after - before) / seconds / workers
        seen = sigs[0].read_beats(members)
    finally:
        for s in sigs:
            s.stop()
    puts = sorted(p for s in stores for p in s.put_seconds)
    return {
        "workers": workers,
        "seconds_per_phase": seconds,
        "write_beat_us_median": statistics.median(caller) * 1e6,
        "write_beat_us_p99": sorted(caller)[int(0.99 * (len(caller) - 1))] * 1e6,
        "files_write_beat_us_median": statistics.median(file_caller) * 1e6,
        "put_ms_median": statistics.median(puts) * 1e3,
        "put_ms_p95": puts[int(0.95 * (len(puts) - 1))] * 1e3,
        "beats_put": len(puts),
        "ops_per_s_training": ops["training"],
        "ops_per_s_judging": ops["judging"],
        "beats_seen_by_a_judge": len(seen),
        "errors": sum(s.ops["errors"] for s in sigs),
    }


def _judge(s: EtcdSignals, members: list[Member], stop: threading.Event) -> None:
    while not stop.wait(0.1):
        s.read_beats(members)
        s.last_failure()
