"""Fault primitives: each acts only on processes of one job and logs one JSON line per fault.

Every function takes a :class:`~chaos.procs.JobRef` and a :class:`ChaosLog`, does one thing and
returns the record it logged (``ts``, ``action``, ``job``, what was hit). Durational faults (freeze,
slowdown, CPU quota, etcd outage, partition) undo themselves in ``finally`` and log a second line with ``phase: "end"``;
a hang (:func:`hang_worker`) is never undone.
Waiting is polling against a deadline, never a sleep that stands in for an event.

Size: every fault primitive in one place, so each acts on one job's processes and logs one line the same way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from chaos.procs import JobNotFound, JobRef, Worker, tree
from elastictrain import fileio
from elastictrain.engine import cgroup
from elastictrain.errors import ScenarioError
from elastictrain.launcher.processes import is_alive
from elastictrain.rundir import layout

TEMP_MARKER = fileio.TEMP_MARKER
"""Checkpoint temp files are ``.<name>.tmp-<writer pid>-<hex>`` (elastictrain/checkpoint/storage.py)."""


class Chooser(Protocol):
    """Picks a target (``random.Random`` does; scenarios pass one that avoids rank 0)."""

    def choice(self, seq: Sequence[Any]) -> Any: ...


class ChaosLog:
    """Appends one JSON object per line (``ts`` first) to the chaos events file; thread-safe."""

    def __init__(self, path: str | os.PathLike[str] | None, *, echo: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.echo = echo
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, action: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "action": action, **fields}
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(line + "\n")
            if self.echo:
                print(line, flush=True)
        return record


def read_chaos(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(ValueError):
                obj = json.loads(line)
                if isinstance(obj, dict):
                    out.append(obj)
    return out


def _signal(procs: Sequence[psutil.Process], sig: int) -> list[int]:
    hit = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)
            hit.append(p.pid)
    return hit


def _wait_gone(procs: Sequence[psutil.Process], timeout: float) -> None:
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs(list(procs), timeout=timeout)


def _signal_value(name: str) -> int:
    try:
        return int(signal.Signals[f"SIG{name.upper().removeprefix('SIG')}"])
    except KeyError:
        raise ValueError(f"unknown signal {name!r} (KILL or TERM)") from None


# ---------------------------------------------------------------------------------------------- workers
def kill_worker(
    job: JobRef, log: ChaosLog, *, rank: int | None = None, rng: Chooser | None = None, sig: str = "KILL"
) -> dict[str, Any]:
    """Signal one worker: ``rank`` (0 = the current rank 0; others by the rank it started with) or a random one."""
    workers = job.workers()
    if not workers:
        raise JobNotFound(f"job {job.job!r} has no live worker")
    target = job.worker_by_rank(rank) if rank is not None else (rng or random.Random()).choice(workers)
    signum = _signal_value(sig)
    # SIGKILL takes the worker's helpers (fork server, checkpoint writer) with it, as a crash of the machine would.
    procs = tree(target.proc) if signum == signal.SIGKILL else [target.proc]
    record = log.log("kill-worker", job=job.job, signal=signal.Signals(signum).name, **target.describe())
    _signal(procs, signum)
    return record


def kill_host(job: JobRef, log: ChaosLog, host: str) -> dict[str, Any]:
    """A machine dies: SIGKILL its agent (its key expires with the lease) and every worker on it."""
    workers = [w for w in job.workers() if w.host == host]
    agent = None
    with contextlib.suppress(JobNotFound):
        agent = job.agent(host)
    if agent is None and not workers:
        raise JobNotFound(f"job {job.job!r} has neither an agent nor a worker on host {host!r}")
    procs = [
        *([agent] if agent is not None else []),
        *(p for w in workers for p in [*tree(w.proc), *([w.client] if w.client is not None else [])]),
    ]
    record = log.log(
        "kill-host",
        job=job.job,
        host=host,
        agent_pid=agent.pid if agent is not None else None,
        workers=[w.describe() for w in workers],
    )
    _signal(procs, signal.SIGKILL)
    return record


def kill_agent(job: JobRef, log: ChaosLog, host: str) -> dict[str, Any]:
    """The agent dies but the machine runs on: SIGKILL the agent only; the host leaves when its lease expires."""
    agent = job.agent(host)
    record = log.log("kill-agent", job=job.job, host=host, agent_pid=agent.pid)
    _signal([agent], signal.SIGKILL)
    return record


def preempt_host(job: JobRef, log: ChaosLog, host: str) -> dict[str, Any]:
    """A spot notice: SIGTERM to the host's agent, which marks it draining (Horovod removes it gracefully)."""
    agent = job.agent(host)
    record = log.log("preempt-host", job=job.job, host=host, agent_pid=agent.pid)
    _signal([agent], signal.SIGTERM)
    return record


