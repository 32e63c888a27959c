"""Invariant checks of a chaos run: pure functions of what the run left behind.

Each check takes plain data (events, the replayed ledger, checkpoint verification results, MLflow run
ids, pids) and returns a :class:`Check`: a name, whether it holds, and one line of detail. The scenario
runner gathers the inputs from the run dir and prints the checks as one table; tests call these with
fakes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastictrain.rundir.events import (
    Event,
    Eviction,
    Metrics,
    Reset,
    Start,
    Straggler,
    lifecycle,
    of_kind,
    training_completed,
)
from elastictrain.tools.audit import SampleAudit

LOSS_ABS_TOLERANCE = 0.1
LOSS_REL_TOLERANCE = 0.1
"""Final loss vs. the fault-free run with the same seed: ``|loss - ref| <= 0.1 + 0.1 * |ref|``.

With ``elastic.policy: global`` the maths does not depend on membership, but a fault changes the
order of floating-point sums (other shares per worker) and which steps the last ``metrics`` interval
covers, so the final losses differ slightly; a lost or doubled stretch of training moves them more.
That holds only for training that is not chaotic: the chaos job clips its gradients (see
:func:`chaos.scenarios.base_config`), without which float rounding alone decides whether loss spikes happen.
"""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool | None
    """True: holds; False: broken; None: not applicable / informational."""
    detail: str
    value: Any = None


# ---------------------------------------------------------------------------------------------- completion
def check_completed(launcher_exit: int | None, events: Sequence[Event]) -> Check:
    ended = lifecycle(events)
    ok = launcher_exit == 0 and training_completed(events)
    return Check("job completed", ok, f"launcher exit {launcher_exit}, run log says {ended.value!r}", launcher_exit)


# ---------------------------------------------------------------------------------------------- samples
def check_exactly_once(audit: SampleAudit | None) -> Check:
    """The ledger audit (:func:`elastictrain.tools.audit.audit_samples`) as a table row; None: no ledger."""
    if audit is None:
        return Check("every sample exactly once per epoch", False, "no ledger (audit.sample_ledger is off?)")
    ok = audit.ok
    bad = {e: v for e, v in audit.per_epoch.items() if v != (0, 0)}
    detail = f"{audit.epochs_checked} epochs: {audit.lost} lost, {audit.duplicated} duplicated"
    return Check("every sample exactly once per epoch", ok, detail + (f" (epoch: (lost, dup) {bad})" if bad else ""))


# ---------------------------------------------------------------------------------------------- loss
def final_loss(events: Sequence[Event]) -> tuple[int, float] | None:
    """(step, loss) of the last ``metrics`` event (``done.final_loss`` is not filled by the worker)."""
    for e in reversed(of_kind(events, Metrics)):
        if e.loss is not None:
            return e.step, e.loss
    return None


def check_final_loss(
    run: tuple[int, float] | None,
    reference: tuple[int, float] | None,
    *,
    abs_tol: float = LOSS_ABS_TOLERANCE,
    rel_tol: float = LOSS_REL_TOLERANCE,
) -> Check:
    name = "final loss vs fault-free run"
    if reference is None:
        return Check(name, False, "no reference loss (the fault-free run did not finish)")
    if run is None:
        return Check(name, False, "no metrics event in this run")
    (step, loss), (ref_step, ref) = run, reference
    tol = abs_tol + rel_tol * abs(ref)
    ok = step == ref_step and math.isfinite(loss) and abs(loss - ref) <= tol
    return Check(
        name,
        ok,
        f"{loss:.4f} at step {step} vs {ref:.4f} at step {ref_step} "
        f"(tolerance {tol:.3f} = {abs_tol:g} + {rel_tol:g}*ref)",
        loss - ref,
    )


# ---------------------------------------------------------------------------------------------- checkpoints
def check_checkpoints(latest: str | None, loaded: str | None, verified: Mapping[str, str | None]) -> Check:
    """``latest`` must name a checkpoint that loads and verifies; ``verified``: folder -> error or None.

    Folders with a manifest that fail verification count as unloadable; folders without one are
    abandoned saves (a crash before the commit point), which the format allows.
    """
    unloadable = {n: err for n, err in verified.items() if err is not None and "no manifest" not in err}
    ok = latest is not None and loaded == latest and not unloadable
    detail = f"latest={latest}, loaded={loaded}, {len(verified)} checkpoints, {len(unloadable)} unloadable"
    if unloadable:
        detail += f": {unloadable}"
    return Check("latest checkpoint loadable and verified", ok, detail, len(unloadable))


# ---------------------------------------------------------------------------------------------- mlflow
def check_one_mlflow_run(run_ids: Sequence[str] | None, file_run_id: str | None) -> Check:
    if run_ids is None:
        return Check("one MLflow run", False, "no MLflow store in the run dir")
    ok = len(run_ids) == 1 and (file_run_id is None or run_ids[0] == file_run_id)
    return Check("one MLflow run", ok, f"{len(run_ids)} run(s) in mlflow.db; mlflow_run_id={file_run_id}")


# ---------------------------------------------------------------------------------------------- processes
def check_no_leftovers(leftovers: Sequence[str], *, name: str = "no process of the job left") -> Check:
    return Check(
        name,
        not leftovers,
        "none" if not leftovers else f"{len(leftovers)} left: {'; '.join(leftovers[:4])}",
        len(leftovers),
    )


# ---------------------------------------------------------------------------------------------- recovery
FAULT_ACTIONS = frozenset(
    {"kill-worker", "kill-host", "preempt-host", "freeze-worker", "etcd-outage", "kill-during-checkpoint",
     "kill-during-commit", "kill-job", "partition-host", "kill-agent", "kill-rank0-spare-writer", "slow-worker",
     "hang-worker", "preemption-notice", "store-down"}
)  # fmt: skip


EXPECTED_REASONS: dict[str, tuple[str, ...]] = {
    "preemption-notice": ("hosts_removed",),
    "partition-host": ("hosts_removed", "worker_failed"),
    "preempt-host": ("hosts_removed",),
    "kill-agent": ("hosts_removed",),
    "kill-worker": ("worker_failed",),
    "kill-host": ("worker_failed", "hosts_removed"),
    "kill-during-checkpoint": ("worker_failed",),
    "kill-during-commit": ("worker_failed",),
    "kill-rank0-spare-writer": ("worker_failed",),
    "hang-worker": ("worker_hung",),
    "slow-worker": ("hosts_removed",),
}


@dataclass(frozen=True, slots=True)
class Recovery:
    action: str
    fault_ts: float
    reset_reason: str | None
    recovery_seconds: float | None
    """The worker's measure: from the failure (or host notice) to the first step at the new size."""
    seconds_to_reset: float | None
    """From the fault to the ``reset`` (or the relaunch's ``start``) that followed it."""
    lost_steps: int | None


