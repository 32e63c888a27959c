"""``hetero``: a mixed fleet, one host slowed by a real CPU quota: throughput of each straggler policy vs the ideal.

One ``elastictrain launch`` job (embedded etcd and agents) per policy on 4 logical hosts, run one after the other
in one run; every job goes through the same schedule: a warm-up, a **uniform** phase (all hosts at full speed),
one non-rank-0 worker's processes put under a CPU quota (:func:`chaos.faults.cpu_quota`, a cgroup) for **half**
its speed, then for a **quarter**, then the quota lifted (**recovered**). Speed is the worker's own: a quota that a
controller corrects every 2 s so that the training thread is held back the right part of the time it wants a core
(:class:`Slowdown`); what the slowed host's speed then is against the others, the profile measures and the ideal
uses.
Policies: ``report`` (equal shares), ``evict`` (drain a host when predicted faster without it; cool-down longer
than the run), ``balance`` (each host's share follows its speed) when this checkout has it.

Measured per phase (throughput in the phase's second half, from ``metrics`` events): samples/s of each policy;
the slowed host's own speed f as the straggler profile measured it (1 / its ``slowest_ratio``; a quota is bursty,
so f is often well below the nominal share of CPU); the ideal, the sum of the hosts' own speeds = the job's uniform
samples/s x (3 + f) / 4 (on one shared machine the others also get the cores the slowed one leaves, and a drained
worker's cores go to the rest, so ``evict`` can pass it); with ``balance``, steps and seconds
from the quota's start and end to the ``shares`` event after which the slowed host's share stays within 10% of the
phase's last one; steps until ``report`` names the host; every job's sample ledger audited (no sample twice).

Goals (issue 40): at half speed ``balance`` >= 0.9 x ideal, >= 1.25 x ``report``, >= ``evict``; uniform phase
``balance`` >= 0.98 x ``report``; shares settle within 50 steps; the audit holds in every run.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.core import BenchContext, BenchError, Goal, Metric, Result, summary
from bench.stragglers import launch_run, steps_until_named, wait_events, window_throughput
from chaos import faults
from chaos.jobs import LaunchedJob
from chaos.procs import JobRef, cpu_seconds
from elastictrain.config import ElasticConfig
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Event, Eviction, Metrics, Reset, Shares, Straggler, of_kind
from elastictrain.tools.audit import AuditError, audit_run_dir

NAME = "hetero"
WORKERS = 4
BATCH = 16
SPEEDS = (0.5, 0.25)
"""The slowed host's speed in the two slow phases (share of its own uniform-phase CPU)."""
SETTLE_TOLERANCE = 0.1
"""A share has settled once it stays within this part of the phase's last share."""
GOAL_IDEAL = Goal(">=", 0.9)
GOAL_VS_REPORT = Goal(">=", 1.25)
GOAL_VS_EVICT = Goal(">=", 1.0)
GOAL_UNIFORM = Goal(">=", 0.98)
GOAL_SETTLE_STEPS = Goal("<=", 50.0)
GOAL_AUDIT = Goal("<=", 0.0)


def policies() -> list[str]:
    """The straggler policies this checkout's config accepts, of report, evict and balance."""
    hints = typing.get_type_hints(ElasticConfig)
    accepted = set(typing.get_args(hints["stragglers"]))
    return [p for p in ("report", "evict", "balance") if p in accepted]


def job_config(run_dir: Path, job: str, policy: str) -> dict[str, Any]:
    """The small test CNN (16x16 synthetic images, 16 a worker), an epoch longer than the run, the ledger on, the
    policy's defaults (evict's cool-down outlasts the run: a drained host stays out)."""
    return {
        "job": job,
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {
            "kind": "synthetic",
            "image_size": 16,
            "batch_size": BATCH,
            "num_samples": 1_281_167,
            "augment": False,
        },
        "training": {"epochs": 1, "log_every_steps": 2, "seed": 7},
        "elastic": {
            "commit_every_steps": 5,
            "min_np": 2,
            "max_np": WORKERS,
            "stragglers": policy,
            "straggler_cooldown_seconds": 3600,
        },
        "checkpoint": {"enabled": False},
        "tracking": {"mlflow": False, "progress_bar": False},
        "audit": {"sample_ledger": True},
        "discovery": {"ttl_seconds": 3, "heartbeat_seconds": 0.5},
    }


