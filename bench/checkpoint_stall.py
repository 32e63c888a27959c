"""``checkpoint_stall``: training-thread stall of an async checkpoint vs a synchronous ``torch.save``, and step time.

``python -m bench.checkpoint_stall [state_mb] [repeats]`` runs it alone and prints the result as JSON.

Measured side by side, alternating which goes first in each repeat, on the same state in one run
(a 256 MiB model/optimizer-shaped state in ``make bench``):

- ``sync_save_s``: ``torch.save`` to a file in a temporary folder plus ``fsync`` (what a durable
  synchronous checkpoint costs; ``sync_save_nofsync_s`` is the part before the fsync);
- ``async_stall_s``: what ``Checkpointer.save`` costs the training thread (snapshot into the reused
  shared buffers and hand-off), with the default process writer;
- ``step_steady_s`` and ``step_during_write_s``: one step of a small CPU train loop (matmuls and a
  convolution on ``train_threads`` threads) with no write running, and while the writer process is
  serialising, hashing, writing and fsyncing.

Goals: stall at most 5% of the synchronous save (``stall_ratio <= 0.05``, >= 20x), and step
time during a write at most 10% above steady state (``step_time_rise <= 0.10``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from bench.core import BenchContext, Goal, Metric, Result
from elastictrain.checkpoint.checkpointer import Checkpointer
from elastictrain.checkpoint.storage import LocalStorage
from elastictrain.rundir.events import Checkpoint, Event, checkpoint_event, of_kind

NAME = "checkpoint_stall"
GOAL_RATIO = Goal("<=", 0.05)
GOAL_RISE = Goal("<=", 0.10)
STATE_MB = 256


def run(ctx: BenchContext) -> Result:
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


def _make_state(state_mb: int, device: str = "cpu") -> dict[str, Any]:
    """A model/optimizer-shaped state: weights plus two Adam moments, 8 MiB tensors, small extras (on ``device``;
    Adam's ``step`` stays on the CPU, as torch keeps it)."""
    total = state_mb << 20
    per_tensor = 8 << 20
    n = max(3, total // per_tensor)
    numel = total // n // 4
    groups = n // 3
    model = {f"layer{i}.weight": torch.randn(numel, device=device) for i in range(n - 2 * groups)}
    opt_state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(numel, device=device),
            "exp_avg_sq": torch.rand(numel, device=device),
        }
        for i in range(groups)
    }
    return {
        "model": model,
        "optimizer": {"state": opt_state, "param_groups": [{"lr": 1e-3, "params": list(range(groups))}]},
        "rng": torch.get_rng_state(),
        "counters": {"global_step": 1000, "epoch": 3},
    }


class _TrainLoop:
    """A small CPU step: three 384x384 matmuls and a 3x3 convolution (a few milliseconds)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(384, 384, generator=g) / 20
        self.x = torch.randn(384, 384, generator=g)
        self.conv = torch.randn(16, 16, 3, 3, generator=g) / 10
        self.img = torch.randn(8, 16, 32, 32, generator=g)

    def step(self) -> float:
        t0 = time.perf_counter()
        y = self.x
        for _ in range(3):
            y = torch.tanh(y @ self.w)
        z = torch.nn.functional.conv2d(self.img, self.conv, padding=1)
        float(y[0, 0] + z[0, 0, 0, 0])
        return time.perf_counter() - t0


def _sync_save(state: dict[str, Any], path: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        t1 = time.perf_counter()
        os.fsync(f.fileno())
    return time.perf_counter() - t0, t1 - t0


def bench_checkpoint_stall(
    state_mb: int = 256,
    repeats: int = 5,
    *,
    tmp_root: str | None = None,
    train_threads: int = 1,
    steady_steps: int = 40,
    device: str = "cpu",
) -> dict[str, Any]:
    """Measure async-checkpoint stall vs synchronous torch.save, and step time during a write.

    Writes into a temporary folder under ``tmp_root`` (default: the system temp dir; put it on the
    filesystem checkpoints will use) and removes it. Returns medians, ratios and whether the goals hold.
    """
    old_threads = torch.get_num_threads()
    torch.set_num_threads(train_threads)
    tmp = tempfile.mkdtemp(prefix="elastictrain-ckpt-bench-", dir=tmp_root)
    state = _make_state(state_mb, device)
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    loop = _TrainLoop()
    sync_s: list[float] = []
    sync_nofsync_s: list[float] = []
    stall_s: list[float] = []
    write_s: list[float] = []
    steady: list[float] = []
    during: list[float] = []
    events: list[Event] = []
    ckpt = Checkpointer(
        LocalStorage(os.path.join(tmp, "checkpoints")),
        keep_last=1,
        writer="process",
        on_event=lambda name, fields: events.append(checkpoint_event(name, fields, step=0, epoch=0, world_size=1)),
    )
    try:
        for _ in range(5):
            loop.step()
        ckpt.save(state, step=0, epoch=0, world_size=1, config_hash="bench")  # allocates the buffers
        ckpt.wait()
        _sync_save(state, os.path.join(tmp, "sync.pt"))
        for r in range(repeats):
            for which in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                if which == "sync":
                    total, before_fsync = _sync_save(state, os.path.join(tmp, "sync.pt"))
                    sync_s.append(total)
                    sync_nofsync_s.append(before_fsync)
                    os.unlink(os.path.join(tmp, "sync.pt"))
                    continue
                steady.extend(loop.step() for _ in range(steady_steps))
                stall_s.append(ckpt.save(state, step=r + 1, epoch=0, world_size=1, config_hash="bench"))
                steps_this_write = []
                while ckpt.in_flight:
                    steps_this_write.append(loop.step())
                during.extend(steps_this_write[:-1] or steps_this_write)  # the last may straddle the end
                ckpt.wait()
                ok = [e for e in of_kind(events, Checkpoint) if e.step == r + 1 and e.write_seconds is not None]
                if ok:
                    write_s.append(float(ok[0].write_seconds or 0.0))
        stats = ckpt.stats
    finally:
        ckpt.close()
        shutil.rmtree(tmp, ignore_errors=True)
        torch.set_num_threads(old_threads)

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    stall, sync = med(stall_s), med(sync_s)
    step_steady, step_during = med(steady), med(during)
    return {
        "state_mb": round(state_bytes / 2**20, 1),
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "train_threads": train_threads,
        "async_stall_s": stall,
        "async_stall_max_s": max(stall_s) if stall_s else float("nan"),
        "async_write_s": med(write_s),
        "sync_save_s": sync,
        "sync_save_nofsync_s": med(sync_nofsync_s),
        "stall_ratio": stall / sync,
        "stall_ratio_vs_nofsync": stall / med(sync_nofsync_s),
        "speedup": sync / stall,
        "step_steady_s": step_steady,
        "step_during_write_s": step_during,
        "steps_measured_during_write": len(during),
        "step_time_rise": step_during / step_steady - 1.0,
        "failures": stats.failures,
        "skipped": stats.skipped,
        "goal_stall_ratio_le_0_05": stall / sync <= 0.05,
        "goal_step_time_rise_le_0_10": step_during / step_steady - 1.0 <= 0.10,
    }


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.checkpoint_stall [state_mb] [repeats]``: the measurement alone, its result as JSON."""
    from elastictrain.logconf import configure_logging

    configure_logging()  # log lines go to stderr, the JSON result alone to stdout
    args = sys.argv[1:] if argv is None else argv
    result = bench_checkpoint_stall(*(int(a) for a in args[:2]))
    sys.stdout.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
