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

The object-store variant (``python -m bench.checkpoint_stall --store s3 [state_mb] [repeats]``; in ``run`` when
moto is installed) does the same against a real S3 API server on loopback (moto's ``moto_server``, a process of
its own): ``sync_save_s`` is a synchronous :func:`~elastictrain.checkpoint.format.write_checkpoint` to the store
(``torch.save`` streamed as a multipart upload, manifest, ``latest``), ``async_stall_s`` what
``Checkpointer.save`` to the same store costs the training thread. Goal: ``stall_ratio <= 0.05``. It runs in a
child process with dummy AWS credentials, so that the writer's fork server starts with them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.core import BenchContext, Goal, Metric, Result
from elastictrain.checkpoint.checkpointer import Checkpointer
from elastictrain.checkpoint.format import write_checkpoint
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
    metrics = [
        Metric("stall ÷ sync torch.save", r["stall_ratio"], "", GOAL_RATIO, note=f"{r['speedup']:.1f}x less"),
        Metric("step-time rise during a write", r["step_time_rise"], "", GOAL_RISE),
    ]
    contenders: dict[str, Any] = {
        "async_stall": {"median": r["async_stall_s"] * 1e3, "max": r["async_stall_max_s"] * 1e3, "unit": "ms"},
        "sync_torch_save": {"median": r["sync_save_s"] * 1e3, "unit": "ms"},
    }
    detail: dict[str, Any] = dict(r)
    if importlib.util.find_spec("moto") is not None and importlib.util.find_spec("s3fs") is not None:
        ctx.progress(f"object store (S3 on moto_server): {STATE_MB} MiB state, {max(2, repeats // 2)} pairs")
        s = run_store_variant(STATE_MB, max(2, repeats // 2))
        ctx.progress(
            f"S3: async stall {s['async_stall_s'] * 1e3:.1f} ms vs sync save {s['sync_save_s'] * 1e3:.0f} ms "
            f"(ratio {s['stall_ratio']:.4f})"
        )
        metrics.append(Metric("S3 store: stall ÷ sync save to the store", s["stall_ratio"], "", GOAL_RATIO))
        contenders["s3_async_stall"] = {"median": s["async_stall_s"] * 1e3, "unit": "ms"}
        contenders["s3_sync_save"] = {"median": s["sync_save_s"] * 1e3, "unit": "ms"}
        detail["s3"] = s
    return Result(NAME, metrics=metrics, contenders=contenders, detail=detail)


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


_DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench-not-a-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def run_store_variant(state_mb: int, repeats: int) -> dict[str, Any]:
    """The object-store variant in a child process (dummy AWS credentials in its environment from the start)."""
    env = {**os.environ, **_DUMMY_AWS}
    env.pop("AWS_PROFILE", None)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.checkpoint_stall", "--store", "s3", str(state_mb), str(repeats)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the S3 variant exited {proc.returncode}: {tail}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@contextlib.contextmanager
def _moto_server() -> Iterator[str]:
    """``moto_server`` (a process of its own) on a free loopback port; its endpoint URL. Killed by pid after."""
    import urllib.request

    from elastictrain.launcher.processes import free_port

    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto_server did not answer on {endpoint}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.kill()
        proc.wait(10)


def bench_checkpoint_stall_store(state_mb: int = 256, repeats: int = 3) -> dict[str, Any]:
    """Async stall vs a synchronous save, both to one S3 store (moto_server on loopback). Needs AWS credentials
    in the environment before the first checkpointer of the process (dummy ones do for moto)."""
    import boto3

    from elastictrain.checkpoint.location import parse_object_location
    from elastictrain.checkpoint.objectstore import FsspecStorage

    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = _make_state(state_mb)
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    sync_s: list[float] = []
    stall_s: list[float] = []
    write_s: list[float] = []
    events: list[Event] = []
    with _moto_server() as endpoint:
        bucket = f"bench-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        location = parse_object_location(f"s3://{bucket}/checkpoint-stall")
        storage = FsspecStorage(location, endpoint_url=endpoint)
        ckpt = Checkpointer(
            storage,
            keep_last=1,
            writer="process",
            on_event=lambda name, fields: events.append(checkpoint_event(name, fields, step=0, epoch=0, world_size=1)),
        )
        step = 0
        try:
            ckpt.save(state, step=step, epoch=0, world_size=1, config_hash="bench")  # buffers, writer, connection
            ckpt.wait()
            for r in range(repeats):
                for which in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                    step += 1
                    if which == "sync":
                        t0 = time.perf_counter()
                        write_checkpoint(storage, state, step=step, epoch=0, world_size=1, config_hash="b", keep_last=1)
                        sync_s.append(time.perf_counter() - t0)
                        continue
                    stall_s.append(ckpt.save(state, step=step, epoch=0, world_size=1, config_hash="bench"))
                    ckpt.wait()
                    ok = [e for e in of_kind(events, Checkpoint) if e.step == step and e.write_seconds is not None]
                    if ok:
                        write_s.append(float(ok[0].write_seconds or 0.0))
            stats = ckpt.stats
        finally:
            ckpt.close()
            torch.set_num_threads(old_threads)
    stall, sync = statistics.median(stall_s), statistics.median(sync_s)
    return {
        "store": "s3 (moto_server on loopback)",
        "state_mb": round(state_bytes / 2**20, 1),
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "async_stall_s": stall,
        "async_stall_max_s": max(stall_s),
        "async_write_s": statistics.median(write_s) if write_s else float("nan"),
        "sync_save_s": sync,
        "sync_save_all_s": sync_s,
        "async_stall_all_s": stall_s,
        "stall_ratio": stall / sync,
        "speedup": sync / stall,
        "failures": stats.failures,
        "skipped": stats.skipped,
        "goal_stall_ratio_le_0_05": stall / sync <= 0.05,
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
    """``python -m bench.checkpoint_stall [--store s3] [state_mb] [repeats]``: the measurement alone, as JSON."""
    from elastictrain.logconf import configure_logging

    configure_logging()  # log lines go to stderr, the JSON result alone to stdout
    args = sys.argv[1:] if argv is None else argv
    if args[:2] == ["--store", "s3"]:
        result = bench_checkpoint_stall_store(*(int(a) for a in args[2:4]))
    else:
        result = bench_checkpoint_stall(*(int(a) for a in args[:2]))
    sys.stdout.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