# ---------------------------------------------------------------------------------------------- pure figures
@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of the schedule: its name, the slowed host's speed (1.0: none) and its wall-clock span."""

    name: str
    speed: float
    t0: float
    t1: float

    def steady(self) -> tuple[float, float]:
        """The second half of the phase: what the throughput is read over (shares and windows have moved)."""
        return (self.t0 + self.t1) / 2, self.t1


def ideal_rate(uniform_rate: float, speed: float, workers: int = WORKERS) -> float:
    """Samples/s of the sum of the hosts' own speeds: ``workers - 1`` at the uniform rate's share, one at ``speed``."""
    return uniform_rate * (workers - 1 + speed) / workers


def measured_speed(events: Sequence[Event], t0: float, t1: float, host: str) -> float | None:
    """``host``'s own speed relative to the others in ``[t0, t1]``, as the straggler profile measured it: 1 / the
    median ``slowest_ratio`` of the ``metrics`` events that name it slowest, else 1 / the ratio of the last
    ``eviction`` or ``straggler`` decision about it in the span (a drained host), else None."""
    ratios = [
        e.slowest_ratio
        for e in of_kind(events, Metrics)
        if t0 <= e.ts <= t1 and e.slowest_host == host and e.slowest_ratio
    ]
    if ratios:
        return 1.0 / statistics.median(ratios)
    decided = [
        e.ratio
        for e in events
        if isinstance(e, (Eviction, Straggler)) and t0 <= e.ts <= t1 and e.host == host and e.ratio
    ]
    return 1.0 / decided[-1] if decided else None


def cpu_quota_for(speed: float, core_share: float) -> float:
    """The quota (share of one core) for ``speed``: that share of ``core_share`` cores, at least the kernel's floor."""
    return max(faults.MIN_CPU_FRACTION, speed * core_share)


def share_settled(events: Sequence[Event], t0: float, t1: float, host: str) -> dict[str, Any] | None:
    """When ``host``'s share settled in ``[t0, t1]``: the first ``shares`` event after which every share of the
    host in the span stays within :data:`SETTLE_TOLERANCE` of the span's last one (its step, seconds from ``t0``,
    the step at ``t0``, the share). None when no ``shares`` event of the span names the host (nothing moved)."""
    span = [e for e in of_kind(events, Shares) if t0 <= e.ts <= t1 and e.shares and host in e.shares]
    if not span:
        return None
    final = span[-1].shares[host]  # type: ignore[index]
    bound = max(1.0, SETTLE_TOLERANCE * final)
    settled = span[-1]
    for e in reversed(span):
        if abs(e.shares[host] - final) > bound:  # type: ignore[index]
            break
        settled = e
    start = max((e.step for e in events if e.ts <= t0), default=0)
    return {
        "steps": settled.step - start,
        "seconds": settled.ts - t0,
        "start_step": start,
        "step": settled.step,
        "share": final,
        "changes": len(span),
    }


def thread_schedstat(pid: int) -> tuple[float, float]:
    """``(seconds on a CPU, seconds runnable but waiting)`` of the main thread of ``pid`` (its training thread)."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def share_while_working(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The share of a core a thread got while it wanted one (on a CPU / runnable), between two schedstat readings."""
    ran, waited = after[0] - before[0], after[1] - before[1]
    return ran / (ran + waited) if ran > 0 and waited >= 0 else None


# ---------------------------------------------------------------------------------------------- one job
def _metrics_at(size: int, steps: int) -> Callable[[list[Event]], Metrics | None]:
    def find(evs: list[Event]) -> Metrics | None:
        at = [e for e in of_kind(evs, Metrics) if e.world_size == size]
        return at[-1] if at and at[-1].step >= at[0].step + steps else None

    return find


CONTROL_SECONDS = 2.0
"""How often :class:`Slowdown` reads the slowed thread's own speed and corrects the quota."""