def freeze_worker(
    job: JobRef, log: ChaosLog, *, rank: int | None, seconds: float, rng: Chooser | None = None
) -> dict[str, Any]:
    """SIGSTOP one worker (and its helpers) for ``seconds``; SIGCONT in ``finally``."""
    target = target_worker(job, rank=rank, rng=rng)
    procs = tree(target.proc)
    record = log.log("freeze-worker", job=job.job, seconds=seconds, **target.describe())
    try:
        _signal(procs, signal.SIGSTOP)
        _hold(seconds)
    finally:
        _signal(procs, signal.SIGCONT)
        log.log("freeze-worker", phase="end", job=job.job, pid=target.pid)
    return record


def hang_worker(
    job: JobRef, log: ChaosLog, *, host: str | None = None, rank: int | None = None, rng: Chooser | None = None
) -> dict[str, Any]:
    """SIGSTOP one worker's training process and its helpers, and never SIGCONT them: a hung worker.

    Whoever ends the job must SIGKILL it (a stopped process ignores SIGTERM until it is continued). The
    record names the stopped training process (``pid``) and every pid stopped (``pids``: its helpers too).
    """
    target = target_worker(job, host=host, rank=rank, rng=rng)
    procs = tree(target.proc)
    record = log.log("hang-worker", job=job.job, pids=[p.pid for p in procs], **target.describe())
    _signal(procs, signal.SIGSTOP)
    return record


def slow_worker(
    job: JobRef,
    log: ChaosLog,
    *,
    host: str | None = None,
    rank: int | None = None,
    slowdown: float,
    seconds: float | None = None,
    period_seconds: float = 0.1,
    stop: threading.Event | None = None,
    rng: Chooser | None = None,
) -> dict[str, Any]:
    """Make one worker ``slowdown`` slower (0.5: it may run 2/3 of the time) with :func:`duty_cycle` on its
    training process and helpers, until ``seconds`` have passed (None: no limit), ``stop`` is set, or the worker
    exits (a drain ends it); they are continued at the end. The target is as in :func:`target_worker`.

    Returns the ``phase: "end"`` record: the achieved ``stopped_fraction`` (of the wall time), ``stopped_seconds``,
    ``elapsed_seconds``, ``cycles``, ``reason`` (``seconds elapsed`` | ``stopped`` | ``worker exited``) and the
    start line's ``ts`` as ``start_ts``.
    """
    check_duty_cycle(slowdown, seconds, period_seconds)
    target = target_worker(job, host=host, rank=rank, rng=rng)
    start = log.log(
        "slow-worker",
        job=job.job,
        slowdown=slowdown,
        seconds=seconds,
        period_seconds=period_seconds,
        target_stopped_fraction=round(stopped_share(slowdown), 4),
        **target.describe(),
    )
    result = None
    try:
        result = duty_cycle([target.proc], slowdown, stop, seconds=seconds, period_seconds=period_seconds, helpers=True)
    finally:
        figures = result.record() if result is not None else {"reason": "interrupted"}
        end = log.log("slow-worker", phase="end", job=job.job, **figures, start_ts=start["ts"], **target.describe())
    return end


MIN_PERIOD_SECONDS = 0.01
"""Shorter duty cycles are lost in the scheduler's noise on a loaded machine (a wake-up is often 1 ms late)."""
TREE_REFRESH_SECONDS = 1.0
"""How often :func:`duty_cycle` looks for new helpers of its processes (a scan of /proc costs milliseconds)."""


def stopped_share(slowdown: float) -> float:
    """The share of the wall time a process ``slowdown`` slower is stopped: ``s / (1 + s)`` (0.5 -> 1/3)."""
    return slowdown / (1.0 + slowdown)


def check_duty_cycle(slowdown: float, seconds: float | None, period_seconds: float) -> None:
    """:class:`ValueError` naming the flag, for a slowdown, duration or period :func:`duty_cycle` cannot run."""
    if not (math.isfinite(slowdown) and slowdown > 0):
        raise ValueError(f"--slowdown {slowdown:g}: must be > 0 (0.5 = 50% slower)")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"--seconds {seconds:g}: must be > 0")
    if not (math.isfinite(period_seconds) and period_seconds >= MIN_PERIOD_SECONDS):
        raise ValueError(f"--period-seconds {period_seconds:g}: must be >= {MIN_PERIOD_SECONDS:g}")


@dataclass(frozen=True, slots=True)
class DutyCycle:
    """What a :func:`duty_cycle` did."""

    reason: str
    """``seconds elapsed`` | ``stopped`` (the event was set) | ``worker exited`` (every process was gone)."""
    target_fraction: float
    stopped_seconds: float
    elapsed_seconds: float
    cycles: int
    """Cycles with a stop (a cycle whose share was already made up has none)."""

    @property
    def stopped_fraction(self) -> float:
        return self.stopped_seconds / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    def record(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "stopped_fraction": round(self.stopped_fraction, 4),
            "target_stopped_fraction": round(self.target_fraction, 4),
            "stopped_seconds": round(self.stopped_seconds, 3),
            "elapsed_seconds": round(self.elapsed_seconds, 3),
            "cycles": self.cycles,
        }


