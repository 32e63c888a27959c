"""``scale_up``: the pause that running workers see when a host joins (2 -> 3 workers), cold against hot join.

Each trial is one job on 3 logical hosts (min 2, max 3 workers), started on 2; after step 15 the third
host is listed. Cold: horovodrun starts ``elastictrain train`` there (an interpreter, torch, Horovod, the
task, the data). Hot: it starts the zygote's client, and the host's warm zygote (started before the job, as
``elastictrain agent --warm-config`` does) forks the worker. The two run alternately in one run.

Measured: the ``recovery_seconds`` of the reset to 3 workers that rank 0 writes, from the host notice to the
first completed step at 3 workers. The running workers stop at their first step boundary after the notice,
so this slightly over-states their pause. Goal: hot median <= 1.5 s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.core import BenchContext, Goal, Metric, Result, alternate, summary, threads_per_worker
from bench.hotjoin import hot_command, warm_zygotes
from chaos.jobs import ElasticJob
from elastictrain import envnames
from elastictrain.commands import train_command
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Reset

NAME = "scale_up"
GOAL_HOT = Goal("<=", 1.5)
SCALE_AFTER_STEP = 15
READY_TIMEOUT_SECONDS = 120


def job_config(run_dir: Path, job: str) -> dict[str, Any]:
    """The default small-CNN job, one long epoch (no epoch end inside a trial)."""
    return {
        "job": job,
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {"kind": "synthetic", "num_samples": 200_000},
        "elastic": {"min_np": 2, "max_np": 3},
        "tracking": {"mlflow": False, "progress_bar": False},
    }


def trial(workdir: Path, hot: bool, hosts: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """One job: 2 workers, then the third host is listed. Returns the pause and the wall seconds."""
    job_name = f"bench-scale-up-{'hot' if hot else 'cold'}"
    config = job_config(workdir / "run", job_name)
    with contextlib.ExitStack() as stack:
        zygotes = stack.enter_context(warm_zygotes(workdir / "job.yaml", config, hosts[:3])) if hot else None
        job = ElasticJob(
            workdir,
            config,
            hosts[:2],
            min_np=2,
            max_np=3,
            threads=threads_per_worker(3),
            command=hot_command if hot else train_command,
            extra_env=zygotes.env if zygotes else {envnames.JOB: job_name},
        )
        stack.callback(job.close)  # before the zygotes are killed
        job.start()
        job.wait_step(SCALE_AFTER_STEP, timeout=240)
        t_listed = time.time()
        job.set_hosts(hosts[:3])
        reset = job.wait_event(
            Reset,
            lambda e: e.ts >= t_listed and e.new_size == 3,
            timeout=180,
            what="the first step at 3 workers",
        )
        out = {"pause": reset.recovery_seconds, "wall": reset.ts - t_listed}
        log(f"{'hot' if hot else 'cold'}: pause {out['pause']:.2f} s ({out['wall']:.2f} s from the listing)")
        return out


def run(ctx: BenchContext) -> Result:
    hosts = local_logical_hosts()
    if len(hosts) < 3:
        raise RuntimeError(f"needs 3 logical hosts, this machine has {hosts}")
    trials = 2 if ctx.quick else 5

    def contender(hot: bool) -> Callable[[int], dict[str, Any]]:
        name = "hot" if hot else "cold"
        return lambda r: trial(ctx.scratch(f"{name}-{r}"), hot, hosts, lambda m: ctx.progress(m))

    runs = alternate([("cold", contender(False)), ("hot", contender(True))], trials, ctx.progress)
    stats = {name: summary([r["pause"] for r in rs], "s") for name, rs in runs.items()}
    hot, cold = stats["hot"], stats["cold"]
    return Result(
        NAME,
        metrics=[
            Metric(
                "scale-up pause 2 → 3, hot join, median",
                hot["median"],
                "s",
                GOAL_HOT,
                note=f"p95 {hot['p95']:.2f} s; cold median {cold['median']:.2f} s, p95 {cold['p95']:.2f} s",
            )
        ],
        contenders=stats,
        detail={"trials": trials, "runs": runs},
    )
