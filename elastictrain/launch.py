"""``elastictrain launch``: run a job with one command, and supervise it across full preemptions.

Usage::

    elastictrain launch --config X [--set k=v ...] [--min-np N] [--max-np M] [--etcd URL] [--job J]
                        [--hosts H1,H2,...] [-- extra horovodrun flags]

Without ``--etcd`` (the *embedded* mode) the launcher starts an etcd of its own (data dir
``run_dir/etcd``, free loopback ports) and one agent per logical host of this machine. Logical hosts
are names that horovodrun runs locally but blacklists separately: ``localhost``, ``127.0.0.1``, the
hostname and the primary address, those of them that resolve to this machine (``--hosts`` picks
them). With ``--etcd`` it uses the cluster's etcd and starts no agents: every node runs its own
``elastictrain agent`` (docs/multinode.md).

It prints the ``horovodrun`` command (with the environment it sets) so that users can run it
themselves, runs it, and supervises it:

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

Exit codes:
    0    training completed
    1    horovodrun failed and no host was lost (a crash, not a preemption); not relaunched
    2    bad flags, config or environment (one line; nothing was started), or the embedded etcd or
         agents failed to start
    3    hosts lost and fewer than --min-np slots came back within --wait-hosts-seconds
    4    hosts lost again after --max-relaunches relaunches
    130  stopped by SIGINT
    143  stopped by SIGTERM (a stopped job is not a completed one; rerun to resume)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import enum
import errno
import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import psutil

from discovery import endpoints as etcd_endpoints
from discovery.endpoints import EtcdAccess
from discovery.fileio import write_atomic
from discovery.record import READY, check_name
from discovery.registry import EtcdRegistry, RegistryError, RegistryUnavailable
from elastictrain.config import ConfigError, DiscoveryConfig, JobConfig, load_config
from elastictrain.config_cli import report_config_error
from elastictrain.lifeline import set_parent_death_signal

PROG = "elastictrain launch"
REPO = Path(__file__).resolve().parents[1]
DISCOVER_SCRIPT = REPO / "discovery" / "discover.sh"
LOCK_FILE = "launch.lock"
"""``run_dir/launch.lock``: flock'ed by the launcher for its whole life (one job per run_dir); names pid and host."""
STATE_FILE = "launch.json"
"""``run_dir/launch.json``: pids, etcd endpoint and hosts of the running launcher (for operators and the demo)."""
LAUNCH_ID_ENV = "ELASTICTRAIN_LAUNCH_ID"
"""Set in every process the launcher starts, so that a process of this job can be recognised by its environment."""

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_HOSTS_TIMEOUT = 3
EXIT_RELAUNCH_LIMIT = 4
EXIT_INTERRUPTED = 130
EXIT_STOPPED = 143

ZYGOTE_CLIENT = ("-m", "elastictrain.zygote", "client", "--")
POLL_SECONDS = 0.2
REGISTRY_POLL_SECONDS = 1.0


class LaunchError(Exception):
    """A user error found before anything was started (exit 2); the message is one line."""


# --------------------------------------------------------------------------------------------------
# options and the horovodrun command (pure)


