"""The just-in-time checkpoint of a cloud's preemption notice: rank 0's reader of the job's host records, and what
rank 0 does at a commit.

Contract:

- :class:`PreemptionWatch` reads the job's host records through the registry interface
  (:meth:`~discovery.registry.HostRegistry.list_hosts`) at most once per ``period`` on a daemon thread of its own, and
  only while ``active()`` is true (this worker holds rank 0). It keeps the last
  :class:`~discovery.notice.CheckpointPlan` of :func:`~discovery.notice.plan_checkpoint`; the training thread only
  reads that field. :meth:`PreemptionWatch.refresh` reads once, now (rank 0 calls it when a host removal interrupts
  training, before the reset's rendezvous may block). A failed read keeps the last plan and is logged once a minute;
  records were validated by :meth:`~discovery.record.HostRecord.from_json` (malformed ones are skipped).
- :func:`jit_action` (pure) says what rank 0 does at a commit: nothing (no plan, or the commit is durable already),
  an asynchronous save of the commit (training goes on), or a save it waits for (the end is within
  ``near_seconds``).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from discovery.notice import CheckpointPlan, plan_checkpoint
from discovery.registry import HostRegistry
from elastictrain import envnames
from elastictrain.errors import ConfigError
from elastictrain.logconf import get_logger

log = get_logger("elastictrain.engine.health.preemption")

PERIOD_SECONDS = 1.0
"""How often rank 0 reads the host records (the agents' notice polls run at 1 s too)."""
NEAR_SECONDS = 30.0
"""Within this many seconds of the earliest notice's end, rank 0 waits for the commit's save to be durable (GCP gives
30 s of warning, AWS 2 minutes: before the last 30 s, saves run in the background and training goes on)."""
TIMEOUT_SECONDS = 2.0
"""Bound of each etcd read."""
LOG_EVERY_SECONDS = 60.0
"""A failing read is logged at most this often."""


@dataclass(frozen=True, slots=True)
class JitAction:
    """Save the commit: ``wait`` for it to be durable, or hand it to the writer and go on."""

    wait: bool
    seconds_left: float
    """Seconds until the earliest notice's end."""


def jit_action(
    plan: CheckpointPlan | None,
    *,
    now: float,
    committed_step: int,
    durable_step: int | None,
    in_flight_step: int | None,
    near_seconds: float = NEAR_SECONDS,
) -> JitAction | None:
    """What rank 0 does at the commit of ``committed_step`` (pure): ``None`` when the notices leave the job able to go
    on (no ``plan``) or the commit is durable already (``durable_step``); a waited save when the plan's deadline is
    within ``near_seconds`` (or past: the instance may still be there); else an asynchronous save, unless the writer is
    already writing this very step (``in_flight_step``)."""
    if plan is None or committed_step == durable_step:
        return None
    left = plan.deadline - now
    if left <= near_seconds:
        return JitAction(wait=True, seconds_left=left)
    if in_flight_step == committed_step:
        return None
    return JitAction(wait=False, seconds_left=left)


class PreemptionWatch:
    """Rank 0's view of the job's preemption notices (see the module docstring)."""

    def __init__(
        self,
        open_registry: Callable[[], HostRegistry],
        *,
        min_np: int,
        active: Callable[[], bool] = lambda: True,
        period: float = PERIOD_SECONDS,
        near_seconds: float = NEAR_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._open_registry = open_registry
        self.min_np = min_np
        self.active = active
        self.period = period
        self.near_seconds = near_seconds
        self.clock = clock
        self.plan: CheckpointPlan | None = None
        """The last plan read (``None``: the job survives the notices, or none was read yet)."""
        self.reads = 0
        """Successful reads so far."""
        self._registry: HostRegistry | None = None
        self._lock = threading.Lock()  # one read at a time: the thread's and refresh()'s share a connection
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged_at = -math.inf

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, min_np: int, active: Callable[[], bool]) -> PreemptionWatch | None:
        """The watch of the job the environment names (the variables the launcher gives horovodrun, as discover.sh
        reads them), or ``None`` when it names no usable etcd (nothing is watched)."""
        from discovery.discover import DiscoverConfig
        from discovery.registry import EtcdRegistry

        try:
            spec, cfg = env[envnames.ETCD], DiscoverConfig.from_env(env)
        except (KeyError, ConfigError):
            return None
        return cls(
            lambda: EtcdRegistry(spec, cfg.job, cfg.prefix, timeout_seconds=TIMEOUT_SECONDS, access=cfg.access),
            min_np=min_np,
            active=active,
        )

    def start(self) -> PreemptionWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastictrain-preemption", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = TIMEOUT_SECONDS + 1) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            self._close_registry()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if self.active():
                self.refresh()

    def refresh(self) -> CheckpointPlan | None:
        """Read the host records once and keep the plan they give; on a failed read, keep the last plan."""
        with self._lock:
            try:
                if self._registry is None:
                    self._registry = self._open_registry()
                listing = self._registry.list_hosts()
            except Exception as e:  # etcd down or slow: the notices read so far stand
                self._close_registry()
                now = time.monotonic()
                if now - self._logged_at >= LOG_EVERY_SECONDS:
                    self._logged_at = now
                    log.warning(
                        "could not read the host records for preemption notices",
                        error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__,
                    )
                return self.plan
            plan = plan_checkpoint([entry.record for entry in listing.entries], self.min_np)
            if plan is not None and plan != self.plan:
                log.warning("preemption notices", plan=plan.describe(self.clock()))
            self.plan = plan
            self.reads += 1
            return plan

    def _close_registry(self) -> None:
        registry, self._registry = self._registry, None
        if registry is not None:
            with contextlib.suppress(Exception):  # closing a broken connection: nothing more to do
                registry.close()
