"""``checkpoint_stall``: training-thread stall of an async checkpoint vs a synchronous ``torch.save``.

Calls :func:`elastictrain.checkpoint.bench.bench_checkpoint_stall` (a 256 MiB model/optimizer-shaped
state, the default process writer; sync and async saves alternate in one run, and step time of a small
CPU loop is measured with and without a write in flight). Goals: stall <= 5% of the synchronous save
(>= 20x), step-time rise while a write is in flight <= 10%.
"""

from __future__ import annotations

from elastictrain.bench.core import BenchContext, Goal, Metric, Result

NAME = "checkpoint_stall"
GOAL_RATIO = Goal("<=", 0.05)
GOAL_RISE = Goal("<=", 0.10)
STATE_MB = 256


def run(ctx: BenchContext) -> Result:
    from elastictrain.checkpoint.bench import bench_checkpoint_stall

    repeats = 2 if ctx.quick else 7
    ctx.progress(f"{STATE_MB} MiB state, {repeats} sync/async pairs")
    r = bench_checkpoint_stall(state_mb=STATE_MB, repeats=repeats, tmp_root=str(ctx.workdir))
    ctx.progress(
        f"async stall {r['async_stall_s'] * 1e3:.1f} ms vs sync torch.save {r['sync_save_s'] * 1e3:.0f} ms "
        f"({r['speedup']:.1f}x); step time +{100 * r['step_time_rise']:.1f}% during a write"
    )
    return Result(
        NAME,
        metrics=[
            Metric("stall ÷ sync torch.save", r["stall_ratio"], "", GOAL_RATIO, note=f"{r['speedup']:.1f}x less"),
            Metric("step-time rise during a write", r["step_time_rise"], "", GOAL_RISE),
        ],
        contenders={
            "async_stall": {"median": r["async_stall_s"] * 1e3, "max": r["async_stall_max_s"] * 1e3, "unit": "ms"},
            "sync_torch_save": {"median": r["sync_save_s"] * 1e3, "unit": "ms"},
        },
        detail=r,
    )