def recoveries(faults: Sequence[Mapping[str, Any]], events: Sequence[Event]) -> list[Recovery]:
    """Match every fault with the first ``reset`` (or a relaunch ``start``) after it and before the next fault.

    Faults with no reset between them (two hosts killed at once) are one burst: each is matched with a reset
    after it and before the first fault that follows the burst's first reset.
    """
    hits = [f for f in faults if f.get("action") in FAULT_ACTIONS and "phase" not in f and "skipped" not in f]
    hits.sort(key=lambda f: float(f["ts"]))
    recovered_at = sorted(e.ts for e in events if isinstance(e, Reset) or _relaunch(e))
    out = []
    for f in hits:
        t = float(f["ts"])
        # Only faults that must cause a reset form bursts; an outage or a freeze keeps to its own window.
        first = next((ts for ts in recovered_at if ts >= t), math.inf) if f.get("action") in RESET_EXPECTED else t
        t_next = next((float(h["ts"]) for h in hits if float(h["ts"]) > max(t, first)), math.inf)
        window = [e for e in events if t <= e.ts < t_next]
        # A reset after the fault; else (the whole job went down) the relaunch's start from a checkpoint.
        resets = of_kind(window, Reset)
        # Prefer the reset the fault causes (a drain: hosts_removed), not a grow-back of an earlier fault.
        wanted = EXPECTED_REASONS.get(str(f.get("action")), ())
        reset = next((e for e in resets if e.reason in wanted), resets[0] if resets else None)
        relaunch = next((e for e in of_kind(window, Start) if _relaunch(e)), None)
        match: Reset | Start | None = (relaunch or reset) if f.get("action") == "kill-job" else (reset or relaunch)
        if match is None:
            out.append(Recovery(str(f["action"]), t, None, None, None, None))
            continue
        rec: float | None
        reason: str | None
        if isinstance(match, Start):
            rec, reason, lost = match.ts - t, "relaunch", None
        else:
            rec, reason, lost = match.recovery_seconds, match.reason, match.lost_steps
        out.append(Recovery(str(f["action"]), t, reason, rec, match.ts - t, lost))
    return out


def _relaunch(e: Event) -> bool:
    """A ``start`` that resumed from a checkpoint (a relaunch after the whole job went down)."""
    return isinstance(e, Start) and e.resumed_from_step is not None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def recovery_stats(recs: Sequence[Recovery], actions: set[str]) -> dict[str, float | int | None]:
    values = [r.recovery_seconds for r in recs if r.action in actions and r.recovery_seconds is not None]
    return {
        "count": len(values),
        "p50": statistics.median(values) if values else None,
        "p95": percentile(values, 95),
    }


