"""Find the processes of one job by pid and environment, never by a broad process name.

A process belongs to job ``J`` when its environment (``/proc/<pid>/environ``, read with psutil) holds
``ELASTICTRAIN_JOB=J`` (horovodrun, ``discover.sh``, every worker and its helpers) or the launch id that
``elastictrain launch`` wrote to ``run_dir/launch.json`` (``ELASTICTRAIN_LAUNCH_ID``: also its etcd and
agents). Pids named in ``launch.json`` are used only after their environment confirms the launch id,
so a reused pid is never signalled.

A *worker* is an ``elastictrain train`` process of the job (not the shell around it, nor a forked
helper such as the checkpoint writer); with hot join, the process the host's zygote forked for
horovodrun's zygote client. ``HOROVOD_RANK`` in its environment is the rank it was
*started* with; after resets the rank may differ, so the current rank 0 is found from what only rank 0
does: it owns the newest ledger file (``run_dir/ledger/<ns>-<pid>.jsonl``) and the checkpoint writer.

Also the process helpers that chaos, the benchmarks and the tests share: :func:`wait_until` (poll with a
deadline), :func:`kill_tree` (a process tree by pid), :func:`checkout_env` (``chaos`` and ``bench`` importable
from any working directory: they run from the checkout, not from the installed package).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from elastictrain import envnames
from elastictrain.errors import ToolError
from elastictrain.launcher.processes import forked_worker, is_alive, is_zygote_client, process_runs_train
from elastictrain.rundir import layout

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
"""The checkout: ``chaos`` and ``bench`` run from it (neither is in the wheel)."""
BIN_DIR = Path(sys.executable).parent
"""Where ``horovodrun`` and ``elastictrain`` live: next to this Python (the virtual environment)."""


class JobNotFound(ToolError):
    """The named job, or the process asked for, cannot be found (one line for the user)."""


class HarnessError(ToolError, RuntimeError):
    """The job harness could not do what it was asked (a wait timed out, a job ended early, no such worker).

    The first line is the message; a job's log tail may follow it.
    """


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` seconds pass (HarnessError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and all its descendants (found with psutil), ignoring ones already gone."""
    try:
        proc = psutil.Process(pid)
        procs = [*proc.children(recursive=True), proc]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    psutil.wait_procs(procs, timeout=10)


