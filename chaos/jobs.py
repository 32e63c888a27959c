"""Run a real ``horovodrun`` job on logical local hosts, and act on it (kill a worker, change the hosts).

horovodrun runs ``localhost``, ``127.0.0.1``, this machine's hostname and its primary address locally,
but treats them as distinct hosts, so killing the workers of one host does not blacklist the rest
(tests and benchmarks take them from ``launch``'s :func:`~elastictrain.launcher.hosts.local_logical_hosts`).
Membership is controlled through a hosts file that a tiny discovery script prints. Not a user API: the
integration tests (with the small job config of ``tests/fixtures/elastic_job.py``) and the benchmarks run their
jobs through it; a timeout or an early end raises :class:`~chaos.procs.HarnessError`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, overload

import psutil
import yaml

from chaos.procs import BIN_DIR, HarnessError, checkout_env, kill_tree, wait_until
from elastictrain import envnames
from elastictrain.commands import runner_command, train_command
from elastictrain.fileio import write_atomic
from elastictrain.launcher.processes import runs_train
from elastictrain.rundir import layout
from elastictrain.rundir.events import E, Event, of_kind, read_events

HOROVODRUN = runner_command()
"""horovodrun as ``elastictrain launch`` starts it (:mod:`elastictrain.horovod.hvdrun`: a cheap discovery executor)."""
STOCK_HOROVODRUN = [str(BIN_DIR / "horovodrun")]
"""Horovod's own horovodrun, for the stock-Horovod contenders of the benchmarks."""