def duty_cycle(
    procs: Sequence[psutil.Process],
    slowdown: float,
    stop: threading.Event | None = None,
    *,
    seconds: float | None = None,
    period_seconds: float = 0.1,
    helpers: bool = False,
) -> DutyCycle:
    """SIGSTOP ``procs`` (with ``helpers``: their descendants too, looked up every second) for
    ``slowdown / (1 + slowdown)`` of every ``period_seconds`` and SIGCONT them for the rest, until ``seconds`` have
    passed (None: no limit), ``stop`` is set, or none of ``procs`` is alive; every process stopped is continued
    in ``finally``. Call it in a thread of its own to slow a process while doing something else.

    Each cycle's stop lasts until the stopped time so far reaches the target share of the time up to the cycle's
    end, on the monotonic clock: a late wake-up on a loaded machine is made up in the next cycles, never added up.
    This is the share of the wall time the processes may run. A process that has a core to itself is then
    ``slowdown`` slower; where processes share cores, the others take up the time a stopped one leaves, and a
    CPU-bound one is slowed less.
    """
    check_duty_cycle(slowdown, seconds, period_seconds)
    fraction = stopped_share(slowdown)
    touched: dict[int, psutil.Process] = {p.pid: p for p in procs}
    targets: list[psutil.Process] = list(procs)
    stopped = 0.0
    cycles = 0
    reason = "seconds elapsed"
    t0 = time.monotonic()
    end = t0 + seconds if seconds is not None else math.inf
    try:
        looked_at = -math.inf
        k = 0
        while True:
            now = time.monotonic()
            if stop is not None and stop.is_set():
                reason = "stopped"
                break
            if not any(is_alive(p) for p in procs):
                reason = "worker exited"
                break
            if now >= end:
                break
            if helpers and now - looked_at >= TREE_REFRESH_SECONDS:  # a helper may start later (checkpoint writer)
                targets, looked_at = [q for p in procs for q in tree(p)], now
                touched.update((q.pid, q) for q in targets)
            k = max(k, int((now - t0) / period_seconds))  # skip the cycles this process overslept
            cycle_end = min(t0 + (k + 1) * period_seconds, end)
            owed = fraction * (cycle_end - t0) - stopped
            if owed > 0:
                stopped_at = time.monotonic()
                _signal(targets, signal.SIGSTOP)
                try:
                    _sleep_until(min(stopped_at + owed, cycle_end), stop)
                finally:
                    _signal(targets, signal.SIGCONT)
                    stopped += time.monotonic() - stopped_at
                cycles += 1
            _sleep_until(cycle_end, stop)
            k += 1
    finally:
        _signal(list(touched.values()), signal.SIGCONT)
    return DutyCycle(reason, fraction, stopped, time.monotonic() - t0, cycles)


# ---------------------------------------------------------------------------------------------- CPU quota
QUOTA_GROUP_PREFIX = "elastictrain-chaos-"
"""Groups :class:`CpuQuota` makes are ``<prefix><creator pid>-<n>`` at the hierarchy's root."""
QUOTA_PERIOD_US = 100_000
MIN_CPU_FRACTION = 0.01
"""Below 1 ms of CPU per 100 ms period (the kernel's floor for a quota) a worker is hung, not slow."""


class QuotaUnavailable(ScenarioError, RuntimeError):
    """This machine has no CPU controller that a quota can be set on (or no right to set one)."""


@dataclass(frozen=True, slots=True)
class CpuBackend:
    """Where a quota goes: cgroup ``version`` 2 (``cpu.max``) or 1 (``cpu.cfs_quota_us``), under ``root``."""

    version: int
    root: str


