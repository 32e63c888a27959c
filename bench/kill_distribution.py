"""``kill_distribution``: recovery time over many SIGKILLs of rank 0, other ranks and pairs, in one 4-worker job.

One elastic job on 4 logical hosts (min 2, max 4 workers, Gloo timeout 60 s as ``elastictrain launch`` sets
it). The hosts stay in discovery, as with ``launch``'s agents when only a worker process dies: Horovod
blacklists a dead worker's host for its cooldown (1-2 s here) and then starts a worker there again. Each
fault waits until the job is back at 4 workers and 5 steps further, then a seeded delay, then SIGKILLs one
of (in turn): the current rank 0; another worker; rank 0 and another worker at the same instant; two other
workers at the same instant. Timed from the kill to the ``reset`` event that rank 0 writes at the first
completed step after it.

Reported: n, median, p95, max seconds. Goals: p95 <= 2 s, max <= 5 s.
``python -m bench.kill_distribution [--kills N] [--seed S]`` runs it alone and prints one line per
kill and the summary; ``python -m bench --only kill_distribution`` runs it with the other measurements.
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench.core import BenchContext, BenchError, Goal, Metric, Result, summary
from bench.sigkill import outcome, sigkill, wait_next_step
from chaos.jobs import ElasticJob
from chaos.procs import wait_until
from elastictrain.cliutil import OneLineParser
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir import layout
from elastictrain.rundir.events import Reset, Start

NAME = "kill_distribution"
GOAL_P95 = Goal("<=", 2.0)
GOAL_MAX = Goal("<=", 5.0)
GLOO_TIMEOUT_SECONDS = 60  # elastictrain launch's default
WORKERS = 4
KINDS = ("rank 0", "other", "rank 0 + other", "two others")


def job_config(run_dir: Path) -> dict[str, Any]:
    """The small test CNN, an ImageNet-sized epoch (far longer than the measurement), frequent commits, the
    ledger on (it names the process that holds rank 0 now)."""
    return {
        "job": "bench-kills",
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {"kind": "synthetic", "image_size": 16, "batch_size": 16, "num_samples": 1_281_167, "augment": False},
        "training": {"epochs": 1, "log_every_steps": 20, "seed": 5},
        "elastic": {"commit_every_steps": 5, "min_np": 2, "max_np": WORKERS},
        "checkpoint": {"enabled": False},
        "tracking": {"mlflow": False, "progress_bar": False},
        "audit": {"sample_ledger": True},
    }


def current_rank0(job: ElasticJob) -> psutil.Process:
    """The worker that holds rank 0 now: the owner of the newest ledger file (rank 0 opens one when it first
    holds rank 0), else the one started as rank 0."""
    workers = {p.pid: p for p in job.workers()}
    ledgers = sorted((job.run_dir / layout.LEDGER).glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    if ledgers:
        pid = ledgers[-1].stem.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) in workers:
            return workers[int(pid)]
    return job.worker(rank=0)


def _size_now(job: ElasticJob) -> int | None:
    for e in reversed(job.events()):
        if isinstance(e, Reset) and e.new_size is not None:
            return e.new_size
        if isinstance(e, Reset | Start):
            return e.world_size
    return None


def wait_full(job: ElasticJob, timeout: float = 180) -> int:
    """Until the job runs at :data:`WORKERS` workers and has made 5 steps since; returns that step."""
    wait_until(lambda: _size_now(job) == WORKERS and len(job.workers()) == WORKERS, timeout, what="4 workers")
    step = job.step() + 5
    job.wait_step(step, timeout=timeout)
    return step


def kill_once(job: ElasticJob, kind: str, rng: random.Random) -> dict[str, Any]:
    """SIGKILL the workers of ``kind`` back to back; the pause to the next step (:mod:`bench.sigkill`)."""
    rank0 = current_rank0(job)
    others = [p for p in job.workers() if p.pid != rank0.pid]
    rng.shuffle(others)
    victims = {
        "rank 0": [rank0],
        "other": others[:1],
        "rank 0 + other": [rank0, *others[:1]],
        "two others": others[:2],
    }[kind]
    t_kill = sigkill(victims)
    reset = wait_next_step(job, t_kill, 4 * GLOO_TIMEOUT_SECONDS, below=WORKERS, what="a reset")
    return {"kind": kind, **outcome(reset, t_kill)}


def measure(workdir: Path, kills: int, seed: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    hosts = local_logical_hosts()
    if len(hosts) < WORKERS:
        raise BenchError(f"needs {WORKERS} logical hosts, this machine has {hosts}")
    rng = random.Random(seed)
    job = ElasticJob(
        workdir,
        job_config(workdir / "run"),
        hosts[:WORKERS],
        min_np=2,
        max_np=WORKERS,
        gloo_timeout=GLOO_TIMEOUT_SECONDS,
        cooldown=(1, 2),
    )
    out: list[dict[str, Any]] = []
    try:
        job.start()
        for i in range(kills):
            wait_full(job)
            time.sleep(rng.uniform(0.0, 0.5))  # land anywhere in a step or a commit (not a synchronization)
            r = kill_once(job, KINDS[i % len(KINDS)], rng)
            out.append(r)
            log(f"kill {i + 1}/{kills} ({r['kind']}): {r['seconds']:.2f} s to the next step, {r['lost_steps']} lost")
    finally:
        job.close()
    return out


def run(ctx: BenchContext) -> Result:
    kills = 8 if ctx.quick else 32
    runs = measure(ctx.scratch(NAME), kills, seed=11, log=ctx.progress)
    s = summary([r["seconds"] for r in runs], "s")
    by_kind = {k: summary([r["seconds"] for r in runs if r["kind"] == k], "s") for k in KINDS}
    return Result(
        NAME,
        metrics=[
            Metric("SIGKILL → next step, p95", s["p95"], "s", GOAL_P95, note=f"n {s['n']}, median {s['median']:.2f} s"),
            Metric("SIGKILL → next step, max", s["max"], "s", GOAL_MAX),
        ],
        contenders={"all": s, **by_kind},
        detail={"kills": kills, "gloo_timeout_seconds": GLOO_TIMEOUT_SECONDS, "runs": runs},
    )


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m bench.kill_distribution", description=__doc__)
    p.add_argument("--kills", type=int, default=32, help="number of faults (default 32)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--workdir", help="keep the job's files here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    if args.kills < 1:
        p.error(f"--kills must be >= 1, got {args.kills}")
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kill-distribution-")))
        runs = measure(workdir, args.kills, args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    s = summary([r["seconds"] for r in runs], "s")
    print(f"n {s['n']}  median {s['median']:.2f} s  p95 {s['p95']:.2f} s  max {s['max']:.2f} s")
    for kind in KINDS:
        k = summary([r["seconds"] for r in runs if r["kind"] == kind], "s")
        if k["n"]:
            print(f"  {kind}: n {k['n']}  median {k['median']:.2f} s  max {k['max']:.2f} s")
    return 0 if s["p95"] <= 2.0 and s["max"] <= 5.0 else 1


if __name__ == "__main__":
    sys.exit(main())