@dataclass(kw_only=True, frozen=True, slots=True)
class LaunchOptions:
    """What ``elastictrain launch`` was asked to do, validated."""

    config: Path
    """The job's YAML config (passed to every worker as an absolute path)."""
    overrides: tuple[str, ...] = ()
    """``--set`` assignments, applied here and passed to every worker."""
    min_np: int = 1
    max_np: int = 1
    etcd: str | None = None
    """The cluster's etcd endpoints; None means an embedded etcd and local agents."""
    etcd_access: EtcdAccess | None = None
    """TLS files and credentials for the cluster's etcd (``--cacert`` ...), passed to discover.sh as
    ``ELASTICTRAIN_ETCD_*`` paths and the user name; the password stays in its file."""
    hosts: tuple[str, ...] = ()
    """Logical hosts to run agents for in the embedded mode."""
    extra: tuple[str, ...] = ()
    """horovodrun flags given after ``--``."""
    gloo_timeout_seconds: int = 60
    """Gloo timeout. It bounds the rendezvous in which old workers wait for a new one to start (import torch,
    init), so it must be generous on a slow machine. Survivors of a dead worker do not wait it out: the
    worker's collective watchdog aborts their blocked receives once a peer failure is known."""
    blacklist_cooldown: tuple[int, int] = (5, 60)
    """horovodrun ``--blacklist-cooldown-range``: a failed host returns after this many seconds (backing off)."""
    reset_limit: int = 100
    """horovodrun ``--reset-limit``: most resets within one horovodrun."""
    elastic_timeout_seconds: int = 600
    hot_join: bool = False
    """Each agent keeps a warm worker process (:mod:`elastictrain.zygote`) and horovodrun starts workers through
    its thin client, so a joining worker does not start an interpreter and import torch while the others wait."""

    @property
    def stall_seconds(self) -> float:
        """No worker alive this long, with enough hosts ready, means horovodrun is stuck: Gloo timeout +
        longest blacklist cooldown + a minute for workers to start."""
        return self.gloo_timeout_seconds + self.blacklist_cooldown[1] + 60

    """horovodrun ``--elastic-timeout``: how long it waits for ``--min-np`` slots before failing."""
    wait_hosts_seconds: float = 300.0
    """After a preemption: how long to wait for ``--min-np`` ready slots before giving up (exit 3)."""
    max_relaunches: int = 5
    stop_timeout_seconds: float = 60.0
    """After SIGTERM to the workers: how long they may take (rank 0 checkpoints) before SIGKILL."""
    drain_grace_seconds: float = 10.0
    """Of the embedded agents: seconds between SIGTERM (draining) and revoking the lease."""

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise LaunchError(f"--min-np must be >= 1, got {self.min_np}")
        if self.max_np < self.min_np:
            raise LaunchError(f"--max-np ({self.max_np}) must be >= --min-np ({self.min_np})")
        lo, hi = self.blacklist_cooldown
        if not 1 <= lo <= hi:
            raise LaunchError(f"--blacklist-cooldown-range must satisfy 1 <= MIN <= MAX, got {lo} {hi}")
        if self.gloo_timeout_seconds < 1:
            raise LaunchError(f"--gloo-timeout-seconds must be >= 1, got {self.gloo_timeout_seconds}")
        if self.max_relaunches < 0:
            raise LaunchError(f"--max-relaunches must be >= 0, got {self.max_relaunches}")
        for name, value in (
            ("--wait-hosts-seconds", self.wait_hosts_seconds),
            ("--stop-timeout", self.stop_timeout_seconds),
            ("--drain-grace", self.drain_grace_seconds),
            ("--elastic-timeout", self.elastic_timeout_seconds),
            ("--reset-limit", self.reset_limit),
        ):
            if not (math.isfinite(value) and value >= 0):  # NaN fails every comparison: test it first
                raise LaunchError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def embedded(self) -> bool:
        return self.etcd is None


def worker_command(opts: LaunchOptions, python: str = sys.executable) -> list[str]:
    """The command horovodrun starts on every slot: ``elastictrain train --config X [--set ...]``; with hot join,
    through the zygote's client (which runs that same command itself when the host has no warm zygote)."""
    script = Path(python).parent / "elastictrain"
    entry = [str(script)] if script.exists() else [python, "-m", "elastictrain.cli"]
    cmd = [*entry, "train", "--config", str(opts.config.resolve())]
    for assignment in opts.overrides:
        cmd += ["--set", assignment]
    return [python, *ZYGOTE_CLIENT, *cmd] if opts.hot_join else cmd