RESET_EXPECTED = frozenset(
    {"kill-worker", "kill-host", "preempt-host", "kill-during-checkpoint", "kill-during-commit", "kill-job",
     "kill-agent", "kill-rank0-spare-writer", "hang-worker"}
)  # fmt: skip
"""Faults that must be followed by a reset or relaunch; a short freeze, a slowdown (evicted only with
``elastic.stragglers: evict``) or an etcd outage need not be."""


def check_recovered(
    recs: Sequence[Recovery], *, expect_reset: bool = True, required: frozenset[str] = RESET_EXPECTED
) -> Check:
    """Every fault of a ``required`` kind was followed by a reset or a relaunch (when the scenario expects one)."""
    missing = [r.action for r in recs if r.reset_reason is None and r.action in required]
    if not recs:
        return Check("recovery seconds per fault", None, "no fault injected")
    parts = [
        f"{r.action}: {r.recovery_seconds:.2f}s ({r.reset_reason}, lost {r.lost_steps})"
        if r.recovery_seconds is not None
        else f"{r.action}: no reset"
        for r in recs
    ]
    ok = (not missing) if expect_reset else None
    return Check("recovery seconds per fault", ok, "; ".join(parts), [r.recovery_seconds for r in recs])


RETURN_MARKERS = ("host-returns", "partition-host")
"""Chaos events after which a node is back: it booted again, or its partition ended (``phase: end``)."""


def check_rejoined(faults: Sequence[Mapping[str, Any]], events: Sequence[Event]) -> Check:
    """Multi-node tier: every node that came back after a fault is in the ring again (a later ``reset``
    lists it among its hosts), i.e. horovodrun started a worker on it over ssh."""
    name = "node rejoined the ring after it came back"
    back = {
        str(f["host"]): float(f["ts"])
        for f in faults
        if f.get("action") in RETURN_MARKERS
        and f.get("host")
        and (f["action"] == "host-returns" or f.get("phase") == "end")
    }
    if not back:
        return Check(name, False, "no node came back (no host-returns or partition end recorded)")
    parts, ok = [], True
    for host, ts in sorted(back.items()):
        rejoin = next((e for e in of_kind(events, Reset) if e.ts >= ts and host in (e.hosts or [])), None)
        if rejoin is None:
            ok = False
            parts.append(f"{host}: not back in the ring")
        else:
            late = rejoin.ts - ts
            parts.append(f"{host}: in the ring {late:.1f}s later (step {rejoin.step}, {rejoin.world_size} workers)")
    return Check(name, ok, "; ".join(parts))


def check_hang_detected(recs: Sequence[Recovery], gloo_timeout_seconds: float) -> Check:
    """Every ``hang-worker`` fault was followed by a ``worker_hung`` reset whose recovery took less than the Gloo
    timeout: the hang was detected, not waited out (a Gloo timeout would have made it ``worker_failed``)."""
    name = f"hung worker detected (worker_hung, recovery < Gloo timeout {gloo_timeout_seconds:g}s)"
    hangs = [r for r in recs if r.action == "hang-worker"]
    if not hangs:
        return Check(name, False, "no hang-worker fault recorded")
    parts, ok = [], True
    for r in hangs:
        if r.reset_reason is None or r.seconds_to_reset is None:
            ok = False
            parts.append("no reset after the SIGSTOP")
            continue
        fast = r.recovery_seconds is not None and r.recovery_seconds < gloo_timeout_seconds
        ok = ok and r.reset_reason == "worker_hung" and fast
        rec = f"{r.recovery_seconds:.2f}s" if r.recovery_seconds is not None else "not measured"
        parts.append(f"reset {r.reset_reason} {r.seconds_to_reset:.1f}s after the SIGSTOP, recovery {rec}")
    return Check(name, ok, "; ".join(parts), [r.recovery_seconds for r in hangs])


def check_processes_gone(pids: Sequence[int], leftovers: Sequence[str], *, name: str) -> Check:
    """None of ``pids`` is among ``leftovers`` (``"<pid> <command line>"``, as the runner lists them)."""
    if not pids:
        return Check(name, False, "no pid recorded")
    wanted = {str(p) for p in pids}
    left = [x for x in leftovers if x.split(" ", 1)[0] in wanted]
    detail = f"pids {sorted(pids)} gone" if not left else f"still alive after the job: {'; '.join(left[:4])}"
    return Check(name, not left, detail, len(left))


