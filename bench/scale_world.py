"""``scale_world``: what a reset, a scale-up, the start and memory cost as the world grows from 4 to 32 workers.

One job per world size N (4, 8, 16, 32; ``--quick``: 4, 8), the same job at each: the small CNN of the other
benchmarks with MLflow, checkpoints and the ledger as a user gets them, one worker per logical host
(:func:`~elastictrain.launcher.hosts.local_logical_hosts`: the machine's names, then ``127.0.0.2``, ...),
``--min-np N/2 --max-np N`` (the card's ``--min-np 4 --max-np 32`` at 8 and 32 alike: a second death during a
reset does not stall the job), launch's Gloo timeout (60 s) and blacklist cooldown (5-60 s). Every other host
(the first, the third, ...) has a warm zygote, as ``elastictrain agent --warm-config`` keeps one; the others
start their workers cold. So one job shows hot and cold side by side.

Per size:

* **start-up**: from horovodrun's start to the ``start`` event (the first sync done; the first step follows).
  The cold hosts set its pace.
* **SIGKILL → next step**: ``KILLS`` kills (quick: 3), the current rank 0 first (its host read from rank 0's
  latest log line), then hot and cold hosts in turn. Timed from the kill to the ``reset`` event of the first
  step at the smaller size. The victim's host stays listed; Horovod takes it back after its cooldown:
* **scale-up N-1 → N**: that return's pause as the running workers see it (``recovery_seconds`` of the reset
  back to N), hot when the victim's host has a zygote, cold otherwise.
* **the parts of each pause** (``reset`` event fields, rank 0's view): detect, rendezvous (Horovod's reset:
  the driver's assignment, the rendezvous, the Gloo contexts), sync, prologue, first step. Our share is
  detect + sync + prologue; Horovod's is the rendezvous; the first step is a step at the new size.
* **collateral deaths**: survivors that died with the victim (Gloo aborts one now and then when the ring breaks
  mid-message, exit 134, as horovod/horovod#3264 reports); the kill's figure includes their cost.
* **memory**: PSS (proportional set size: a page shared by k processes counts 1/k to each) of each worker's
  processes, at N workers before the first kill: hot workers (the zygote's client and the forked worker) and
  cold ones; the zygotes' own PSS is reported beside them.
* **steady step time** at N (``metrics`` events before the first kill), to read the first step against.

Then the growth ratio (largest size ÷ 4) of each figure. Goals (at the largest size): SIGKILL → next step
p95 <= 3 s and max <= 10 s; hot scale-up median <= 3 s; growth of our share <= 2x; hot workers' PSS <= 0.7 x
cold workers'.

``python -m bench.scale_world [--sizes 4,8] [--kills K]`` runs it alone.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.core import BenchContext, BenchError, Goal, Metric, Result, summary, threads_per_worker
from bench.hotjoin import WarmZygotes, hot_command, warm_zygotes
from bench.sigkill import sigkill, training_processes, wait_next_step
from chaos.jobs import ElasticJob
from chaos.procs import HarnessError
from elastictrain.cliutil import OneLineParser
from elastictrain.engine.reset import PAUSE_PARTS
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Metrics, Reset, Start

NAME = "scale_world"
SIZES = (4, 8, 16, 32)
QUICK_SIZES = (4, 8)
KILLS, QUICK_KILLS = 4, 3
GOAL_KILL_P95 = Goal("<=", 3.0)
GOAL_KILL_MAX = Goal("<=", 10.0)
GOAL_HOT_UP = Goal("<=", 3.0)
GOAL_OWN_GROWTH = Goal("<=", 2.0)
GOAL_PSS_RATIO = Goal("<=", 0.7)
GLOO_TIMEOUT_SECONDS = 60  # elastictrain launch's defaults
COOLDOWN = (5, 60)
OURS = ("detect", "sync", "prologue")
"""The parts of a pause that are elastictrain's own; ``rendezvous`` is Horovod's, ``first_step`` a step."""
STEADY_STEPS = 4
"""Steps at full size after a return before the next kill."""


def timeout_for(size: int) -> float:
    """How long any one wait of a job of ``size`` workers may take on this machine (cold starts share 2 cores)."""
    return 120.0 + 20.0 * size


def min_np(size: int) -> int:
    return max(2, size // 2)


def job_config(run_dir: Path, size: int) -> dict[str, Any]:
    """The small-CNN job, one long epoch; MLflow, checkpoints and the ledger on, as a user gets them."""
    return {
        "job": f"bench-scale-{size}",
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {"kind": "synthetic", "image_size": 16, "batch_size": 16, "num_samples": 400_000, "augment": False},
        "training": {"epochs": 1, "log_every_steps": 4},
        "elastic": {"min_np": min_np(size), "max_np": size, "base_world_size": 4},
        "tracking": {"progress_bar": False},
        "audit": {"sample_ledger": True},
    }


def rank0_host(log_path: Path) -> str | None:
    """The host of rank 0 now, from the latest structured log line of rank 0 in horovodrun's output."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - (1 << 20)))
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        _, sep, body = raw.partition(b"<stderr>:")
        if not sep or not body.startswith(b"{"):
            continue
        try:
            rec = json.loads(body)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("rank") == 0 and isinstance(rec.get("host"), str):
            return str(rec["host"])
    return None


