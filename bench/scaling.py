"""``scaling``: samples/s of ``elastictrain train`` at world size 1 and 2 on this machine (report only).

Each worker gets cores / workers OMP threads, as ``elastictrain launch`` sets them. World size 2
reuses the runs of ``elastic_overhead`` when it ran. On a GPU machine the same runs use the GPU.
"""

from __future__ import annotations

from bench.core import BenchContext, Metric, Result, alternate, summary
from bench.runs import run_elastictrain

NAME = "scaling"


def run(ctx: BenchContext) -> Result:
    steps = 60 if ctx.quick else 300
    ws2 = ctx.cache.get("elastictrain_ws2") or []
    if ws2:
        ctx.progress(f"world size 2: reusing {len(ws2)} run(s) of elastic_overhead")
        runs = alternate(
            [("1", lambda _r: run_elastictrain(ctx.scratch("ws1"), world_size=1, max_steps=steps))],
            1 if ctx.quick else 2,
            ctx.progress,
        )
        runs["2"] = ws2
    else:
        repeats = 1 if ctx.quick else 2
        runs = alternate(
            [
                ("1", lambda _r: run_elastictrain(ctx.scratch("ws1"), world_size=1, max_steps=steps)),
                ("2", lambda _r: run_elastictrain(ctx.scratch("ws2"), world_size=2, max_steps=steps)),
            ],
            repeats,
            ctx.progress,
        )
    stats = {f"world_size_{k}": summary([r["samples_per_sec"] for r in v], "samples/s") for k, v in runs.items()}
    one, two = stats["world_size_1"]["median"], stats["world_size_2"]["median"]
    ctx.progress(f"{one:.0f} samples/s at 1 worker, {two:.0f} at 2")
    return Result(
        NAME,
        metrics=[
            Metric("samples/s, world size 1", one, "samples/s"),
            Metric("samples/s, world size 2", two, "samples/s"),
            Metric("speedup 1 → 2 workers", two / one, "x"),
        ],
        contenders=stats,
        detail={"steps_per_run": steps},
    )