@contextlib.contextmanager
def duty_cycled(proc: psutil.Process, slowdown: float) -> Iterator[None]:
    """``proc`` and its helpers slowed by :func:`duty_cycle` (in a thread) for the ``with`` block; continued after."""
    stop = threading.Event()
    t = threading.Thread(target=duty_cycle, args=([proc], slowdown, stop), kwargs={"helpers": True}, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


def choose_cpu_backend(h: cgroup.Hierarchies, v2_controllers: str | None) -> CpuBackend:
    """cgroup v2 when its root offers the ``cpu`` controller (``cgroup.controllers``), else v1's ``cpu`` mount.

    :class:`QuotaUnavailable` when neither can take a quota."""
    if h.v2 is not None and v2_controllers is not None and "cpu" in v2_controllers.split():
        return CpuBackend(2, h.v2)
    if h.v1_cpu is not None:
        return CpuBackend(1, h.v1_cpu)
    raise QuotaUnavailable("no CPU cgroup controller: neither cgroup v2 with 'cpu' nor a v1 'cpu' mount")


def check_cpu_fraction(cpu_fraction: float | None) -> None:
    """:class:`ValueError` naming the flag for a quota :class:`CpuQuota` cannot set (None: no limit)."""
    if cpu_fraction is not None and not (math.isfinite(cpu_fraction) and MIN_CPU_FRACTION <= cpu_fraction <= 1024):
        raise ValueError(f"--cpu {cpu_fraction:g}: must be a share of one core >= {MIN_CPU_FRACTION:g} (0.5 = half)")


def quota_files(version: int, cpu_fraction: float | None) -> dict[str, str]:
    """The files (and values) that set ``cpu_fraction`` of one core per period (None: no limit)."""
    check_cpu_fraction(cpu_fraction)
    quota = "max" if cpu_fraction is None else str(max(1000, round(cpu_fraction * QUOTA_PERIOD_US)))
    if version == 2:
        return {"cpu.max": f"{quota} {QUOTA_PERIOD_US}"}
    return {"cpu.cfs_period_us": str(QUOTA_PERIOD_US), "cpu.cfs_quota_us": "-1" if quota == "max" else quota}


def _read_text(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def cpu_backend() -> CpuBackend:
    """This machine's :func:`choose_cpu_backend`."""
    h = cgroup.cpu_hierarchies(_read_text(cgroup.MOUNTINFO) or "")
    return choose_cpu_backend(h, _read_text(os.path.join(h.v2, "cgroup.controllers")) if h.v2 else None)


def _group_of(version: int, pid: int) -> str | None:
    text = _read_text(f"/proc/{pid}/cgroup")
    if text is None:
        return None
    v1, v2 = cgroup.cgroup_paths(text)
    return v2 if version == 2 else v1


class CpuQuota:
    """A CPU quota on some processes, as a container limit or a slower machine sets one: a cgroup of their own.

    :meth:`add` moves processes (whole thread groups) into the group, remembering where each came from; their
    children forked later are in it from birth, and :meth:`follow` moves descendants that were not.
    :meth:`set` changes the quota at any time (None: no limit, a host that recovers). :meth:`close` (also on
    leaving a ``with``) lifts the quota, moves every process still in the group back, and deletes the group,
    whatever happened before; :func:`remove_stale_quota_groups` deletes those of a creator that died.
    """

    _seq = 0

    def __init__(self, cpu_fraction: float | None, *, backend: CpuBackend | None = None) -> None:
        check_cpu_fraction(cpu_fraction)
        self.backend = backend or cpu_backend()
        remove_stale_quota_groups(self.backend)
        CpuQuota._seq += 1
        self.path = Path(self.backend.root) / f"{QUOTA_GROUP_PREFIX}{os.getpid()}-{CpuQuota._seq}"
        self.origins: dict[int, str] = {}
        self.cpu_fraction: float | None = None
        self._enabled_cpu = False
        try:
            if self.backend.version == 2:
                self._enable_v2_cpu()
            self.path.mkdir()
        except OSError as e:
            raise QuotaUnavailable(f"cannot make a CPU cgroup at {self.path}: {e.strerror}") from None
        try:
            self.set(cpu_fraction)
        except BaseException:
            self.close()
            raise

    def _enable_v2_cpu(self) -> None:
        control = Path(self.backend.root) / "cgroup.subtree_control"
        if "cpu" not in (_read_text(control) or "").split():
            control.write_text("+cpu")
            self._enabled_cpu = True

    def set(self, cpu_fraction: float | None) -> None:
        """Limit the group to ``cpu_fraction`` of one core (None: no limit)."""
        for name, value in quota_files(self.backend.version, cpu_fraction).items():
            (self.path / name).write_text(value)
        self.cpu_fraction = cpu_fraction

    def add(self, procs: Sequence[psutil.Process]) -> list[int]:
        """Move ``procs`` into the group (gone ones are skipped); returns the pids moved now."""
        moved = []
        for p in procs:
            if p.pid in self.origins:
                continue
            origin = _group_of(self.backend.version, p.pid)
            if origin is None:
                continue
            if origin == "/" + self.path.name:  # born in the group: it goes back with the process it came from
                origin = next(iter(self.origins.values()), "/")
            try:
                (self.path / "cgroup.procs").write_text(str(p.pid))
            except OSError:  # it exited meanwhile
                continue
            self.origins[p.pid] = origin
            moved.append(p.pid)
        return moved

    def follow(self, procs: Sequence[psutil.Process]) -> list[int]:
        """Move the descendants of ``procs`` that are not in the group yet (started by another process)."""
        return self.add([q for p in procs for q in tree(p)])

    def pids(self) -> list[int]:
        """The processes in the group now."""
        text = _read_text(self.path / "cgroup.procs") or ""
        return [int(x) for x in text.split() if x.isdigit()]

    def stat(self) -> dict[str, float]:
        """The group's throttling so far: ``throttled_seconds`` and ``nr_throttled`` (periods)."""
        text = _read_text(self.path / "cpu.stat") or ""
        fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
        nr = fields.get("nr_throttled", "0").strip()
        return {
            "throttled_seconds": round(cgroup.throttled_seconds(text) or 0.0, 3),
            "nr_throttled": int(nr) if nr.isdigit() else 0,
        }

    def close(self, timeout: float = 10.0) -> None:
        """Lift the quota, move every process back to where it came from (the root for one born here), delete
        the group. Idempotent."""
        if not self.path.exists():
            return
        with contextlib.suppress(OSError, ValueError):
            self.set(None)
        _empty_and_remove(self.path, self.backend, self.origins, timeout)
        if self._enabled_cpu:
            with contextlib.suppress(OSError):  # another group may use it now: then it stays
                (Path(self.backend.root) / "cgroup.subtree_control").write_text("-cpu")

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _empty_and_remove(path: Path, backend: CpuBackend, origins: dict[int, str], timeout: float) -> None:
    """Move the group's processes out (to ``origins`` or the root) and rmdir it, retrying until ``timeout``
    (a dying process leaves the group only when it is reaped)."""
    deadline = time.monotonic() + timeout
    root = Path(backend.root)
    while True:
        for pid_text in (_read_text(path / "cgroup.procs") or "").split():
            pid = int(pid_text)
            back = root / origins.get(pid, "/").lstrip("/") / "cgroup.procs"
            for target in (back, root / "cgroup.procs"):
                try:
                    target.write_text(str(pid))
                    break
                except OSError:
                    continue
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def remove_stale_quota_groups(backend: CpuBackend | None = None) -> list[str]:
    """Delete the quota groups whose creator is gone (a test process killed before its ``finally``)."""
    try:
        backend = backend or cpu_backend()
    except QuotaUnavailable:
        return []
    removed = []
    for path in Path(backend.root).glob(f"{QUOTA_GROUP_PREFIX}*"):
        creator = path.name.removeprefix(QUOTA_GROUP_PREFIX).split("-", 1)[0]
        if not creator.isdigit() or psutil.pid_exists(int(creator)):
            continue
        with contextlib.suppress(OSError):
            _empty_and_remove(path, backend, {}, timeout=5.0)
            removed.append(path.name)
    return removed


@dataclass(frozen=True, slots=True)
class QuotaRun:
    """What a :func:`cpu_quota` did."""

    reason: str
    """``seconds elapsed`` | ``stopped`` (the event was set) | ``worker exited`` (every process was gone)."""
    cpu_fraction: float
    backend: str
    pids: tuple[int, ...]
    """Every process that was in the group."""
    throttled_seconds: float
    nr_throttled: int
    elapsed_seconds: float

    def record(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "cpu_fraction": self.cpu_fraction,
            "backend": self.backend,
            "pids": list(self.pids),
            "throttled_seconds": self.throttled_seconds,
            "nr_throttled": self.nr_throttled,
            "elapsed_seconds": round(self.elapsed_seconds, 3),
        }


def cpu_quota(
    procs: Sequence[psutil.Process],
    cpu_fraction: float,
    stop: threading.Event | None = None,
    *,
    seconds: float | None = None,
    helpers: bool = True,
    backend: CpuBackend | None = None,
) -> QuotaRun:
    """Hold ``procs`` (with ``helpers``: their descendants too, looked up every second) to ``cpu_fraction`` of one
    core until ``seconds`` have passed (None: no limit), ``stop`` is set, or none of ``procs`` is alive; the
    quota is lifted and the group deleted in ``finally``. Call it in a thread of its own to slow a process for a
    while (a host that becomes slow mid-run and recovers)."""
    check_cpu_fraction(cpu_fraction)
    if seconds is not None and not seconds > 0:
        raise ValueError(f"--seconds {seconds:g}: must be > 0")
    t0 = time.monotonic()
    end = t0 + seconds if seconds is not None else math.inf
    reason = "seconds elapsed"
    with CpuQuota(cpu_fraction, backend=backend) as quota:
        quota.add(procs)
        while True:
            if helpers:
                quota.follow(procs)
            if stop is not None and stop.is_set():
                reason = "stopped"
                break
            if not any(is_alive(p) for p in procs):
                reason = "worker exited"
                break
            if time.monotonic() >= end:
                break
            _sleep_until(min(time.monotonic() + TREE_REFRESH_SECONDS, end), stop)
        stat = quota.stat()
        return QuotaRun(
            reason,
            cpu_fraction,
            f"cgroup v{quota.backend.version}",
            tuple(quota.origins),
            stat["throttled_seconds"],
            int(stat["nr_throttled"]),
            time.monotonic() - t0,
        )


def quota_worker(
    job: JobRef,
    log: ChaosLog,
    *,
    host: str | None = None,
    rank: int | None = None,
    cpu_fraction: float,
    seconds: float | None = None,
    stop: threading.Event | None = None,
    rng: Chooser | None = None,
) -> dict[str, Any]:
    """Put one worker's machine under a CPU quota of ``cpu_fraction`` of one core (its training process and
    helpers, :func:`cpu_quota`) until ``seconds`` have passed, ``stop`` is set, or the worker exits; the quota is
    lifted at the end. The target is as in :func:`target_worker`.

    Returns the ``phase: "end"`` record: ``reason``, ``backend``, ``pids``, ``throttled_seconds``,
    ``nr_throttled``, ``elapsed_seconds`` and the start line's ``ts`` as ``start_ts``.
    """
    check_cpu_fraction(cpu_fraction)
    target = target_worker(job, host=host, rank=rank, rng=rng)
    start = log.log("quota-worker", job=job.job, cpu_fraction=cpu_fraction, seconds=seconds, **target.describe())
    result = None
    try:
        result = cpu_quota([target.proc], cpu_fraction, stop, seconds=seconds)
    finally:
        figures = result.record() if result is not None else {"reason": "interrupted"}
        end = log.log("quota-worker", phase="end", job=job.job, **figures, start_ts=start["ts"], **target.describe())
    return end


def target_worker(
    job: JobRef, *, host: str | None = None, rank: int | None = None, rng: Chooser | None = None
) -> Worker:
    """The worker a fault aims at: started as ``rank`` (0 = the current rank 0), else the first (by rank) on
    ``host``, else one drawn by ``rng`` among all but the current rank 0. :class:`JobNotFound` when there is none."""
    if host is not None and rank is not None:
        raise ValueError("name the worker by --rank or by --host, not both")
    if rank is not None:
        return job.worker_by_rank(rank)
    workers = job.workers()
    if host is not None:
        on_host = [w for w in workers if w.host == host]
        if not on_host:
            raise JobNotFound(f"job {job.job!r} has no live worker on host {host!r}")
        return on_host[0]
    r0 = job.rank0()
    candidates = [w for w in workers if w != r0] or workers
    if not candidates:
        raise JobNotFound(f"job {job.job!r} has no live worker")
    chosen: Worker = (rng or random.Random()).choice(candidates)
    return chosen


def _sleep_until(deadline: float, stop: threading.Event | None) -> None:
    """Sleep to a monotonic ``deadline`` in one wait (returns early when ``stop`` is set)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return
    if stop is not None:
        stop.wait(left)
    else:
        time.sleep(left)


def _hold(seconds: float) -> None:
    """The fault's duration is the point here: wait it out (interruptible by Ctrl-C)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.2, left))


# ---------------------------------------------------------------------------------------------- etcd
def etcd_outage(job: JobRef, log: ChaosLog, *, seconds: float, etcd_pid: int | None = None) -> dict[str, Any]:
    """SIGSTOP the job's etcd for ``seconds`` (clients time out as on a network outage); SIGCONT in ``finally``."""
    etcd = job.etcd(etcd_pid)
    record = log.log("etcd-outage", job=job.job, seconds=seconds, etcd_pid=etcd.pid)
    try:
        etcd.send_signal(signal.SIGSTOP)
        _hold(seconds)
    finally:
        with contextlib.suppress(psutil.Error):
            etcd.send_signal(signal.SIGCONT)
        log.log("etcd-outage", phase="end", job=job.job, etcd_pid=etcd.pid)
    return record


# ---------------------------------------------------------------------------------------------- checkpoints
def checkpoint_temp_files(run_dir: Path) -> list[Path]:
    """Temp files of a checkpoint being written (``checkpoints/step-*/.state.pt.tmp-<pid>-<hex>``)."""
    root = run_dir / layout.CHECKPOINTS
    out: list[Path] = []
    with contextlib.suppress(OSError):
        for d in os.scandir(root):
            if d.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    out.extend(Path(f.path) for f in os.scandir(d.path) if TEMP_MARKER in f.name)
            elif TEMP_MARKER in d.name and not d.name.startswith(".latest"):
                pass  # a `latest` pointer being replaced: too short to aim at
    return out


def writer_pid(temp: Path) -> int | None:
    tail = temp.name.split(TEMP_MARKER, 1)[-1]
    pid = tail.split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def kill_during_checkpoint(
    job: JobRef, log: ChaosLog, *, timeout: float = 120.0, poll_seconds: float = 0.002
) -> dict[str, Any]:
    """Wait for a checkpoint temp file, then SIGKILL the writer and rank 0 (the worker above it) at once.

    Records whether the temp file was still there just after the kill (``mid_write``): the save was
    interrupted, not merely followed. The writer is SIGSTOPped the moment its temp file is seen, before the
    job's processes are looked up (a scan of every process's environment, tens of ms): a small model's save
    ends in a few ms, and without the freeze most kills landed after it.
    """
    writes = _checkpoint_writes(job, "kill-during-checkpoint", timeout, poll_seconds, freeze=True)
    for temp, pid, worker, run_dir in writes:
        writer = None
        with contextlib.suppress(psutil.Error):
            writer = psutil.Process(pid)
        procs = [*([writer] if writer is not None and writer.pid != worker.pid else []), *tree(worker.proc)]
        _signal(procs, signal.SIGKILL)
        mid_write = temp.exists()
        return log.log(
            "kill-during-checkpoint",
            job=job.job,
            temp_file=str(temp.relative_to(run_dir)),
            writer_pid=pid,
            mid_write=mid_write,
            **worker.describe(),
        )
    raise AssertionError("not reached: _checkpoint_writes raises when it gives up")


def _checkpoint_writes(
    job: JobRef, name: str, timeout: float, poll_seconds: float, *, freeze: bool = False
) -> Iterator[tuple[Path, int, Worker, Path]]:
    """Checkpoint writes in flight, as ``(temp file, writer pid, the worker above it, run dir)``, polled every
    ``poll_seconds``; :class:`JobNotFound` when none was seen within ``timeout``.

    With ``freeze``, the writer pid named by the temp file is SIGSTOPped before it is looked up, and SIGCONTed
    again when it is not a process of the job (or the lookup fails); a write that is yielded stays frozen for the
    caller to kill. A pid that is stopped already (its stop is not ours to undo), or that started after the temp
    file was last written (a reused pid of an older, interrupted save), is not touched."""
    if job.run_dir is None:
        raise JobNotFound(f"{name} needs --run-dir")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for temp in checkpoint_temp_files(job.run_dir):
            pid = writer_pid(temp)
            if pid is None or pid <= 1 or pid == os.getpid():
                continue
            if freeze and not _freeze_writer(pid, temp):
                continue
            handed = False
            try:
                worker = job.worker_of(pid)
                if worker is not None:
                    handed = True
                    yield temp, pid, worker, job.run_dir
            finally:
                if freeze and not handed:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)
        time.sleep(poll_seconds)
    raise JobNotFound(f"no checkpoint write of job {job.job!r} seen within {timeout:g}s")


def _freeze_writer(pid: int, temp: Path) -> bool:
    """SIGSTOP ``pid`` when it runs (not stopped already) and started before ``temp`` was last written."""
    try:
        written = temp.stat().st_mtime
        p = psutil.Process(pid)
        if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) or p.create_time() > written + 1.0:
            return False
        os.kill(pid, signal.SIGSTOP)
    except (OSError, psutil.Error):
        return False
    return True


