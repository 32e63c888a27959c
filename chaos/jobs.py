"""The job harness: a real elastic job, started either way the project starts one, and acted on by pid.

- :class:`LaunchedJob`: ``elastictrain launch`` (embedded etcd, agents, horovodrun, the supervisor), the way a user
  runs a job; the handle of every chaos scenario and tier (:mod:`chaos.scenarios`, :mod:`chaos.netns`,
  :mod:`chaos.campaign`). It restarts a host's agent with the command the launcher gave it and finds what is left
  of the job by pid and environment.
- :class:`ElasticJob`: ``horovodrun`` alone, with the command lines ``launch`` builds
  (:func:`~elastictrain.commands.runner_command`, :func:`~elastictrain.commands.train_command`), over a hosts file
  that a tiny discovery script prints: membership is set by the caller (:meth:`ElasticJob.set_hosts`), and the
  benchmarks' stock-Horovod contenders run their own worker under Horovod's own ``horovodrun``. horovodrun runs
  ``localhost``, ``127.0.0.1``, this machine's hostname and its primary address locally but treats them as distinct
  hosts (:func:`~elastictrain.launcher.hosts.local_logical_hosts`), so killing one host's workers blacklists no other.

Both read what the job wrote through :class:`JobRecords` (``events.jsonl``: steps, world size, checkpoints) and wait
through one polling loop that ends with :attr:`error` when the job's process exits first or a deadline passes
(:class:`~chaos.procs.HarnessError` for tests and benchmarks, :class:`~elastictrain.errors.ScenarioError` for
scenarios). Not a user API: the integration tests, the benchmarks and the chaos runner all start jobs here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, overload

import psutil
import yaml

from chaos import faults
from chaos.procs import (
    BIN_DIR,
    HarnessError,
    JobNotFound,
    JobRef,
    checkout_env,
    environ,
    kill_tree,
    read_launch_state,
    wait_until,
)
from elastictrain import envnames
from elastictrain.commands import elastictrain_command, runner_command, train_command
from elastictrain.errors import ScenarioError
from elastictrain.fileio import write_atomic
from elastictrain.launcher.processes import is_alive, runs_train
from elastictrain.rundir import layout
from elastictrain.rundir.events import Checkpoint, E, Event, Metrics, Reset, Start, of_kind, read_events

HOROVODRUN = runner_command()
"""horovodrun as ``elastictrain launch`` starts it (:mod:`elastictrain.horovod.hvdrun`: a cheap discovery executor)."""
STOCK_HOROVODRUN = [str(BIN_DIR / "horovodrun")]
"""Horovod's own horovodrun, for the stock-Horovod contenders of the benchmarks."""

# Launcher flags of every chaos run: a short Gloo timeout that still covers a new worker's start-up on 2 cores,
# quick blacklist cooldown, short drain grace. The seed's job: 3 logical hosts, min 2 workers.
GLOO_TIMEOUT_SECONDS = 15
LAUNCH_FLAGS = (
    "--gloo-timeout-seconds", str(GLOO_TIMEOUT_SECONDS),
    "--blacklist-cooldown-range", "1", "2",
    "--drain-grace", "2",
    "--wait-hosts-seconds", "90",
    "--stop-timeout", "30",
)  # fmt: skip