@dataclass
class ElasticJob:
    """One elastic horovodrun job over a hosts file; every process it started is killed by pid in :meth:`close`.

    ``command`` builds the worker command from the config path (default: ``elastictrain train``);
    the benchmark's stock-Horovod baseline passes its own worker.
    """

    workdir: Path
    config: dict[str, Any]
    hosts: list[str]
    min_np: int = 2
    max_np: int = 3
    gloo_timeout: int = 60  # bounds the rendezvous with a starting worker; the watchdog cuts failures short
    cooldown: tuple[int, int] = (1, 2)
    """horovodrun ``--blacklist-cooldown-range``."""
    threads: int = 1
    """OMP_NUM_THREADS of every worker."""
    command: Callable[[Path], list[str]] = train_command
    launcher: list[str] = field(default_factory=lambda: list(HOROVODRUN))
    """The horovodrun command (default: :data:`HOROVODRUN`)."""
    proc: subprocess.Popen | None = None
    started: float = 0.0
    extra_env: dict[str, str] = field(default_factory=dict)
    log: IO[str] | None = None

    def __post_init__(self) -> None:
        # horovodrun runs in workdir: a relative workdir or run_dir would name other folders there.
        self.workdir = Path(self.workdir).resolve()
        if "run_dir" in self.config:
            self.config = {**self.config, "run_dir": str(Path(self.config["run_dir"]).resolve())}

    @property
    def run_dir(self) -> Path:
        return Path(self.config["run_dir"])

    @property
    def events_path(self) -> Path:
        return self.run_dir / layout.EVENTS

    def set_hosts(self, hosts: list[str]) -> None:
        """Replace the hosts that discovery lists (atomically); horovodrun notices within about a second."""
        # not durable: a scratch file read by the discovery script of a benchmark job that a crash ends anyway
        write_atomic(self.workdir / "hosts.txt", "".join(f"{h}:1\n" for h in hosts), durable=False)
        self.hosts = list(hosts)

    def start(self) -> ElasticJob:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.workdir / "job.yaml"
        text = yaml.safe_dump(self.config)
        # Written only when it differs: warm zygotes of this job (bench.hotjoin) may have read it already, and a
        # zygote that sees its config's mtime change refuses to fork and re-warms (the workers would start cold).
        if not cfg_path.exists() or cfg_path.read_text() != text:
            cfg_path.write_text(text)
        self.set_hosts(self.hosts)
        script = self.workdir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.workdir / 'hosts.txt'}\n")
        script.chmod(0o755)
        env = {
            **checkout_env(),  # the benchmarks' baseline workers are ``python -m bench.baseline_worker``
            "PATH": f"{BIN_DIR}:{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": str(self.threads),
            envnames.LOG_FORMAT: "json",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        cmd = [
            *self.launcher,
            "-np", str(min(len(self.hosts), self.max_np)),
            "--min-np", str(self.min_np),
            "--max-np", str(self.max_np),
            "--host-discovery-script", str(script),
            "--network-interfaces", "lo",
            "--gloo",
            "--gloo-timeout-seconds", str(self.gloo_timeout),
            "--blacklist-cooldown-range", str(self.cooldown[0]), str(self.cooldown[1]),
            *self.command(cfg_path),
        ]  # fmt: skip
        self.log = open(self.workdir / "horovodrun.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir, start_new_session=True
        )
        self.started = time.time()
        return self

    def _running(self) -> subprocess.Popen:
        if self.proc is None:
            raise HarnessError("the job was not started")
        return self.proc

    @overload
    def events(self) -> list[Event]: ...

    @overload
    def events(self, kind: type[E]) -> list[E]: ...

    def events(self, kind: type[Event] = Event) -> list[Any]:
        """The run log's events (only those of ``kind`` when given); [] before the file exists."""
        try:
            evs = read_events(self.events_path, on_skip=lambda line, reason: None)
        except FileNotFoundError:
            return []
        return of_kind(evs, kind)

    def step(self) -> int:
        return max((e.step for e in self.events()), default=0)

    def wait_step(self, step: int, timeout: float = 120) -> None:
        proc = self._running()
        wait_until(
            lambda: self.step() >= step or proc.poll() is not None,
            timeout,
            what=f"step {step} in {self.events_path}",
        )
        if proc.poll() is not None:
            raise HarnessError(f"job ended early (exit {proc.returncode}):\n{self.tail()}")

    def wait_event(self, kind: type[E], predicate: Callable[[E], bool], timeout: float = 120, what: str = "") -> E:
        """The first event of ``kind`` that satisfies ``predicate``, waiting for it up to ``timeout`` seconds."""
        proc = self._running()

        def find() -> E | None:
            return next((e for e in of_kind(self.events(), kind) if predicate(e)), None)

        found = wait_until(lambda: find() or proc.poll() is not None, timeout, what=what or "an event")
        if not isinstance(found, kind):
            raise HarnessError(f"job ended before {what or 'the event'} (exit {proc.returncode}):\n{self.tail()}")
        return found

    def workers(self) -> list[psutil.Process]:
        """Worker processes of this job: descendants of horovodrun that Horovod gave a rank."""
        proc = self._running()
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    cmd = p.cmdline()
                    # horovodrun's own shell and middleman run ``sh -c`` / ``python -c``; a worker is
                    # ``elastictrain train`` or a ``python -m`` worker of the benchmarks' baselines.
                    worker = runs_train(cmd) or (len(cmd) > 2 and cmd[1] == "-m")
                    if "HOROVOD_RANK" in p.environ() and worker:
                        found[p.pid] = p
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        # A forked helper (checkpoint writer) inherits the command line and environment: keep the parents.
        out = []
        for p in found.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.ppid() not in found:
                    out.append(p)
        return out

    def worker(self, *, rank: int | None = None, host: str | None = None) -> psutil.Process:
        for p in self.workers():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                env = p.environ()
                if (rank is None or env.get("HOROVOD_RANK") == str(rank)) and (
                    host is None or env.get("HOROVOD_HOSTNAME") == host
                ):
                    return p
        raise HarnessError(f"no worker with rank={rank} host={host}")

    def kill_worker(self, *, rank: int, sig: int = signal.SIGKILL) -> tuple[str, float]:
        """Send ``sig`` to the worker of ``rank``; returns its host and the unix time of the kill."""
        p = self.worker(rank=rank)
        host = p.environ()["HOROVOD_HOSTNAME"]
        t = time.time()
        p.send_signal(sig)
        return host, t

    def wait(self, timeout: float = 240) -> int:
        proc = self._running()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise HarnessError(f"job did not finish in {timeout}s:\n{self.tail()}") from None

    def tail(self, n: int = 60) -> str:
        path = self.workdir / "horovodrun.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def close(self) -> None:
        """Kill horovodrun and every process under it (by pid), and close the log."""
        if self.proc is not None:
            kill_tree(self.proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self.log is not None:
            self.log.close()
            self.log = None