def kill_rank0_spare_writer(
    job: JobRef, log: ChaosLog, *, timeout: float = 120.0, poll_seconds: float = 0.002
) -> dict[str, Any]:
    """Wait for a checkpoint temp file; SIGSTOP its writer, then SIGKILL rank 0 (the worker above it) alone.

    The writer is left alive and stopped mid-save, as a writer that outlives its trainer would be; the
    caller decides when to SIGCONT it (:func:`resume_process`). Records ``writer_pid`` and ``latest`` as it
    was at the kill.
    """
    for temp, pid, worker, run_dir in _checkpoint_writes(job, "kill-rank0-spare-writer", timeout, poll_seconds):
        if pid == worker.pid:
            continue
        try:
            writer = psutil.Process(pid)
        except psutil.Error:
            continue
        _signal([writer], signal.SIGSTOP)
        _signal([worker.proc], signal.SIGKILL)
        latest = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            latest = (run_dir / layout.CHECKPOINTS / layout.LATEST).read_text().strip()
        return log.log(
            "kill-rank0-spare-writer",
            job=job.job,
            temp_file=str(temp.relative_to(run_dir)),
            writer_pid=pid,
            latest=latest,
            **worker.describe(),
        )
    raise AssertionError("not reached: _checkpoint_writes raises when it gives up")


