"""A hung worker is a failure: heartbeats, the verdict (pure), and what the survivors do about it.

A worker that stops making progress while its process lives (SIGSTOP, a kernel hang, a deadlocked data loader)
holds every other worker in the next collective, and nothing in Horovod or Gloo ends that before the Gloo timeout:
the kernel keeps its TCP connections open and even acknowledges them while the process is stopped. So:

* **Heartbeats.** Each worker's watchdog thread writes a heartbeat about once a second through the job's
  signals (:mod:`~elastictrain.engine.health.signals`: ``run_dir/.elastic/heartbeats/`` or the job's etcd):
  its pid, machine (boot id and PID namespace), the time, and where its step stands: ``local`` (taking its batch,
  computing: work only it can finish), ``waiting`` (its gradients are ready; from here it waits on the others), or
  ``idle`` (between steps, validation, a reset). A stopped process, or a machine that hangs, writes none; a live process
  stuck in its own work keeps writing ``local`` with an old start.
  A (re)start has phases of its own, each written at once when it begins (not on the next beat), so that an
  operator or the chaos campaign (:mod:`chaos.campaign`, which aims faults by them) sees where a reset stands:
  ``startup`` (the process runs, ``hvd.init`` not called yet), ``rendezvous`` (a failure or host notice was caught,
  or a new process called ``hvd.init``: Horovod's reset), ``sync`` (the state sync), ``prologue`` (the training
  function's start); the first step of a ring is also written at once (``local`` then ``waiting`` with
  ``steps`` 0). Only ``local`` and a stale beat are judged. Until a worker's own detector runs (``startup``, its
  first ``hvd.init``), a small thread keeps its announced beat fresh (:func:`announce`), so a stale beat means a
  process that does not run, or one whose start-up holds the GIL (which a rendezvous's verdict tells apart by CPU
  time, below).
* **The verdict** (:func:`hung_peers`, pure): while this worker has waited ``hang_seconds`` in a step whose own work
  it has finished, a member of its ring (ranks, hosts and pids gathered after each rendezvous) is hung when its
  heartbeat is ``hang_seconds`` old, or says ``local`` since ``hang_seconds`` ago. In the ring's first step (until
  the judge has completed a step in its ring, and so has every member: a step is synchronous) silence counts after
  at least ``first_step_seconds`` (:func:`first_step_bound`), and its own work only after ``first_step_hang_seconds``
  (``elastic.first_step_hang_seconds``, 30 min by default): a joiner's loader start-up, cudnn autotune or cold cache
  cannot be told from a stuck one, and nothing in the ring times out meanwhile. A member with no heartbeat here (the
  run_dir is not shared with its machine and the signals are not in etcd) is never judged.
* **In a rendezvous** (:func:`silent_in_rendezvous`, pure): a survivor whose reset has waited ``min(hang_seconds,
  first_step_seconds)`` in its rendezvous judges every heartbeat of the run written on this machine: the process
  that wrote it (same pid and start time, a worker of the job: :func:`job_worker_runs`) still exists but has not beaten
  for that long, and has used no CPU time for :data:`QUIET_SECONDS` (so a stopped or deadlocked process, not one
  whose start-up holds the GIL, nor a judge whose clock jumped or whose disk refuses writes), so it is hung. The
  rendezvous waits for such a peer for good: the driver sees it alive, so it neither aborts the round nor leaves it
  out, and each ``hvd.init`` attempt ends at the Gloo timeout. Killed, it is a dead peer, which the driver's abort
  ends at once. Peers on other machines are not judged there (a stale beat cannot tell a hung peer from a dead one
  there, and a dead one's host must not be evicted as it returns).
* **A dead member** that ran on this machine needs no bound (:func:`gone_peers`): its pid is gone. The collective
  watchdog asks :meth:`HangDetector.gone` once a step is overdue and aborts the ring's connections then, since Gloo
  does not always notice (a survivor whose operation waits on a live peer that waits on it sees nothing until the
  Gloo timeout).
* **The cure**, by every survivor that reaches the verdict (all idempotent): record it
  (the signals' hung verdict: the ``failure`` event's reason becomes ``worker_hung``), then SIGKILL the
  hung process when it runs on this machine (checked by boot id, pid and start time, and that it is a worker of the
  job: :func:`job_worker_runs`) -- from there the job
  recovers exactly as after a SIGKILL -- or else evict its host through etcd, on a thread of its own (a drain:
  Horovod removes the host, stops its worker, and the watchdog's host-removed path ends the wait).

Size: the heartbeat's writers and its three verdicts share one set of rules (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from elastictrain import envnames
from elastictrain.config import FIRST_STEP_HANG_SECONDS
from elastictrain.engine.health.signals import (
    IDLE,
    LOCAL,
    RENDEZVOUS,
    RESET_PHASES,
    WAITING,
    Beat,
    Member,
    WorkerSignals,
)
from elastictrain.hotjoin.protocol import CHECKER_NAME
from elastictrain.logconf import get_logger

log = get_logger("elastictrain.engine.health.hang")

MIN_HANG_SECONDS = 10.0
HANG_STEPS = 10.0
FIRST_STEP_SECONDS = 60.0
"""How long a peer may be silent (no heartbeat) in a ring's first step before it is hung, unless the Gloo timeout is
shorter: :func:`first_step_bound`. Its own work there is bounded by ``elastic.first_step_hang_seconds``."""
GLOO_SHARE = 0.5
BEAT_SECONDS = 1.0
GONE_CHECK_SECONDS = 0.5
QUIET_SECONDS = 2.0
"""How long a process silent in a rendezvous must also have used no CPU time before it is hung."""


def gloo_timeout_seconds(environ: Mapping[str, str] | None = None) -> float | None:
    """``HOROVOD_GLOO_TIMEOUT_SECONDS`` as horovodrun gives it to its workers (None when unset or not a number > 0)."""
    raw = (os.environ if environ is None else environ).get("HOROVOD_GLOO_TIMEOUT_SECONDS", "")
    return float(raw) if raw.isdigit() and int(raw) > 0 else None


def first_step_bound(gloo_timeout: float | None) -> float:
    """The silence (no heartbeat) that makes a peer hung in a ring's first step: :data:`FIRST_STEP_SECONDS`, at most
    :data:`GLOO_SHARE` of the Gloo timeout. A stopped peer stops Horovod's negotiation too, so the survivors'
    collectives fail at the Gloo timeout and they go into the next rendezvous, where only a peer of their own machine
    is judged (:func:`silent_in_rendezvous`): the verdict must come from the step, before that. A peer that beats is
    not judged by time in its first step, so this bound cannot end a slow but live start. Also the bound of a
    rendezvous's verdict: it must come before a ``hvd.init`` attempt ends."""
    if gloo_timeout is None:
        return FIRST_STEP_SECONDS
    return min(FIRST_STEP_SECONDS, GLOO_SHARE * gloo_timeout)