def victims(kills: int) -> list[str]:
    """What each kill aims at, in order: rank 0 first, then hot and cold hosts in turn."""
    return ["rank0", *(("hot", "cold")[i % 2] for i in range(kills - 1))]


def pss(procs: Sequence[psutil.Process]) -> float:
    """Total PSS of ``procs`` and their descendants in MiB (processes that are gone count 0)."""
    seen: dict[int, psutil.Process] = {}
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            seen[p.pid] = p
            for c in p.children(recursive=True):
                seen[c.pid] = c
    total = 0
    for p in seen.values():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_full_info().pss
    return total / (1 << 20)


def memory(job: ElasticJob, zygotes: WarmZygotes, hot_hosts: set[str]) -> dict[str, Any]:
    """PSS per worker (MiB): hot (client + forked worker) and cold, and the zygotes' own."""
    hot, cold = [], []
    for client in job.workers():
        with contextlib.suppress(psutil.NoSuchProcess, KeyError):
            host = client.environ()["HOROVOD_HOSTNAME"]
            if host in hot_hosts and zygotes.forked(host):
                hot.append(pss([client]) + pss(zygotes.forked(host)))
            else:
                cold.append(pss([client]))
    zy = [pss([psutil.Process(p.pid)]) - pss(zygotes.forked(h)) for h, p in zygotes.procs.items()]
    return {
        "hot_worker_mib": statistics.median(hot) if hot else None,
        "cold_worker_mib": statistics.median(cold) if cold else None,
        "zygote_mib": statistics.median(zy) if zy else None,
        "hot_workers": len(hot),
        "cold_workers": len(cold),
    }


def parts_of(reset: Reset) -> dict[str, float | None]:
    return {p: getattr(reset, f"{p}_seconds") for p in PAUSE_PARTS}


def pick(job: ElasticJob, aim: str, hot_hosts: set[str], used: set[str]) -> str:
    """The host to kill for ``aim`` (rank0 | hot | cold), preferring one not killed yet in this job."""
    if aim == "rank0":
        host = rank0_host(job.workdir / "horovodrun.log")
        if host is None:
            raise BenchError("rank 0's host is not in the log")
        return host
    live = []
    for p in job.workers():
        with contextlib.suppress(psutil.NoSuchProcess, KeyError):
            live.append(p.environ()["HOROVOD_HOSTNAME"])
    pool = [h for h in live if (h in hot_hosts) == (aim == "hot")]
    fresh = [h for h in pool if h not in used]
    if not (fresh or pool):
        raise BenchError(f"no {aim} worker to kill among {live}")
    return sorted(fresh or pool)[-1]


