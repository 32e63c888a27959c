"""One chaos job under ``elastictrain launch``, the handle every scenario and tier acts through.

:class:`Run` writes the job's config, starts the launcher (with :data:`LAUNCH_FLAGS` and any tier's
flags and environment), waits on what the job writes (``events.jsonl``, ``launch.json``), restarts a
host's agent with the command the launcher gave it, and finds what is left of the job by pid and
environment. Waits end with :class:`ScenarioError` (from :mod:`elastictrain.errors`) when the launcher
exits first or a deadline passes. Scenario code (:mod:`chaos.scenarios`) and the multi-node tier
(:mod:`chaos.netns`) both build on this module; it imports neither.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil
import yaml

from chaos import faults
from chaos.procs import BIN_DIR, HarnessError, JobNotFound, JobRef, environ, read_launch_state, wait_until
from elastictrain import envnames
from elastictrain.commands import elastictrain_command
from elastictrain.errors import ScenarioError as ScenarioError
from elastictrain.launcher.processes import is_alive
from elastictrain.rundir import layout
from elastictrain.rundir.events import Checkpoint, Event, Metrics, Reset, Start, of_kind, read_events

# Launcher flags of every run: a short Gloo timeout that still covers a new worker's start-up on 2 cores,
# quick blacklist cooldown, short drain grace. The seed's job: 3 logical hosts, min 2 workers.
GLOO_TIMEOUT_SECONDS = 15
LAUNCH_FLAGS = (
    "--gloo-timeout-seconds", str(GLOO_TIMEOUT_SECONDS),
    "--blacklist-cooldown-range", "1", "2",
    "--drain-grace", "2",
    "--wait-hosts-seconds", "90",
    "--stop-timeout", "30",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- one launch
class Run:
    """One job under ``elastictrain launch`` (possibly launched again after ``kill-job``), and its faults."""

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
        self.exit_code: int | None = None
        self.started = 0.0

    # -- life
    def start(self) -> Run:
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
        with (self.run_dir / "launch.log").open("ab") as out:
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

    def running(self) -> bool:
        return self.launcher is not None and self.launcher.poll() is None

    def wait_for(self, predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> Any:
        """What ``predicate`` returns once it is truthy; ScenarioError when ``timeout`` seconds pass or the launcher
        exits first."""

        def check() -> object:
            value = predicate()
            if not value and self.launcher is not None and self.launcher.poll() is not None:
                raise ScenarioError(f"the launcher exited ({self.launcher.returncode}) while waiting for {what}")
            return value

        try:
            return wait_until(check, timeout, interval, what)
        except HarnessError as e:
            raise ScenarioError(str(e)) from None

    def wait_exit(self, timeout: float) -> int:
        assert self.launcher is not None
        try:
            self.exit_code = self.launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ScenarioError(f"the job did not finish within {timeout:g}s") from None
        return self.exit_code

    # -- what the job wrote
    def events(self) -> list[Event]:
        try:
            return read_events(self.run_dir / layout.EVENTS, on_skip=lambda line, reason: None)
        except FileNotFoundError:
            return []

    def step(self) -> int:
        return max((e.step for e in self.events()), default=0)

    def wait_step(self, step: int, timeout: float = 120) -> None:
        self.wait_for(lambda: self.step() >= step, timeout, f"step {step}")

    def world_size(self) -> int | None:
        for e in reversed(self.events()):
            if isinstance(e, Start | Reset | Metrics):
                return e.world_size
        return None

    def wait_world(self, size: int, timeout: float = 120) -> None:
        self.wait_for(lambda: self.world_size() == size, timeout, f"world size {size}")

    def checkpoint_steps(self) -> list[int]:
        return [e.step for e in of_kind(self.events(), Checkpoint)]

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
