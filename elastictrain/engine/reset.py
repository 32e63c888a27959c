"""What a (re)start of the training function means, decided by one pure function: :func:`plan_reset`.

After every sync (the job's start, a resume, a failure, a host change) the engine knows the committed world
size (0: no step has run since this start of the job), the new world size, the LR ramp, and the failure
that caused the reset, if any. From those alone it follows whether this is the job's start, whether a reset
is to be reported (a ``failure`` event now, a ``reset`` event after the first step at the new size), and the
LR ramp towards the new size's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastictrain.config import ElasticConfig
from elastictrain.engine.policy import ScaleRamp, lr_scale
from elastictrain.rundir.events import RESET_PARTS


@dataclass(frozen=True, slots=True)
class PendingReset:
    """A reset to report: the ``failure`` event at once, the ``reset`` event after the first step it allows."""

    old_size: int
    new_size: int
    reason: str
    """``worker_failed``, ``hosts_changed`` or ``hosts_removed``."""
    failure_ts: float
    """When the failure or host notice happened: recovery is timed from here."""
    lost_steps: int


@dataclass(frozen=True, slots=True)
class ResetPlan:
    starting: bool
    """No step has run at any size since the job (re)started: a ``start`` event, not a ``reset``."""
    reset: PendingReset | None
    ramp: ScaleRamp | None
    """The LR ramp towards the new size's scale when the world size changed (commit it at once), else None."""


def plan_reset(
    *,
    step: int,
    committed_size: int,
    new_size: int,
    ramp: ScaleRamp,
    failure: tuple[str, float] | None,
    lost_steps: int,
    elastic: ElasticConfig,
    now: float,
) -> ResetPlan:
    """The plan for a (re)start at ``step`` (see the module docstring).

    ``committed_size`` is the world size the committed state was trained at (0 at a start); ``failure`` is
    ``(reason, unix time)`` of what caused this reset, None for a start or a resume. A changed size ramps the
    LR multiplier from where it stands (``ramp`` at ``step``) to the new size's scale over
    ``elastic.lr_ramp_steps``; at a start it jumps there.
    """
    target = lr_scale(elastic, new_size)
    if committed_size == new_size:
        if failure is None:
            return ResetPlan(starting=False, reset=None, ramp=None)
        reason, ts = failure
        return ResetPlan(False, PendingReset(new_size, new_size, reason, ts, lost_steps), None)
    if committed_size == 0:
        return ResetPlan(starting=True, reset=None, ramp=ScaleRamp(target, target, step, 0))
    new_ramp = ScaleRamp(ramp.at(step), target, step, elastic.lr_ramp_steps)
    reason, ts = failure or ("hosts_changed", now)
    return ResetPlan(False, PendingReset(committed_size, new_size, reason, ts, lost_steps), new_ramp)


PAUSE_PARTS = tuple(field.removesuffix("_seconds") for field in RESET_PARTS)
"""The parts of a reset's pause, in order; they add up to its ``recovery_seconds``:

- ``detect``: from the failure (the failed step's start) or the host notice to this worker leaving the step;
- ``rendezvous``: Horovod's reset (``hvd.shutdown`` and ``hvd.init``: the driver's new assignment, the
  rendezvous and the Gloo contexts);
- ``sync``: the state sync from the most advanced rank, from Horovod's reset on (the watchdog takes the new
  ring's connections just before the sync's first mark: :func:`elastictrain.engine.watch.guard_sync`); 0 when
  Horovod skips it (hosts removed only);
- ``prologue``: the training function's start (reset plan, rank-0 services, LR, the ring's host list);
- ``first_step``: the first step at the new size.
"""

PAUSE_MARKS = ("caught", "reset", "sync_start", "sync_end", "prologue_end")
"""What :func:`pause_parts` reads, as ``time.time()`` values a worker records through a reset."""


def pause_parts(failure_ts: float, marks: dict[str, float], now: float) -> dict[str, float | None]:
    """The parts (:data:`PAUSE_PARTS`) of a reset's pause in seconds, from this worker's marks (:data:`PAUSE_MARKS`).

    A part whose marks this worker did not see (a worker that started during the reset has no ``caught`` or
    ``reset``) is None; a skipped sync is 0. Negative spans (clocks read on different threads) count as 0.
    """

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(max(0.0, b - a), 3)

    caught, reset = marks.get("caught"), marks.get("reset")
    sync_start, sync_end = marks.get("sync_start"), marks.get("sync_end")
    synced = sync_start is not None and sync_end is not None and reset is not None and sync_start >= reset
    prologue_end = marks.get("prologue_end")
    return {
        "detect": span(failure_ts, caught),
        "rendezvous": span(caught, reset),
        "sync": span(reset, sync_end) if synced else (0.0 if reset is not None else None),
        "prologue": span(sync_end if synced else reset, prologue_end),
        "first_step": span(prologue_end, now),
    }
