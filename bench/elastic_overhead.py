"""``elastic_overhead``: steady-state samples/s of ``elastictrain train`` vs a plain non-elastic Horovod loop.

Both run under real horovodrun with 2 workers on the logical hosts ``localhost`` and ``127.0.0.1``, the
same small CNN, synthetic data, batch and world size. elastictrain runs as a user gets it by default
(elastic mode with a discovery script, commit every 10 steps, async checkpoint every 100 steps,
events, MLflow in run_dir); the baseline is ``hvd.DistributedOptimizer`` in a plain loop
(:mod:`bench.baseline_worker`). Start-up is excluded (samples/s from the ``metrics`` events
after step 20; rank 0 opens its MLflow run before the first step, as in every job).

The two run back to back as a pair, in alternating order (A B, B A, ...), and the result is the median of
the pairs' ratios: a shared machine's speed drifts by more than the difference being measured, and a pair
sees the same machine (docs/decisions.md). The ratio of the two medians is reported beside it.
Goal: ratio >= 0.97.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.core import BenchContext, Goal, Metric, Result, alternate, summary
from bench.runs import WARMUP_STEPS, run_elastictrain, run_plain_horovod

NAME = "elastic_overhead"
GOAL = Goal(">=", 0.97)
WORLD_SIZE = 2


def plan(quick: bool) -> tuple[int, int]:
    """(pairs of runs, steps per run)."""
    return (1, 150) if quick else (5, 600)


def run(ctx: BenchContext) -> Result:
    pairs, steps = plan(ctx.quick)
    et_runs: list[dict[str, Any]] = ctx.cache.setdefault("elastictrain_ws2", [])  # commit, scaling reuse them

    def elastictrain(_r: int) -> dict[str, Any]:
        out = run_elastictrain(ctx.scratch("elastictrain"), world_size=WORLD_SIZE, max_steps=steps)
        et_runs.append(out)
        ctx.progress(
            f"elastictrain: {out['samples_per_sec']:.0f} samples/s, {out.get('cpu_ms_per_sample', 0):.2f} CPU ms each"
        )
        return out

    def plain(_r: int) -> dict[str, Any]:
        out = run_plain_horovod(ctx.scratch("plain"), world_size=WORLD_SIZE, max_steps=steps)
        ctx.progress(
            f"plain horovod: {out['samples_per_sec']:.0f} samples/s, {out.get('cpu_ms_per_sample', 0):.2f} CPU ms each"
        )
        return out

    runs = alternate([("elastictrain", elastictrain), ("plain_horovod", plain)], pairs, ctx.progress)
    et = summary([r["samples_per_sec"] for r in runs["elastictrain"]], "samples/s")
    base = summary([r["samples_per_sec"] for r in runs["plain_horovod"]], "samples/s")
    ratios = [a["samples_per_sec"] / b["samples_per_sec"] for a, b in zip(*runs.values(), strict=True)]
    ratio = statistics.median(ratios)
    cpu_ratios = [
        b["cpu_ms_per_sample"] / a["cpu_ms_per_sample"]
        for a, b in zip(*runs.values(), strict=True)
        if a.get("cpu_ms_per_sample") and b.get("cpu_ms_per_sample")
    ]
    return Result(
        NAME,
        metrics=[
            Metric(
                "samples/s ratio elastictrain ÷ plain Horovod",
                ratio,
                "",
                GOAL,
                note=f"{WORLD_SIZE} workers, median of {len(ratios)} pairs",
            ),
            Metric(
                "CPU per sample, plain Horovod ÷ elastictrain",
                statistics.median(cpu_ratios) if cpu_ratios else None,
                "",
                note="every process of each job in the steady window; 1 = the same CPU work per sample",
            ),
        ],
        contenders={"elastictrain": et, "plain_horovod": base},
        detail={
            "steps_per_run": steps,
            "warmup_steps": WARMUP_STEPS,
            "pair_ratios": ratios,
            "ratio_of_medians": et["median"] / base["median"],
            # Where the time went: CPU of every process of the job per sample, and the machine's steal.
            "cpu_ms_per_sample": {k: [r.get("cpu_ms_per_sample") for r in v] for k, v in runs.items()},
            "cores_busy": {k: [r.get("cores_busy") for r in v] for k, v in runs.items()},
            "steal_fraction": {k: [r.get("steal_fraction") for r in v] for k, v in runs.items()},
            "step_seconds_median": {k: [r["step_seconds_median"] for r in v] for k, v in runs.items()},
            "interval_median_samples_per_sec": {
                k: [r["interval_median_samples_per_sec"] for r in v] for k, v in runs.items()
            },
        },
    )