def hang_bound(configured: float | None, typical_step: float) -> float:
    """``elastic.hang_seconds``, or 10 x the typical step and at least 10 s."""
    return configured if configured is not None else max(MIN_HANG_SECONDS, HANG_STEPS * typical_step)


@dataclass(frozen=True, slots=True)
class Hung:
    member: Member
    beat: Beat
    why: str


def hung_peers(
    *,
    now: float,
    me: int,
    members: Sequence[Member],
    beats: dict[tuple[str, int], Beat],
    hang_seconds: float,
    ring_steps: int,
    first_step_seconds: float = FIRST_STEP_SECONDS,
    first_step_hang_seconds: float = FIRST_STEP_HANG_SECONDS,
) -> list[Hung]:
    """The members of this ring (other than rank ``me``) that are hung by their heartbeats (see the module);
    ``ring_steps``: steps the judge completed since its ring formed. In the ring's first step a member is hung when
    silent for ``max(hang_seconds, first_step_seconds)``, or in its own work for ``max(hang_seconds,
    first_step_hang_seconds)``."""
    out = []
    first = ring_steps == 0
    bound = max(hang_seconds, first_step_seconds) if first else hang_seconds
    work_bound = max(hang_seconds, first_step_hang_seconds) if first else hang_seconds
    for m in members:
        b = beats.get((m.host, m.slot))
        if m.rank == me or b is None or b.pid != m.pid:
            continue
        who = f"host {m.host} rank {m.rank} (pid {m.pid})"
        if now - b.ts >= bound:
            out.append(Hung(m, b, f"{who}: no heartbeat for {now - b.ts:.1f}s (stopped, or its machine hangs)"))
        elif b.phase == LOCAL and now - b.since >= work_bound:
            part = "the ring's first step" if first else "a step"
            why = f"{who}: stuck in its own part of {part} (data loading or compute) for {now - b.since:.1f}s"
            out.append(Hung(m, b, why))
    return out