def horovodrun_command(opts: LaunchOptions, horovodrun: Sequence[str], python: str = sys.executable) -> list[str]:
    """The full horovodrun command line for ``opts``; ``horovodrun`` is the runner's argv prefix
    (:func:`runner_command`)."""
    lo, hi = opts.blacklist_cooldown
    cmd = [
        *horovodrun,
        "-np", str(opts.min_np),
        "--min-np", str(opts.min_np),
        "--max-np", str(opts.max_np),
        "--host-discovery-script", str(DISCOVER_SCRIPT),
    ]  # fmt: skip
    if opts.embedded:
        cmd += ["--network-interfaces", "lo"]
    cmd += [
        "--gloo",
        "--gloo-timeout-seconds", str(opts.gloo_timeout_seconds),
        "--blacklist-cooldown-range", str(lo), str(hi),
        "--reset-limit", str(opts.reset_limit),
        "--elastic-timeout", str(opts.elastic_timeout_seconds),
        *opts.extra,
    ]  # fmt: skip
    return cmd + worker_command(opts, python)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launch_env(
    opts: LaunchOptions,
    *,
    etcd: str,
    job: str,
    attempt: int,
    run_dir: Path,
    prefix: str | None = None,
    launch_id: str = "",
    cores: int | None = None,
) -> dict[str, str]:
    """The variables the launcher sets for horovodrun (and so for discover.sh and every worker)."""
    env = {
        "ELASTICTRAIN_ETCD": etcd,
        "ELASTICTRAIN_JOB": job,
        "ELASTICTRAIN_ATTEMPT": str(attempt),
        "ELASTICTRAIN_DISCOVER_CACHE": str(run_dir / "discover-cache.json"),
    }
    if prefix and prefix != "/elastictrain":
        env["ELASTICTRAIN_ETCD_PREFIX"] = prefix
    if opts.etcd_access is not None:
        env.update(opts.etcd_access.env())
    if opts.embedded:
        # Logical hosts share this machine's cores; Horovod's local_size is 1 on each, so say it here.
        env["OMP_NUM_THREADS"] = str(max(1, (cores or usable_cores()) // opts.max_np))
    if launch_id:
        env[LAUNCH_ID_ENV] = launch_id
    return env


def format_command(env: Mapping[str, str], cmd: Sequence[str]) -> str:
    """``VAR=value ... horovodrun ...`` as a shell line a user can paste."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd)])


# --------------------------------------------------------------------------------------------------
# logical hosts of this machine


def local_addresses() -> set[str]:
    """IPv4 addresses of this machine's interfaces (what horovodrun compares with to run a host locally)."""
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def primary_address() -> str | None:
    """The first IPv4 address of an interface that is up and not loopback (no packet is sent)."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def local_logical_hosts() -> list[str]:
    """``localhost``, ``127.0.0.1``, the hostname and the primary address: those that resolve to this machine."""
    local = local_addresses()
    out: list[str] = []
    for name in ("localhost", "127.0.0.1", socket.gethostname(), primary_address()):
        if name and name not in out and resolve(name) in local:
            out.append(name)
    return out


# --------------------------------------------------------------------------------------------------
# decisions (pure)


class Outcome(enum.Enum):
    COMPLETED = "completed"
    RELAUNCH = "relaunch"
    FAILED = "failed"
    RELAUNCH_LIMIT = "relaunch_limit"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the launcher decided after horovodrun ended, as an outcome and the sentence it prints."""

    outcome: Outcome
    reason: str
    exit_code: int | None = None

    def __str__(self) -> str:
        return self.reason


def decide_after_exit(
    *,
    returncode: int,
    completed: bool,
    hosts_lost: Sequence[str],
    min_ready_slots: int,
    min_np: int,
    relaunches: int,
    max_relaunches: int,
    stop_signal: int | None = None,
    stalled: str | None = None,
) -> Decision:
    """Decide what follows one horovodrun: pure, from its exit code, events.jsonl and what the registry showed."""
    if stop_signal is not None:
        code = EXIT_INTERRUPTED if stop_signal == signal.SIGINT else EXIT_STOPPED
        return Decision(Outcome.STOPPED, f"stopped by {signal.Signals(stop_signal).name}", code)
    if returncode == 0 and completed:
        return Decision(Outcome.COMPLETED, "training completed", EXIT_COMPLETED)
    if returncode == 0:
        return Decision(Outcome.FAILED, "horovodrun exited 0 but events.jsonl does not end with 'done'", EXIT_FAILED)
    why = []
    if hosts_lost:
        why.append(f"hosts lost: {', '.join(hosts_lost)}")
    if min_ready_slots < min_np:
        why.append(f"ready slots fell to {min_ready_slots} < --min-np {min_np}")
    if stalled:
        why.append(stalled)
    if not why:
        return Decision(
            Outcome.FAILED,
            f"horovodrun exited {returncode} while every host stayed registered (a failure, not a preemption)",
            EXIT_FAILED,
        )
    if relaunches >= max_relaunches:
        return Decision(
            Outcome.RELAUNCH_LIMIT,
            f"horovodrun exited {returncode} ({'; '.join(why)}) after {relaunches} relaunches "
            f"(--max-relaunches {max_relaunches}); giving up",
            EXIT_RELAUNCH_LIMIT,
        )
    return Decision(
        Outcome.RELAUNCH,
        f"horovodrun exited {returncode} ({'; '.join(why)}); relaunch {relaunches + 1} when hosts return",
    )


def training_completed(events_path: Path) -> bool:
    """Whether the last ``start``/``done``/``stopped`` event of ``events.jsonl`` is ``done``."""
    last = None
    try:
        with events_path.open("rb") as f:
            for raw in f:
                try:
                    event = json.loads(raw).get("event")
                except (ValueError, AttributeError):
                    continue
                if event in ("start", "done", "stopped"):
                    last = event
    except OSError:
        return False
    return last == "done"


@dataclass(slots=True)
class HostWatch:
    """What the registry showed during one attempt: hosts lost (vanished or registered anew, not drained)."""

    baseline: dict[str, tuple[int, float]] = field(default_factory=dict)
    """host -> (agent pid, registered_at) of the ready hosts when the attempt started."""
    drained: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    min_ready_slots: int | None = None
    ready_slots: int = 0
    stalled: str | None = None
    """Set when the launcher ended a horovodrun that kept no worker alive while enough hosts were ready."""

    def observe(self, entries: Iterable[Any]) -> None:
        """Feed one listing (``Listing.entries``)."""
        now: dict[str, tuple[int, float]] = {}
        ready = 0
        for e in entries:
            r = e.record
            if r.state == READY:
                ready += r.slots
            else:
                self.drained.add(r.host)
            now[r.host] = (r.pid, r.registered_at)
        if not self.baseline and self.min_ready_slots is None:
            self.baseline = {h: ident for h, ident in now.items() if h not in self.drained}
        for host, ident in self.baseline.items():
            if host not in self.drained and now.get(host) != ident:
                self.lost.add(host)
        self.ready_slots = ready
        self.min_ready_slots = ready if self.min_ready_slots is None else min(self.min_ready_slots, ready)


# --------------------------------------------------------------------------------------------------
# processes


class RunDirLock:
    """The exclusive ``flock`` on ``run_dir/launch.lock`` that makes one launcher the only driver of a run_dir.

    The lock belongs to the open file, which the launcher keeps until it exits (children never inherit it:
    the descriptor is close-on-exec), so it ends with the launcher however that ends, SIGKILL included.

    On a local filesystem this is exact. On NFS, Linux implements ``flock`` with the server's byte-range
    locks (NLM for NFSv3, the protocol's own locks for NFSv4), so two launchers on two machines exclude
    each other as long as the mount has locking (not ``nolock`` or ``local_lock=flock|all``, which keep
    locks on one client). When the launcher's machine dies or is cut off from the server, the server
    frees the lock only after the client's lease runs out (NFSv4: about 90 s) or its lock manager
    recovers; a launcher cut off longer than that may have lost its lock without knowing.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: Path) -> RunDirLock:
        """Take the lock (creating run_dir and the lock file if needed); :class:`LaunchError` naming the
        holder when another launcher has it. Nothing else in run_dir is read or written."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LaunchError(f"run_dir {run_dir}: cannot lock {path.name}: {e.strerror}") from None
            raise LaunchError(
                f"run_dir {run_dir} is driven by a live launcher ({_describe_holder(holder)}); "
                "stop it first or use another run_dir"
            ) from None
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}) + "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the file ends the flock
            self.fd = -1