def own_speed(ran: float, waited: float, throttled: float) -> float | None:
    """A thread's speed relative to itself without the quota, over an interval: of the time it was runnable (``ran``
    on a CPU + ``waited`` for one), the part its group was not throttling it (``throttled``, capped by ``waited``)."""
    total = ran + waited
    if total <= 0:
        return None
    return (total - min(max(throttled, 0.0), max(waited, 0.0))) / total


def next_quota(quota: float, measured: float | None, target: float, most: float = 2.0) -> float:
    """The quota after one correction: multiplied by sqrt(target / measured), at most x2 or /2 a step (damped: the
    speed answers a quota with noise), within the kernel's floor and ``most`` cores; unchanged without a reading."""
    factor = 1.0 if not measured else min(2.0, max(0.5, (target / measured) ** 0.5))
    return min(most, max(faults.MIN_CPU_FRACTION, quota * factor))


class Slowdown:
    """One worker held at a target speed of its own by a CPU quota (:class:`chaos.faults.CpuQuota`) that a thread
    corrects every :data:`CONTROL_SECONDS` from the training thread's ``schedstat`` and the group's throttled time
    (a fixed quota gives a speed that depends on the machine's load: 0.12 of a core made a worker 10x slower here,
    0.25 of a core barely slowed it); the thread also moves the worker's new helpers in. ``samples`` has every
    correction: ``(ts, quota, measured own speed)``."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.samples: list[tuple[float, float, float | None]] = []
        self.target = 1.0
        self._quota: faults.CpuQuota | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, speed: float, initial_quota: float) -> None:
        """Aim at ``speed`` (of its own), starting from ``initial_quota`` cores (later targets: from the quota that
        held the last one, scaled)."""
        with self._lock:
            old, self.target = self.target, speed
            if self._quota is None:
                self._quota = faults.CpuQuota(initial_quota)
                self._quota.add([self.proc])
                self._thread = threading.Thread(target=self._control, daemon=True)
                self._thread.start()
            elif self._quota.cpu_fraction is not None:  # from what held it at the last target, scaled
                self._quota.set(max(faults.MIN_CPU_FRACTION, self._quota.cpu_fraction * speed / old))

    def _control(self) -> None:
        quota = self._quota
        assert quota is not None
        before = (*thread_schedstat(self.proc.pid), quota.stat()["throttled_seconds"])
        while not self._stop.wait(CONTROL_SECONDS) and self.proc.is_running():
            quota.follow([self.proc])
            now = (*thread_schedstat(self.proc.pid), quota.stat()["throttled_seconds"])
            measured = own_speed(now[0] - before[0], now[1] - before[1], now[2] - before[2])
            before = now
            with self._lock:
                if quota.cpu_fraction is None or self._stop.is_set():
                    break
                q = next_quota(quota.cpu_fraction, measured, self.target)
                with contextlib.suppress(OSError):
                    quota.set(q)
                self.samples.append((time.time(), q, measured))

    def lift(self) -> None:
        """Lift the quota and delete the group (the worker and its helpers go back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(20)
        with self._lock:
            if self._quota is not None:
                self._quota.close()
            self._quota = None


def policy_trial(
    workdir: Path, hosts: list[str], policy: str, warmup: int, phase_seconds: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """One job under ``policy`` through the schedule (uniform, each of :data:`SPEEDS`, recovered)."""
    config = job_config(workdir / "run", f"bench-hetero-{policy}", policy)
    job: LaunchedJob = launch_run(workdir, config, hosts)
    slow: Slowdown | None = None
    try:
        job.start()
        wait_events(job, _metrics_at(WORKERS, warmup), 300, f"{warmup} steps at {WORKERS} workers")
        ref = JobRef.resolve(config["job"], job.run_dir)
        r0 = ref.rank0()
        worker = sorted((w for w in ref.workers() if w != r0), key=lambda w: w.host)[-1]
        host, proc = worker.host, worker.proc
        phases: list[Phase] = []
        t = time.time()
        cpu0, sched0 = cpu_seconds(proc), thread_schedstat(proc.pid)
        time.sleep(phase_seconds)  # the uniform phase: the schedule's own duration, not a wait for an event
        cpu_rate = (cpu_seconds(proc) - cpu0) / (time.time() - t)
        working = share_while_working(sched0, thread_schedstat(proc.pid)) or cpu_rate
        phases.append(Phase("uniform", 1.0, t, time.time()))
        log(f"{policy}: uniform phase done; {host} used {cpu_rate:.2f} CPU s/s, {working:.2f} of a core while working")
        slow = Slowdown(proc)
        for speed in SPEEDS:
            quota = cpu_quota_for(speed, working)
            t = time.time()
            slow.set(speed, quota)
            log(f"{policy}: {host} at {speed:.0%} of its speed (quota from {quota:.2f} of a core, corrected)")
            time.sleep(phase_seconds)
            phases.append(Phase(f"speed {speed:g}", speed, t, time.time()))
        t = time.time()
        slow.lift()
        log(f"{policy}: quota lifted")
        time.sleep(phase_seconds)
        phases.append(Phase("recovered", 1.0, t, time.time()))
        evs = job.events()
    finally:
        if slow is not None:
            slow.lift()
        job.close()
    try:
        audit = audit_run_dir(job.run_dir)
        audited: dict[str, Any] = {
            "ok": audit.audit.ok,
            "duplicates": audit.audit.duplicated,
            "steps": audit.steps,
            "epochs_checked": audit.audit.epochs_checked,
        }
    except AuditError as e:
        audited = {"ok": False, "error": str(e), "duplicates": None}
    out: dict[str, Any] = {
        "policy": policy,
        "host": host,
        "cpu_per_second_uniform": cpu_rate,
        "core_share_while_working": working,
        "audit": audited,
    }
    out["phases"] = {}
    control = slow.samples if slow is not None else []
    for ph in phases:
        a, b = ph.steady()
        out["phases"][ph.name] = {
            "speed": ph.speed,
            "t": [ph.t0, ph.t1],
            "steady": window_throughput(evs, a, b, BATCH),
            "whole": window_throughput(evs, ph.t0, ph.t1, BATCH),
            "settled": share_settled(evs, ph.t0, ph.t1, host),
            "measured_speed": measured_speed(evs, a, b, host) if ph.speed < 1.0 else None,
            "own_speed": _median([m for ts, _q, m in control if a <= ts <= b and m is not None]),
            "quota": _median([q for ts, q, _m in control if a <= ts <= b]),
        }
    slow_start = phases[1].t0
    out["named"] = steps_until_named([e for e in evs if e.ts <= phases[-1].t1], slow_start, host)
    out["quota_control"] = [[round(ts, 3), round(q, 4), m and round(m, 3)] for ts, q, m in control]
    out["evictions"] = [e.to_record() for e in of_kind(evs, Eviction)]
    out["resets"] = [
        {"step": r.step, "reason": r.reason, "sizes": [r.old_size, r.new_size]} for r in of_kind(evs, Reset)
    ]
    out["shares"] = [{"step": e.step, "ts": e.ts, "shares": e.shares, "reason": e.reason} for e in of_kind(evs, Shares)]
    rates = {k: (v["steady"] or {}).get("samples_per_sec") for k, v in out["phases"].items()}
    log(f"{policy}: samples/s " + ", ".join(f"{k} {_f(v)}" for k, v in rates.items()) + f"; audit {audited}")
    return out


# ---------------------------------------------------------------------------------------------- run
def run(ctx: BenchContext) -> Result:
    hosts = local_logical_hosts()
    if len(hosts) < WORKERS:
        raise BenchError(f"hetero needs {WORKERS} logical hosts, this machine has {hosts}")
    hosts = hosts[:WORKERS]
    try:
        backend = faults.cpu_backend()
    except faults.QuotaUnavailable as e:
        raise BenchError(f"hetero needs a CPU cgroup for its quota: {e}") from None
    warmup = 20 if ctx.quick else 40
    phase_seconds = 40.0 if ctx.quick else 90.0
    names = policies()
    trials = {p: policy_trial(ctx.scratch(f"hetero-{p}"), hosts, p, warmup, phase_seconds, ctx.progress) for p in names}

    def rate(policy: str, phase: str) -> float | None:
        t = trials.get(policy)
        w = t["phases"][phase]["steady"] if t else None
        return w["samples_per_sec"] if w else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    half, quarter = (f"speed {s:g}" for s in SPEEDS)
    has_balance = "balance" in trials
    metrics: list[Metric] = []

    def speed_of(policy: str, phase: str, nominal: float) -> float:
        """The slowed host's measured speed in the phase (the nominal one where the profile has none)."""
        m = trials[policy]["phases"][phase]["measured_speed"]
        return m if m is not None else nominal

    for phase, speed in ((half, SPEEDS[0]), (quarter, SPEEDS[1])):
        ideal = {p: ideal_rate(u, speed_of(p, phase, speed)) for p in names if (u := rate(p, "uniform")) is not None}
        note = " · ".join(
            f"{p} {_f(rate(p, phase))} (ideal {_f(ideal.get(p))} at measured speed {speed_of(p, phase, speed):.2f}, "
            f"uniform {_f(rate(p, 'uniform'))})"
            for p in names
        )
        goal = speed == SPEEDS[0]  # the goals are at half speed; a quarter is reported
        if has_balance:
            bal = rate("balance", phase)
            metrics += [
                Metric(f"balance / ideal, one host at {speed:.0%}", ratio(bal, ideal.get("balance")), "",
                       GOAL_IDEAL if goal else None, note=f"samples/s: {note}"),
                Metric(f"balance / report, one host at {speed:.0%}", ratio(bal, rate("report", phase)), "",
                       GOAL_VS_REPORT if goal else None),
                Metric(f"balance / evict, one host at {speed:.0%}", ratio(bal, rate("evict", phase)), "",
                       GOAL_VS_EVICT if goal else None),
            ]  # fmt: skip
        else:
            metrics.append(
                Metric(f"report / ideal, one host at {speed:.0%}", ratio(rate("report", phase), ideal.get("report")),
                       "", note=f"no balance policy in this checkout; samples/s: {note}")
            )  # fmt: skip
    if has_balance:
        metrics.append(
            Metric("balance / report, uniform fleet", ratio(rate("balance", "uniform"), rate("report", "uniform")), "",
                   GOAL_UNIFORM, note="the two jobs' uniform phases (separate jobs, one after the other)")
        )  # fmt: skip
        settle = [
            (ph, s["steps"])
            for ph in (half, quarter, "recovered")
            if (s := trials["balance"]["phases"][ph]["settled"]) is not None
        ]
        metrics.append(
            Metric("shares settle after a change, worst", max((s for _, s in settle), default=None), "steps",
                   GOAL_SETTLE_STEPS, note=", ".join(f"{ph}: {s}" for ph, s in settle) or "no shares event")
        )  # fmt: skip
    named = trials["report"]["named"] if "report" in trials else None
    metrics.append(
        Metric("report: quota -> host named", float(named["steps"]) if named else None, "steps", Goal("<=", 100.0),
               note=f"ratio {named['ratio']}" if named else "not named")
    )  # fmt: skip
    duplicates = [t["audit"].get("duplicates") for t in trials.values()]
    twice = None if any(d is None for d in duplicates) else float(sum(d or 0 for d in duplicates))
    audits = ", ".join(f"{p}: {'ok' if t['audit']['ok'] else t['audit']}" for p, t in trials.items())
    metrics.append(Metric("samples twice (audit), all jobs", twice, "", GOAL_AUDIT, note=audits))
    return Result(
        NAME,
        metrics=metrics,
        contenders={
            f"{p} {ph}": summary([r] if (r := rate(p, ph)) is not None else [], "samples/s")
            for p in names
            for ph in ("uniform", half, quarter, "recovered")
        },
        detail={
            "policies": names,
            "balance_missing": not has_balance,
            "backend": f"cgroup v{backend.version}",
            "config": job_config(Path("<run_dir>"), "bench-hetero-<policy>", "<policy>"),
            "hosts": hosts,
            "warmup_steps": warmup,
            "phase_seconds": phase_seconds,
            "speeds": SPEEDS,
            "trials": trials,
        },
    )


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"