def gone_peers(
    *,
    me: int,
    members: Sequence[Member],
    beats: dict[tuple[str, int], Beat],
    boot: str,
    alive: Callable[[int], bool],
) -> list[str]:
    """The members of this ring (other than rank ``me``) whose process ran on this machine (their heartbeat's boot
    id is ``boot``) and is gone now (``alive(pid)`` is false): why, one line each. Unlike a hang, a death
    needs no bound: the process is not there. (Its Gloo connections do not always say so: a survivor whose
    operation waits on a live peer, itself waiting on it, sees nothing until the Gloo timeout.)"""
    out = []
    for m in members:
        b = beats.get((m.host, m.slot))
        if m.rank == me or b is None or b.pid != m.pid or not boot or b.boot_id != boot:
            continue
        if not alive(b.pid):
            out.append(f"host {m.host} rank {m.rank} (pid {m.pid}) on this machine is gone")
    return out


def silent_in_rendezvous(
    *,
    now: float,
    beats: Iterable[Beat],
    bound: float,
    boot: str,
    me: int,
    runs: Callable[[Beat], bool],
) -> list[Hung]:
    """The processes on this machine (heartbeat boot id ``boot``, pid not ``me``) silent for ``bound`` seconds whose
    writer still exists (``runs(beat)``: :func:`job_worker_runs`): while a rendezvous waits, such a process may hold
    it (the caller also asks that it used no CPU time). A dead one is the driver's (its exit aborts the round); a
    peer on another machine is not judged here (see the module)."""
    out = []
    for b in beats:
        if not boot or b.boot_id != boot or b.pid == me or now - b.ts < bound or not runs(b):
            continue
        who = f"host {b.host} slot {b.slot} (pid {b.pid})"
        why = f"{who}: no heartbeat for {now - b.ts:.1f}s while its ring forms (in {b.phase}; stopped, or hangs)"
        out.append(Hung(Member(-1, b.host, b.slot, b.pid), b, why))
    return out