def checkout_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the checkout first on ``PYTHONPATH``, so that a child started in
    another folder (a horovodrun worker in its job's workdir) can run ``python -m bench.<name>`` or ``chaos``."""
    base = dict(os.environ if env is None else env)
    rest = base.get("PYTHONPATH", "")
    base["PYTHONPATH"] = f"{REPO}{os.pathsep}{rest}" if rest else str(REPO)
    return base


def read_launch_state(run_dir: Path | None) -> dict[str, Any] | None:
    if run_dir is None:
        return None
    try:
        state = json.loads((run_dir / layout.LAUNCH_STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def environ(p: psutil.Process) -> dict[str, str]:
    try:
        return dict(p.environ())
    except (psutil.Error, OSError):
        return {}


@dataclass(frozen=True, slots=True)
class Worker:
    proc: psutil.Process
    """The training process (with hot join: the one its host's zygote forked)."""
    start_rank: int | None
    """``HOROVOD_RANK`` the worker was started with."""
    host: str
    client: psutil.Process | None = None
    """With hot join, the zygote client horovodrun started for it (it exits as the worker does)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_rank": self.start_rank, "host": self.host}


@dataclass(slots=True)
class JobRef:
    """One job: its name, its run dir (optional) and the launcher's state file when it is running."""

    job: str
    run_dir: Path | None = None
    launch: dict[str, Any] | None = None

    @classmethod
    def resolve(cls, job: str | None, run_dir: str | os.PathLike[str] | None) -> JobRef:
        rd = Path(run_dir).resolve() if run_dir is not None else None
        launch = read_launch_state(rd)
        name = job or (launch or {}).get("job")
        if not name:
            raise JobNotFound("name the job with --job, or give --run-dir of a job started by `elastictrain launch`")
        if launch is not None and launch.get("job") != name:
            launch = None  # the run dir's launcher runs another job
        return cls(str(name), rd, launch)

    def refresh(self) -> None:
        launch = read_launch_state(self.run_dir)
        if launch is not None and launch.get("job") == self.job:
            self.launch = launch

    @property
    def launch_id(self) -> str | None:
        return (self.launch or {}).get("launch_id")

    def owns(self, env: dict[str, str]) -> bool:
        lid = self.launch_id
        return env.get(envnames.JOB) == self.job or (lid is not None and env.get(envnames.LAUNCH_ID) == lid)

    def processes(self, extra_launch_ids: Iterable[str] = ()) -> list[psutil.Process]:
        """Every live process of the job (not this one), found by its environment."""
        ids = {i for i in (self.launch_id, *extra_launch_ids) if i}
        me = os.getpid()
        out = []
        for p in psutil.process_iter():
            if p.pid == me:
                continue
            env = environ(p)
            if not env:
                continue
            if (env.get(envnames.JOB) == self.job or env.get(envnames.LAUNCH_ID) in ids) and is_alive(p):
                out.append(p)
        return out

    def launched_pid(self, pid: int | None) -> psutil.Process | None:
        """The process ``pid`` named in launch.json, when its environment carries this launch's id."""
        if pid is None or self.launch_id is None:
            return None
        try:
            p = psutil.Process(int(pid))
        except (psutil.Error, ValueError):
            return None
        return p if is_alive(p) and environ(p).get(envnames.LAUNCH_ID) == self.launch_id else None

    def launcher(self) -> psutil.Process | None:
        """The launcher itself (its own environment has no launch id: checked by its command line and pid)."""
        pid = (self.launch or {}).get("pid")
        if pid is None:
            return None
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(int(pid))
            cmd = p.cmdline()
            if is_alive(p) and "launch" in cmd and any(a.endswith("elastictrain") or "elastictrain" in a for a in cmd):
                return p
        return None

    # ---------------------------------------------------------------------------------- workers
    def workers(self) -> list[Worker]:
        """The job's workers. A hot-joined one is the process its host's zygote forked (found through its client,
        whose environment says its rank and host), so that a signal reaches the training process itself."""
        out = []
        mine = self.processes()
        procs = [p for p in mine if environ(p).get(envnames.JOB) == self.job and process_runs_train(p)]
        pids = {p.pid for p in procs}
        for p in procs:
            with contextlib.suppress(psutil.Error):
                parent = p.parent()
                if parent is not None and parent.pid in pids:
                    continue  # a forked helper of a worker
            env = environ(p)
            rank = env.get("HOROVOD_RANK")
            proc, client = p, None
            with contextlib.suppress(psutil.Error):
                if is_zygote_client(p.cmdline()) and (forked := forked_worker(p, mine)) is not None:
                    proc, client = forked, p
            start_rank = int(rank) if rank and rank.isdigit() else None
            out.append(Worker(proc, start_rank, env.get("HOROVOD_HOSTNAME", ""), client))
        return sorted(out, key=lambda w: (w.start_rank if w.start_rank is not None else 1 << 30, w.pid))

    def worker_of(self, pid: int) -> Worker | None:
        """The worker that is ``pid`` or an ancestor of it (e.g. of its checkpoint writer)."""
        by_pid = {w.pid: w for w in self.workers()}
        try:
            p: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            return None
        while p is not None:
            if p.pid in by_pid:
                return by_pid[p.pid]
            try:
                p = p.parent()
            except psutil.Error:
                return None
        return None

    def rank0(self) -> Worker | None:
        """The worker holding rank 0 now: the owner of the newest ledger file, else the one started as rank 0."""
        if self.run_dir is not None:
            ledgers = sorted((self.run_dir / layout.LEDGER).glob("*.jsonl"))
            for path in reversed(ledgers):
                pid = path.stem.rsplit("-", 1)[-1]
                if pid.isdigit():
                    w = self.worker_of(int(pid))
                    if w is not None and w.pid == int(pid):
                        return w
                break  # only the newest ledger names the current rank 0
        workers = self.workers()
        return next((w for w in workers if w.start_rank == 0), None)

    def worker_by_rank(self, rank: int) -> Worker:
        if rank == 0:
            w = self.rank0()
            if w is not None:
                return w
        for w in self.workers():
            if w.start_rank == rank:
                return w
        raise JobNotFound(f"job {self.job!r} has no live worker started as rank {rank}")

    # ---------------------------------------------------------------------------------- services
    def agent(self, host: str) -> psutil.Process:
        """The agent of ``host``: from launch.json (pid confirmed by the launch id), else by job and host flags."""
        agents = (self.launch or {}).get("agents") or {}
        p = self.launched_pid(agents.get(host))
        if p is not None:
            return p
        for q in self.processes():
            with contextlib.suppress(psutil.Error):
                cmd = q.cmdline()
                if "agent" in cmd and _flag(cmd, "--job") == self.job and _flag(cmd, "--host") == host:
                    return q
        raise JobNotFound(f"no live agent of host {host!r} in job {self.job!r}")

    def etcd(self, pid: int | None = None) -> psutil.Process:
        if pid is not None:
            try:
                given = psutil.Process(pid)
                name = given.name()
            except psutil.Error:
                raise JobNotFound(f"--etcd-pid {pid}: no such process") from None
            if "etcd" not in name:
                raise JobNotFound(f"--etcd-pid {pid} is {name!r}, not etcd")
            return given
        p = self.launched_pid((self.launch or {}).get("etcd_pid"))
        if p is None:
            raise JobNotFound(f"job {self.job!r}: no embedded etcd in run_dir/launch.json (pass --etcd-pid)")
        return p

    def hosts(self) -> list[str]:
        return list((self.launch or {}).get("hosts") or sorted({w.host for w in self.workers()}))


def _flag(cmd: list[str], name: str) -> str | None:
    with contextlib.suppress(ValueError, IndexError):
        return cmd[cmd.index(name) + 1]
    return None


def tree(p: psutil.Process) -> list[psutil.Process]:
    """``p`` and its descendants, the deepest first (so a helper stops before its parent can react)."""
    try:
        kids = p.children(recursive=True)
    except psutil.Error:
        kids = []
    return [*reversed(kids), p]


def cpu_seconds(p: psutil.Process) -> float:
    """CPU seconds (user + system) of ``p`` and its descendants so far; a process gone meanwhile counts 0."""
    total = 0.0
    for q in tree(p):
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total
