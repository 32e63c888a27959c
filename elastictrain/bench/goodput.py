"""``goodput``: productive step time ÷ wall time under a seeded SIGKILL of a worker every 60 s for 10 minutes
(``--quick``: every 30 s for 2 minutes).

One ``elastictrain train`` job on 3 logical hosts (min 1, max 3 workers, Gloo timeout 30 s,
``elastictrain launch``'s blacklist cooldown 5-60 s). A killed worker's host stays listed, as when
only the process died: Horovod blacklists it, and takes it back after the cooldown (a scale-up, whose
rendezvous waits for the new worker to start). The victim's rank is drawn from a seeded RNG.

Two computations over the window from the first ``start`` event:

* ``elastictrain.report.summarize`` of ``events.jsonl``: kept step time (docs/events.md) ÷ the window.
  (``summarize`` alone divides by the time to the last event, which leaves out a final stretch in
  which the job had not recovered yet; its own ratio is kept in the detail.)
* this benchmark's own bookkeeping: window - the time from each kill to the next ``reset`` - the
  recovery time of every other reset (scale-ups) - rolled-back steps x the median step time, ÷ window.
  It counts commits, metric logs and epoch ends as productive, and a kill not recovered by the end of
  the window as down until the end.

Goal: >= 0.85.
"""

from __future__ import annotations

import random
import signal
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastictrain._testing.jobs import ElasticJob
from elastictrain.bench.core import BenchContext, BenchError, Goal, Metric, Result, threads_per_worker
from elastictrain.events import Event, Metrics, Reset, Start, of_kind
from elastictrain.launcher.hosts import local_logical_hosts

NAME = "goodput"
GOAL = Goal(">=", 0.85)
SEED = 6


def plan(quick: bool) -> tuple[float, float]:
    """(window seconds, seconds between kills)."""
    return (120.0, 30.0) if quick else (600.0, 60.0)


def job_config(run_dir: Path) -> dict[str, Any]:
    """The default small-CNN job with long epochs (about a minute each here) so that it outlasts the window."""
    return {
        "job": "bench-goodput",
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {"kind": "synthetic", "num_samples": 65_536},
        "training": {"epochs": 1000},
        "elastic": {"min_np": 1, "max_np": 3},
    }


def own_goodput(events: Sequence[Event], kills: list[float], t0: float, t_end: float) -> dict[str, Any]:
    """Goodput from the kill times and the ``reset`` events (see the module docstring)."""
    resets = [e for e in of_kind(events, Reset) if t0 <= e.ts <= t_end]
    steps = [e.step_seconds for e in of_kind(events, Metrics) if t0 <= e.ts <= t_end and e.step_seconds is not None]
    step_s = statistics.median(steps) if steps else 0.0
    down = 0.0
    used: set[int] = set()
    for k in kills:
        nxt = next((i for i, e in enumerate(resets) if e.ts >= k and i not in used), None)
        if nxt is None:
            down += t_end - k  # not recovered within the window
            continue
        used.add(nxt)
        down += resets[nxt].ts - k
    for i, e in enumerate(resets):
        if i not in used:
            down += e.recovery_seconds or 0.0
    lost = sum(e.lost_steps or 0 for e in resets)
    wall = t_end - t0
    return {
        "goodput": max(0.0, wall - down - lost * step_s) / wall,
        "downtime_seconds": down,
        "lost_steps": lost,
        "step_seconds_median": step_s,
        "resets": len(resets),
        "wall_seconds": wall,
    }


def run(ctx: BenchContext) -> Result:
    from elastictrain.report import summarize

    window, every = plan(ctx.quick)
    hosts = local_logical_hosts()
    if len(hosts) < 3:
        raise BenchError(f"needs 3 logical hosts, this machine has {hosts}")
    rng = random.Random(SEED)
    workdir = ctx.scratch("goodput")
    job = ElasticJob(
        workdir,
        job_config(workdir / "run"),
        hosts[:3],
        min_np=1,
        max_np=3,
        gloo_timeout=30,
        cooldown=(5, 60),
        threads=threads_per_worker(3),
    )
    kills: list[dict[str, Any]] = []
    try:
        job.start()
        start = job.wait_event(Start, lambda e: True, 240, what="the first start event")
        t0 = start.ts
        t_end = t0 + window
        ctx.progress(f"job started; {window:.0f} s window, a SIGKILL every {every:.0f} s")
        next_kill = t0 + every
        while time.time() < t_end:
            if time.time() >= next_kill and next_kill < t_end:
                workers = job.workers()
                if workers:
                    victim = rng.randrange(len(workers))
                    ranks = sorted(int(p.environ()["HOROVOD_RANK"]) for p in workers)
                    rank = ranks[victim]
                    host, ts = job.kill_worker(rank=rank, sig=signal.SIGKILL)
                    kills.append({"ts": ts, "rank": rank, "host": host, "world_size": len(workers)})
                    ctx.progress(f"SIGKILL rank {rank} on {host} at +{ts - t0:.0f} s ({len(workers)} workers)")
                next_kill += every
            if job.proc is not None and job.proc.poll() is not None:
                raise BenchError(f"the job ended during the window (exit {job.proc.returncode}):\n{job.tail(20)}")
            time.sleep(0.2)
        events = [e for e in job.events() if e.ts <= t_end]
    finally:
        job.close()
    s = summarize(events)
    kept = float(s["productive_seconds"]) / window
    own = own_goodput(events, [k["ts"] for k in kills], t0, t_end)
    ctx.progress(f"goodput {kept:.3f} (report.summarize kept step time), {own['goodput']:.3f} (own bookkeeping)")
    return Result(
        NAME,
        metrics=[
            Metric("goodput (report.summarize kept step time)", kept, "", GOAL, note=f"{len(kills)} kills"),
            Metric("goodput (own bookkeeping)", own["goodput"], "", GOAL),
        ],
        contenders={
            "report.summarize": {"median": kept, "unit": ""},
            "own bookkeeping": {"median": own["goodput"], "unit": ""},
        },
        detail={
            "window_seconds": window,
            "kill_every_seconds": every,
            "seed": SEED,
            "kills": [{**k, "t": k["ts"] - t0} for k in kills],
            "summarize_goodput_to_last_event": s["goodput"],
            "summary": {k: v for k, v in s.items() if k not in ("marks",)},
            "own": own,
        },
    )
