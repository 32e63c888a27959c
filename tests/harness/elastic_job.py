"""Run a real ``elastictrain train`` job under real ``horovodrun`` on logical local hosts, and act on it.

horovodrun runs ``localhost``, ``127.0.0.1``, this machine's hostname and its primary address locally,
but treats them as distinct hosts, so killing the workers of one host does not blacklist the rest. The
test controls membership through a hosts file that a tiny discovery script prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from tests.fixtures.procs import REPO, VENV_BIN, kill_tree, wait_until


def logical_hosts() -> list[str]:
    """Names this machine answers to that horovodrun treats as separate local hosts (at least 3)."""
    names = ["localhost", "127.0.0.1"]
    hostname = socket.gethostname()
    for candidate in (hostname, _primary_address()):
        if candidate and candidate not in names and _is_local(candidate):
            names.append(candidate)
    return names


def _primary_address() -> str | None:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
        return next((a for a in out if "." in a), None)
    except (OSError, subprocess.SubprocessError):
        return None


def _is_local(name: str) -> bool:
    from horovod.runner.util.network import get_local_host_addresses  # type: ignore[import-not-found]

    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return False
    return addr in get_local_host_addresses() or addr.startswith("127.")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


@dataclass
class ElasticJob:
    """One horovodrun job over a hosts file; every process it started is killed by pid in :meth:`close`."""

    workdir: Path
    config: dict[str, Any]
    hosts: list[str]
    min_np: int = 2
    max_np: int = 3
    gloo_timeout: int = 10
    proc: subprocess.Popen | None = None
    started: float = 0.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return Path(self.config["run_dir"])

    @property
    def events_path(self) -> Path:
        return self.run_dir / "events.jsonl"

    def set_hosts(self, hosts: list[str]) -> None:
        tmp = self.workdir / "hosts.txt.tmp"
        tmp.write_text("".join(f"{h}:1\n" for h in hosts))
        os.replace(tmp, self.workdir / "hosts.txt")
        self.hosts = list(hosts)

    def start(self) -> ElasticJob:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.workdir / "job.yaml"
        cfg_path.write_text(yaml.safe_dump(self.config))
        self.set_hosts(self.hosts)
        script = self.workdir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.workdir / 'hosts.txt'}\n")
        script.chmod(0o755)
        env = {
            **os.environ,
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1",
            "ELASTICTRAIN_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        cmd = [
            str(VENV_BIN / "horovodrun"),
            "-np",
            str(min(len(self.hosts), self.max_np)),
            "--min-np",
            str(self.min_np),
            "--max-np",
            str(self.max_np),
            "--host-discovery-script",
            str(script),
            "--network-interfaces",
            "lo",
            "--gloo",
            "--gloo-timeout-seconds",
            str(self.gloo_timeout),
            "--blacklist-cooldown-range",
            "1",
            "2",
            sys.executable,
            "-m",
            "elastictrain.cli",
            "train",
            "--config",
            str(cfg_path),
        ]
        self.log = open(self.workdir / "horovodrun.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        self.started = time.time()
        return self

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        evs = read_jsonl(self.events_path)
        return [e for e in evs if name is None or e["event"] == name]

    def step(self) -> int:
        evs = self.events()
        return max((e["step"] for e in evs), default=0)

    def wait_step(self, step: int, timeout: float = 120) -> None:
        wait_until(
            lambda: self.step() >= step or self.proc.poll() is not None,
            timeout,
            what=f"step {step} in {self.events_path}",
        )
        assert self.proc.poll() is None, f"job ended early:\n{self.tail()}"

    def wait_event(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120, what: str = "") -> dict:
        def find() -> dict | None:
            return next((e for e in self.events() if predicate(e)), None)

        found = wait_until(lambda: find() or self.proc.poll() is not None, timeout, what=what or "an event")
        assert isinstance(found, dict), f"job ended before {what or 'the event'}:\n{self.tail()}"
        return found

    def workers(self) -> list[psutil.Process]:
        """Worker processes of this job: descendants of horovodrun running ``elastictrain.cli train``."""
        assert self.proc is not None
        out = []
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    cmd = p.cmdline()
                    if "elastictrain.cli" in cmd and "train" in cmd and "HOROVOD_RANK" in p.environ():
                        out.append(p)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        except psutil.NoSuchProcess:
            pass
        return out

    def worker(self, *, rank: int | None = None, host: str | None = None) -> psutil.Process:
        for p in self.workers():
            env = p.environ()
            if (rank is None or env.get("HOROVOD_RANK") == str(rank)) and (
                host is None or env.get("HOROVOD_HOSTNAME") == host
            ):
                return p
        raise AssertionError(f"no worker with rank={rank} host={host}")

    def kill_worker(self, *, rank: int, sig: int = signal.SIGKILL) -> tuple[str, float]:
        p = self.worker(rank=rank)
        host = p.environ()["HOROVOD_HOSTNAME"]
        t = time.time()
        p.send_signal(sig)
        return host, t

    def wait(self, timeout: float = 240) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not finish in {timeout}s:\n{self.tail()}") from None

    def tail(self, n: int = 60) -> str:
        path = self.workdir / "horovodrun.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def close(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if getattr(self, "log", None):
            self.log.close()


def job_config(run_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A small CPU job: synthetic 16x16 images, GroupNorm CNN, frequent commits, ledger on, MLflow off."""
    cfg: dict[str, Any] = {
        "job": "itest",
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {
            "kind": "synthetic",
            "image_size": 16,
            "batch_size": 16,
            "num_samples": 768,
            "num_val_samples": 96,
            "augment": False,
        },
        "training": {"epochs": 2, "base_lr": 0.02, "log_every_steps": 4, "seed": 3},
        "elastic": {"commit_every_steps": 3, "base_world_size": 2},
        "checkpoint": {"every_steps": 12, "writer": "thread"},
        "tracking": {"mlflow": False, "progress_bar": False},
        "audit": {"sample_ledger": True},
    }
    for dotted, value in overrides.items():
        node = cfg
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg
