"""``elastictrain launch``: run a job with one command, and supervise it across full preemptions.

Usage::

    elastictrain launch --config X [--set k=v ...] [--min-np N] [--max-np M] [--etcd URL] [--job J]
                        [--hosts H1,H2,...] [-- extra horovodrun flags]

Without ``--etcd`` (the *embedded* mode) the launcher starts an etcd of its own (data dir
``run_dir/etcd``, free loopback ports) and one agent per logical host of this machine
(:mod:`elastictrain.launcher.hosts`; ``--hosts`` picks them). With ``--etcd`` it uses the cluster's etcd
and starts no agents: every node runs its own ``elastictrain agent`` (docs/multinode.md).

It prints the ``horovodrun`` command (with the environment it sets) so that users can run it
themselves, runs it, and supervises it; what follows each horovodrun is decided by
:func:`~elastictrain.launcher.decisions.decide_after_exit`:

- horovodrun exits 0 and ``events.jsonl`` ends with ``done``: the job is complete, exit 0.
- horovodrun exits non-zero after hosts were lost (their keys expired or their agents registered
  anew, e.g. a full preemption) or while fewer than ``--min-np`` slots are ready: wait up to
  ``--wait-hosts-seconds`` for ``--min-np`` ready slots and relaunch, at most ``--max-relaunches``
  times. The worker resumes from the latest checkpoint in the same MLflow run; ``ELASTICTRAIN_ATTEMPT``
  tells it the relaunch count.
- SIGTERM or SIGINT to the launcher: SIGTERM to every worker (rank 0 checkpoints the last commit and
  they exit 143), a deadline of ``--stop-timeout`` seconds, then SIGKILL of what is left; agents and the
  embedded etcd are stopped. Every process the launcher started is tracked by pid (with its
  descendants, through psutil; the launcher is also their child subreaper), so none remains.

The embedded etcd is kept up: when it exits while the job runs (killed, out of memory), the launcher starts it
again on the same ports and data dir, so the registry's keys and leases survive and the agents and
``discover.sh`` reconnect; a start that fails is retried every :data:`ETCD_RETRY_SECONDS`.

Signal handlers only record the signal; the loop polls and stops gracefully in ``finally``.

Exit codes (:mod:`elastictrain.launcher.decisions`):
    0    training completed
    1    horovodrun failed and no host was lost (a crash, not a preemption); not relaunched
    2    bad flags, config or environment (one line; nothing was started), or the embedded etcd or
         agents failed to start
    3    hosts lost and fewer than --min-np slots came back within --wait-hosts-seconds
    4    hosts lost again after --max-relaunches relaunches
    130  stopped by SIGINT
    143  stopped by SIGTERM (a stopped job is not a completed one; rerun to resume)

Size: a launch's whole life (start, supervise, relaunch, stop); what follows an exit is ``decisions.py``'s (pure).
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
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from discovery import endpoints as etcd_endpoints
from discovery.kv import EtcdKeyValue
from discovery.record import READY
from discovery.registry import EtcdRegistry, RegistryError
from elastictrain import envnames
from elastictrain.cliutil import EXIT_USAGE
from elastictrain.commands import (
    agent_command,
    format_command,
    horovodrun_command,
    launch_env,
)
from elastictrain.config import JobConfig, etcd_transport
from elastictrain.engine.tracking import read_run_id
from elastictrain.errors import LaunchError
from elastictrain.fileio import write_atomic
from elastictrain.launcher.decisions import (
    EXIT_HOSTS_TIMEOUT,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    HostWatch,
    decide_after_exit,
)
from elastictrain.launcher.etcd import EtcdError, EtcdServer, etcd_data_dir_in_use, find_etcd
from elastictrain.launcher.options import PROG, LaunchOptions
from elastictrain.launcher.processes import (
    ProcessTracker,
    create_time,
    die_with_parent,
    is_alive,
    is_remote_worker,
    is_worker,
    set_child_subreaper,
    terminate,
)
from elastictrain.logconf import get_logger
from elastictrain.rundir import layout
from elastictrain.rundir.events import training_completed_in
from elastictrain.rundir.outbox import Collector, OutboxStateError, outbox_prefix
from elastictrain.rundir.worker_error import WorkerError, first_cause, read_worker_errors
from elastictrain.tools.live_view import LiveView

log = get_logger("elastictrain.launcher.supervisor")


POLL_SECONDS = 0.2
REGISTRY_POLL_SECONDS = 1.0
COLLECT_SECONDS = 10.0
"""After horovodrun exits, how long the launcher keeps taking the workers' last records from etcd
(``elastic.outputs: etcd``) before it reads the run log."""
ETCD_START_SECONDS = 30.0
"""How long the embedded etcd may take to answer ``/health``."""
ETCD_RETRY_SECONDS = 5.0
"""After a failed start of the embedded etcd that had exited, the next try waits this long."""


class Launcher:
    """Starts etcd and agents (embedded mode), runs horovodrun, relaunches after preemptions, cleans up.

    Signal handlers only record the signal (:meth:`on_signal`); :meth:`run` polls and stops gracefully in
    ``finally``.
    """

    def __init__(
        self,
        opts: LaunchOptions,
        cfg: JobConfig,
        *,
        horovodrun: Sequence[str],
        etcd_binary: str | None = None,
        out: Callable[[str], None] | None = None,
    ) -> None:
        self.opts = opts
        self.cfg = cfg
        self.horovodrun = list(horovodrun)
        self.etcd_binary = etcd_binary
        self.run_dir = cfg.run_path.resolve()
        t = cfg.training
        self.live = LiveView(self.run_dir / layout.EVENTS, sys.stdout, every_seconds=opts.status_every_seconds,
                             epochs=t.epochs, max_steps=t.max_steps)  # fmt: skip
        self.out = self.live.around(out or (lambda line: print(f"{PROG}: {line}", flush=True)))
        self.tracker = ProcessTracker()
        self.launch_id = uuid.uuid4().hex
        self.stop_signal: int | None = None
        self.etcd_endpoint = opts.etcd or ""
        self.etcd: EtcdServer | None = None
        """The embedded etcd (None with ``--etcd``)."""
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.hvd_proc: subprocess.Popen[bytes] | None = None
        self.registry: EtcdRegistry | None = None
        self.collector: Collector | None = None
        """Writes what the workers put in etcd into this run_dir (``elastic.outputs: etcd``); None with files."""
        self.attempt = 0
        self.worker_error: WorkerError | None = None
        """Why the job failed, when a worker of the last attempt raised (:mod:`elastictrain.rundir.worker_error`)."""
        self.etcd_restarts = 0
        self._etcd_retry_at = 0.0

    # -- signals
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    # -- the whole life
    def run(self) -> int:
        set_child_subreaper()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        try:
            return self._supervise()
        finally:
            self.live.close()
            self.shutdown()

    def _supervise(self) -> int:
        if self.opts.embedded:
            try:
                self._start_etcd()
                self._start_agents()
            except LaunchError as e:
                self.out(f"error: {e}")
                return EXIT_USAGE
        self.registry = EtcdRegistry(
            self.etcd_endpoint,
            self.cfg.job,
            self.cfg.discovery.prefix,
            timeout_seconds=2.0,
            access=self.opts.etcd_access,
        )
        if etcd_transport("elastic.outputs", self.cfg.elastic.outputs, {envnames.ETCD: self.etcd_endpoint}) == "etcd":
            try:
                self.collector = Collector(
                    EtcdKeyValue(
                        self.etcd_endpoint,
                        self.cfg.job,
                        self.cfg.discovery.prefix,
                        timeout_seconds=2.0,
                        access=self.opts.etcd_access,
                    ),
                    outbox_prefix(self.cfg.discovery.prefix, self.cfg.job),
                    self.run_dir,
                )
            except OutboxStateError as e:
                self.out(f"error: {e}")
                return EXIT_USAGE
        relaunches = 0
        while True:
            if not self._wait_for_hosts():
                if self.stopping:
                    return self._stopped_code()
                self.out(
                    f"fewer than {self.opts.min_np} ready slots within {self.opts.wait_hosts_seconds:g}s; giving up"
                )
                return EXIT_HOSTS_TIMEOUT
            self.attempt = relaunches
            returncode, watch = self._run_attempt()
            self._collect(until_empty=COLLECT_SECONDS)  # the workers' last records, before the run log is read
            if returncode != 0 and not self.stopping:
                self._settle(watch)
            decision = decide_after_exit(
                returncode=returncode,
                completed=training_completed_in(self.run_dir / layout.EVENTS),
                hosts_lost=sorted(watch.lost),
                min_ready_slots=watch.min_ready_slots if watch.min_ready_slots is not None else 0,
                min_np=self.opts.min_np,
                relaunches=relaunches,
                max_relaunches=self.opts.max_relaunches,
                stop_signal=self.stop_signal,
                stalled=watch.stalled,
            )
            self.out(str(decision))
            if decision.exit_code is not None:
                if decision.exit_code != 0 and not self.stopping:
                    errors = read_worker_errors(self.run_dir, launch_id=self.launch_id, attempt=self.attempt)
                    self.worker_error = first_cause(errors)
                return decision.exit_code
            relaunches += 1

    def _stopped_code(self) -> int:
        return EXIT_INTERRUPTED if self.stop_signal == signal.SIGINT else EXIT_STOPPED

    def _keep_etcd(self) -> None:
        """Start the embedded etcd again when it has exited (see the module docstring)."""
        etcd = self.etcd
        if etcd is None or etcd.proc is None or etcd.proc.poll() is None or self.stopping:
            return
        now = time.monotonic()
        if now < self._etcd_retry_at:
            return
        self.out(f"embedded etcd exited ({etcd.proc.returncode}); starting it again at {etcd.endpoint} with its data")
        try:
            etcd.start(deadline_seconds=ETCD_START_SECONDS, abort=lambda: self.stopping)
        except EtcdError as e:
            self._etcd_retry_at = now + ETCD_RETRY_SECONDS
            self.out(f"embedded etcd did not start again ({str(e).splitlines()[0][:200]}); retrying")
            return
        finally:
            if etcd.proc is not None:
                self.tracker.add(etcd.proc)
        self.etcd_restarts += 1
        self._write_state()
        self.out(f"embedded etcd is back (pid {etcd.pid})")

    # -- embedded etcd and agents
    def _start_etcd(self) -> None:
        binary = self.etcd_binary or find_etcd()
        if not os.access(binary, os.X_OK):
            raise LaunchError(f"etcd binary not found ({binary}); install etcd-server or pass --etcd URL")
        data_dir = self.run_dir / "etcd"
        if etcd_data_dir_in_use(data_dir):
            raise LaunchError(
                f"{data_dir} is in use by a running etcd (left by a launcher that died?); stop it "
                f"(its pid is etcd_pid in {self.run_dir / layout.LAUNCH_STATE}) and launch again"
            )
        log = self.run_dir / "logs" / "etcd.log"
        self.etcd = EtcdServer(
            data_dir,
            log,
            binary,
            name=f"elastictrain-{self.cfg.job}",
            env={**os.environ, envnames.LAUNCH_ID: self.launch_id},
            # SIGTERM: etcd shuts down cleanly (and fast) when the launcher dies.
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        self.etcd_endpoint = self.etcd.endpoint
        try:
            # Membership is ephemeral (wipe): stale leases would only delay the agents.
            self.etcd.start(wipe=True, deadline_seconds=ETCD_START_SECONDS, abort=lambda: self.stopping)
        except EtcdError:
            if self.etcd.proc is not None and self.etcd.proc.poll() is not None:
                raise LaunchError(f"embedded etcd exited with {self.etcd.proc.returncode}; see {log}") from None
            raise LaunchError(f"embedded etcd not healthy within {ETCD_START_SECONDS:g}s; see {log}") from None
        finally:
            if self.etcd.proc is not None:
                self.tracker.add(self.etcd.proc)
        self.out(f"embedded etcd at {self.etcd_endpoint} (pid {self.etcd.pid}, data {data_dir})")
        self._write_state()

    def agent_command(self, host: str) -> list[str]:
        return agent_command(
            self.cfg.discovery,
            etcd=self.etcd_endpoint,
            job=self.cfg.job,
            host=host,
            drain_grace_seconds=self.opts.drain_grace_seconds,
            warm_config=self.opts.config.resolve() if self.opts.hot_join else None,
            warm_overrides=self.opts.overrides,
        )

    def start_agent(self, host: str) -> subprocess.Popen[bytes]:
        proc = self._spawn(self.agent_command(host), self.run_dir / "logs" / f"agent-{host}.log")
        self.agents[host] = proc
        self._write_state()
        return proc

    def _start_agents(self) -> None:
        for host in self.opts.hosts:
            self.start_agent(host)
        self.out(f"agents for {', '.join(self.opts.hosts)} (1 slot each)")

    def _spawn(
        self,
        args: list[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        *,
        parent_death_signal: int = signal.SIGKILL,
    ) -> subprocess.Popen[bytes]:
        """Start a service process (an agent); it gets ``parent_death_signal`` if the launcher dies."""
        full_env = {**os.environ, **(env or {}), envnames.LAUNCH_ID: self.launch_id}
        with log_path.open("ab") as log:
            # A new session: Ctrl-C in a terminal reaches only the launcher, which stops the rest in order.
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                preexec_fn=die_with_parent(parent_death_signal),
            )
        self.tracker.add(proc)
        return proc

    def _write_state(self) -> None:
        state: dict[str, Any] = {
            "pid": os.getpid(),
            "launch_id": self.launch_id,
            "job": self.cfg.job,
            "etcd": self.etcd_endpoint,
            "embedded": self.opts.embedded,
            "etcd_pid": self.etcd.pid if self.etcd else None,
            "agents": {h: p.pid for h, p in self.agents.items() if p.poll() is None},
            "horovodrun_pid": self.hvd_proc.pid if self.hvd_proc and self.hvd_proc.poll() is None else None,
            "attempt": self.attempt,
            "hosts": list(self.opts.hosts),
            "host": socket.gethostname(),  # ``status`` checks the pids only on this host
        }
        pids = [os.getpid(), state["etcd_pid"], state["horovodrun_pid"], *(p.pid for p in self.agents.values())]
        state["create_times"] = {str(p): t for p in pids if p is not None and (t := create_time(p)) is not None}
        write_atomic(self.run_dir / layout.LAUNCH_STATE, json.dumps(state, indent=2) + "\n", durable=False)

    # -- hosts
    def _collect(self, until_empty: float = 0.0) -> None:
        """Apply what the workers put in etcd to this run_dir (no-op with ``elastic.outputs: files``); with
        ``until_empty``, pass after pass until a pass finds nothing, for at most that many seconds."""
        if self.collector is None:
            return
        deadline = time.monotonic() + until_empty
        while True:
            try:
                applied = self.collector.collect()
            except (RegistryError, OSError) as e:
                log.warning("outbox_collect_failed", error=str(e)[:200])
                applied = 0
            if not applied or time.monotonic() >= deadline:
                return

    def _listing(self) -> list[Any] | None:
        assert self.registry is not None
        try:
            return list(self.registry.list_hosts().entries)
        except RegistryError:
            return None

    def _wait_for_hosts(self) -> bool:
        """Poll until ``--min-np`` slots are ready; False after ``--wait-hosts-seconds`` or a stop signal."""
        deadline = time.monotonic() + self.opts.wait_hosts_seconds
        said = False
        while not self.stopping:
            entries = self._listing()
            ready = sum(e.record.slots for e in entries or [] if e.record.state == READY)
            if ready >= self.opts.min_np:
                return True
            self._keep_etcd()
            if not said:
                self.out(
                    f"waiting up to {self.opts.wait_hosts_seconds:g}s for {self.opts.min_np} ready slots ({ready} now)"
                )
                said = True
            if time.monotonic() > deadline:
                return False
            self._sleep(REGISTRY_POLL_SECONDS)
        return False

    def _settle(self, watch: HostWatch) -> None:
        """After a failed horovodrun, watch the registry for one lease TTL: a preempted host's key expires then."""
        if watch.lost or (watch.min_ready_slots or 0) < self.opts.min_np:
            return
        deadline = time.monotonic() + self.cfg.discovery.ttl_seconds + 2
        while time.monotonic() < deadline and not self.stopping:
            entries = self._listing()
            if entries is not None:
                watch.observe(entries)
            if watch.lost or (watch.min_ready_slots or 0) < self.opts.min_np:
                return
            self._sleep(REGISTRY_POLL_SECONDS)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(POLL_SECONDS, left))

    # -- one horovodrun
    def _run_attempt(self) -> tuple[int, HostWatch]:
        env = launch_env(
            self.opts,
            etcd=self.etcd_endpoint,
            job=self.cfg.job,
            attempt=self.attempt,
            run_dir=self.run_dir,
            prefix=self.cfg.discovery.prefix,
        )
        cmd = horovodrun_command(self.opts, self.horovodrun)
        self.out(f"attempt {self.attempt}: {format_command(env, cmd)}")
        # The launcher's own ELASTICTRAIN_ETCD_* settings reach discover.sh only through ``env`` (none in the
        # embedded mode, whose etcd is plain loopback).
        inherited = {k: v for k, v in os.environ.items() if k not in etcd_endpoints.ENV_VARS}
        run_id = read_run_id(self.run_dir, {})  # the job's MLflow run, for workers on machines with empty disks
        if run_id is not None:
            env[envnames.MLFLOW_RUN_ID] = run_id
        self.hvd_proc = subprocess.Popen(
            cmd,
            env={**inherited, **env, envnames.LAUNCH_ID: self.launch_id},
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # If the launcher dies, horovodrun dies at once; its middlemen then end the workers (SIGTERM, then
            # SIGKILL after 5 s), as they do whenever horovodrun is killed.
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
        self.tracker.add(self.hvd_proc)
        self._write_state()
        watch = HostWatch()
        next_poll = 0.0
        no_worker_since: float | None = None
        while self.hvd_proc.poll() is None:
            if self.stopping:
                self._stop_workers()
                break
            if time.monotonic() >= next_poll:
                self._keep_etcd()
                entries = self._listing()
                if entries is not None:
                    watch.observe(entries)
                # A worker on another host shows here as horovodrun's ssh client that runs it.
                workers = [p for p in self.tracker.alive() if is_worker(p) or is_remote_worker(p)]
                now = time.monotonic()
                if workers or watch.ready_slots < self.opts.min_np:
                    no_worker_since = None
                elif no_worker_since is None:
                    no_worker_since = now
                elif now - no_worker_since > self.opts.stall_seconds:
                    # Seen in the chaos soak after a burst of kills: horovodrun kept running with no worker
                    # although every host was ready. A relaunch from the checkpoint ends the stall.
                    watch.stalled = (
                        f"no worker alive for {now - no_worker_since:.0f}s while {watch.ready_slots} slots were ready"
                    )
                    self.out(f"horovodrun stalled: {watch.stalled}; ending it")
                    terminate(self.hvd_proc)
                    break
                next_poll = now + REGISTRY_POLL_SECONDS
                self._collect()
            self.live.tick()
            time.sleep(POLL_SECONDS)
        rc = self.hvd_proc.wait() if self.hvd_proc.poll() is not None else -1
        # Nothing of this attempt may outlive it (a worker stuck in a rendezvous, a checkpoint writer).
        leftovers = [p for p in self.tracker.alive() if p.pid not in self._service_pids()]
        if leftovers and not self.stopping:
            self.tracker.kill_all(leftovers)
        self._write_state()
        return rc, watch

    def _service_pids(self) -> set[int]:
        """Agents, their warm zygotes (an agent's only children) and the embedded etcd."""
        agents = {p.pid for p in self.agents.values()}
        pids = set(agents)
        for p in self.tracker.alive():
            with contextlib.suppress(psutil.Error):
                if p.ppid() in agents:
                    pids.add(p.pid)
        if self.etcd is not None and self.etcd.pid is not None:
            pids.add(self.etcd.pid)
        return pids

    def _stop_workers(self) -> None:
        """SIGTERM every worker; wait for them (rank 0 checkpoints the last commit) and for horovodrun."""
        hvd = self.hvd_proc
        assert hvd is not None
        signalled: set[int] = set()
        deadline = time.monotonic() + self.opts.stop_timeout_seconds
        self.out(f"stopping: SIGTERM to the workers, waiting up to {self.opts.stop_timeout_seconds:g}s")
        while hvd.poll() is None and time.monotonic() < deadline:
            # Keep signalling new workers: horovodrun may start one while the others stop.
            for p in self.tracker.descendants(hvd.pid):
                if p.pid not in signalled and is_worker(p):
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(signal.SIGTERM)
                    signalled.add(p.pid)
            self.tracker.refresh()
            if signalled and not any(is_worker(p) and is_alive(p) for p in self.tracker.descendants(hvd.pid)):
                # Workers are gone; horovodrun ends once it has collected them.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    hvd.wait(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
                break
            time.sleep(POLL_SECONDS)
        if hvd.poll() is None:
            self.out("workers or horovodrun did not stop in time; killing them")
            self.tracker.refresh()
            self.tracker.kill_all(self.tracker.tree(hvd.pid))

    # -- cleanup
    def shutdown(self) -> None:
        """Stop horovodrun (if still running), the agents and the embedded etcd; kill anything left."""
        if self.hvd_proc is not None and self.hvd_proc.poll() is None:
            self.tracker.refresh()
            self.tracker.kill_all(self.tracker.tree(self.hvd_proc.pid))
        for proc in self.agents.values():  # a second SIGTERM skips the drain grace: revoke the lease, exit
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    time.sleep(0.05)
                    proc.send_signal(signal.SIGTERM)
        for proc in self.agents.values():
            terminate(proc, signal.SIGTERM, timeout=10)
        if self.registry is not None:
            with contextlib.suppress(Exception):
                self.registry.close()
        if self.etcd is not None:
            self.etcd.stop(signal.SIGTERM, timeout=10)
        self.tracker.kill_all()
        with contextlib.suppress(OSError):
            (self.run_dir / layout.LAUNCH_STATE).unlink()