# ------------------------------------------------------------------------------------------- what a job wrote
class JobRecords:
    """What a job wrote to its run_dir, and waits on it that end when the job's process exits first.

    A subclass names its run_dir, its process (:meth:`_process`), its log (:attr:`log_path`) and the
    :attr:`error` its waits raise.
    """

    error: ClassVar[type[Exception]] = HarnessError
    error_with_tail: ClassVar[bool] = True
    """Whether an error carries the log's tail (a scenario's error is one line for the user)."""
    run_dir: Path
    log_path: Path
    exit_code: int | None = None
    """The job's exit code once :meth:`wait_exit` saw it end."""

    def _process(self) -> subprocess.Popen[Any] | None:
        raise NotImplementedError

    @property
    def events_path(self) -> Path:
        return self.run_dir / layout.EVENTS

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

    def world_size(self) -> int | None:
        for e in reversed(self.events()):
            if isinstance(e, Start | Reset | Metrics):
                return e.world_size
        return None

    def checkpoint_steps(self) -> list[int]:
        return [e.step for e in self.events(Checkpoint)]

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the job's log."""
        path = self.log_path
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def wait_for(self, predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> Any:
        """What ``predicate`` returns once it is truthy; :attr:`error` when ``timeout`` seconds pass or the job's
        process exits first (with the log's tail)."""
        proc = self._process()
        if proc is None:
            raise self.error("the job was not started")

        def check() -> object:
            value = predicate()
            if not value and proc.poll() is not None:
                raise self.error(f"the job exited ({proc.returncode}) while waiting for {what}{self._tail_for_error()}")
            return value

        try:
            return wait_until(check, timeout, interval, what)
        except HarnessError as e:
            if isinstance(e, self.error):
                raise
            raise self.error(str(e)) from None

    def wait_exit(self, timeout: float = 240) -> int:
        """The job's exit code once its process exits; :attr:`error` after ``timeout`` seconds."""
        proc = self._process()
        if proc is None:
            raise self.error("the job was not started")
        try:
            self.exit_code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self.error(f"the job did not finish within {timeout:g}s{self._tail_for_error()}") from None
        return self.exit_code

    def _tail_for_error(self) -> str:
        return f":\n{self.tail()}" if self.error_with_tail else ""

    def wait_step(self, step: int, timeout: float = 120) -> None:
        self.wait_for(lambda: self.step() >= step, timeout, f"step {step} in {self.events_path}")

    def wait_world(self, size: int, timeout: float = 120) -> None:
        self.wait_for(lambda: self.world_size() == size, timeout, f"world size {size}")

    def wait_event(self, kind: type[E], predicate: Callable[[E], bool], timeout: float = 120, what: str = "") -> E:
        """The first event of ``kind`` that satisfies ``predicate``, waiting for it up to ``timeout`` seconds."""
        found: E = self.wait_for(
            lambda: next((e for e in self.events(kind) if predicate(e)), None), timeout, what or "an event"
        )
        return found


# ------------------------------------------------------------------------------------ under elastictrain launch
class LaunchedJob(JobRecords):
    """One job under ``elastictrain launch`` (possibly launched again after ``kill-job``), and its faults."""

    error = ScenarioError
    error_with_tail = False

    def __init__(
        self,
        run_dir: Path,
        cfg: dict[str, Any],
        *,
        flags: tuple[str, ...] = LAUNCH_FLAGS,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.run_dir = run_dir.resolve()
        self.cfg = {**cfg, "run_dir": str(self.run_dir)}
        self.job_name = str(cfg["job"])
        self.flags = flags
        self.env = dict(env or {})
        """The launcher's environment on top of this process's (the multi-node tier puts its ssh first on PATH)."""
        self.config_path = self.run_dir / "job.yaml"
        self.log = faults.ChaosLog(self.run_dir / "chaos.jsonl")
        self.launcher: subprocess.Popen[bytes] | None = None
        self.launch_ids: list[str] = []
        self.agent_specs: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.restarted: list[subprocess.Popen[bytes]] = []
        self.exit_code = None
        self.started = 0.0

    # -- life
    def start(self) -> LaunchedJob:
        self.agent_specs = {}  # a relaunch starts agents of its own (another embedded etcd endpoint)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.cfg, sort_keys=False))
        env = {
            **os.environ,
            "PATH": f"{BIN_DIR}:{os.environ.get('PATH', '')}",
            envnames.LOG_LEVEL: "warning",
            envnames.JOB: self.job_name,  # inherited by etcd and the agents too: all found by environment
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        env.pop(envnames.ETCD, None)
        cmd = elastictrain_command("launch", "--config", str(self.config_path), *self.flags)
        with self.log_path.open("ab") as out:
            self.launcher = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started = time.monotonic()
        self.exit_code = None
        self.wait_for(self._launch_ready, 120, "the launcher's launch.json with horovodrun running")
        return self

    def _launch_ready(self) -> bool:
        state = read_launch_state(self.run_dir)
        if not state or not state.get("horovodrun_pid") or self.launcher is None:
            return False
        if state.get("pid") != self.launcher.pid:
            return False
        if state["launch_id"] not in self.launch_ids:
            self.launch_ids.append(state["launch_id"])
        job = self.job()
        for host in state.get("hosts", []):
            if host not in self.agent_specs:
                with contextlib.suppress(JobNotFound, psutil.Error):
                    agent = job.agent(host)
                    self.agent_specs[host] = (agent.cmdline(), environ(agent))
        return True

    def job(self) -> JobRef:
        return JobRef.resolve(self.job_name, self.run_dir)

    @property
    def log_path(self) -> Path:  # type: ignore[override]
        return self.run_dir / "launch.log"

    def _process(self) -> subprocess.Popen[Any] | None:
        return self.launcher

    def running(self) -> bool:
        return self.launcher is not None and self.launcher.poll() is None

    def victim_host(self) -> str:
        """A host whose worker is not rank 0 (so a host fault does not also hit the ledger writer)."""
        job = self.job()
        r0 = job.rank0()
        hosts = [w.host for w in job.workers() if r0 is None or w.pid != r0.pid]
        if not hosts:
            raise ScenarioError("no worker besides rank 0 to aim at")
        return sorted(hosts)[-1]

    # -- hosts coming back
    def restart_agent(self, host: str, timeout: float = 30) -> None:
        """Start the host's agent again with the command and environment the launcher gave the first one."""
        cmd, env = self.agent_specs[host]
        job = self.job()
        with contextlib.suppress(JobNotFound):
            old = job.agent(host)
            self.wait_for(lambda: not is_alive(old), timeout, f"the old agent of {host} to exit")
        with (self.run_dir / "logs" / f"agent-{host}-restarted.log").open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.restarted.append(proc)
        self.log.log("host-returns", job=self.job_name, host=host, agent_pid=proc.pid)

    def stop_restarted_agents(self) -> None:
        for proc in self.restarted:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                    proc.send_signal(signal.SIGTERM)  # a second signal skips the drain grace
        for proc in self.restarted:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def leftovers(self, settle_seconds: float = 15.0) -> list[str]:
        """Processes of the job still alive once the launcher has gone (polled for ``settle_seconds``)."""
        job = self.job()
        deadline = time.monotonic() + settle_seconds
        while True:
            procs = job.processes(self.launch_ids)
            if not procs or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                out.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        return out

    def close(self) -> list[str]:
        """After the job (or a failed scenario): end it if it still runs, stop the agents a scenario restarted,
        and return the job's processes that were still alive (then killed, by pid): none is the invariant."""
        if self.running():
            self.kill_everything()
        self.stop_restarted_agents()
        leftovers = self.leftovers()
        if leftovers:
            self.kill_everything()
        return leftovers

    def kill_everything(self) -> None:
        """Last resort after a failed scenario: SIGKILL every process of the job, by pid."""
        if self.launcher is not None and self.launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.launcher.kill()
            self.launcher.wait(timeout=10)
        for proc in self.restarted:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        procs = self.job().processes(self.launch_ids)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)


# ------------------------------------------------------------------------------------------ horovodrun alone
@dataclass
class ElasticJob(JobRecords):
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
    proc: subprocess.Popen[Any] | None = None
    started: float = 0.0
    extra_env: dict[str, str] = field(default_factory=dict)
    log: IO[str] | None = None

    def __post_init__(self) -> None:
        # horovodrun runs in workdir: a relative workdir or run_dir would name other folders there.
        self.workdir = Path(self.workdir).resolve()
        if "run_dir" in self.config:
            self.config = {**self.config, "run_dir": str(Path(self.config["run_dir"]).resolve())}

    @property
    def run_dir(self) -> Path:  # type: ignore[override]
        return Path(self.config["run_dir"])

    @property
    def log_path(self) -> Path:  # type: ignore[override]
        return self.workdir / "horovodrun.log"

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

    def _process(self) -> subprocess.Popen[Any] | None:
        return self.proc

    def _running(self) -> subprocess.Popen[Any]:
        if self.proc is None:
            raise HarnessError("the job was not started")
        return self.proc

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
