"""SIGKILL → next step: the one measurement that ``recovery``, ``kill_distribution``, ``goodput`` and ``scale_world``
share.

A kill is SIGKILL sent back to back to the training processes it aims at (:func:`sigkill`; on a host with a warm
zygote, the worker the zygote forked: :func:`training_processes`), and its time is taken just before the first
signal. The job's next step after it is the first ``reset`` event at or after that time, at fewer workers than
``below`` when the caller knows the size the kill broke (:func:`is_next_step`). ``reset`` is what rank 0 writes at
the first completed step of the new membership, so ``reset.ts - t_kill`` is the pause (:func:`outcome`).
:func:`next_step` finds it in a finished run's events; :func:`wait_next_step` waits for it in a running job.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Container, Iterable, Sequence
from typing import Any

import psutil

from bench.hotjoin import WarmZygotes
from chaos.jobs import ElasticJob
from elastictrain.rundir.events import Reset


def training_processes(started: psutil.Process, zygotes: WarmZygotes | None = None) -> list[psutil.Process]:
    """The processes that train for the worker horovodrun ``started``: the worker its host's warm zygote forked,
    else ``started`` itself (a cold worker, or a zygote's client that got no answer and ran the worker itself).
    Never a zygote."""
    if zygotes is not None:
        forked = zygotes.forked(started.environ()["HOROVOD_HOSTNAME"])
        if forked:
            return forked
    return [started]


def sigkill(procs: Iterable[psutil.Process]) -> float:
    """SIGKILL every process of ``procs`` back to back (one already gone is skipped); returns the kill's unix time,
    taken before the first signal."""
    t = time.time()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    return t


def is_next_step(e: Reset, t_kill: float, below: int | None = None) -> bool:
    """Whether ``e`` can be the first step after a kill at ``t_kill``: at or after it, and (``below`` given) at
    fewer than ``below`` workers."""
    return e.ts >= t_kill and (below is None or (e.new_size is not None and e.new_size < below))


def next_step(
    resets: Sequence[Reset], t_kill: float, below: int | None = None, taken: Container[int] = ()
) -> int | None:
    """The index in ``resets`` (in time order) of the first step after a kill at ``t_kill``, leaving out the indices
    in ``taken`` (the steps of earlier kills); None when the run has none."""
    return next((i for i, e in enumerate(resets) if i not in taken and is_next_step(e, t_kill, below)), None)


def wait_next_step(job: ElasticJob, t_kill: float, timeout: float, below: int | None = None, what: str = "") -> Reset:
    """The first step after a kill at ``t_kill`` in a running job, waiting up to ``timeout`` seconds
    (:class:`~chaos.procs.HarnessError` when it does not come)."""
    return job.wait_event(
        Reset, lambda e: is_next_step(e, t_kill, below), timeout, what=what or "the first step after the kill"
    )


def outcome(reset: Reset, t_kill: float) -> dict[str, Any]:
    """What every report takes from a kill and its next step: the pause in seconds, the steps rolled back, the step
    and size it resumed at, and (elastictrain only) the worker's own ``recovery_seconds`` (from the failure or host
    notice it saw)."""
    return {
        "seconds": reset.ts - t_kill,
        "lost_steps": reset.lost_steps,
        "step": reset.step,
        "new_size": reset.new_size,
        "worker_recovery_seconds": reset.recovery_seconds,
    }
