"""``python -m chaos campaign --faults N --seed S``: N faults aimed at every phase of one job, and their figures.

One job under ``elastictrain launch`` (4 workers on the local tier's logical hosts, ``--min-np`` 2, hot join as
launch does by default, the embedded etcd, MLflow, the sample ledger) receives ``N`` faults in the order of a
seeded plan (:func:`plan`, pure) over the cells of :data:`CELLS`: a *phase* of the job and a *kind* of fault.

Every fault is aimed by watching the job, never by a fixed sleep: its run log (``events.jsonl``, read as it
grows), the workers' heartbeats (:mod:`elastictrain.engine.health.hang`: each worker writes ``startup``, ``rendezvous``,
``sync``, ``prologue`` and its ring's first step the moment it enters them), the ledger (a commit) and the
checkpoint writer's temp file (a save). A fault aimed at a reset's phase first needs a reset: a *primer*
SIGKILL of another worker, recorded as a fault of its own. What the victim's last heartbeat said when it was
hit is recorded beside what was aimed at (``hit``), so a fault that landed a phase late is counted as such.

Before each fault the job is whole again: 4 workers training, every host the campaign took down started again
(its agent, with the command the launcher gave it). After the job: the suite's invariants
(:func:`chaos.scenarios.check_run`: completed, exactly once per epoch, final loss against a fault-free run of
the same config, checkpoints verified and loaded, one MLflow run, nothing left running), every checkpoint loaded
with ``torch.load(weights_only=True)``, and per phase x kind (:func:`figures`, pure): count, seconds from the
fault to the job's next completed step (median, p95, max), steps lost, and hangs: a fault after which no step
completed within :data:`HANG_SECONDS` (:data:`RELAUNCH_HANG_SECONDS` for a relaunch; for the ``--min-np``
boundary, timed from the hosts' return, since below ``--min-np`` the job waits for hosts by design), or any
other stretch that long without a completed step.

Exit codes: 0 every invariant held and no hang; 1 otherwise; 2 bad flags.

Size: one campaign read in one place: the plan (pure), the aim at each phase, the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from chaos import faults
from chaos import invariants as inv
from chaos.jobs import LAUNCH_FLAGS, LaunchedJob
from chaos.procs import REPO, JobNotFound, Worker, tree
from elastictrain.engine.health.signals import IDLE, LOCAL, RENDEZVOUS, STARTUP, SYNC, WAITING, Beat
from elastictrain.errors import ScenarioError, ToolError
from elastictrain.rundir import layout
from elastictrain.rundir.events import Commit, Event, Metrics, Reset, Start
from elastictrain.tools.live_view import EventTail

PROG = "python -m chaos campaign"

# ---------------------------------------------------------------------------------------------- the plan
STEP, COMMIT, CHECKPOINT = "step", "commit", "checkpoint"
AT_RENDEZVOUS, AT_SYNC, FIRST_STEP, AT_STARTUP, AT_MIN_NP = "rendezvous", "sync", "first-step", "startup", "min-np"
PHASES = (STEP, COMMIT, CHECKPOINT, AT_RENDEZVOUS, AT_SYNC, FIRST_STEP, AT_STARTUP, AT_MIN_NP)

SIGKILL, SIGTERM, SIGSTOP, TWO = "SIGKILL", "SIGTERM", "SIGSTOP (hang)", "2 x SIGKILL"
AGENT, DRAIN, ETCD, JOB = "agent SIGKILL", "host drain", "etcd SIGKILL + restart", "job SIGKILL + relaunch"
KINDS = (SIGKILL, SIGTERM, SIGSTOP, TWO, AGENT, DRAIN, ETCD, JOB)
RANK0 = " (rank 0)"
"""Appended to the kind when the victim held rank 0."""
HANG_PRIMER = "SIGKILL priming a hang"
"""The figures' kind of a primer whose fault is a SIGSTOP: its reset waits for the hang's verdict."""


@dataclass(frozen=True, slots=True)
class Cell:
    phase: str
    kind: str
    weight: float
    """Share of the draws after every cell has had one (a relaunch is not drawn: see :func:`plan`)."""
    rank0_share: float = 0.0
    """Chance that the victim is the worker holding rank 0."""


CELLS = (
    Cell(STEP, SIGKILL, 5, rank0_share=0.3),
    Cell(STEP, SIGTERM, 1.5, rank0_share=0.3),
    Cell(STEP, SIGSTOP, 1, rank0_share=0.2),
    Cell(STEP, TWO, 1.5, rank0_share=0.3),
    Cell(STEP, AGENT, 1),
    Cell(STEP, DRAIN, 1),
    Cell(STEP, ETCD, 1),
    Cell(STEP, JOB, 0),
    Cell(COMMIT, SIGKILL, 2.5, rank0_share=0.5),
    Cell(CHECKPOINT, SIGKILL, 2, rank0_share=1.0),
    Cell(AT_RENDEZVOUS, SIGKILL, 3, rank0_share=0.3),
    Cell(AT_RENDEZVOUS, SIGSTOP, 1, rank0_share=0.2),
    Cell(AT_SYNC, SIGKILL, 3, rank0_share=0.3),
    Cell(FIRST_STEP, SIGKILL, 3, rank0_share=0.3),
    Cell(AT_STARTUP, SIGKILL, 3),
    Cell(AT_MIN_NP, SIGKILL, 0.5),
)
"""Every phase x kind the campaign aims at. A checkpoint is written by rank 0's writer: its victim is rank 0
(with the writer). A worker in start-up holds no rank yet."""


@dataclass(frozen=True, slots=True)
class Planned:
    index: int
    phase: str
    kind: str
    rank0: bool


def plan(n: int, seed: int) -> list[Planned]:
    """``n`` faults (pure): every cell once (in a seeded order; the first ``n`` when ``n`` is smaller), then draws by
    weight; relaunches of the whole job (one per 100 faults, at least one from :data:`CELLS`'s count on) spread
    evenly; each victim is rank 0 with its cell's share."""
    if n < 1:
        raise ValueError("--faults must be >= 1")
    rng = random.Random(seed)
    drawn = [c for c in CELLS if c.kind != JOB]
    relaunches = max(1, n // 100) if n >= len(CELLS) else 0
    order = drawn[:]
    rng.shuffle(order)
    picks = order[: n - relaunches]
    while len(picks) < n - relaunches:
        picks.append(rng.choices(drawn, weights=[c.weight for c in drawn])[0])
    job = next(c for c in CELLS if c.kind == JOB)
    for k in range(relaunches):
        picks.insert(min(len(picks), round((k + 0.5) * n / relaunches)), job)
    return [Planned(i, c.phase, c.kind, rng.random() < c.rank0_share) for i, c in enumerate(picks)]


# ---------------------------------------------------------------------------------------------- the job
WORKERS = 4
MIN_WORKERS = 2
STEPS_PER_EPOCH = 60
STEPS_PER_FAULT = 120
"""Steps the job trains per fault, which sizes the job so that it outlasts the plan: the ring trains on while a
host returns (a warm zygote after a SIGKILL, an agent and its zygote started again after a drain), at about 10
steps a second with 3 workers on 2 cores: 72 a fault over the cells' mix in a 20-fault run, 89 over 109 faults of
a 120-fault run (which its job, sized at 80, did not outlast). A job that ends first
leaves the rest of the plan undone, reported as such; after the plan the job trains on to its end."""


def campaign_config(n: int) -> dict[str, Any]:
    """The chaos suite's small CPU job on 4 workers, long enough for ``n`` faults (60 steps an epoch)."""
    from chaos.scenarios import base_config

    cfg = base_config(epochs=math.ceil(n * STEPS_PER_FAULT / STEPS_PER_EPOCH) + 2)
    cfg["elastic"] = {**cfg["elastic"], "min_np": MIN_WORKERS, "max_np": WORKERS}
    cfg["tracking"] = {**cfg["tracking"], "experiment": "chaos-campaign"}
    return cfg


def reset_limit(n: int) -> int:
    """horovodrun's ``--reset-limit`` for ``n`` faults: launch's default (100) would end the job after about 40 of
    them (a fault takes up to 3 resets: a primer's, its own, and the host's return)."""
    return 4 * n + 100


HANG_SECONDS = 30.0
"""No completed step for this long after a fault (or anywhere in the run) is a hang. It covers the slowest paths
that are not hangs: a SIGSTOPped worker is detected after ``elastic.hang_seconds`` (10 s by default) and then
recovers like a SIGKILL; a lease expiry (3 s) ends an agent's host."""
RELAUNCH_HANG_SECONDS = 180.0
"""A relaunch of the whole job starts every process cold (etcd, agents, zygotes, horovodrun, workers)."""
READY_SECONDS = 60.0
"""How long the job may take to be whole again (4 workers, each host back) before it is reported
(``return-missed``); after twice that the next fault goes ahead on the workers there are."""
AIM_SECONDS = 60.0
POLL_SECONDS = 0.002


class RunLog:
    """``events.jsonl`` as it grows, every event kept (read through the launcher's
    :class:`~elastictrain.tools.live_view.EventTail`; the campaign polls it every few milliseconds)."""

    def __init__(self, path: Path) -> None:
        self.tail = EventTail(path)
        self.events: list[Event] = []

    def poll(self) -> list[Event]:
        self.events.extend(self.tail.poll())
        return self.events

    def since(self, ts: float) -> list[Event]:
        return [e for e in self.poll() if e.ts >= ts]


def step_done(e: Event) -> bool:
    """An event written once a step has completed (a ``reset`` comes after the first step at the new size)."""
    return isinstance(e, Metrics | Commit | Reset)


def read_beats(folder: Path) -> dict[tuple[str, int], Beat]:
    """Every worker's heartbeat in the run dir (untrusted: an unreadable or malformed file is skipped)."""
    out = {}
    with contextlib.suppress(OSError):
        for path in folder.glob("*.json"):
            with contextlib.suppress(OSError):
                beat = Beat.parse(path.read_bytes())
                if beat is not None:
                    out[(beat.host, beat.slot)] = beat
    return out


def _same_process(beat: Beat) -> psutil.Process | None:
    """The live process that wrote ``beat`` (pid and start time), else None."""
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(beat.pid)
        if abs(p.create_time() - beat.created) < 0.5 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    return None


def _zygote_of(job: Any, host: str) -> int | None:
    """The pid of ``host``'s warm zygote (its agent's ``zygote serve`` child), or None (no agent, a cold host)."""
    with contextlib.suppress(JobNotFound, psutil.Error):
        for child in job.agent(host).children():
            with contextlib.suppress(psutil.Error):
                if "serve" in child.cmdline() and any("zygote" in a for a in child.cmdline()):
                    return int(child.pid)
    return None


def _children(pid: int) -> set[int]:
    """The direct children of ``pid``'s main thread (which forks the workers), from one read of /proc."""
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except (OSError, ValueError):
        return set()


def _sigkill(procs: Iterable[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)


class NotAimed(ToolError):
    """The phase aimed at did not come within :data:`AIM_SECONDS` (the fault is reported as not injected)."""


class Campaign:
    """One campaign run: the job, the plan, and what each fault hit."""

    def __init__(self, run: LaunchedJob, planned: Sequence[Planned], seed: int, out: Callable[[str], None]) -> None:
        self.run = run
        self.planned = planned
        self.rng = random.Random(seed + 1)
        self.out = out
        self.tail = RunLog(run.run_dir / layout.EVENTS)
        self.beats_dir = layout.RunDir(run.run_dir).heartbeats
        self.down: set[str] = set()
        """Hosts whose agent the campaign stopped and has not started again."""
        self.records: list[dict[str, Any]] = []
        self.last_fault = 0.0

    # -- what the job is doing
    def world(self) -> int | None:
        for e in reversed(self.tail.poll()):
            if isinstance(e, Start | Reset):
                return e.new_size if isinstance(e, Reset) and e.new_size is not None else e.world_size
        return None

    def whole(self) -> bool:
        """4 workers train: the newest reset (or start) is at 4, two steps completed since it and since the last
        fault, and 4 live workers' heartbeats say they train in a ring that has completed a step."""
        events = self.tail.poll()
        last = next((i for i in range(len(events) - 1, -1, -1) if isinstance(events[i], Start | Reset)), None)
        if last is None or self.world() != WORKERS:
            return False
        if sum(1 for e in events[last + 1 :] if step_done(e) and e.ts > self.last_fault) < 2:
            return False
        training = [
            b
            for b in read_beats(self.beats_dir).values()
            if b.phase in (LOCAL, WAITING, IDLE) and b.steps > 0 and psutil.pid_exists(b.pid)
        ]
        return len(training) >= WORKERS

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        return self.run.wait_for(predicate, timeout, what, interval=POLL_SECONDS * 5)

    def make_whole(self) -> None:
        """Start the hosts the campaign took down again, and wait until 4 workers train; a job that does not get
        there in :data:`READY_SECONDS` is reported (``return-missed``, with who is missing) and waited for again."""
        for host in sorted(self.down):
            self.run.restart_agent(host)
            self.down.discard(host)
        for attempt in range(2):
            try:
                self.wait(self.whole, READY_SECONDS, "4 workers training")
                return
            except ScenarioError:
                if not self.run.running():
                    raise
                missing = self.missing()
                self.run.log.log("return-missed", job=self.run.job_name, attempt=attempt, **missing)
                self.out(f"campaign: the job is not whole after {READY_SECONDS:g}s: {missing}")
                for host in missing["hosts_without_agent"]:
                    self.run.restart_agent(host)
        if (self.world() or 0) > MIN_WORKERS:
            return  # reported above; the next fault goes ahead on the workers there are
        raise ScenarioError(f"the job never had more than {MIN_WORKERS} workers again: {self.missing()}")

    def missing(self) -> dict[str, Any]:
        job = self.run.job()
        hosts = job.hosts()
        workers = {w.host for w in job.workers()}
        no_agent = []
        for h in hosts:
            try:
                job.agent(h)
            except JobNotFound:
                no_agent.append(h)
        return {
            "world": self.world(),
            "hosts_without_worker": sorted(set(hosts) - workers),
            "hosts_without_agent": no_agent,
        }

    def left(self, host: str, since: float) -> bool:
        return any(isinstance(e, Reset) and host not in (e.hosts or []) for e in self.tail.since(since))

    def resumed(self, since: float) -> bool:
        return any(isinstance(e, Start) and e.resumed_from_step is not None for e in self.tail.since(since))

    def reached(self, size: int, since: float) -> bool:
        """A reset (or relaunch) since ``since`` brought the job to ``size`` workers and a step completed there."""
        return any(isinstance(e, Reset | Start) and e.world_size == size for e in self.tail.since(since))

    def has_worker(self, host: str) -> bool:
        return any(w.host == host for w in self.run.job().workers())

    # -- victims
    def workers(self, rank0: bool) -> tuple[Worker, list[Worker]]:
        """(rank 0's worker, the others), found afresh."""
        job = self.run.job()
        r0 = job.rank0()
        if r0 is None:
            raise JobNotFound("no worker holds rank 0")
        others = [w for w in job.workers() if w.pid != r0.pid]
        return r0, others

    def victim(self, rank0: bool) -> Worker:
        r0, others = self.workers(rank0)
        if rank0 or not others:
            return r0
        return self.rng.choice(sorted(others, key=lambda w: w.host))

    def beat_of(self, pid: int) -> Beat | None:
        return next((b for b in read_beats(self.beats_dir).values() if b.pid == pid), None)

    def hit(self, pid: int, default: str) -> str:
        """The phase the process ``pid`` was in when it was hit: its last heartbeat's (a ``local`` or ``waiting``
        beat of a ring that has trained is a step; of a new ring, its first step)."""
        b = self.beat_of(pid)
        if b is None:
            return default
        if b.phase in (LOCAL, WAITING, IDLE):
            return FIRST_STEP if b.steps == 0 and b.phase != IDLE else STEP
        return {STARTUP: AT_STARTUP, RENDEZVOUS: AT_RENDEZVOUS, SYNC: AT_SYNC}.get(b.phase, b.phase)

    # -- one fault
    def record(
        self,
        p: Planned | None,
        fault: Mapping[str, Any],
        *,
        phase: str,
        kind: str,
        hit: str,
        role: str = "aimed",
        **extra: Any,
    ) -> dict[str, Any]:
        rec = self.run.log.log(
            "campaign-fault",
            job=self.run.job_name,
            index=p.index if p is not None else None,
            role=role,
            phase=phase,
            kind=kind,
            hit=hit,
            fault_action=fault.get("action"),
            fault_ts=float(fault["ts"]),
            **extra,
        )
        self.records.append(rec)
        self.last_fault = max(self.last_fault, float(fault["ts"]), float(extra.get("returned_ts") or 0.0))
        return rec

    def kill(self, w: Worker, action: str = "kill-worker", **fields: Any) -> dict[str, Any]:
        """SIGKILL a worker and its helpers (checkpoint writer), as a crash would."""
        record = self.run.log.log(action, job=self.run.job_name, signal="SIGKILL", **w.describe(), **fields)
        _sigkill(tree(w.proc))
        return record

    def stop(self, w: Worker, **fields: Any) -> dict[str, Any]:
        """SIGSTOP a worker and its helpers (a hang): never undone; the job's hang detector must end it."""
        procs = tree(w.proc)
        pids = [x.pid for x in procs]
        record = self.run.log.log("hang-worker", job=self.run.job_name, pids=pids, **w.describe(), **fields)
        for x in procs:
            with contextlib.suppress(psutil.Error):
                x.send_signal(signal.SIGSTOP)
        return record

    def kind_of(self, kind: str, w: Worker, r0: Worker | None) -> str:
        return kind + (RANK0 if r0 is not None and w.pid == r0.pid else "")

    def inject(self, p: Planned) -> None:
        getattr(self, "_" + p.phase.replace("-", "_"))(p)

    # step: every kind
    def _step(self, p: Planned) -> None:
        job, log = self.run.job(), self.run.log
        if p.kind in (SIGKILL, SIGTERM, SIGSTOP):
            r0, _ = self.workers(p.rank0)
            w = self.victim(p.rank0)
            hit = self.hit(w.pid, STEP)
            if p.kind == SIGKILL:
                f = self.kill(w)
            elif p.kind == SIGTERM:
                f = log.log("kill-worker", job=job.job, signal="SIGTERM", **w.describe())
                with contextlib.suppress(psutil.Error):
                    w.proc.send_signal(signal.SIGTERM)
            else:
                f = self.stop(w)
            self.record(p, f, phase=STEP, kind=self.kind_of(p.kind, w, r0), hit=hit)
        elif p.kind == TWO:
            r0, others = self.workers(p.rank0)
            pair = [r0, self.rng.choice(others)] if p.rank0 else self.rng.sample(others, 2)
            f = log.log(
                "kill-worker", job=job.job, signal="SIGKILL", pids=[w.pid for w in pair], hosts=[w.host for w in pair]
            )
            _sigkill([x for w in pair for x in tree(w.proc)])
            self.record(p, f, phase=STEP, kind=self.kind_of(TWO, pair[0], r0), hit=STEP)
        elif p.kind in (AGENT, DRAIN):
            host = self.victim(False).host
            f = (faults.kill_agent if p.kind == AGENT else faults.preempt_host)(job, log, host)
            self.down.add(host)
            self.record(p, f, phase=STEP, kind=p.kind, hit=STEP, host=host)
            # Started again once the host has left the ring (its lease expired, or it drained).
            self.wait(lambda: self.left(host, float(f["ts"])), AIM_SECONDS, f"host {host} to leave the ring")
        elif p.kind == ETCD:
            etcd = job.etcd()
            f = log.log("etcd-restart", job=job.job, etcd_pid=etcd.pid)
            _sigkill([etcd])
            self.record(p, f, phase=STEP, kind=ETCD, hit=STEP)

            def back() -> bool:
                job.refresh()
                pid = (job.launch or {}).get("etcd_pid")
                return isinstance(pid, int) and pid != etcd.pid and psutil.pid_exists(pid)

            self.wait(back, AIM_SECONDS, "the launcher to start etcd again")
        elif p.kind == JOB:
            f = faults.kill_job(job, log)
            self.record(p, f, phase=STEP, kind=JOB, hit=STEP)
            self.run.wait_exit(10)
            self.down.clear()
            self.run.start()  # the same command on the same run dir resumes from the latest checkpoint
            self.wait(lambda: self.resumed(float(f["ts"])), RELAUNCH_HANG_SECONDS, "the relaunch to resume")
        else:
            raise ValueError(f"unknown kind {p.kind!r}")

    def _commit(self, p: Planned) -> None:
        r0, others = self.workers(p.rank0)
        w = r0 if p.rank0 else self.rng.choice(others)
        f = faults.kill_during_commit(self.run.job(), self.run.log, target=w, timeout=AIM_SECONDS)
        self.record(p, f, phase=COMMIT, kind=self.kind_of(SIGKILL, w, r0), hit=COMMIT)

    def _checkpoint(self, p: Planned) -> None:
        f = faults.kill_during_checkpoint(self.run.job(), self.run.log, timeout=AIM_SECONDS)
        self.record(p, f, phase=CHECKPOINT, kind=SIGKILL + RANK0, hit=CHECKPOINT if f.get("mid_write") else STEP)

    def _prime(self, p: Planned) -> tuple[dict[str, Any], Worker]:
        """A SIGKILL of a worker that is not rank 0, to start a reset; recorded as a fault of its own."""
        _, others = self.workers(False)
        if not others:
            raise NotAimed("no worker besides rank 0 to prime a reset with")
        w = self.rng.choice(others)
        f = self.kill(w)
        self.record(p, f, phase=STEP, kind=SIGKILL, hit=self.hit(w.pid, STEP), role="primer")
        return f, w

    def _aim_in_reset(self, p: Planned, want: Callable[[Beat], bool]) -> None:
        """Prime a reset, then SIGKILL (or SIGSTOP, as the plan's kind says) a survivor the moment one's heartbeat
        says ``want`` (the rank-0 worker when the plan says so and it is there)."""
        r0, _ = self.workers(p.rank0)
        f0, primed = self._prime(p)
        since = float(f0["ts"])

        def found() -> Beat | None:
            beats = [b for b in read_beats(self.beats_dir).values() if b.since >= since and want(b)]
            beats = [b for b in beats if b.pid not in (primed.pid,)]
            if not beats:
                return None
            if p.rank0:
                return next((b for b in beats if b.pid == r0.pid), None)
            return next((b for b in beats if b.pid != r0.pid), None)

        beat = self._poll(found, f"a survivor in {p.phase}")
        proc = _same_process(beat)
        if proc is None:
            raise NotAimed(f"the survivor in {p.phase} (pid {beat.pid}) was gone before the kill")
        w = Worker(proc, None, beat.host)
        f = self.stop(w, phase_aimed=p.phase) if p.kind == SIGSTOP else self.kill(w, phase_aimed=p.phase)
        self.record(p, f, phase=p.phase, kind=self.kind_of(p.kind, w, r0), hit=self.hit(w.pid, p.phase))

    def _poll(self, found: Callable[[], Any], what: str) -> Any:
        try:
            return self.run.wait_for(found, AIM_SECONDS, what, interval=POLL_SECONDS)
        except ScenarioError:
            if not self.run.running():
                raise
            raise NotAimed(f"no {what} within {AIM_SECONDS:g}s") from None

    def _rendezvous(self, p: Planned) -> None:
        self._aim_in_reset(p, lambda b: b.phase == RENDEZVOUS)

    def _sync(self, p: Planned) -> None:
        self._aim_in_reset(p, lambda b: b.phase == SYNC)

    def _first_step(self, p: Planned) -> None:
        self._aim_in_reset(p, lambda b: b.phase in (LOCAL, WAITING) and b.steps == 0)

    def _startup(self, p: Planned) -> None:
        """Prime a reset on host H, then SIGKILL H's next worker as soon as it exists: a child of H's warm zygote
        (its fork is seen in ``/proc/<zygote>/task/<zygote>/children`` within a millisecond, before the worker has
        even read its config), or a cold worker's ``startup`` heartbeat; both come before ``hvd.init`` (which the
        worker announces with a ``rendezvous`` heartbeat)."""
        job = self.run.job()
        f0, primed = self._prime(p)
        since, host = float(f0["ts"]), primed.host
        zygote = _zygote_of(job, host)
        before = _children(zygote) if zygote is not None else set()

        def found() -> psutil.Process | None:
            if zygote is not None:
                for pid in sorted(_children(zygote) - before):
                    with contextlib.suppress(psutil.Error):
                        return psutil.Process(pid)
            for b in read_beats(self.beats_dir).values():
                if b.host == host and b.pid != primed.pid and b.since >= since and b.phase == STARTUP:
                    return _same_process(b)
            return None

        proc = self._poll(found, f"a new worker on {host}")
        f = self.kill(Worker(proc, None, host), phase_aimed=AT_STARTUP)
        self.record(p, f, phase=AT_STARTUP, kind=SIGKILL, hit=self.hit(proc.pid, AT_STARTUP), host=host)

    def _min_np(self, p: Planned) -> None:
        """Two hosts die (the job at --min-np), then a third (below it); then the three come back."""
        log = self.run.log
        _, others = self.workers(False)
        hosts = sorted({w.host for w in others})
        if len(hosts) < 3:
            raise NotAimed(f"{len(hosts)} hosts besides rank 0's; the boundary needs 3")
        first, second, third = self.rng.sample(hosts, 3)
        for h, size in ((first, WORKERS - 1), (second, MIN_WORKERS)):
            f = faults.kill_host(self.run.job(), log, h)
            self.down.add(h)
            self.record(p, f, phase=STEP, kind=SIGKILL, hit=STEP, role="primer", host=h)
            since = float(f["ts"])
            self.wait(functools.partial(self.reached, size, since), AIM_SECONDS, f"the job at {size} workers")
        f = faults.kill_host(self.run.job(), log, third)
        self.down.add(third)
        self.wait(lambda: not self.has_worker(third), AIM_SECONDS, f"{third}'s worker gone")
        for h in sorted(self.down):
            self.run.restart_agent(h)
        self.down.clear()
        returned = time.time()
        self.record(p, f, phase=AT_MIN_NP, kind=SIGKILL, hit=AT_MIN_NP, host=third, returned_ts=returned)

    # -- the whole campaign
    def job_ended(self, p: Planned) -> bool:
        """The job completed (its launcher exited 0) before fault ``p``: the rest of the plan is not reached."""
        launcher = self.run.launcher
        if launcher is None or launcher.poll() != 0:
            return False
        self.run.log.log("campaign", phase="job-ended", job=self.run.job_name, index=p.index)
        return True

    def run_plan(self) -> list[dict[str, Any]]:
        self.run.wait_for((self.run.run_dir / layout.MLFLOW_RUN_ID).exists, 180, "the MLflow run (mlflow_run_id)")
        self.run.log.log("campaign", phase="start", job=self.run.job_name, faults=len(self.planned))
        for p in self.planned:
            if self.job_ended(p):
                break
            try:
                self.make_whole()
            except ScenarioError:
                if self.job_ended(p):
                    break
                raise
            self.out(
                f"campaign: fault {p.index + 1}/{len(self.planned)}: {p.phase} x {p.kind}"
                f"{' (rank 0)' if p.rank0 else ''}"
            )
            try:
                self.inject(p)
            except ScenarioError as e:  # what the fault waited for did not come: a finding, then the job is healed
                if self.job_ended(p):
                    break
                if not self.run.running():
                    raise
                self.run.log.log("campaign-stuck", job=self.run.job_name, index=p.index, phase=p.phase,
                                 kind=p.kind, why=str(e), **self.missing())  # fmt: skip
                self.out(f"campaign: fault {p.index + 1} stuck: {e}")
            except (NotAimed, JobNotFound, IndexError, KeyError, psutil.Error) as e:
                self.run.log.log(
                    "campaign-skipped", job=self.run.job_name, index=p.index, phase=p.phase, kind=p.kind, why=str(e)
                )
        for host in sorted(self.down):
            self.run.restart_agent(host)
        self.down.clear()
        self.run.log.log("campaign", phase="end", job=self.run.job_name)
        return self.records


# ---------------------------------------------------------------------------------------------- figures
@dataclass(slots=True)
class Row:
    phase: str
    kind: str
    count: int = 0
    hit: int = 0
    """Faults whose victim was in the phase aimed at."""
    recovery: list[float] = field(default_factory=list)
    lost_steps: list[int] = field(default_factory=list)
    hangs: int = 0

    def as_dict(self) -> dict[str, Any]:
        r = sorted(self.recovery)
        return {
            "phase": self.phase,
            "kind": self.kind,
            "count": self.count,
            "hit": self.hit,
            "recovery_median_s": statistics.median(r) if r else None,
            "recovery_p95_s": inv.percentile(r, 95),
            "recovery_max_s": r[-1] if r else None,
            "lost_steps_total": sum(self.lost_steps),
            "lost_steps_max": max(self.lost_steps, default=None),
            "hangs": self.hangs,
        }


def next_step_after(events: Sequence[Event], t: float) -> Event | None:
    return next((e for e in events if e.ts > t and step_done(e)), None)


def figures(
    records: Sequence[Mapping[str, Any]], events: Sequence[Event], aimed_at: Mapping[int, str] | None = None
) -> dict[str, Any]:
    """Per phase x kind (pure): count, hits, seconds from each fault to the job's next completed step, steps lost
    (the ``lost_steps`` of the first reset after it), hangs; and the longest stretch without a completed step
    outside the waits that are by design (a relaunch's start, below ``--min-np`` until the hosts return). ``hangs``
    counts stretches (several faults late in one stretch are one hang); ``faults_in_hangs`` counts the faults.
    The primer of a hang (the SIGKILL that starts the reset in which a survivor is then SIGSTOPped) waits for the
    hang's verdict: it has a row of its own (:data:`HANG_PRIMER`), outside the SIGKILL figures. ``aimed_at`` (the
    plan's phase by index) puts the primers of a ``--min-np`` fault whose last kill never came (its wait ran out) with
    the boundary's kills too."""
    events = sorted(events, key=lambda e: e.ts)
    resets = [e for e in events if isinstance(e, Reset)]
    rows: dict[tuple[str, str], Row] = {}
    excused: list[tuple[float, float]] = []
    hung: list[tuple[float, float]] = []
    per_fault = []
    aimed_kind = {rec.get("index"): str(rec["kind"]) for rec in records if rec.get("role") == "aimed"}
    for rec in sorted(records, key=lambda r: float(r["fault_ts"])):
        if rec.get("role") == "primer" and aimed_kind.get(rec.get("index"), "").startswith(SIGSTOP):
            rec = {**rec, "kind": HANG_PRIMER}
        row = rows.setdefault((str(rec["phase"]), str(rec["kind"])), Row(str(rec["phase"]), str(rec["kind"])))
        row.count += 1
        row.hit += rec.get("hit") == rec["phase"]
        t = float(rec.get("returned_ts") or rec["fault_ts"])
        nxt = next_step_after(events, t)
        took = nxt.ts - t if nxt is not None else None
        bound = RELAUNCH_HANG_SECONDS if rec["kind"] == JOB else HANG_SECONDS
        if rec["kind"] == JOB or rec["phase"] == AT_MIN_NP:
            excused.append((float(rec["fault_ts"]), nxt.ts if nxt is not None else math.inf))
        if took is not None:
            row.recovery.append(took)
        if took is None or took > bound:
            row.hangs += 1
            hung.append((t, nxt.ts if nxt is not None else math.inf))
        reset = next((r for r in resets if r.ts > float(rec["fault_ts"])), None) if rec["kind"] != JOB else None
        if reset is not None and reset.lost_steps is not None:
            row.lost_steps.append(int(reset.lost_steps))
        per_fault.append(
            {**{k: rec.get(k) for k in ("index", "role", "phase", "kind", "hit", "fault_ts")}, "to_next_step_s": took}
        )
    done = [e.ts for e in events if step_done(e)]
    gaps = [(a, b) for a, b in itertools.pairwise(done) if not any(lo <= b and a <= hi for lo, hi in excused)]
    longest = max((b - a for a, b in gaps), default=0.0)
    long_gaps = [(a, b) for a, b in gaps if b - a > HANG_SECONDS]
    # One incident per stretch: a long gap, or the faults' own late windows (merged) that no long gap holds.
    merged: list[tuple[float, float]] = []
    for a, b in sorted(hung):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    outside = [w for w in merged if not any(ga <= w[0] and w[1] <= gb for ga, gb in long_gaps)]
    killed = [r for r in rows.values() if r.kind.startswith((SIGKILL, TWO)) and r.kind != HANG_PRIMER]
    sigkills = [x for r in killed for x in r.recovery]
    # The --min-np boundary's kills (its primers too) end when hosts return and start workers: no recovery of the
    # job's own can come sooner, so they are also summed up apart.
    boundary = {rec.get("index") for rec in records if rec["phase"] == AT_MIN_NP}
    boundary |= {i for i, phase in (aimed_at or {}).items() if phase == AT_MIN_NP}
    elsewhere = [
        p["to_next_step_s"]
        for p in per_fault
        if str(p["kind"]).startswith((SIGKILL, TWO))
        and p["kind"] != HANG_PRIMER
        and p["index"] not in boundary
        and p["to_next_step_s"] is not None
    ]
    return {
        "rows": [rows[k].as_dict() for k in sorted(rows, key=lambda k: (PHASES.index(k[0]), k[1]))],
        "faults": sum(r.count for r in rows.values()),
        "cells": len(rows),
        "hangs": len(long_gaps) + len(outside),
        "faults_in_hangs": sum(r.hangs for r in rows.values()),
        "longest_stretch_without_a_step_s": longest,
        "sigkill_recovery": _summary(sigkills),
        "sigkill_recovery_off_min_np": _summary(elsewhere),
        "per_fault": per_fault,
    }


def _summary(seconds: Sequence[float]) -> dict[str, Any]:
    return {
        "count": len(seconds),
        "median_s": statistics.median(seconds) if seconds else None,
        "p95_s": inv.percentile(list(seconds), 95),
        "max_s": max(seconds, default=None),
    }


def load_weights_only(run_dir: Path) -> tuple[int, list[str]]:
    """(checkpoints loaded, the ones that failed, with why): each checkpoint folder verified and its state loaded by
    :func:`~elastictrain.checkpoint.load_checkpoint`, which uses ``torch.load(weights_only=True)``."""
    from elastictrain.checkpoint import CheckpointDamaged, LocalStorage, list_checkpoints, load_checkpoint

    storage = LocalStorage.for_run_dir(run_dir)
    loaded, bad = 0, []
    for _, name in list_checkpoints(storage):
        try:
            load_checkpoint(storage, name)
            loaded += 1
        except CheckpointDamaged as e:
            bad.append(str(e).splitlines()[0][:200])
    return loaded, bad


def markdown(report: Mapping[str, Any]) -> str:
    f = report["figures"]
    lines = [
        f"`{report['command']}` on {report['date']}, {report['machine_line']}; {report['wall_seconds']:.0f} s.",
        "",
        f"{f['faults']} faults ({report['planned']} planned, {report['injected']} of them injected, "
        f"{report['skipped']} skipped, {report['not_reached']} not reached before the job ended; the rest primers) in "
        f"{f['cells']} phase x kind cells; hangs: {f['hangs']} stretches with {f['faults_in_hangs']} faults in them "
        f"(bound {HANG_SECONDS:g} s, relaunch {RELAUNCH_HANG_SECONDS:g} s); "
        f"longest stretch without a completed step {f['longest_stretch_without_a_step_s']:.1f} s; "
        f"the job not whole {READY_SECONDS:g} s after a fault: {len(report['returns_missed'])} times; "
        f"a fault's wait that ran out: {len(report['stuck'])} times.",
        "",
        "| phase | kind | faults | hit the phase | to next step median / p95 / max (s) | steps lost (total, max) "
        "| hangs |",
        "|---|---|---|---|---|---|---|",
    ]

    def s(v: Any) -> str:
        return "—" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    for r in f["rows"]:
        lines.append(
            f"| {r['phase']} | {r['kind']} | {r['count']} | {r['hit']} | {s(r['recovery_median_s'])} / "
            f"{s(r['recovery_p95_s'])} / {s(r['recovery_max_s'])} | {r['lost_steps_total']}, {s(r['lost_steps_max'])} "
            f"| {r['hangs']} |"
        )
    k, o = f["sigkill_recovery"], f.get("sigkill_recovery_off_min_np") or _summary([])
    lines += [
        "",
        f"All SIGKILLs ({k['count']}): to the next step median {s(k['median_s'])} s, p95 {s(k['p95_s'])} s, "
        f"max {s(k['max_s'])} s. Outside the --min-np boundary (its kills and their primers; the job trains again "
        f"there only once hosts return) ({o['count']}): median {s(o['median_s'])} s, p95 {s(o['p95_s'])} s, "
        f"max {s(o['max_s'])} s.",
        "",
        "| invariant | ok | value |",
        "|---|---|---|",
        *(f"| {c['name']} | {c['ok']} | {c['detail']} |" for c in report["checks"]),
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- running
def run_campaign(
    n: int,
    seed: int,
    run_dir: Path | None,
    out_path: Path | None,
    out: Callable[[str], None] = print,
    *,
    with_reference: bool = True,
) -> int:
    from bench.core import describe_machine, result_stem
    from chaos.scenarios import DEFAULT_RUNS, Scenario, check_run, reference_loss

    started = time.time()
    planned = plan(n, seed)
    run_dir = (run_dir or DEFAULT_RUNS / f"campaign-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ScenarioError(f"--run-dir {run_dir} is not empty (a campaign needs a fresh run dir)")
    cfg = campaign_config(n)
    reference = None
    if with_reference:
        out(f"campaign: {n} faults, seed {seed}; reference run (cached under {run_dir.parent / '.chaos-reference'})")
        reference = reference_loss(cfg, run_dir.parent, timeout=14400)
    job = f"chaos-campaign-{os.urandom(3).hex()}"
    run = LaunchedJob(run_dir, {"job": job, **cfg}, flags=(*LAUNCH_FLAGS, "--reset-limit", str(reset_limit(n))))
    campaign = Campaign(run, planned, seed, out)
    error = None
    try:
        run.start()
        campaign.run_plan()
        run.wait_exit(max(600.0, 3 * cfg["training"]["epochs"] * STEPS_PER_EPOCH * 0.2))
    except ScenarioError as e:
        error = str(e)
        run.log.log("scenario-error", job=job, error=error)
        out(f"campaign: {e}")
    finally:
        if run.launcher is not None and run.launcher.poll() is not None and run.exit_code is None:
            run.exit_code = run.launcher.returncode  # the job ended while the campaign waited on it
        leftovers = run.close()
    scenario = Scenario("campaign", f"{n} faults, seed {seed}", lambda r, q: None, ci=False, expect_reset=False)
    result = check_run(scenario, run, reference, leftovers)
    if not with_reference:  # said, not failed: the run was asked not to make the comparison
        result.checks = [
            inv.Check(c.name, None, "not compared (--no-reference)") if c.name == "final loss vs fault-free run" else c
            for c in result.checks
        ]
    loaded, refused = load_weights_only(run_dir)
    detail = f"{loaded} loaded; refused: {refused[:3]}" if refused else f"{loaded} loaded"
    checks = [*result.checks, inv.Check("checkpoints load with weights_only=True", not refused and loaded > 0, detail)]
    figs = figures(campaign.records, run.events(), {p.index: p.phase for p in planned})
    checks.append(inv.Check(f"no hang (no step for > {HANG_SECONDS:g} s)", figs["hangs"] == 0, str(figs["hangs"])))
    if error is not None:
        checks.append(inv.Check("the campaign ran to its end", False, error))
    chaos_events = faults.read_chaos(run_dir / "chaos.jsonl")
    skipped = [e for e in chaos_events if e.get("action") == "campaign-skipped"]
    missed = [e for e in chaos_events if e.get("action") == "return-missed"]
    stuck = [e for e in chaos_events if e.get("action") == "campaign-stuck"]
    machine = describe_machine()
    report = {
        "command": f"{PROG} --faults {n} --seed {seed}{'' if with_reference else ' --no-reference'}",
        "date": time.strftime("%Y-%m-%d", time.localtime(started)),
        "machine": machine,
        "machine_line": f"{machine['cpu_model']}, {machine['usable_cores']} cores, {machine['memory_gib']} GiB, "
        f"torch {machine.get('torch')}, Horovod {machine.get('horovod')}",
        "wall_seconds": time.time() - started,
        "run_dir": str(run_dir),
        "planned": n,
        "skipped": len(skipped),
        "injected": len({r["index"] for r in campaign.records if r.get("role") == "aimed"}),
        "not_reached": n
        - len(
            {r["index"] for r in campaign.records if r.get("role") == "aimed"}
            | {e.get("index") for e in [*skipped, *stuck]}
        ),
        "skipped_detail": [{k: e.get(k) for k in ("index", "phase", "kind", "why")} for e in skipped],
        "returns_missed": [{k: v for k, v in e.items() if k != "job"} for e in missed],
        "stuck": [{k: v for k, v in e.items() if k != "job"} for e in stuck],
        "figures": figs,
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
        "plan": [asdict(p) for p in planned],
    }
    (run_dir / "campaign.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (run_dir / "campaign.md").write_text(markdown(report))
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        stem = out_path.name.removesuffix(".json")
        write_results_pair(report, out_path.parent, stem)
    else:
        stem = result_stem(started, machine["hostname"], False) + "-campaign"
        write_results_pair(report, REPO / "bench" / "results", stem)
    out(markdown(report))
    ok = inv.passed(checks) and figs["hangs"] == 0
    return 0 if ok else 1


def refigure(run_dir: Path, out_path: Path | None = None, out: Callable[[str], None] = print) -> int:
    """The figures of a campaign's run dir computed again by this code's :func:`figures` from the run's own logs
    (its ``campaign-fault`` records and its run log), written over ``campaign.json``/``.md`` there (and ``out_path``);
    the report says so (``refigured``). Returns the campaign's exit code for the new figures."""

    from elastictrain.rundir.events import read_events

    report = json.loads((run_dir / "campaign.json").read_text())
    records = [e for e in faults.read_chaos(run_dir / "chaos.jsonl") if e.get("action") == "campaign-fault"]
    events = read_events(run_dir / layout.EVENTS, on_skip=lambda line, reason: None)
    figs = figures(records, events, {int(p["index"]): str(p["phase"]) for p in report.get("plan", [])})
    hang_check = f"no hang (no step for > {HANG_SECONDS:g} s)"
    checks = [c for c in report["checks"] if c["name"] != hang_check]
    checks.append({"name": hang_check, "ok": figs["hangs"] == 0, "detail": str(figs["hangs"])})
    report |= {"figures": figs, "checks": checks, "refigured": time.strftime("%Y-%m-%d %H:%M:%S")}
    (run_dir / "campaign.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (run_dir / "campaign.md").write_text(markdown(report))
    if out_path is not None:
        write_results_pair(report, out_path.parent, out_path.name.removesuffix(".json"))
    out(markdown(report))
    return 0 if all(c["ok"] is not False for c in checks) else 1


def write_results_pair(report: Mapping[str, Any], folder: Path, stem: str) -> None:
    from elastictrain.fileio import write_atomic

    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / f"{stem}.json", json.dumps(report, indent=1, default=str) + "\n")
    write_atomic(folder / f"{stem}.md", markdown(report))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", type=int, required=True, help="how many faults the plan holds (>= 1)")
    p.add_argument("--seed", type=int, required=True, help="seed of the plan and of the victims")
    p.add_argument("--run-dir", default=None, help="a fresh run dir (default runs/chaos/campaign-<time>)")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/<date>-<host>-campaign.json)")
    p.add_argument("--plan", action="store_true", help="print the plan and exit")
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the fault-free run of the same job (as long in training steps as the campaign's) and the final-loss "
        "comparison with it",
    )


def main(args: argparse.Namespace) -> int:
    if args.faults < 1:
        print(f"{PROG}: error: --faults must be >= 1", file=sys.stderr)
        return 2
    if args.run_dir and Path(args.run_dir).exists() and not Path(args.run_dir).is_dir():
        print(f"{PROG}: error: --run-dir {args.run_dir} is not a folder", file=sys.stderr)
        return 2
    if args.plan:
        for p in plan(args.faults, args.seed):
            print(f"{p.index:>4} {p.phase:<11} {p.kind}{RANK0 if p.rank0 else ''}")
        return 0
    try:
        return run_campaign(
            args.faults,
            args.seed,
            Path(args.run_dir) if args.run_dir else None,
            Path(args.out) if args.out else None,
            with_reference=not args.no_reference,
        )
    except ScenarioError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