def one_size(workdir: Path, size: int, kills: int, log: Callable[[str], None]) -> dict[str, Any]:
    """One job of ``size`` workers through ``kills`` SIGKILLs and the returns (see the module)."""
    hosts = local_logical_hosts(size)
    if len(hosts) < size:
        raise BenchError(f"needs {size} logical hosts, this machine gives {len(hosts)}")
    hot_hosts = set(hosts[::2])
    config = job_config(workdir / "run", size)
    wait = timeout_for(size)
    out: dict[str, Any] = {"size": size, "hosts": hosts, "hot_hosts": sorted(hot_hosts), "kills": []}
    with contextlib.ExitStack() as stack:
        t_zy = time.time()
        zygotes = stack.enter_context(warm_zygotes(workdir / "job.yaml", config, sorted(hot_hosts)))
        out["zygotes_warm_seconds"] = time.time() - t_zy
        job = ElasticJob(
            workdir,
            config,
            hosts,
            min_np=min_np(size),
            max_np=size,
            gloo_timeout=GLOO_TIMEOUT_SECONDS,
            cooldown=COOLDOWN,
            threads=threads_per_worker(size),
            command=hot_command,
            extra_env=zygotes.env,
        )
        stack.callback(job.close)  # before the zygotes are killed
        job.start()
        start = job.wait_event(Start, lambda e: True, wait, what="the first start event")
        out["startup_seconds"] = start.ts - job.started
        log(f"{size} workers: started in {out['startup_seconds']:.1f} s ({len(hot_hosts)} hot hosts)")
        job.wait_step(start.step + 2 * STEADY_STEPS, timeout=wait)
        out["memory"] = memory(job, zygotes, hot_hosts)
        steady = [e.step_seconds for e in job.events(Metrics) if e.world_size == size and e.step_seconds]
        out["step_seconds"] = statistics.median(steady) if steady else None
        log(
            f"{size} workers: step {out['step_seconds'] or float('nan'):.2f} s; PSS per worker hot "
            f"{out['memory']['hot_worker_mib'] or float('nan'):.0f} MiB, cold "
            f"{out['memory']['cold_worker_mib'] or float('nan'):.0f} MiB, zygote {out['memory']['zygote_mib'] or 0:.0f}"
        )
        used: set[str] = set()
        for aim in victims(kills):
            host = pick(job, aim, hot_hosts, used)
            used.add(host)
            t_kill = sigkill(training_processes(job.worker(host=host), zygotes))
            down = wait_next_step(job, t_kill, wait, below=size, what=f"the first step after the SIGKILL of {host}")
            try:
                back: Reset | None = job.wait_event(
                    Reset,
                    lambda e: e.ts > down.ts and e.new_size == size,  # noqa: B023 - used at once
                    wait,
                    what=f"{host} back at {size} workers",
                )
            except HarnessError as e:  # a result: this size's further kills are not made
                back, out["error"] = None, str(e).splitlines()[0]
            kind = "hot" if host in hot_hosts else "cold"
            down_parts = parts_of(down)
            up_parts = parts_of(back) if back is not None else dict.fromkeys(PAUSE_PARTS)
            k: dict[str, Any] = {
                "aim": aim,
                "host": host,
                "kill_to_step": down.ts - t_kill,
                "new_size": down.new_size,
                # survivors that died too: Gloo aborts one now and then as the ring breaks (horovod/horovod#3264)
                "collateral": size - 1 - (down.new_size or size - 1),
                "reason": down.reason,
                "down_parts": down_parts,
                "up_kind": kind,
                "up_pause": back.recovery_seconds if back is not None else None,
                "up_parts": up_parts,
            }
            out["kills"].append(k)
            log(
                f"{size} workers: SIGKILL {aim} ({host}) -> next step at {down.new_size} {k['kill_to_step']:.2f} s "
                f"[{fmt_parts(down_parts)}]; {kind} return {k['up_pause'] or float('nan'):.2f} s "
                f"[{fmt_parts(up_parts)}]" + (f"; {out['error']}" if back is None else "")
            )
            if back is None:
                break
            job.wait_step(back.step + STEADY_STEPS, timeout=wait)
        if not all(zygotes.alive().values()):
            raise BenchError(f"a warm zygote died: {zygotes.alive()}")
    return out