def check_evicted(
    fault: Mapping[str, Any] | None,
    events: Sequence[Event],
    end: Mapping[str, Any] | None = None,
) -> Check:
    """The host of the ``slow-worker`` ``fault`` was drained (an ``eviction`` with ``action: drain`` after the fault
    began), and no other host was. ``end``: the fault's ``phase: "end"`` record (its achieved stopped fraction)."""
    name = "slowed host evicted (drain), no other host"
    if fault is None:
        return Check(name, False, "no slow-worker fault recorded")
    host, t = fault.get("host"), float(fault["ts"])
    drains = [e for e in of_kind(events, Eviction) if e.action == "drain" and e.ts >= t]
    mine = [e for e in drains if e.host == host]
    others = sorted({str(e.host) for e in drains if e.host != host})
    named = [e for e in of_kind(events, Straggler) if e.slow and e.host == host and e.ts >= t]
    if mine:
        e = mine[0]
        detail = f"{host} drained {e.ts - t:.1f}s after the slowdown began (step {e.step}, ratio {e.ratio})"
    else:
        detail = f"{host} not drained"
    detail += f"; {len(named)} straggler event(s) named it"
    if end is not None:
        detail += f"; stopped {end.get('stopped_fraction')} of the time (target {end.get('target_stopped_fraction')})"
    if others:
        detail += f"; also drained: {', '.join(others)}"
    return Check(name, bool(mine) and not others, detail)


def check_readmitted(fault: Mapping[str, Any] | None, events: Sequence[Event]) -> Check:
    """Informational: whether the evicted host was back in the ring (a later ``reset`` lists it) before the end."""
    name = "evicted host back after its cool-down"
    drain = next(
        (
            e
            for e in of_kind(events, Eviction)
            if fault is not None and e.action == "drain" and e.host == fault.get("host") and e.ts >= float(fault["ts"])
        ),
        None,
    )
    if drain is None:
        return Check(name, None, "no eviction")
    back = next((e for e in of_kind(events, Reset) if e.ts > drain.ts and drain.host in (e.hosts or [])), None)
    if back is None:
        return Check(name, None, f"not back before the end (cool-down {drain.cooldown_seconds}s)")
    return Check(name, None, f"back {back.ts - drain.ts:.1f}s after the drain (cool-down {drain.cooldown_seconds}s)")


def check_no_step_lost(recs: Sequence[Recovery]) -> Check:
    lost = {r.action: r.lost_steps for r in recs if r.lost_steps}
    return Check("no step lost (graceful)", not lost, f"lost steps: {lost}" if lost else "0 steps rolled back")


def check_goodput(goodput: float | None, minimum: float | None = None) -> Check:
    if goodput is None:
        return Check("goodput", False, "no goodput (no events?)")
    ok = None if minimum is None else goodput >= minimum
    return Check("goodput", ok, f"{goodput:.3f}" + (f" (minimum {minimum:g})" if minimum is not None else ""), goodput)


# ---------------------------------------------------------------------------------------------- table
def format_table(title: str, checks: Sequence[Check]) -> str:
    width = max([len(c.name) for c in checks] + [9])
    mark = {True: "ok", False: "FAIL", None: "-"}
    lines = [title, f"{'invariant':<{width}}  {'result':<6}  detail", f"{'-' * width}  ------  {'-' * 40}"]
    lines += [f"{c.name:<{width}}  {mark[c.ok]:<6}  {c.detail}" for c in checks]
    verdict = "PASS" if all(c.ok is not False for c in checks) else "FAIL"
    lines.append(f"{'verdict':<{width}}  {verdict}")
    return "\n".join(lines)


def passed(checks: Sequence[Check]) -> bool:
    return all(c.ok is not False for c in checks)


def check_orphan_writer(record: Mapping[str, Any] | None) -> list[Check]:
    """From the ``orphan-writer`` record of the ``kill-rank0-spare-writer`` scenario: the writer of the killed
    rank 0 died with it, and once it was gone ``latest`` named a step at least the one it named before, whose
    folder (or a newer latest) is still there."""
    if record is None:
        return [Check("orphaned writer died with its trainer", False, "not recorded")]
    died = record.get("writer_died_seconds")
    out = [
        Check(
            "orphaned writer died with its trainer",
            died is not None,
            f"writer {record.get('writer_pid')} gone {died:.2f} s after rank 0's SIGKILL"
            if died is not None
            else f"writer {record.get('writer_pid')} still alive {record.get('waited_seconds')} s after; resumed",
        )
    ]
    before, after = record.get("latest_before"), record.get("latest_after")
    b, a = _step_of(before), _step_of(after)
    forward = b is None or (a is not None and a >= b and (a > b or bool(record.get("latest_before_kept"))))
    out.append(
        Check(
            "latest only moved forward, nothing newer pruned",
            forward,
            f"latest {before} before the writer could finish, {after} after; {before} kept: "
            f"{record.get('latest_before_kept')}",
        )
    )
    return out


def _step_of(name: Any) -> int | None:
    if isinstance(name, str) and name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None