def kill_during_commit(
    job: JobRef,
    log: ChaosLog,
    *,
    rank: int | None = 0,
    timeout: float = 120.0,
    poll_seconds: float = 0.001,
    target: Worker | None = None,
) -> dict[str, Any]:
    """SIGKILL a worker (``target``, else by ``rank``, default rank 0) the moment rank 0 writes a commit's ledger
    lines.

    Rank 0 writes the ledger of the steps being committed *before* the in-memory commit, so a kill
    then hits the commit (or lands within a millisecond after it); the ledger then holds steps that
    the survivors roll back. Needs ``audit.sample_ledger: true``.
    """
    if job.run_dir is None:
        raise JobNotFound("kill-during-commit needs --run-dir")
    ledger_dir = job.run_dir / layout.LEDGER
    deadline = time.monotonic() + timeout

    def newest() -> tuple[Path | None, int]:
        from elastictrain.rundir.ledger import ledger_files

        files = ledger_files(ledger_dir)
        if not files:
            return None, 0
        with contextlib.suppress(OSError):
            return files[-1], files[-1].stat().st_size
        return None, 0

    # Chosen before watching: finding processes takes tens of milliseconds, a commit less than one.
    if target is None:
        target = job.worker_by_rank(rank) if rank is not None else random.choice(job.workers())
    procs = tree(target.proc)
    path, size = newest()
    while time.monotonic() < deadline:
        now_path, now_size = newest()
        if now_path is not None and now_path == path and now_size > size:
            _signal(procs, signal.SIGKILL)
            lines = now_path.read_text().splitlines()
            last_step = next((json.loads(x).get("step") for x in reversed(lines) if '"step"' in x), None)
            return log.log("kill-during-commit", job=job.job, ledger_step=last_step, **target.describe())
        path, size = now_path, now_size
        time.sleep(poll_seconds)
    raise JobNotFound(f"no commit of job {job.job!r} seen in {ledger_dir} within {timeout:g}s")


