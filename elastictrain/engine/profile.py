"""A worker's own step profile, off the hot path: compute and data-loading time per step, summed to the next commit.

Per step: ``step_started`` (before the batch is taken from the loader), ``data_ready`` (the batch is here),
``grads_ready`` (the backward passes are done: from here the step waits on the other workers' gradients), and
``step_finished``. Compute time is data_ready -> grads_ready, which excludes the time spent waiting for slower
peers in the allreduce; that is what makes a slow host stand out (every rank's *step* lasts as long as the
slowest's). On the CPU it is the host's own time (:func:`own_compute_seconds`): the wall time less the run-queue
delay (``/proc/thread-self/schedstat``) that other processes holding the cores explain, so workers sharing a
machine's cores are compared by their own work; the part of that delay during which the thread's CPU cgroup was
throttled (:mod:`elastictrain.engine.cgroup`: a quota, a container's CPU limit) stays in, as do a stop, a slower
clock and a hypervisor's steal. On a CUDA device compute time is taken from CUDA events, read at :meth:`take`, at a
commit, never in a step.

:meth:`take` returns the sums in the order of :data:`elastictrain.engine.health.stragglers.FIGURES` and starts again;
they travel with the commit's existing collective (:meth:`ElasticTrainingState.check_host_updates`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from elastictrain.engine.cgroup import ThrottleClock


def own_compute_seconds(wall: float, run_delay: float, throttled: float) -> float:
    """A step's compute seconds on the CPU: ``wall`` less the ``run_delay`` (waiting runnable for a core) that
    other processes explain, i.e. less the delay beyond the ``throttled`` time of the thread's CPU cgroup (a
    quota holding the thread back is the host's own slowness). Never negative."""
    excused = max(0.0, run_delay - max(0.0, throttled))
    return max(0.0, wall - excused)


class StepProfile:
    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self._sched: int | None = None
        """A descriptor of the training thread's ``schedstat`` (-1: not available), opened by that thread."""
        self._rq_data = self._throttled_data = 0.0
        self.throttle = ThrottleClock()
        """The training thread's CPU cgroups' throttled time; looked up again at every :meth:`take`."""
        self.discard()

    def discard(self) -> None:
        """Forget what was summed (after a reset: the next commit reports the new world's steps only)."""
        self.steps = 0
        self.samples = 0
        self.compute = self.data = self.step = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._t0 = self._t_data = self._t_grads = 0.0
        self._ev_data: Any = None

    def step_started(self) -> None:
        if self.enabled:
            self._t0 = time.perf_counter()

    def run_delay(self) -> float:
        """Seconds the calling thread has waited runnable for a CPU (0 where Linux does not say)."""
        if self._sched is None:
            try:
                self._sched = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                self._sched = -1
        if self._sched < 0:
            return 0.0
        try:
            return int(os.pread(self._sched, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def data_ready(self) -> None:
        if not self.enabled:
            return
        self._t_data = time.perf_counter()
        if not self.cuda:
            self._rq_data = self.run_delay()
            self._throttled_data = self.throttle.seconds()
        if self.cuda:
            self._ev_data = torch.cuda.Event(enable_timing=True)
            self._ev_data.record()

    def grads_ready(self) -> None:
        if not self.enabled:
            return
        self._t_grads = time.perf_counter()
        if not self.cuda:
            wall = self._t_grads - self._t_data
            own = own_compute_seconds(
                wall, self.run_delay() - self._rq_data, self.throttle.seconds() - self._throttled_data
            )
            self._t_grads = self._t_data + own
        if self.cuda and self._ev_data is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._ev_data, end))
            self._ev_data = None

    def step_finished(self, samples: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        self.steps += 1
        self.samples += samples
        self.data += self._t_data - self._t0
        if not self.cuda:
            self.compute += max(0.0, self._t_grads - self._t_data)
        self.step += now - self._t0

    def take(self) -> list[float]:
        """``[steps, compute_seconds, data_seconds, step_seconds, samples]`` since the last take; then zeros."""
        if self._events:
            self._events[-1][1].synchronize()
            self.compute += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
        out = [float(self.steps), self.compute, self.data, self.step, float(self.samples)]
        self.discard()
        self.throttle.refresh()  # the process may have been moved to another group (a quota set at run time)
        return out
