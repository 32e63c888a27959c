"""``recovery``: from a fault to the first completed step at the new size, elastictrain vs stock Horovod elastic.

Each trial is one job on 3 logical hosts (min 1, max 3 workers), run by each contender side by side: the
``elastictrain train`` worker, and the stock Horovod elastic loop (``hvd.elastic.TorchState`` +
``ElasticSampler``, same model and config, :mod:`bench.baseline_worker`). Both use
horovodrun's Gloo timeout of 30 s (its default) and ``elastictrain launch``'s blacklist cooldown.

1. SIGKILL: after step 15 and a seeded delay, the rank-2 worker is SIGKILLed and its host leaves the
   discovery list (the machine is gone). Timed from the kill to the ``reset`` event that rank 0 writes
   at the first completed step at 2 workers.
2. Drain: 10 steps later the rank-1 worker's host leaves the discovery list (a graceful removal, as an
   agent does on a spot notice). Timed from the list change to the first completed step at 1 worker.

elastictrain runs twice, once per ``elastic.rollback`` mode (``commit``: back to the last commit, every 10
steps; ``none``: no rollback), so the three contenders run side by side in one run.

Reported: median / p95 seconds and steps rolled back per failure. Goals: SIGKILL median <= 5 s and drain
median <= 2 s (for the default rollback mode); drain with 0 steps lost; with ``rollback: none`` 0 steps
rolled back per SIGKILL.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.core import BenchContext, Goal, Metric, Result, alternate, summary, threads_per_worker
from bench.sigkill import outcome, sigkill, wait_next_step
from chaos.jobs import HOROVODRUN, STOCK_HOROVODRUN, ElasticJob
from elastictrain.commands import train_command
from elastictrain.config import ElasticConfig
from elastictrain.launcher.hosts import local_logical_hosts

NAME = "recovery"
GOAL_KILL = Goal("<=", 5.0)
GOAL_DRAIN = Goal("<=", 2.0)
GOAL_DRAIN_LOST = Goal("<=", 0.0)
GLOO_TIMEOUT_SECONDS = 30  # horovodrun's default
COOLDOWN = (5, 60)  # elastictrain launch's default --blacklist-cooldown-range
KILL_AFTER_STEP = 15
DEFAULT_ROLLBACK = ElasticConfig().rollback


GOAL_KILL_LOST_NONE = Goal("<=", 0.0)
ROLLBACK_MODES = ("commit", "none")


def job_config(run_dir: Path, rollback: str = DEFAULT_ROLLBACK) -> dict[str, Any]:
    """The default small-CNN job, one long epoch (no epoch end inside a trial), in rollback mode ``rollback``."""
    return {
        "job": "bench-recovery",
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {"kind": "synthetic", "num_samples": 200_000},
        "elastic": {"min_np": 1, "max_np": 3, "rollback": rollback},
    }


def stock_command(cfg_path: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "bench.baseline_worker", "stock-elastic", "--config", str(cfg_path)]


def trial(
    workdir: Path,
    command: Callable[[Path], list[str]],
    hosts: list[str],
    rng: random.Random,
    log: Callable[[str], None],
    rollback: str = DEFAULT_ROLLBACK,
) -> dict[str, Any]:
    """One job: SIGKILL 3 -> 2, then drain 2 -> 1. Returns seconds and lost steps of each."""
    job = ElasticJob(
        workdir,
        job_config(workdir / "run", rollback),
        hosts[:3],
        min_np=1,
        max_np=3,
        gloo_timeout=GLOO_TIMEOUT_SECONDS,
        cooldown=COOLDOWN,
        threads=threads_per_worker(3),
        command=command,
        launcher=STOCK_HOROVODRUN if command is stock_command else HOROVODRUN,
    )
    try:
        job.start()
        job.wait_step(KILL_AFTER_STEP, timeout=240)
        time.sleep(rng.uniform(0.0, 1.0))  # land anywhere between two commits
        victim = job.worker(rank=2)
        host = victim.environ()["HOROVOD_HOSTNAME"]
        t_kill = sigkill([victim])
        job.set_hosts([h for h in job.hosts if h != host])
        reset = wait_next_step(job, t_kill, 4 * GLOO_TIMEOUT_SECONDS, below=3, what="the first step at 2 workers")
        kill = outcome(reset, t_kill)
        log(f"SIGKILL: {kill['seconds']:.2f} s to the first step at 2 workers, {kill['lost_steps']} steps rolled back")
        job.wait_step(reset.step + 10, timeout=120)
        drained = job.worker(rank=1).environ()["HOROVOD_HOSTNAME"]
        t_drain = time.time()
        job.set_hosts([h for h in job.hosts if h != drained])
        reset = wait_next_step(job, t_drain, 4 * GLOO_TIMEOUT_SECONDS, below=2, what="the first step at 1 worker")
        drain = outcome(reset, t_drain)
        log(f"drain: {drain['seconds']:.2f} s to the first step at 1 worker, {drain['lost_steps']} steps rolled back")
        return {"sigkill": kill, "drain": drain}
    finally:
        job.close()


def run(ctx: BenchContext) -> Result:
    hosts = local_logical_hosts()
    if len(hosts) < 3:
        raise RuntimeError(f"needs 3 logical hosts, this machine has {hosts}")
    trials = 1 if ctx.quick else 3
    rng = random.Random(9)
    delays = [random.Random(rng.random()) for _ in range(trials)]  # the same delay for both contenders

    def contender(command: Callable[[Path], list[str]], name: str, rollback: str) -> Callable[[int], dict[str, Any]]:
        return lambda r: trial(
            ctx.scratch(name),
            command,
            hosts,
            random.Random(delays[r].random()),
            lambda m: ctx.progress(f"{name}: {m}"),
            rollback,
        )

    runs = alternate(
        [
            *[
                (f"elastictrain_{mode}", contender(train_command, f"elastictrain_{mode}", mode))
                for mode in ROLLBACK_MODES
            ],
            ("stock_horovod", contender(stock_command, "stock", DEFAULT_ROLLBACK)),
        ],
        trials,
        ctx.progress,
    )
    stats: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        for kind in ("sigkill", "drain"):
            stats[f"{name} {kind}"] = summary([r[kind]["seconds"] for r in rs], "s")
            stats[f"{name} {kind}"]["lost_steps"] = [r[kind]["lost_steps"] for r in rs]
    default = f"elastictrain_{DEFAULT_ROLLBACK}"
    et_kill, et_drain = stats[f"{default} sigkill"], stats[f"{default} drain"]
    drain_lost = max(x or 0 for mode in ROLLBACK_MODES for x in stats[f"elastictrain_{mode} drain"]["lost_steps"])

    def median_lost(mode: str) -> float:
        lost = sorted(x or 0 for x in stats[f"elastictrain_{mode} sigkill"]["lost_steps"])
        return float(lost[len(lost) // 2])

    return Result(
        NAME,
        metrics=[
            Metric(
                "SIGKILL → first step at new size, median",
                et_kill["median"],
                "s",
                GOAL_KILL,
                note=f"rollback {DEFAULT_ROLLBACK} (default); p95 {et_kill['p95']:.2f} s; "
                + "; ".join(
                    f"rollback {m} {stats[f'elastictrain_{m} sigkill']['median']:.2f} s"
                    for m in ROLLBACK_MODES
                    if m != DEFAULT_ROLLBACK
                )
                + f"; stock {stats['stock_horovod sigkill']['median']:.1f} s",
            ),
            Metric(
                "drain → first step at new size, median",
                et_drain["median"],
                "s",
                GOAL_DRAIN,
                note=f"p95 {et_drain['p95']:.2f} s; stock {stats['stock_horovod drain']['median']:.1f} s",
            ),
            Metric("steps rolled back per drain (max)", float(drain_lost), "steps", GOAL_DRAIN_LOST),
            Metric(
                "steps rolled back per SIGKILL, median, rollback commit",
                median_lost("commit"),
                "steps",
                note="commit every 10 steps",
            ),
            Metric(
                "steps rolled back per SIGKILL, median, rollback none",
                median_lost("none"),
                "steps",
                GOAL_KILL_LOST_NONE,
                note=f"max {max(x or 0 for x in stats['elastictrain_none sigkill']['lost_steps'])}",
            ),
        ],
        contenders={k: v for k, v in stats.items()},
        detail={"trials": trials, "gloo_timeout_seconds": GLOO_TIMEOUT_SECONDS, "runs": runs},
    )