# ---------------------------------------------------------------------------------------------- the job
def kill_job(job: JobRef, log: ChaosLog) -> dict[str, Any]:
    """SIGKILL everything of the job: the launcher first (so it does not react), then every process by env."""
    launcher = job.launcher()
    if launcher is not None:
        _signal([launcher], signal.SIGKILL)
    procs = job.processes()
    record = log.log(
        "kill-job",
        job=job.job,
        launcher_pid=launcher.pid if launcher is not None else None,
        pids=sorted(p.pid for p in procs),
    )
    _signal(procs, signal.SIGKILL)
    _wait_gone([*procs, *([launcher] if launcher is not None else [])], timeout=10)
    return record


# ---------------------------------------------------------------------------------------------- network
def partition_host(log: ChaosLog, job: JobRef, host: str, *, seconds: float, veth: str) -> dict[str, Any]:
    """Multi-node tier: ``ip link set <veth> down`` (the host's bridge end) for ``seconds``; up in ``finally``."""
    record = log.log("partition-host", job=job.job, host=host, veth=veth, seconds=seconds)
    try:
        subprocess.run(["ip", "link", "set", veth, "down"], check=True, capture_output=True, timeout=10)
        _hold(seconds)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=False, capture_output=True, timeout=10)
        log.log("partition-host", phase="end", job=job.job, host=host, veth=veth)
    return record