def _describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {int(info['pid'])} on {check_name('host', info['host'])}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def etcd_data_dir_in_use(data_dir: Path) -> bool:
    """Whether a running etcd has ``data_dir`` open: its bbolt database holds an exclusive ``flock``
    (on NFS as on a local disk, see :class:`RunDirLock`). The probe takes a shared lock and releases it."""
    try:
        fd = os.open(data_dir / "member" / "snap" / "db", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def die_with_parent(sig: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when the launcher dies, SIGKILL and OOM included.

    Linux delivers it when the thread that forked the child exits; the launcher starts every process
    from its main thread. A launcher that died between fork and ``prctl`` is caught by the parent check.
    """
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def _set_child_subreaper() -> None:
    """Orphaned descendants (e.g. a worker whose horovodrun middleman died) re-parent to us, so we find them."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _runs_train(proc: psutil.Process) -> bool:
    try:
        return runs_train(proc.cmdline())
    except psutil.Error:
        return False


def runs_train(cmd: Sequence[str]) -> bool:
    """``[python] .../elastictrain train ...``, ``python -m elastictrain.cli train ...``, or either behind the
    zygote's client (the process horovodrun started; it relays signals to the warm-forked worker). Not
    horovodrun, whose command line contains the worker's further on (pure)."""
    if tuple(cmd[1:5]) == ZYGOTE_CLIENT:
        cmd = cmd[5:]
    for i, arg in enumerate(cmd[:3]):
        if (arg == "elastictrain" or arg.endswith("/elastictrain")) and cmd[i + 1 : i + 2] == ["train"]:
            return True
    return cmd[1:4] == ["-m", "elastictrain.cli", "train"]


def is_worker(proc: psutil.Process) -> bool:
    """An ``elastictrain train`` process: not the shell around it, nor a forked helper of it (checkpoint writer)."""
    if not _runs_train(proc):
        return False
    try:
        parent = proc.parent()
    except psutil.Error:
        return True
    return parent is None or not _runs_train(parent)


def ssh_runs_train(cmd: Sequence[str]) -> bool:
    """``ssh [opts] HOST '... elastictrain train ...'``: how horovodrun runs a worker on another host (pure)."""
    return bool(cmd) and Path(cmd[0]).name == "ssh" and any("elastictrain" in a and " train " in a for a in cmd[1:])


def is_remote_worker(proc: psutil.Process) -> bool:
    """An ssh client of horovodrun's that runs a worker on another host (the worker is not our descendant)."""
    try:
        return ssh_runs_train(proc.cmdline())
    except psutil.Error:
        return False


class ProcessTracker:
    """Every process the launcher started, and every descendant of them it has seen (identified by pid
    and create time, so a reused pid is never signalled)."""

    def __init__(self) -> None:
        self.seen: dict[int, psutil.Process] = {}
        self.popens: dict[int, subprocess.Popen[bytes]] = {}

    def add(self, popen: subprocess.Popen[bytes]) -> None:
        self.popens[popen.pid] = popen
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen[popen.pid] = psutil.Process(popen.pid)

    def refresh(self) -> None:
        """Record the current descendants of this process; reap orphans that re-parented to it."""
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for p in children:
            self.seen.setdefault(p.pid, p)
        for p in psutil.Process().children():
            if p.pid not in self.popens:
                with contextlib.suppress(OSError, psutil.Error):
                    if p.status() == psutil.STATUS_ZOMBIE:
                        os.waitpid(p.pid, os.WNOHANG)
        for pid, p in list(self.seen.items()):
            if not _alive(p):
                del self.seen[pid]

    def alive(self) -> list[psutil.Process]:
        self.refresh()
        return [p for p in self.seen.values() if _alive(p)]

    def descendants(self, pid: int) -> list[psutil.Process]:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def tree(self, pid: int) -> list[psutil.Process]:
        """``pid`` and its descendants."""
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_all(self, procs: Iterable[psutil.Process] | None = None) -> None:
        targets = list(self.alive() if procs is None else procs)
        for p in targets:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(targets, timeout=5)
        for popen in self.popens.values():
            with contextlib.suppress(Exception):
                popen.wait(timeout=1)
        self.refresh()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _terminate(popen: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    if popen is None or popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        popen.send_signal(sig)
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            popen.kill()
        popen.wait(timeout=5)


def etcd_healthy(endpoint: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=timeout) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------------------
# the launcher


class Launcher:
    """Starts etcd and agents (embedded mode), runs horovodrun, relaunches after preemptions, cleans up.

    Signal handlers only record the signal; :meth:`run` polls and stops gracefully in ``finally``.
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
        self.out = out or (lambda line: print(f"{PROG}: {line}", flush=True))
        self.run_dir = cfg.run_path.resolve()
        self.tracker = ProcessTracker()
        self.launch_id = uuid.uuid4().hex
        self.stop_signal: int | None = None
        self.etcd_endpoint = opts.etcd or ""
        self.etcd_proc: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.hvd_proc: subprocess.Popen[bytes] | None = None
        self.registry: EtcdRegistry | None = None
        self.attempt = 0

    # -- signals
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    # -- the whole life
    def run(self) -> int:
        _set_child_subreaper()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        try:
            return self._supervise()
        finally:
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
            if returncode != 0 and not self.stopping:
                self._settle(watch)
            decision = decide_after_exit(
                returncode=returncode,
                completed=training_completed(self.run_dir / "events.jsonl"),
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
                return decision.exit_code
            relaunches += 1

    def _stopped_code(self) -> int:
        return EXIT_INTERRUPTED if self.stop_signal == signal.SIGINT else EXIT_STOPPED

    # -- embedded etcd and agents
    def _start_etcd(self) -> None:
        binary = self.etcd_binary or shutil.which("etcd") or "/usr/bin/etcd"
        if not os.access(binary, os.X_OK):
            raise LaunchError(f"etcd binary not found ({binary}); install etcd-server or pass --etcd URL")
        data_dir = self.run_dir / "etcd"
        if etcd_data_dir_in_use(data_dir):
            raise LaunchError(
                f"{data_dir} is in use by a running etcd (left by a launcher that died?); stop it "
                f"(its pid is etcd_pid in {self.run_dir / STATE_FILE}) and launch again"
            )
        shutil.rmtree(data_dir, ignore_errors=True)  # membership is ephemeral; stale leases only delay agents
        client, peer = free_port(), free_port()
        self.etcd_endpoint = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        args = [
            binary,
            "--name", f"elastictrain-{self.cfg.job}",
            "--data-dir", str(data_dir),
            "--listen-client-urls", self.etcd_endpoint,
            "--advertise-client-urls", self.etcd_endpoint,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"elastictrain-{self.cfg.job}={peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
        ]  # fmt: skip
        # SIGTERM: etcd shuts down cleanly (and fast) when the launcher dies.
        self.etcd_proc = self._spawn(args, self.run_dir / "logs" / "etcd.log", parent_death_signal=signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not etcd_healthy(self.etcd_endpoint):
            if self.etcd_proc.poll() is not None:
                raise LaunchError(
                    f"embedded etcd exited with {self.etcd_proc.returncode}; see {self.run_dir}/logs/etcd.log"
                )
            if time.monotonic() > deadline or self.stopping:
                raise LaunchError(f"embedded etcd not healthy within 30s; see {self.run_dir}/logs/etcd.log")
            time.sleep(0.05)
        self.out(f"embedded etcd at {self.etcd_endpoint} (pid {self.etcd_proc.pid}, data {data_dir})")
        self._write_state()

    def agent_command(self, host: str) -> list[str]:
        cmd = agent_command(
            self.cfg.discovery,
            etcd=self.etcd_endpoint,
            job=self.cfg.job,
            host=host,
            drain_grace_seconds=self.opts.drain_grace_seconds,
        )
        if self.opts.hot_join:
            cmd += ["--warm-config", str(self.opts.config.resolve())]
            for assignment in self.opts.overrides:
                cmd += ["--warm-set", assignment]
        return cmd

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
        """Start a service process (etcd, an agent); it gets ``parent_death_signal`` if the launcher dies."""
        full_env = {**os.environ, **(env or {}), LAUNCH_ID_ENV: self.launch_id}
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
            "etcd_pid": self.etcd_proc.pid if self.etcd_proc else None,
            "agents": {h: p.pid for h, p in self.agents.items() if p.poll() is None},
            "horovodrun_pid": self.hvd_proc.pid if self.hvd_proc and self.hvd_proc.poll() is None else None,
            "attempt": self.attempt,
            "hosts": list(self.opts.hosts),
            "host": socket.gethostname(),  # ``status`` checks the pids only on this host
        }
        pids = [os.getpid(), state["etcd_pid"], state["horovodrun_pid"], *(p.pid for p in self.agents.values())]
        state["create_times"] = {str(p): t for p in pids if p is not None and (t := _create_time(p)) is not None}
        write_atomic(self.run_dir / STATE_FILE, json.dumps(state, indent=2) + "\n", durable=False)

    # -- hosts
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
        self.hvd_proc = subprocess.Popen(
            cmd,
            env={**inherited, **env, LAUNCH_ID_ENV: self.launch_id},
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
                    _terminate(self.hvd_proc)
                    break
                next_poll = now + REGISTRY_POLL_SECONDS
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
        if self.etcd_proc is not None:
            pids.add(self.etcd_proc.pid)
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
            if signalled and not any(is_worker(p) and _alive(p) for p in self.tracker.descendants(hvd.pid)):
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
            _terminate(proc, signal.SIGTERM, timeout=10)
        if self.registry is not None:
            with contextlib.suppress(Exception):
                self.registry.close()
        _terminate(self.etcd_proc, signal.SIGTERM, timeout=10)
        self.tracker.kill_all()
        with contextlib.suppress(OSError):
            (self.run_dir / STATE_FILE).unlink()


def _create_time(pid: int) -> float | None:
    """When ``pid`` started (psutil's clock), so a reader of launch.json can tell a reused pid; None if gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def agent_command(
    discovery: DiscoveryConfig, *, etcd: str, job: str, host: str, drain_grace_seconds: float
) -> list[str]:
    """``elastictrain agent`` for ``host`` with the timing of the job's ``discovery`` settings (1 slot)."""
    ttl = max(2, round(discovery.ttl_seconds))
    return [
        *_elastictrain(),
        "agent",
        "--etcd", etcd,
        "--job", job,
        "--host", host,
        "--slots", "1",
        "--ttl", str(ttl),
        "--heartbeat", f"{min(discovery.heartbeat_seconds, ttl / 3):g}",
        "--request-timeout", f"{min(2.0, ttl / 6):g}",
        "--drain-grace", f"{drain_grace_seconds:g}",
        "--prefix", discovery.prefix,
    ]  # fmt: skip


def _elastictrain() -> list[str]:
    script = Path(sys.executable).parent / "elastictrain"
    return [str(script)] if script.exists() else [sys.executable, "-m", "elastictrain.cli"]


# --------------------------------------------------------------------------------------------------
# CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Run a job: embedded etcd and agents (unless --etcd), horovodrun, relaunch after preemption.",
        epilog="Flags after `--` go to horovodrun unchanged.",
    )
    p.add_argument("--config", required=True, help="YAML job config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    p.add_argument("--min-np", type=int, default=None, help="fewest workers (default elastic.min_np)")
    p.add_argument("--max-np", type=int, default=None, help="most workers (default elastic.max_np)")
    p.add_argument("--etcd", default=None, metavar="URL", help="the cluster's etcd; none: start an embedded one")
    p.add_argument("--job", default=None, help="job name (default: the config's job)")
    p.add_argument("--hosts", default=None, help="embedded mode: logical hosts to run agents for (default: all)")
    p.add_argument(
        "--gloo-timeout-seconds",
        type=int,
        default=60,
        metavar="S",
        help="horovodrun Gloo timeout; bounds the rendezvous with a starting worker (60)",
    )
    p.add_argument(
        "--blacklist-cooldown-range", type=int, nargs=2, default=[5, 60], metavar=("MIN", "MAX"), help="(5 60)"
    )
    p.add_argument("--reset-limit", type=int, default=100, help="horovodrun --reset-limit (100)")
    p.add_argument("--elastic-timeout", type=int, default=600, metavar="S", help="horovodrun --elastic-timeout (600)")
    p.add_argument("--wait-hosts-seconds", type=float, default=300.0, metavar="S", help="after a preemption (300)")
    p.add_argument("--max-relaunches", type=int, default=5, help="relaunches after preemptions (5)")
    p.add_argument("--stop-timeout", type=float, default=60.0, metavar="S", help="SIGTERM to SIGKILL of workers (60)")
    p.add_argument("--drain-grace", type=float, default=10.0, metavar="S", help="embedded agents' drain grace (10)")
    p.add_argument(
        "--hot-join",
        action="store_true",
        help="start workers from a warm process per host (embedded agents keep one), so a scale-up waits for no "
        "interpreter start; hosts without one start workers cold",
    )
    etcd_endpoints.add_arguments(p)  # --cacert --cert --key --user --password-file, for --etcd
    return p


def find_horovodrun() -> str | None:
    local = Path(sys.executable).parent / "horovodrun"
    return str(local) if local.exists() else shutil.which("horovodrun")


def runner_command(python: str = sys.executable) -> list[str]:
    """How the launcher starts horovodrun: through :mod:`elastictrain.hvdrun` (the same horovodrun, with a
    host discovery that does not start a Python interpreter every second)."""
    return [python, "-m", "elastictrain.hvdrun"]


def parse(argv: Sequence[str]) -> tuple[LaunchOptions, JobConfig]:
    """Flags and config -> options; raises :class:`LaunchError` or :class:`ConfigError` (nothing is started)."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.job is not None:
        overrides.append(f"job={args.job}")
    cfg = load_config(args.config, overrides)
    min_np = args.min_np if args.min_np is not None else cfg.elastic.min_np
    max_np = args.max_np if args.max_np is not None else cfg.elastic.max_np
    if args.max_np is None and max_np < min_np:
        max_np = min_np  # --min-np above the config's max_np raises the default max
    hosts: tuple[str, ...] = ()
    access: EtcdAccess | None = None
    if args.etcd is not None:
        if args.hosts is not None:
            raise LaunchError("--hosts applies to the embedded mode only (with --etcd every node runs its agent)")
        try:
            parsed = etcd_endpoints.parse_endpoints(args.etcd)
        except ValueError as e:
            raise LaunchError(f"--etcd: {e}") from None
        try:
            access = etcd_endpoints.from_args(args, os.environ).check(parsed)
        except ValueError as e:
            raise LaunchError(str(e)) from None
    elif not etcd_endpoints.from_args(args, {}).empty:
        raise LaunchError(
            "--cacert, --cert, --key, --user and --password-file apply with --etcd only "
            "(the embedded etcd listens on loopback without TLS or auth)"
        )
    else:
        local = local_addresses()
        if args.hosts is not None:
            hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
            for h in hosts:
                if resolve(h) not in local:
                    raise LaunchError(f"--hosts: {h!r} does not resolve to this machine (the embedded mode is local)")
            if len(set(hosts)) != len(hosts):
                raise LaunchError(f"--hosts: duplicate names in {args.hosts!r}")
        else:
            hosts = tuple(local_logical_hosts()[: max(max_np, 1)])
    opts = LaunchOptions(
        config=Path(args.config),
        overrides=tuple(overrides),
        min_np=min_np,
        max_np=max_np,
        etcd=args.etcd,
        etcd_access=access,
        hosts=hosts,
        extra=tuple(extra),
        gloo_timeout_seconds=args.gloo_timeout_seconds,
        blacklist_cooldown=(args.blacklist_cooldown_range[0], args.blacklist_cooldown_range[1]),
        reset_limit=args.reset_limit,
        elastic_timeout_seconds=args.elastic_timeout,
        wait_hosts_seconds=args.wait_hosts_seconds,
        max_relaunches=args.max_relaunches,
        stop_timeout_seconds=args.stop_timeout,
        drain_grace_seconds=args.drain_grace,
        hot_join=args.hot_join,
    )
    if opts.embedded and len(hosts) < opts.min_np:
        raise LaunchError(
            f"--min-np {opts.min_np} needs {opts.min_np} logical hosts but this machine has {len(hosts)} "
            f"({', '.join(hosts) or 'none'}); lower --min-np or pass --etcd for a cluster"
        )
    return opts, cfg


def check_etcd(
    endpoints: str, job: str, prefix: str, timeout_seconds: float = 3.0, access: EtcdAccess | None = None
) -> None:
    """Raise :class:`LaunchError` unless the cluster's etcd answers a range request."""
    registry = EtcdRegistry(endpoints, job, prefix, timeout_seconds=timeout_seconds, access=access)
    try:
        registry.list_hosts()
    except RegistryError as e:
        how = "unreachable" if isinstance(e, RegistryUnavailable) else "refused the job's hosts range"
        raise LaunchError(f"--etcd {endpoints}: {how} ({str(e).splitlines()[0] if str(e) else 'no answer'})") from None
    finally:
        with contextlib.suppress(Exception):
            registry.close()


def run_complete(cfg: JobConfig) -> str | None:
    """One line saying that the run_dir's latest checkpoint already holds the whole training, else None.

    The workers would resume from that checkpoint and train nothing; a damaged one (the workers fall back
    to an older one) or a longer training (more epochs, a higher ``max_steps``) is not complete.
    """
    if not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        return None
    from elastictrain.policy import training_complete
    from elastictrain.status import latest_checkpoint

    ck = latest_checkpoint(cfg.run_path, time.time())
    if not ck or ck.get("error") or not isinstance(ck.get("step"), int) or not isinstance(ck.get("epoch"), int):
        return None
    if not training_complete(cfg.training, ck["epoch"], ck["step"]):
        return None
    from elastictrain.checkpoint import CheckpointDamaged, LocalStorage, verify_checkpoint

    try:
        verify_checkpoint(LocalStorage.for_run_dir(cfg.run_path), str(ck["name"]))
    except (CheckpointDamaged, OSError, ValueError):
        return None
    t = cfg.training
    target = f"epoch {ck['epoch']} of {t.epochs}" + (f", step {ck['step']} of {t.max_steps}" if t.max_steps else "")
    return f"run complete: {cfg.run_path} already holds the whole training ({target}); nothing to train"


TASK_CHECK_TIMEOUT_SECONDS = 300.0


def check_task(opts: LaunchOptions, python: str = sys.executable) -> None:
    """Raise :class:`ConfigError` unless the config's task imports and builds (``elastictrain config validate``:
    on the meta device, in a child process, so the launcher imports neither torch nor the user's code)."""
    cmd = [python, "-m", "elastictrain.cli", "config", "validate", "--config", str(opts.config)]
    for assignment in opts.overrides:
        cmd += ["--set", assignment]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=TASK_CHECK_TIMEOUT_SECONDS
        )
    except subprocess.TimeoutExpired:
        limit = TASK_CHECK_TIMEOUT_SECONDS
        raise ConfigError(f"task: checking the task of {opts.config} took over {limit:g}s") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"the task check exited {done.returncode}"
        raise ConfigError(last.removeprefix("elastictrain: config error: "))


def main(argv: list[str]) -> int:
    try:
        opts, cfg = parse(argv)
        if (complete := run_complete(cfg)) is not None:
            print(f"{PROG}: {complete}", flush=True)
            return 0
        if find_horovodrun() is None:
            raise LaunchError("horovodrun not found next to this Python or on PATH (run `make setup`)")
        check_task(opts)
        if opts.etcd is not None:
            check_etcd(opts.etcd, cfg.job, cfg.discovery.prefix, access=opts.etcd_access)
    except ConfigError as e:
        report_config_error(e, PROG)
        return EXIT_USAGE
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        lock = RunDirLock.acquire(cfg.run_path.resolve())
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        launcher = Launcher(opts, cfg, horovodrun=runner_command())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, launcher.on_signal)
        code = launcher.run()
        print(f"{PROG}: exit {code}", flush=True)
        return code
    finally:
        lock.release()