def fmt_parts(parts: dict[str, float | None]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if v is not None)


def figures(run: dict[str, Any]) -> dict[str, float | None]:
    """The per-size figures of one size's run, medians where there are several."""
    kills = run["kills"]

    def med(values: Sequence[float | None]) -> float | None:
        xs = [v for v in values if v is not None]
        return statistics.median(xs) if xs else None

    out: dict[str, float | None] = {
        "startup": run["startup_seconds"],
        "step": run["step_seconds"],
        "kill_to_step_median": med([k["kill_to_step"] for k in kills]),
        "kill_to_step_max": max((k["kill_to_step"] for k in kills), default=None),
        "hot_up_median": med([k["up_pause"] for k in kills if k["up_kind"] == "hot"]),
        "cold_up_median": med([k["up_pause"] for k in kills if k["up_kind"] == "cold"]),
        "hot_worker_pss_mib": run["memory"]["hot_worker_mib"],
        "cold_worker_pss_mib": run["memory"]["cold_worker_mib"],
        "zygote_pss_mib": run["memory"]["zygote_mib"],
        "collateral_deaths": float(sum(k.get("collateral", 0) for k in kills)),
    }
    for part in PAUSE_PARTS:
        out[f"kill_{part}"] = med([k["down_parts"][part] for k in kills])
        out[f"up_{part}"] = med([k["up_parts"][part] for k in kills])
    own = [sum(k["down_parts"][p] or 0.0 for p in OURS) for k in kills]
    out["kill_own_share"] = med(own)
    step = run["step_seconds"]
    # In steps of this world: a collective costs about a step when N workers share the cores, so this is the
    # share's size in rounds over the world, which does not grow with the per-round cost of a crowded machine.
    out["kill_own_share_steps"] = out["kill_own_share"] / step if out["kill_own_share"] is not None and step else None
    return out


def growth(by_size: dict[int, dict[str, float | None]]) -> dict[str, float | None]:
    """Each figure at the largest size ÷ at the smallest (None where either is missing or zero)."""
    lo, hi = by_size[min(by_size)], by_size[max(by_size)]
    return {k: (hi[k] / lo[k] if hi.get(k) is not None and lo.get(k) else None) for k in lo}  # type: ignore[operator]