# ---------------------------------------------------------------------------------------------- schedules
LOOP_ACTIONS = (
    "kill-worker",
    "kill-host",
    "preempt-host",
    "freeze-worker",
    "etcd-outage",
    "kill-during-checkpoint",
    "slow-worker",
    "hang-worker",
)


@dataclass(slots=True)
class LoopPlan:
    """A seeded schedule: (seconds from start, action) pairs. Pure, so tests check it without a job."""

    seed: int
    mtbf: float
    actions: tuple[str, ...]
    duration: float
    fixed: bool = False
    """Every ``mtbf`` seconds exactly instead of exponential gaps."""
    schedule: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = [a for a in self.actions if a not in LOOP_ACTIONS]
        if unknown or not self.actions:
            raise ValueError(f"--actions: unknown {unknown or 'none given'} (choose from {', '.join(LOOP_ACTIONS)})")
        if self.mtbf <= 0 or self.duration <= 0:
            raise ValueError("--mtbf and --duration must be > 0")
        rng = random.Random(self.seed)
        t = 0.0
        while True:
            t += self.mtbf if self.fixed else rng.expovariate(1.0 / self.mtbf)
            if t >= self.duration:
                break
            self.schedule.append((round(t, 3), rng.choice(self.actions)))


def run_loop(
    plan: LoopPlan,
    act: Callable[[str, random.Random], dict[str, Any] | None],
    log: ChaosLog,
    *,
    job: JobRef,
    stop: Callable[[], bool] = lambda: False,
) -> list[dict[str, Any]]:
    """Run ``plan``: at each scheduled time call ``act(action, rng)``; a fault that finds nothing to hit is
    logged as skipped. Stops early when ``stop()`` turns true (e.g. the job ended)."""
    rng = random.Random(plan.seed + 1)
    log.log("loop", phase="start", job=job.job, seed=plan.seed, mtbf=plan.mtbf, schedule=plan.schedule)
    t0 = time.monotonic()
    done: list[dict[str, Any]] = []
    for at, action in plan.schedule:
        while (left := t0 + at - time.monotonic()) > 0:
            if stop():
                log.log("loop", phase="end", job=job.job, reason="stopped", faults=len(done))
                return done
            time.sleep(min(0.2, left))
        job.refresh()
        try:
            record = act(action, rng)
        except JobNotFound as e:
            log.log(action, job=job.job, skipped=str(e), scheduled_at=at)
            continue
        if record is not None:
            done.append(record)
    log.log("loop", phase="end", job=job.job, reason="schedule done", faults=len(done))
    return done


def default_action(job: JobRef, log: ChaosLog, action: str, rng: random.Random) -> dict[str, Any] | None:
    """One loop action with default parameters, targets drawn from ``rng``."""
    if action == "kill-worker":
        return kill_worker(job, log, rng=rng)
    if action == "kill-host":
        return kill_host(job, log, rng.choice(_live_hosts(job)))
    if action == "preempt-host":
        return preempt_host(job, log, rng.choice(_live_hosts(job)))
    if action == "freeze-worker":
        return freeze_worker(job, log, rank=None, seconds=5.0, rng=rng)
    if action == "etcd-outage":
        return etcd_outage(job, log, seconds=10.0)
    if action == "kill-during-checkpoint":
        return kill_during_checkpoint(job, log, timeout=60.0)
    if action == "slow-worker":
        return slow_worker(job, log, slowdown=0.5, seconds=30.0, rng=rng)
    if action == "hang-worker":
        return hang_worker(job, log, rng=rng)
    raise ValueError(f"unknown action {action!r}")


def _live_hosts(job: JobRef) -> list[str]:
    hosts = sorted({w.host for w in job.workers() if is_alive(w.proc)})
    if not hosts:
        raise JobNotFound(f"job {job.job!r} has no live worker")
    return hosts
