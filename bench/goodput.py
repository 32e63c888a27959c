"""``goodput``: productive step time ÷ wall time under a seeded SIGKILL of a worker every 60 s for 10 minutes
(``--quick``: every 30 s for 2 minutes), with hot join and recovery without rollback.

One ``elastictrain train`` job on 3 logical hosts (min 1, max 3 workers, Gloo timeout 30 s,
``elastictrain launch``'s blacklist cooldown 5-60 s), with ``elastic: {rollback: none}`` and a warm zygote
per host (:mod:`bench.hotjoin`, as ``elastictrain agent --warm-config`` keeps one): horovodrun
starts the zygote's client, and the zygote forks the worker. A killed worker's host stays listed, as when
only the process died: Horovod blacklists it, and takes it back after the cooldown (a scale-up, whose
rendezvous waits for a worker forked from the still-warm zygote). The victim is drawn from a seeded RNG
among the running workers, in the order of their launch ranks; the process killed is the training process
the zygote forked (its client then dies of the same signal, as horovodrun would see a cold worker die),
never a zygote.

Two computations over the window from the first ``start`` event:

* ``elastictrain.rundir.report.summarize`` of ``events.jsonl``: kept step time (docs/events.md) ÷ the window.
  (``summarize`` alone divides by the time to the last event, which leaves out a final stretch in
  which the job had not recovered yet; its own ratio is kept in the detail.)
* this benchmark's own bookkeeping: window - the time from each kill to the next ``reset`` - the
  recovery time of every other reset (scale-ups) - rolled-back steps x the median step time, ÷ window.
  It counts commits, metric logs and epoch ends as productive, and a kill not recovered by the end of
  the window as down until the end. Its detail lists each kill's and each scale-up's downtime.

Goal: >= 0.95.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.core import BenchContext, BenchError, Goal, Metric, Result, threads_per_worker
from bench.hotjoin import WarmZygotes, hot_command, warm_zygotes
from bench.sigkill import next_step, sigkill, training_processes
from chaos.jobs import ElasticJob
from chaos.procs import HarnessError
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Event, Metrics, Reset, Start, of_kind

NAME = "goodput"
GOAL = Goal(">=", 0.95)
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
        "elastic": {"min_np": 1, "max_np": 3, "rollback": "none"},
    }


def own_goodput(events: Sequence[Event], kills: list[float], t0: float, t_end: float) -> dict[str, Any]:
    """Goodput from the kill times and the ``reset`` events (see the module docstring), with the downtime of
    each kill (None: not recovered within the window) and of each other reset (scale-ups), at ``t`` seconds
    into the window."""
    resets = [e for e in of_kind(events, Reset) if t0 <= e.ts <= t_end]
    steps = [e.step_seconds for e in of_kind(events, Metrics) if t0 <= e.ts <= t_end and e.step_seconds is not None]
    step_s = statistics.median(steps) if steps else 0.0
    down = 0.0
    used: set[int] = set()
    per_kill: list[dict[str, Any]] = []
    for k in kills:
        nxt = next_step(resets, k, taken=used)
        if nxt is None:
            down += t_end - k  # not recovered within the window
            per_kill.append({"t": k - t0, "down_seconds": None, "lost_steps": None})
            continue
        used.add(nxt)
        down += resets[nxt].ts - k
        per_kill.append({"t": k - t0, "down_seconds": resets[nxt].ts - k, "lost_steps": resets[nxt].lost_steps})
    others: list[dict[str, Any]] = []
    for i, e in enumerate(resets):
        if i not in used:
            down += e.recovery_seconds or 0.0
            others.append({"t": e.ts - t0, "down_seconds": e.recovery_seconds, "sizes": [e.old_size, e.new_size]})
    lost = sum(e.lost_steps or 0 for e in resets)
    wall = t_end - t0
    return {
        "goodput": max(0.0, wall - down - lost * step_s) / wall,
        "downtime_seconds": down,
        "lost_steps": lost,
        "step_seconds_median": step_s,
        "resets": len(resets),
        "wall_seconds": wall,
        "kills": per_kill,
        "other_resets": others,
    }


def victim_rank(rng: random.Random, ranks: Sequence[int]) -> int:
    """The rank to kill: a seeded draw among the running ranks (in rank order, whatever order they were found in).

    The ranks are those Horovod gave the processes at their start (``HOROVOD_RANK``); a reset renumbers the
    ranks inside the job, so a launch rank is not always the current rank (launch rank 1 may be rank 0 now).
    """
    return sorted(ranks)[rng.randrange(len(ranks))]


def kill_rank(job: ElasticJob, zygotes: WarmZygotes, rank: int) -> dict[str, Any]:
    """SIGKILL the training process of ``rank``: the worker its host's zygote forked, or, where the client
    started it cold (no answer from the zygote), the process horovodrun started. Never a zygote."""
    started = job.worker(rank=rank)  # a zygote's client (or a cold worker): the process horovodrun started
    host = started.environ()["HOROVOD_HOSTNAME"]
    procs = training_processes(started, zygotes)
    t = sigkill(procs)
    return {"ts": t, "rank": rank, "host": host, "killed": "cold worker" if procs == [started] else "forked worker"}


def kill_one(job: ElasticJob, zygotes: WarmZygotes, rng: random.Random) -> dict[str, Any] | None:
    """Kill a drawn rank (:func:`kill_rank`); None when no worker runs, or one ended while it was looked at
    (the caller tries again at its next poll)."""
    try:
        ranks = [int(p.environ()["HOROVOD_RANK"]) for p in job.workers()]
        return {**kill_rank(job, zygotes, victim_rank(rng, ranks)), "world_size": len(ranks)} if ranks else None
    except (psutil.NoSuchProcess, HarnessError):  # a worker ended while it was looked at
        return None


def run(ctx: BenchContext) -> Result:
    from elastictrain.rundir.report import summarize

    window, every = plan(ctx.quick)
    hosts = local_logical_hosts()
    if len(hosts) < 3:
        raise BenchError(f"needs 3 logical hosts, this machine has {hosts}")
    rng = random.Random(SEED)
    workdir = ctx.scratch("goodput")
    config = job_config(workdir / "run")
    kills: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        zygotes = stack.enter_context(warm_zygotes(workdir / "job.yaml", config, hosts[:3]))
        job = ElasticJob(
            workdir,
            config,
            hosts[:3],
            min_np=1,
            max_np=3,
            gloo_timeout=30,
            cooldown=(5, 60),
            threads=threads_per_worker(3),
            command=hot_command,
            extra_env=zygotes.env,
        )
        stack.callback(job.close)  # before the zygotes are killed
        job.start()
        start = job.wait_event(Start, lambda e: True, 240, what="the first start event")
        t0 = start.ts
        t_end = t0 + window
        ctx.progress(f"job started (hot join, rollback none); {window:.0f} s window, a SIGKILL every {every:.0f} s")
        next_kill = t0 + every
        while time.time() < t_end:
            if time.time() >= next_kill and next_kill < t_end:
                kill = kill_one(job, zygotes, rng)
                if kill is not None:
                    kills.append(kill)
                    ctx.progress(
                        f"SIGKILL launch rank {kill['rank']} ({kill['killed']}) on {kill['host']}"
                        f" at +{kill['ts'] - t0:.0f} s"
                        f" ({kill['world_size']} workers)"
                    )
                    next_kill = max(next_kill + every, kill["ts"] + every)  # a late kill is no reason for two at once
            if job.proc is not None and job.proc.poll() is not None:
                raise BenchError(f"the job ended during the window (exit {job.proc.returncode}):\n{job.tail(20)}")
            time.sleep(0.2)
        events = [e for e in job.events() if e.ts <= t_end]
        zygotes_alive = zygotes.alive()
    if not all(zygotes_alive.values()):
        raise BenchError(f"a warm zygote died during the window: {zygotes_alive}")
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
            "hot_join": True,
            "rollback": config["elastic"]["rollback"],
            "kills": [{**k, "t": k["ts"] - t0} for k in kills],
            "summarize_goodput_to_last_event": s["goodput"],
            "summary": {k: v for k, v in s.items() if k not in ("marks",)},
            "own": own,
        },
    )