def run(ctx: BenchContext, sizes: Sequence[int] | None = None, kills: int | None = None) -> Result:
    sizes = tuple(sizes or (QUICK_SIZES if ctx.quick else SIZES))
    kills = kills or (QUICK_KILLS if ctx.quick else KILLS)
    runs: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    for size in sizes:
        try:  # a size that fails is reported; the others still run
            runs[size] = one_size(ctx.scratch(f"size-{size}"), size, kills, ctx.progress)
        except (BenchError, HarnessError) as e:
            failed[size] = str(e).splitlines()[0]
            ctx.progress(f"{size} workers: failed: {failed[size]}")
    if not runs:
        raise BenchError(f"no world size ran: {failed}")
    by_size = {size: figures(r) for size, r in runs.items() if r["kills"]}
    grow = growth(by_size) if len(by_size) > 1 else {}
    top = max(by_size)
    kill_values = [k["kill_to_step"] for k in runs[top]["kills"]]
    s = summary(kill_values, "s")
    f = by_size[top]
    pss_ratio = (
        f["hot_worker_pss_mib"] / f["cold_worker_pss_mib"]
        if f["hot_worker_pss_mib"] and f["cold_worker_pss_mib"]
        else None
    )
    metrics = [
        Metric(f"SIGKILL -> next step at {top} workers, p95", s["p95"], "s", GOAL_KILL_P95, note=f"n {s['n']}"),
        Metric(f"SIGKILL -> next step at {top} workers, max", s["max"], "s", GOAL_KILL_MAX),
        Metric(f"hot scale-up {top - 1} -> {top}, median", f["hot_up_median"], "s", GOAL_HOT_UP),
        Metric(
            f"hot worker PSS / cold worker PSS at {top}",
            pss_ratio,
            "",
            GOAL_PSS_RATIO,
            note=f"zygote {f['zygote_pss_mib'] or 0:.0f} MiB each",
        ),
    ]
    if grow:
        metrics.append(
            Metric(
                f"growth {min(by_size)} -> {top} of our share of a SIGKILL's pause",
                grow.get("kill_own_share"),
                "x",
                GOAL_OWN_GROWTH,
                note=f"Horovod's rendezvous grew {grow.get('kill_rendezvous') or float('nan'):.1f}x",
            )
        )
        metrics.append(
            Metric(
                f"growth {min(by_size)} -> {top} of our share in steps of each world",
                grow.get("kill_own_share_steps"),
                "x",
                GOAL_OWN_GROWTH,
                note=f"step time grew {grow.get('step') or float('nan'):.1f}x",
            )
        )
        metrics += [
            Metric(f"growth {min(by_size)} -> {top}: {k}", v, "x")
            for k, v in grow.items()
            if k not in ("kill_own_share", "kill_own_share_steps")
        ]
    errors = {**{str(k): v for k, v in failed.items()}, **{str(k): r["error"] for k, r in runs.items() if "error" in r}}
    metrics.append(
        Metric(
            "kills (all sizes) after which survivors died too",
            float(sum(1 for r in runs.values() for k in r["kills"] if k["collateral"])),
            "",
            note=f"of {sum(len(r['kills']) for r in runs.values())}; stopped: {errors or 'none'}",
        )
    )
    return Result(
        NAME,
        metrics=metrics,
        contenders={str(size): {**fig, "unit": "s / MiB"} for size, fig in by_size.items()},
        detail={
            "sizes": list(sizes),
            "kills_per_size": kills,
            "failed": {str(k): v for k, v in failed.items()},
            "runs": {str(k): v for k, v in runs.items()},
        },
    )


def main(argv: list[str] | None = None) -> int:
    """Run alone; writes ``<out>/<date>-<host>-scale-world.json`` / ``.md`` like ``python -m bench``."""
    p = OneLineParser(prog="python -m bench.scale_world", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="world sizes, comma-separated (4,8,16,32)")
    p.add_argument("--kills", type=int, default=KILLS, help=f"SIGKILLs per size, rank 0 first ({KILLS})")
    p.add_argument("--out", metavar="DIR", default="bench/results", help="where results go (bench/results)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sizes: not a list of integers: {args.sizes!r}")
    if not sizes or any(s < 2 for s in sizes) or args.kills < 1:
        p.error("--sizes must be integers >= 2 and --kills >= 1")
    from bench.core import (
        Progress,
        build_report,
        describe_machine,
        load_average,
        markdown_table,
        result_stem,
        write_results,
    )

    started, load_before, machine = time.time(), load_average(), describe_machine()
    with tempfile.TemporaryDirectory(prefix="elastictrain-scale-") as tmp:
        ctx = BenchContext(quick=False, workdir=Path(tmp), progress=Progress())
        t0 = time.monotonic()
        try:
            result = run(ctx, sizes, args.kills)
        except (BenchError, HarnessError) as e:
            print(f"scale_world: {e}", file=sys.stderr)
            return 1
        result.seconds = time.monotonic() - t0
    report = build_report(
        [result],
        machine=machine,
        quick=False,
        argv=["python", "-m", "bench.scale_world", *(sys.argv[1:] if argv is None else argv)],
        started=started,
        finished=time.time(),
        load_before=load_before,
        load_after=load_average(),
    )
    stem = result_stem(started, machine["hostname"], False) + "-scale-world"
    json_path, md_path = write_results(report, Path(args.out), stem)
    sys.stdout.write(markdown_table(report))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
