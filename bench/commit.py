"""``commit``: what an in-memory commit costs.

1. In a real run at the default interval (``elastic.commit_every_steps`` = 10): the median
   ``commit_seconds`` of the ``commit`` events over the interval's step time (10 x the median
   ``step_seconds``), in percent. Goal <= 2%. Uses the world-size-2 runs of ``elastic_overhead``
   when it ran, else one run of its own (both in the default ``elastic.rollback`` mode).
2. In-process: ``elastictrain.engine.state.CommittedState.save()`` (copies into buffers allocated once) vs
   stock ``horovod.torch.elastic.TorchState(model=..., optimizer=...).save()`` (deep copies of the
   state dicts) on the same state (ResNet-18 and the small CNN, SGD with momentum after one step),
   alternating. Goal: stock / elastictrain >= 3. Beside them, one ``copy_`` of the same number of bytes
   into a buffer allocated once: the floor for any commit that copies the state. When stock is less than
   3x that floor (a large state, where a deep copy is itself mostly memory traffic), no copying commit can
   reach the goal; the note of each metric says how far both are from the floor. And ``LiveState.save()``
   (``elastic.rollback: none``), which copies nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.core import BenchContext, Goal, Metric, Result, alternate, summary, threads_per_worker
from bench.runs import run_elastictrain

NAME = "commit"
GOAL_PCT = Goal("<=", 2.0)
GOAL_SPEEDUP = Goal(">=", 3.0)
COMMIT_EVERY_STEPS = 10  # the config default (ElasticConfig.commit_every_steps)


def build_state(model_name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and an SGD-with-momentum optimizer after one step (so momentum buffers exist)."""
    from elastictrain.engine.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(2, 3, 32, 32)
    torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1])).backward()
    optimizer.step()
    return model, optimizer


def savers(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Callable[[], None]]:
    """The ``save()`` calls on the same live state: ours with ``elastic.rollback`` commit and none, and stock's.
    None needs ``hvd.init()``."""
    from horovod.torch.elastic import TorchState

    from elastictrain.engine.policy import ScaleRamp
    from elastictrain.engine.sampler import SamplerState
    from elastictrain.engine.state import Counters, make_state

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda _: 1.0)
    ours, live = (
        make_state(mode, model, optimizer, scheduler, None, SamplerState(), Counters(), ScaleRamp(1.0, 1.0, 0, 0))
        for mode in ("commit", "none")
    )
    stock = TorchState(model=model, optimizer=optimizer)
    return {"elastictrain": ours.save, "elastictrain_rollback_none": live.save, "stock_torchstate": stock.save}


def time_call(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def microbench(model_name: str, repeats: int, progress: Callable[[str], None]) -> dict[str, Any]:
    model, optimizer = build_state(model_name)
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    state_mb += (
        sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        / 2**20
    )
    fns = savers(model, optimizer)
    # The floor for any commit that copies: one contiguous copy of the same number of bytes into a buffer
    # allocated once (a single memcpy at this machine's memory bandwidth).
    nbytes = int(state_mb * 2**20)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    def memcpy() -> None:
        dst.copy_(src)

    fns["memcpy_floor"] = memcpy
    for fn in fns.values():  # first save allocates elastictrain's buffers; warm both
        fn()
    contenders: list[tuple[str, Callable[[int], float]]] = [
        (k, lambda _r, fn=fn: time_call(fn))  # type: ignore[misc]
        for k, fn in fns.items()
    ]
    times = alternate(contenders, repeats)
    ours, stock = statistics.median(times["elastictrain"]), statistics.median(times["stock_torchstate"])
    floor = statistics.median(times["memcpy_floor"])
    none = statistics.median(times["elastictrain_rollback_none"])
    progress(
        f"{model_name} ({state_mb:.0f} MiB): elastictrain {ours * 1e3:.2f} ms (rollback none {none * 1e3:.4f} ms), "
        f"stock TorchState {stock * 1e3:.2f} ms, one memcpy of the same bytes {floor * 1e3:.2f} ms"
    )
    return {
        "state_mb": state_mb,
        "elastictrain": summary([t * 1e3 for t in times["elastictrain"]], "ms"),
        "elastictrain_rollback_none": summary([t * 1e3 for t in times["elastictrain_rollback_none"]], "ms"),
        "stock_torchstate": summary([t * 1e3 for t in times["stock_torchstate"]], "ms"),
        "memcpy_floor": summary([t * 1e3 for t in times["memcpy_floor"]], "ms"),
        "speedup": stock / ours,
        "stock_over_floor": stock / floor,
        "elastictrain_over_floor": ours / floor,
    }


def commit_share(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Commit time as a share of step time in real runs: per commit, and spread over the commit interval."""
    commits = [c for r in runs for c in r["commit_seconds"]]
    step = statistics.median(r["step_seconds_median"] for r in runs)
    commit = statistics.median(commits)
    return {
        "commit_seconds_median": commit,
        "commit_seconds_p95": sorted(commits)[min(len(commits) - 1, round(0.95 * (len(commits) - 1)))],
        "commits": len(commits),
        "step_seconds_median": step,
        "percent_of_step_time": 100.0 * commit / (COMMIT_EVERY_STEPS * step),
        "percent_of_one_step": 100.0 * commit / step,
    }


def run(ctx: BenchContext) -> Result:
    runs = ctx.cache.get("elastictrain_ws2") or []
    if not runs:
        ctx.progress("one elastictrain run (2 workers) for commit events")
        runs = [run_elastictrain(ctx.scratch("commit"), world_size=2, max_steps=80)]
        ctx.cache["elastictrain_ws2"] = runs
    share = commit_share(runs)
    ctx.progress(
        f"commit {share['commit_seconds_median'] * 1e3:.2f} ms per {COMMIT_EVERY_STEPS} steps of "
        f"{share['step_seconds_median'] * 1e3:.1f} ms: {share['percent_of_step_time']:.3f}% of step time"
    )
    repeats = 10 if ctx.quick else 30
    # The threads a worker has here (cores / 2 workers, as launch sets them): more threads than cores
    # left over by other load make parallel copies spin instead of copy.
    threads, old_threads = threads_per_worker(2), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        micro = {name: microbench(name, repeats, ctx.progress) for name in ("resnet18", "small_cnn")}
    finally:
        torch.set_num_threads(old_threads)
    return Result(
        NAME,
        metrics=[
            Metric(
                "commit cost, % of step time (default interval 10)",
                share["percent_of_step_time"],
                "%",
                GOAL_PCT,
                note=f"{share['percent_of_one_step']:.2f}% of the step it follows",
            ),
            *(
                Metric(
                    f"save() speedup vs stock TorchState, {name}",
                    m["speedup"],
                    "x",
                    GOAL_SPEEDUP,
                    note=(
                        f"{m['state_mb']:.0f} MiB; elastictrain {m['elastictrain_over_floor']:.2f}x and stock "
                        f"{m['stock_over_floor']:.2f}x one memcpy of the same bytes"
                    ),
                )
                for name, m in micro.items()
            ),
            Metric(
                "save() with rollback none, resnet18",
                micro["resnet18"]["elastictrain_rollback_none"]["median"],
                "ms",
                note="no copy: the live state is the commit",
            ),
        ],
        contenders={
            "elastictrain (resnet18)": micro["resnet18"]["elastictrain"],
            "elastictrain rollback none (resnet18)": micro["resnet18"]["elastictrain_rollback_none"],
            "stock_torchstate (resnet18)": micro["resnet18"]["stock_torchstate"],
        },
        detail={"in_run": share, "microbench": micro, "repeats": repeats, "torch_threads": threads},
    )