def process_alive(pid: int) -> bool:
    """Whether ``pid`` still runs: False only when it is gone or a zombie. Its start time is not compared (it moves
    with a wall-clock step, and a wrong "gone" aborts a healthy step; a pid reused within a step is the far rarer
    miss, and it only leaves the wait to the Gloo timeout). A process this user may not inspect counts as running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def job_worker_runs(beat: Beat, job: str, *, launch_id: str = "") -> bool:
    """Whether the process that wrote ``beat`` still exists as a worker: its pid, not a zombie, started when the
    beat says (within a second), and either horovodrun's worker of the beat's host and slot of ``job`` by its
    environment (``HOROVOD_HOSTNAME``, ``HOROVOD_LOCAL_RANK``, ``ELASTICTRAIN_JOB`` and, when the judge has one,
    ``ELASTICTRAIN_LAUNCH_ID``: a cold worker, or the zygote client whose end ends its forked worker), or a worker
    forked by a zygote of ``job`` (:func:`forked_by_zygote`). A heartbeat file is untrusted: it
    must not get any other process killed (the job's environment alone names horovodrun, an agent, the zygote itself).
    Unlike :func:`process_alive` this errs towards False: it decides a SIGKILL."""
    try:
        p = psutil.Process(beat.pid)
        if p.status() == psutil.STATUS_ZOMBIE or abs(p.create_time() - beat.created) >= 1.0:
            return False
        env = p.environ()
        ours = env.get(envnames.JOB, "") == job and (not launch_id or env.get(envnames.LAUNCH_ID) == launch_id)
        if ours and env.get("HOROVOD_HOSTNAME") == beat.host and env.get("HOROVOD_LOCAL_RANK") == str(beat.slot):
            return True
        return forked_by_zygote(p, job)
    except (psutil.Error, OSError):
        return False


def forked_by_zygote(p: psutil.Process, job: str) -> bool:
    """Whether ``p`` is a worker that a zygote of ``job`` forked (hot join, :mod:`elastictrain.hotjoin`). A fork shows
    its parent's command line and environment, so such a worker looks like its zygote; it is told apart by its
    parent: a zygote of ``job`` (``zygote serve``, ``ELASTICTRAIN_JOB``) that was not itself forked by one (a
    worker's own forked helpers look like the zygote too), and by its name: the zygote's checker process is named
    :data:`~elastictrain.hotjoin.protocol.CHECKER_NAME`. Raises psutil's errors."""
    if not job or p.name() == CHECKER_NAME or not _runs_zygote(p, job):
        return False
    zygote = p.parent()
    return zygote is not None and _is_zygote(zygote, job)


def _is_zygote(p: psutil.Process, job: str) -> bool:
    parent = p.parent()
    return _runs_zygote(p, job) and (parent is None or not _runs_zygote(parent, job))


def _runs_zygote(p: psutil.Process, job: str) -> bool:
    """``p``'s command line is a zygote's (``... zygote serve ...``) and its environment names ``job``."""
    try:
        cmd = p.cmdline()
        return p.environ().get(envnames.JOB) == job and any(cmd[i : i + 2] == ZYGOTE_SERVE for i in range(len(cmd)))
    except psutil.AccessDenied:
        return False


ZYGOTE_SERVE = ["zygote", "serve"]
"""What a zygote's command line holds (``elastictrain zygote serve ...``; the one a forked worker shows too)."""


def cpu_ns(pid: int) -> int | None:
    """CPU time the process has used, in ns, summed over its threads (``/proc/<pid>/task/*/schedstat``: exact,
    where ``/proc/<pid>/stat``'s clock ticks miss a thread that runs a few microseconds a second); None when
    unreadable."""
    total, seen = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            continue
    return total if seen else None


def boot_id() -> str:
    """Where a pid means the same process: the kernel's boot id and this process's PID namespace
    (``<boot id>/pidns:<inode>``; containers on one machine share the boot id, not the namespace). Empty when
    unknown: then no pid of another worker is ever acted on."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        own_proc = os.readlink("/proc/self") == str(os.getpid())  # /proc is this namespace's
    except OSError:
        return ""
    return f"{boot}/pidns:{namespace}" if boot and own_proc else ""


@dataclass(slots=True)
class HangDetector:
    """What the collective watchdog's thread does about hangs: beat, and judge while its step is overdue."""

    signals: WorkerSignals
    """Where heartbeats are written and read and the verdict recorded."""
    host: Callable[[], str]
    slot: Callable[[], int]
    configured_seconds: float | None = None
    evict: Callable[[str], str] | None = None
    """Evicts a host of another machine (returns what it did, one line); None: no etcd to do it through."""
    first_step_seconds: float = FIRST_STEP_SECONDS
    """A peer's silence (no heartbeat) that makes it hung in a ring's first step (:func:`first_step_bound`)."""
    first_step_hang_seconds: float = FIRST_STEP_HANG_SECONDS
    """How long a peer that beats may stay in its own work of a ring's first step
    (``elastic.first_step_hang_seconds``)."""
    members: tuple[Member, ...] = ()
    me: int = 0
    phase: str = IDLE
    since: float = 0.0
    steps: int = 0
    last_beat: float = 0.0
    last_check: float = 0.0
    last_gone_check: float = 0.0
    gone_found: str | None = None
    cured: tuple[int, ...] = ()
    quiet: dict[int, tuple[int, float]] | None = None
    """Suspects of a rendezvous: pid -> (CPU ns when first seen at that value, when)."""
    _identity: tuple[str, float] | None = None

    def set_ring(self, me: int, members: Sequence[Member]) -> None:
        """After each rendezvous: the ring's members, and a heartbeat at once (a hang may follow quickly)."""
        self.me, self.members, self.steps, self.cured = me, tuple(members), 0, ()
        self.last_gone_check, self.gone_found = 0.0, None
        self.set_phase(IDLE)
        self.beat(time.time())

    def set_phase(self, phase: str) -> None:
        if phase == IDLE and self.steps == 0 and self.phase in RESET_PHASES:
            return  # a reset's phase (the prologue at last) holds until the new ring's first step begins
        self.phase, self.since = phase, time.time()
        if self.steps == 0 and phase != IDLE:  # the first step of a ring is shown at once, like a reset's phases
            self.beat(self.since)

    def mark(self, phase: str) -> None:
        """A phase of a (re)start (:data:`RESET_PHASES`) begins: set it and write a heartbeat at once."""
        self.steps = 0
        self.since = time.time()  # before the phase: the watchdog's thread reads them without a lock
        self.phase = phase
        self.quiet = None
        self.beat(self.since)

    def step_done(self) -> None:
        self.steps += 1
        self.set_phase(IDLE)

    def identity(self) -> tuple[str, float]:
        if self._identity is None:
            self._identity = (boot_id(), psutil.Process().create_time())
        return self._identity

    def beat(self, now: float) -> None:
        if self.last_beat == 0.0:
            stop_announcing()  # this detector beats from now on
        boot, created = self.identity()
        self.signals.write_beat(
            Beat(
                pid=os.getpid(),
                host=self.host(),
                slot=self.slot(),
                boot_id=boot,
                created=created,
                ts=now,
                phase=self.phase,
                since=self.since,
                steps=self.steps,
            )
        )
        self.last_beat = now

    def tick(self, now: float, waited: float | None, typical_step: float) -> list[Hung]:
        """Called by the watchdog's thread on each poll: beat once a second; while this worker has waited in a step
        whose own work is done, judge its ring once a second and cure what is hung. Returns the peers cured now."""
        if now - self.last_beat >= BEAT_SECONDS:
            self.beat(now)
        bound = hang_bound(self.configured_seconds, typical_step)
        if self.phase == RENDEZVOUS:
            return self.judge_rendezvous(now, min(bound, self.first_step_seconds), cpu_ns)
        if waited is None or self.phase != WAITING or waited < bound or now - self.last_check < BEAT_SECONDS:
            return []
        self.last_check = now
        found = [
            h
            for h in hung_peers(
                now=now,
                me=self.me,
                members=self.members,
                beats=self.signals.read_beats(self.members),
                hang_seconds=bound,
                ring_steps=self.steps,
                first_step_seconds=self.first_step_seconds,
                first_step_hang_seconds=self.first_step_hang_seconds,
            )
            if h.member.pid not in self.cured
        ]
        for h in found:
            self.cured = (*self.cured, h.member.pid)
            self.cure(h)
        return found

    def judge_rendezvous(self, now: float, bound: float, cpu: Callable[[int], int | None]) -> list[Hung]:
        """While this worker's reset waits in its rendezvous: from half ``bound`` on, once a second, note the CPU time
        of this machine's processes silent for half ``bound``; from ``bound`` on, cure those silent for ``bound``
        whose CPU time has not moved for :data:`QUIET_SECONDS` (:func:`silent_in_rendezvous`). Returns the peers
        cured now."""
        if now - self.since < bound / 2 or now - self.last_check < BEAT_SECONDS:
            return []
        self.last_check = now
        job, launch_id = os.environ.get(envnames.JOB, ""), os.environ.get(envnames.LAUNCH_ID, "")
        suspects = silent_in_rendezvous(
            now=now,
            beats=self.signals.all_beats(),
            bound=bound / 2,
            boot=self.identity()[0],
            me=os.getpid(),
            runs=lambda b: job_worker_runs(b, job, launch_id=launch_id),
        )
        quiet, self.quiet = self.quiet or {}, {}
        found = []
        for h in suspects:
            used = cpu(h.member.pid)
            if used is None or h.member.pid in self.cured:
                continue
            seen = quiet.get(h.member.pid)
            self.quiet[h.member.pid] = seen if seen is not None and seen[0] == used else (used, now)
            first = self.quiet[h.member.pid][1]
            if now - self.since >= bound and now - h.beat.ts >= bound and now - first >= QUIET_SECONDS:
                found.append(h)
        for h in found:
            self.cured = (*self.cured, h.member.pid)
            self.cure(h)
        return found

    def retire(self) -> None:
        """This worker is closing (its watchdog stopped): its heartbeat goes, so that a process that only finishes
        its last checkpoint or its tracking, beating no more, is never taken for a hung one."""
        with contextlib.suppress(ValueError):
            self.signals.remove_beat(self.host(), self.slot(), os.getpid())

    def gone(self, now: float | None = None) -> str | None:
        """Why a member of this ring that ran on this machine is gone (see :func:`gone_peers`), or None; looked up at
        most every :data:`GONE_CHECK_SECONDS` (the watchdog asks on every poll of an overdue step)."""
        now = time.time() if now is None else now
        if now - self.last_gone_check >= GONE_CHECK_SECONDS:
            self.last_gone_check = now
            found = gone_peers(
                me=self.me,
                members=self.members,
                beats=self.signals.read_beats(self.members),
                boot=self.identity()[0],
                alive=process_alive,
            )
            self.gone_found = found[0] if found else None
        return self.gone_found

    def cure(self, h: Hung) -> None:
        """Record the verdict, then SIGKILL the hung process here (only a worker of this job: :func:`job_worker_runs`),
        or evict its host when it runs elsewhere: on a thread of its own (:meth:`evict_host`), since etcd may take
        seconds and this thread must go on beating and aborting meanwhile."""
        boot, _ = self.identity()
        evict = None
        if h.beat.boot_id == boot and boot:
            mine = os.environ.get(envnames.JOB, ""), os.environ.get(envnames.LAUNCH_ID, "")
            if job_worker_runs(h.beat, mine[0], launch_id=mine[1]):
                done = kill_if_same(h.beat.pid, h.beat.created)
            else:
                done = f"pid {h.beat.pid} is no worker of this job here (a stale or forged heartbeat): not killed"
        elif self.evict is not None:
            evict, done = self.evict, f"evicting host {h.member.host} through etcd"
        else:
            done = "no etcd to evict its host through: waiting for the Gloo timeout"
        found_at = time.time()
        self.signals.record_verdict(f"{h.why}; {done}", found_at)
        log.warning("hung peer", why=h.why, action=done)
        if evict is not None:
            args = (evict, h, found_at)
            threading.Thread(target=self.evict_host, args=args, name="hang-eviction", daemon=True).start()

    def evict_host(self, evict: Callable[[str], str], h: Hung, found_at: float) -> None:
        """Evict the hung member's host (``evict``: :attr:`evict`) and record what it did as the verdict found at
        ``found_at`` (etcd may answer seconds later: a failure that begins meanwhile is not this hang)."""
        try:
            done = evict(h.member.host)
        except Exception as e:  # the evictor reports its own failures; this is a safety net for the thread
            done = f"could not evict host {h.member.host}: {type(e).__name__}"
            log.exception("hung peer's eviction failed", host=h.member.host)
        self.signals.record_verdict(f"{h.why}; {done}", found_at)
        log.warning("hung peer's host", why=h.why, action=done)


def announce(signals: WorkerSignals, phase: str, environ: dict[str, str] | None = None) -> None:
    """A heartbeat of a worker that has no :class:`HangDetector` yet (``startup``, and ``rendezvous`` when it calls
    ``hvd.init``), from horovodrun's ``HOROVOD_HOSTNAME`` and ``HOROVOD_LOCAL_RANK``; nothing outside horovodrun.
    It is written at once and then kept fresh once a second by a daemon thread (:class:`BeatKeeper`) until the
    worker's detector beats (:func:`stop_announcing`): a worker that starts slowly (cold imports, a long first
    ``hvd.init``) is not silent, and one that is stopped is."""
    env = os.environ if environ is None else environ
    host, slot = env.get("HOROVOD_HOSTNAME", ""), env.get("HOROVOD_LOCAL_RANK", "")
    if not host or not slot.isdigit():
        return
    with contextlib.suppress(ValueError, psutil.Error):
        now = time.time()
        me = psutil.Process()
        beat = Beat(os.getpid(), host, int(slot), boot_id(), me.create_time(), now, phase, now, 0)
        _KEEPER.keep(signals, beat)


class BeatKeeper:
    """Re-writes the last announced heartbeat (a new ``ts``, the same phase and ``since``) every
    :data:`BEAT_SECONDS` in a daemon thread of this process, until :meth:`stop`. After a fork the child keeps
    nothing of its parent's (no thread crosses a fork)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._current: tuple[WorkerSignals, Beat] | None = None
        self.thread: threading.Thread | None = None

    def keep(self, signals: WorkerSignals, beat: Beat) -> None:
        with self._lock:
            if self._stop.is_set():
                return  # the detector beats already: an announcement would write an older phase
            signals.write_beat(beat)
            self._current = (signals, beat)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="heartbeat-keeper", daemon=True)
                self.thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            with self._lock:
                if self._stop.is_set() or self._current is None:
                    return
                signals, beat = self._current
                signals.write_beat(replace(beat, ts=time.time()))


_KEEPER = BeatKeeper()
os.register_at_fork(after_in_child=_KEEPER._reset)


def stop_announcing() -> None:
    """The worker's :class:`HangDetector` beats from now on: stop keeping the announced beat."""
    _KEEPER.stop()


def kill_if_same(pid: int, created: float) -> str:
    """SIGKILL ``pid`` and its children when it is the process that started at ``created``; say what happened."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - created) >= 1.0:
            return f"pid {pid} is another process now: not killed"
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return f"pid {pid} is gone"
    for q in procs:
        with contextlib.suppress(psutil.Error):
            q.kill()
    return f"killed pid {pid} (SIGKILL)"


def gathered_members(rows: Sequence[Any]) -> list[Member] | None:
    """The ring's members from the ``(host, slot, pid)`` each rank gathered (untrusted shapes are refused)."""
    out = []
    for rank, row in enumerate(rows):
        if not (isinstance(row, tuple | list) and len(row) == 3):
            return None
        host, slot, pid = row
        if not isinstance(host, str) or not isinstance(slot, int) or not isinstance(pid, int):
            return None
        out.append(Member(rank, host, slot, pid))
    return out
