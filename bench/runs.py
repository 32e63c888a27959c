"""Short training runs under real horovodrun, shared by ``elastic_overhead``, ``commit`` and ``scaling``.

:func:`run_elastictrain` runs ``elastictrain train`` as a user does (elastic: a host discovery script,
commits every ``elastic.commit_every_steps``, async checkpoints, events, MLflow in ``run_dir``);
:func:`run_plain_horovod` runs the plain non-elastic loop of :mod:`bench.baseline_worker`
with ``horovodrun -np N -H ...`` on the same config. Both report steady-state samples/s from the
``metrics`` events after a warm-up.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.core import BenchError, threads_per_worker
from bench.cpu import TreeCpuMonitor
from chaos.jobs import ElasticJob
from chaos.procs import BIN_DIR, checkout_env, kill_tree
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir import layout
from elastictrain.rundir.events import Checkpoint, Commit, Event, Metrics, of_kind, read_events

WARMUP_STEPS = 20
"""Steps excluded from throughput: process start, first allocations, MLflow run creation."""


def throughput_config(run_dir: Path, *, max_steps: int, world_size: int) -> dict[str, Any]:
    """The default job (small CNN, 32x32 synthetic images, 32 per worker, commit every 10, checkpoints every
    100 steps, MLflow on) with only the length set: one epoch long enough for ``max_steps``."""
    batch = 32
    return {
        "job": "bench",
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {"kind": "synthetic", "num_samples": batch * world_size * (max_steps + 10)},
        "training": {"max_steps": max_steps},
    }


def merge_config(cfg: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``cfg`` with ``overrides`` merged in: dict values update the section of the same name, others replace."""
    out = dict(cfg)
    for key, value in (overrides or {}).items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def steady_throughput(events: Sequence[Event], *, batch: int, warmup_steps: int = WARMUP_STEPS) -> dict[str, Any]:
    """Samples/s from the ``metrics`` events after ``warmup_steps``: samples between the first and the last
    such event over the time between them (commits and checkpoints inside the window count), plus the
    median of the per-interval ``samples_per_sec``."""
    metrics = [e for e in of_kind(events, Metrics) if e.step > warmup_steps]
    if len(metrics) < 2:
        raise BenchError(f"fewer than 2 metrics events after step {warmup_steps}: the run was too short")
    first, last = metrics[0], metrics[-1]
    ws = last.world_size
    samples = (last.step - first.step) * batch * ws
    seconds = last.ts - first.ts
    return {
        "samples_per_sec": samples / seconds,
        "interval_median_samples_per_sec": statistics.median(e.samples_per_sec or 0.0 for e in metrics[1:]),
        "step_seconds_median": statistics.median(e.step_seconds or 0.0 for e in metrics[1:]),
        "steps_measured": last.step - first.step,
        "seconds_measured": seconds,
        "window_ts": [first.ts, last.ts],
        "world_size": ws,
    }


def add_cpu_usage(out: dict[str, Any], monitor: TreeCpuMonitor) -> dict[str, Any]:
    """Add what the job's processes used in the steady window: cores busy, CPU ms per sample, and the steal
    fraction of the machine (another tenant's load shows there, not in our processes)."""
    window = monitor.between(*out["window_ts"])
    if window is not None and window["seconds"] > 0:
        cores = window["cpu_seconds"] / window["seconds"]
        out["cores_busy"] = cores
        out["cpu_ms_per_sample"] = 1000 * cores / out["samples_per_sec"]
        out["steal_fraction"] = window["steal_fraction"]
    return out


def run_elastictrain(
    workdir: Path, *, world_size: int, max_steps: int, timeout: float = 300, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One ``elastictrain train`` job on ``world_size`` logical hosts; returns throughput and commit events.
    ``overrides`` are merged into :func:`throughput_config` (section by section)."""
    workdir = workdir.resolve()  # the job runs in it
    hosts = local_logical_hosts()[:world_size]
    if len(hosts) < world_size:
        raise BenchError(f"this machine has {len(hosts)} logical hosts, {world_size} needed")
    cfg = merge_config(throughput_config(workdir / "run", max_steps=max_steps, world_size=world_size), overrides)
    job = ElasticJob(
        workdir,
        cfg,
        hosts,
        min_np=world_size,
        max_np=world_size,
        gloo_timeout=30,
        cooldown=(5, 60),
        threads=threads_per_worker(world_size),
    )
    t0 = time.monotonic()
    monitor: TreeCpuMonitor | None = None
    try:
        job.start()
        assert job.proc is not None
        monitor = TreeCpuMonitor(job.proc.pid).start()
        rc = job.wait_exit(timeout)
        if rc != 0:
            raise BenchError(f"elastictrain train exited {rc}:\n{job.tail(20)}")
        events = job.events()
    finally:
        if monitor is not None:
            monitor.stop()
        job.close()
    out = add_cpu_usage(steady_throughput(events, batch=cfg["data"].get("batch_size", 32)), monitor)
    out["commit_seconds"] = [e.commit_seconds for e in of_kind(events, Commit) if e.step > 0]
    out["checkpoint_stall_seconds"] = [e.stall_seconds for e in of_kind(events, Checkpoint)]
    out["wall_seconds"] = time.monotonic() - t0
    return out


def run_plain_horovod(
    workdir: Path, *, world_size: int, max_steps: int, timeout: float = 300, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The plain non-elastic Horovod loop with ``horovodrun -np world_size`` on the same config."""
    workdir = workdir.resolve()  # horovodrun runs in it
    hosts = local_logical_hosts()[:world_size]
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "job.yaml"
    cfg = merge_config(throughput_config(workdir / "run", max_steps=max_steps, world_size=world_size), overrides)
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {
        **checkout_env(),  # the worker is ``python -m bench.baseline_worker``, started in workdir
        "PATH": f"{BIN_DIR}:{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": str(threads_per_worker(world_size)),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        str(BIN_DIR / "horovodrun"),
        "-np", str(world_size),
        "-H", ",".join(f"{h}:1" for h in hosts),
        "--network-interfaces", "lo",
        "--gloo",
        "--gloo-timeout-seconds", "30",
        sys.executable, "-m", "bench.baseline_worker", "plain", "--config", str(cfg_path),
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(workdir / "horovodrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)
        monitor = TreeCpuMonitor(proc.pid).start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            monitor.stop()
            kill_tree(proc.pid)
            proc.wait(timeout=10)
    if rc != 0:
        tail = "\n".join((workdir / "horovodrun.log").read_text(errors="replace").splitlines()[-20:])
        raise BenchError(f"plain Horovod loop {'timed out' if rc is None else f'exited {rc}'}:\n{tail}")
    out = add_cpu_usage(
        steady_throughput(read_events(workdir / "run" / layout.EVENTS), batch=cfg["data"].get("batch_size", 32)),
        monitor,
    )
    out["wall_seconds"] = time.monotonic() - t0
    return out
