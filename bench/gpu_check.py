"""``make gpu-check``: the checks that need a CUDA GPU, in one run of about 4 minutes on one GPU.

Without a GPU it prints one line and exits 0. With one it runs every check of :data:`CHECKS` in turn, each
isolated (an exception marks that check FAIL with a one-line reason; the others still run), then prints a
markdown table and writes it as JSON to ``runs/gpu-check/<time>.json``. Exit status 1 when a check failed.

Checks: the NCCL build; async checkpoint stall vs a synchronous ``torch.save`` of GPU state; a 1-GPU fp16 +
GradScaler job checkpointed, SIGKILLed and resumed on CUDA; ResNet-50 samples/s of ``elastictrain train`` vs the
plain ``hvd.DistributedOptimizer`` loop; two workers sharing the GPU with a SIGKILL of one. Jobs run through the
job harness (:mod:`chaos.jobs`, :mod:`bench.runs`).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.core import BenchError
from chaos.procs import kill_tree, wait_until
from elastictrain.rundir.events import Done, Reset, Start

DEVICE = "cuda"
"""The device of the jobs of the checks (a CPU run of the job checks sets ``cpu`` to try their logic)."""

Check = tuple[str, Callable[[Path], str]]
"""A check: its name and a function of a scratch folder returning a one-line result (raises on failure)."""


def _job_config(run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A small CUDA job: synthetic 32x32 images, frequent commits and checkpoints, MLflow off."""
    cfg: dict[str, Any] = {
        "job": "gpu-check",
        "run_dir": str(run_dir),
        "device": DEVICE,
        "data": {"kind": "synthetic", "batch_size": 32, "num_samples": 32 * 120, "num_val_samples": 64},
        "training": {"epochs": 1, "log_every_steps": 5, "seed": 3},
        "elastic": {"commit_every_steps": 5, "base_world_size": 1},
        "checkpoint": {"every_steps": 10},
        "tracking": {"mlflow": False, "progress_bar": False},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def check_nccl(_work: Path) -> str:
    import horovod.torch as hvd

    if not hvd.nccl_built():
        raise BenchError("Horovod was built without NCCL")
    return f"nccl_built={hvd.nccl_built()}"


def check_fp16_resume(work: Path) -> str:
    from chaos.jobs import ElasticJob
    from elastictrain.checkpoint.format import load_latest
    from elastictrain.checkpoint.storage import LocalStorage
    from elastictrain.launcher.hosts import local_logical_hosts

    cfg = _job_config(work / "run", precision={"mode": "fp16"}, training={"optimizer": "adamw"})
    hosts = local_logical_hosts()[:1]
    first = ElasticJob(work / "a", cfg, hosts, min_np=1, max_np=1)
    try:
        first.start()
        assert first.proc is not None
        storage = LocalStorage.for_run_dir(first.run_dir)
        wait_until(lambda: load_latest(storage) is not None and first.step() >= 15, 180, what="a checkpoint")
        kill_tree(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)
    finally:
        first.close()
    ckpt = load_latest(storage)
    if ckpt is None:
        raise BenchError("no checkpoint after the kill")
    second = ElasticJob(work / "b", cfg, hosts, min_np=1, max_np=1)
    try:
        rc = second.start().wait_exit(300)
        if rc != 0:
            raise BenchError(f"the resumed job exited {rc}: {second.tail(1)}")
        starts = second.events(Start)
    finally:
        second.close()
    if not starts or starts[-1].resumed_from_step != ckpt.step:
        raise BenchError(f"resumed from {starts[-1].resumed_from_step if starts else None}, not {ckpt.step}")
    return f"killed after step {ckpt.step}, resumed there on {DEVICE} and finished"


def check_shared_gpu_kill(work: Path) -> str:
    """Two workers on two logical hosts of this machine: both local rank 0, so both on GPU 0.

    Where NCCL carries the gradients (a GPU job, Horovod built with NCCL) the job must stop at its first sync with
    one line naming the two ranks and the GPU (NCCL runs one rank per GPU: :mod:`elastictrain.engine.gpus`);
    elsewhere (the CPU run of this check) one worker is SIGKILLed and the job resets to the other and finishes.
    """
    import horovod.torch as hvd

    from chaos.jobs import ElasticJob
    from elastictrain.launcher.hosts import local_logical_hosts

    cfg = _job_config(work / "run", elastic={"base_world_size": 2}, data={"num_samples": 32 * 2 * 80})
    if DEVICE == "cuda" and hvd.nccl_built():
        return _two_ranks_on_one_gpu_stop(ElasticJob(work / "job", cfg, local_logical_hosts()[:2], min_np=2, max_np=2))
    job = ElasticJob(work / "job", cfg, local_logical_hosts()[:2], min_np=1, max_np=2, cooldown=(5, 10))
    try:
        job.start()
        job.wait_step(10, timeout=120)
        _host, _t = job.kill_worker(rank=1)
        rc = job.wait_exit(180)
        if rc != 0:
            raise BenchError(f"job exited {rc} after the SIGKILL: {job.tail(1)}")
        done, resets = job.events(Done), job.events(Reset)
    finally:
        job.close()
    if not done or not resets:
        raise BenchError(f"{len(done)} done and {len(resets)} reset events after the SIGKILL (1 and >= 1 expected)")
    r = resets[0]
    return (
        f"rank 1 SIGKILLed; reset {r.old_size}->{r.new_size} in {r.recovery_seconds or 0.0:.1f}s, "
        f"finished at step {done[-1].step}"
    )


def _two_ranks_on_one_gpu_stop(job: Any) -> str:
    from elastictrain.rundir.worker_error import read_worker_errors

    try:
        job.start()
        wait_until(lambda: read_worker_errors(job.run_dir, launch_id="", attempt=0), 120, what="a worker's error")
        errors, steps = read_worker_errors(job.run_dir, launch_id="", attempt=0), job.step()
    finally:
        job.close()
    if steps > 0 or "share GPU" not in errors[0].message:
        raise BenchError(f"{steps} steps, then {errors[0].line()} (expected no step and 'share GPU')")
    return f"stopped at the first sync, no step: {errors[0].type}: {errors[0].message[:90]}..."


def check_checkpoint_stall(work: Path) -> str:
    from bench.checkpoint_stall import bench_checkpoint_stall

    r = bench_checkpoint_stall(state_mb=256, repeats=3, tmp_root=str(work), device="cuda")
    return (
        f"async stall {r['async_stall_s'] * 1e3:.1f} ms vs sync torch.save {r['sync_save_s'] * 1e3:.0f} ms "
        f"({r['speedup']:.1f}x)"
    )


def check_resnet50(work: Path) -> str:
    from bench.runs import run_elastictrain, run_plain_horovod

    steps, batch = 80, 64
    overrides = {
        "device": "cuda",
        "task_args": {"model": "resnet50", "num_classes": 1000, "image_size": 224, "augment": False},
        "data": {"kind": "synthetic", "batch_size": batch, "num_samples": batch * (steps + 10), "loader_workers": 4},
        "precision": {"mode": "fp16"},
    }
    ours = run_elastictrain(work / "elastictrain", world_size=1, max_steps=steps, overrides=overrides)
    plain = run_plain_horovod(work / "plain", world_size=1, max_steps=steps, overrides=overrides)
    a, b = ours["samples_per_sec"], plain["samples_per_sec"]
    return f"elastictrain {a:.0f} samples/s, plain hvd.DistributedOptimizer {b:.0f} ({a / b:.2f}x)"


CHECKS: list[Check] = [
    ("nccl build", check_nccl),
    ("checkpoint stall vs torch.save (GPU state)", check_checkpoint_stall),
    ("1-GPU fp16 kill + resume", check_fp16_resume),
    ("ResNet-50 samples/s vs plain Horovod", check_resnet50),
    ("2 workers on 1 GPU (NCCL: stop with one line)", check_shared_gpu_kill),
]
"""In order of what a failure would cost: the quick ones first, the two-worker job (the one most likely to wait out a
timeout on a single GPU) last."""


def run_checks(checks: list[Check], workdir: Path) -> list[dict[str, Any]]:
    """Run every check in its own scratch folder; a check that raises gives a FAIL row with a one-line reason."""
    rows = []
    for i, (name, fn) in enumerate(checks):
        t0 = time.monotonic()
        try:
            scratch = workdir / f"{i}"
            scratch.mkdir(parents=True, exist_ok=True)
            status, detail = "PASS", fn(scratch)
        except Exception as exc:  # one failing check must not stop the others
            lines = str(exc).strip().splitlines()
            status, detail = "FAIL", f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        rows.append({"check": name, "status": status, "seconds": round(time.monotonic() - t0, 1), "detail": detail})
        print(f"[gpu-check] {name}: {status} ({detail})", flush=True)
    return rows


def describe_software() -> dict[str, str]:
    """What a GPU result depends on: the GPUs, torch and its CUDA, the NCCL torch loads, Horovod."""
    import torch

    out = {
        "gpus": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    try:
        import horovod

        out["horovod"] = horovod.__version__
    except ImportError as exc:
        out["horovod"] = f"not importable ({exc})"
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (``|`` in a detail is escaped)."""
    out = ["| check | result | seconds | detail |", "|---|---|---|---|"]
    for r in rows:
        detail = str(r["detail"]).replace("|", "\\|")
        out.append(f"| {r['check']} | {r['status']} | {r['seconds']:.1f} | {detail} |")
    return "\n".join(out)


def main(
    argv: list[str] | None = None, *, checks: list[Check] | None = None, root: Path = Path("runs/gpu-check")
) -> int:
    """``--only TEXT`` runs the checks whose name contains TEXT (exit 2 with one line when none does)."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="TEXT", help="run only the checks whose name contains TEXT")
    args = parser.parse_args(argv)
    chosen = CHECKS if checks is None else checks
    if args.only is not None:
        chosen = [c for c in chosen if args.only.lower() in c[0].lower()]
        if not chosen:
            names = ", ".join(repr(name) for name, _ in (CHECKS if checks is None else checks))
            print(f"gpu-check: --only {args.only!r} names no check (checks: {names})", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to check")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    software = describe_software()
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in software.items()), flush=True)
    rows = run_checks(chosen, root / f"work-{stamp}")
    print(format_table(rows))
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{stamp}.json"
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "software": software, "rows": rows}, indent=2))
    print(f"gpu-check: table written to {out}")
    return 0 if all(r["status"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
