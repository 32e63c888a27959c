"""``python -m bench [--quick] [--only NAME[,NAME]] [--out DIR]``: every performance goal, measured side by side.

Runs from the checkout (``make bench``); neither this package nor ``chaos`` is part of the wheel, and the product
never imports them.

Each measurement is one module of this package with ``run(ctx) -> Result``; contenders run
alternating (A B, B A, ...) in the same run, and the result holds medians and the ratio to each goal.
Progress goes to stderr, the table to stdout, and ``<out>/<date>-<host>[-quick].json`` / ``.md`` are
written (machine, load average before and after, every number). Exit 0 when every measurement ran
(a missed goal is a result, not an error), 1 when one failed, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.core import (
    BenchContext,
    Progress,
    Result,
    build_report,
    describe_machine,
    load_average,
    markdown_table,
    result_stem,
    write_results,
)
from elastictrain.cliutil import OneLineParser

# name -> what it measures, in run order (``commit`` and ``scaling`` reuse the runs of ``elastic_overhead``).
MEASUREMENTS: dict[str, str] = {
    "discovery": "discover.sh wall time against a live etcd with 32 hosts",
    "control_plane": "1,000 hosts on one etcd (simulated agents, churn, real agents SIGKILLed): discover.sh p50/p99, "
    "etcd requests/s and bytes/host/min, agent death -> gone from discovery, Horovod driver assignment time",
    "elastic_overhead": "samples/s of elastictrain train vs a plain Horovod loop, 2 workers",
    "commit": "commit cost as % of step time; CommittedState.save() vs stock TorchState.save()",
    "scaling": "samples/s at world size 1 and 2 (report only)",
    "checkpoint_stall": "async checkpoint stall vs synchronous torch.save (256 MiB); step time during a write; the "
    "same stall vs a synchronous save to an S3 store (moto_server on loopback)",
    "recovery": "SIGKILL and drain to the first step at the new size, steps rolled back; rollback none and commit "
    "vs stock Horovod elastic",
    "scale_up": "pause of the running workers at a scale-up 2 -> 3, cold start vs hot join (warm zygote)",
    "kill_distribution": "recovery over 32 SIGKILLs (rank 0, others, pairs) in one 4-worker job (quick: 8)",
    "goodput": "productive step time / wall time under a seeded SIGKILL every 60 s for 10 min (quick: 30 s, 2 min), "
    "hot join and rollback none",
    "scale_world": "world sizes 4, 8, 16, 32 (quick: 4, 8) on logical hosts: SIGKILL -> next step, hot and cold "
    "scale-up N-1 -> N, start-up, the parts of each pause, PSS per worker hot vs cold, growth 32 / 4",
    "stragglers": "a worker 50% slower in 4: steps until named, seconds until drained, samples/s before / during / "
    "after vs fault-free 3 and 4 workers; SIGSTOP -> next completed step",
    "signals": "the workers' signals in etcd: write_beat for the caller (vs files), a beat's Put, etcd ops/s per "
    "worker while training and while judging a hang",
    "hetero": "4 workers, one under a CPU quota at 50% then 25% of its speed, then lifted: samples/s of report "
    "(equal shares), evict and balance vs the ideal (sum of the hosts' speeds), shares' settling in steps, audit "
    "(quick: about 12 min, full: about 25)",
    "peers": "elastictrain vs stock Horovod elastic, torchrun and TorchFT on one task: samples/s, SIGKILL recovery, "
    "scale-up pause, steps redone, goodput, exactly once (torchrun and TorchFT need `make peers-env`)",
}

QUICK_RUN = ("discovery", "elastic_overhead", "commit", "scaling", "checkpoint_stall", "recovery", "scale_up")
"""What ``--quick`` runs when ``--only`` names nothing: the measurements whose quick modes together take a few
minutes (their recorded times are in ``--help``); any other runs in its quick mode with ``--quick --only NAME``."""

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["MEASUREMENTS", "QUICK_RUN", "main", "parse_only", "recorded_times"]


def parse_only(value: str | None, *, quick: bool = False) -> list[str]:
    """The measurements named by ``--only`` (comma-separated), in run order; when None, all of them, or
    :data:`QUICK_RUN` with ``quick``.

    Raises ``ValueError`` with one line naming an unknown name and the valid ones.
    """
    if value is None:
        return [n for n in MEASUREMENTS if n in QUICK_RUN] if quick else list(MEASUREMENTS)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in MEASUREMENTS]
    if unknown or not names:
        raise ValueError(
            f"--only: unknown measurement {', '.join(unknown) or repr(value)} (choose from {', '.join(MEASUREMENTS)})"
        )
    return [n for n in MEASUREMENTS if n in names]


def recorded_times(results: Path = RESULTS) -> dict[str, dict[str, tuple[float, str]]]:
    """name -> mode (``quick``/``full``) -> (seconds, file) of the newest run in ``results`` that measured it; files
    that are not a run's JSON are skipped."""
    out: dict[str, dict[str, tuple[float, str]]] = {}
    for path in sorted(results.glob("*.json")):  # by name: dates first, so a later file wins
        try:
            report = json.loads(path.read_text())
            mode, measured = report["mode"], report["measurements"]
            for name, entry in measured.items():
                seconds = float(entry["seconds"])
                if mode in ("quick", "full") and name in MEASUREMENTS and seconds > 0:
                    out.setdefault(name, {})[mode] = (seconds, path.name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def _minutes(times: dict[str, tuple[float, str]], mode: str) -> str:
    return f"{mode} {times[mode][0] / 60:.1f} min" if mode in times else f"{mode} not timed"


def describe_measurements(times: dict[str, dict[str, tuple[float, str]]]) -> str:
    """The help's list: each measurement, whether ``--quick`` runs it, and its last recorded times."""
    lines = []
    for name, about in MEASUREMENTS.items():
        t = times.get(name, {})
        run = "in --quick" if name in QUICK_RUN else "--quick --only"
        lines.append(f"  {name} ({run}; last run: {_minutes(t, 'quick')}, {_minutes(t, 'full')}): {about}")
    return "\n".join(lines)


def run_measurement(name: str, ctx: BenchContext) -> Result:
    """Run one measurement module; an exception becomes an ``error`` result (the run goes on)."""
    t0 = time.monotonic()
    try:
        module = importlib.import_module(f"bench.{name}")
        result: Result = module.run(ctx)
    except Exception as e:  # a failed measurement must not lose the others' results
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        ctx.progress(f"failed: {type(e).__name__}: {first}")
        result = Result(
            name, status="error", error=f"{type(e).__name__}: {first}", detail={"traceback": traceback.format_exc()}
        )
    result.seconds = time.monotonic() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="python -m bench",
        description="Measure the performance goals side by side; results to DIR/<date>-<host>.json and .md.",
        epilog="measurements (times: their last run on the 2-core VM, bench/results):\n"
        + describe_measurements(recorded_times()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"quick modes (fewer repeats, shorter windows); without --only: {', '.join(QUICK_RUN)}",
    )
    p.add_argument("--only", metavar="NAME[,NAME]", help="run only these measurements")
    p.add_argument("--out", metavar="DIR", default="bench/results", help="where results go (bench/results)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        names = parse_only(args.only, quick=args.quick)
    except ValueError as e:
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    from elastictrain.logconf import configure_logging

    configure_logging()  # library log lines go to stderr
    progress = Progress()
    started = time.time()
    load_before = load_average()
    machine = describe_machine()
    progress(
        f"{'quick' if args.quick else 'full'} run of {', '.join(names)} on {machine['hostname']} "
        f"({machine['usable_cores']} cores, load {load_before[0] if load_before else '?'})"
    )
    workdir = Path(tempfile.mkdtemp(prefix="elastictrain-bench-"))
    ctx = BenchContext(quick=args.quick, workdir=workdir, progress=progress)
    results = []
    try:
        for name in names:
            progress.scope = ""
            progress(f"{name}: {MEASUREMENTS[name]}")
            progress.scope = name
            results.append(run_measurement(name, ctx))
            progress(f"done in {results[-1].seconds:.0f} s")
    finally:
        progress.scope = ""
        shutil.rmtree(workdir, ignore_errors=True)
    report = build_report(
        results,
        machine=machine,
        quick=args.quick,
        argv=["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)],
        started=started,
        finished=time.time(),
        load_before=load_before,
        load_after=load_average(),
    )
    json_path, md_path = write_results(report, Path(args.out), result_stem(started, machine["hostname"], args.quick))
    sys.stdout.write(markdown_table(report))
    progress(f"wrote {json_path} and {md_path}")
    return 1 if any(r.status != "ok" for r in results) else 0
