"""Fast recovery from a dead peer without shortening Horovod's Gloo timeout.

After a worker dies, the survivors that share a Gloo connection with it fail at once. A survivor
waiting only on a *live* peer can block in a Gloo receive until ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (30 s by
default; measured here: 20 s of a 20 s timeout). The peer that failed first keeps its old sockets open
while it waits in the next rendezvous. Shortening the timeout is not an answer: the same timeout
bounds the rendezvous in which old workers wait for a new one to start (import torch, init), so a
short one breaks scale-up on a slow machine.

Instead each worker runs a watchdog thread. It aborts this process's Gloo connections, so the blocked
receive fails now and Horovod's elastic loop rolls back and re-forms the ring, only when both hold:

* a peer failure is known: another worker recorded one in the run dir's failure marker, or Horovod's
  driver notified this worker that hosts changed (it does so within about a second of blacklisting a
  dead worker's host); and
* this worker is stuck: it has been inside one step far longer than steps take (see
  :class:`WatchdogPolicy`; shorter when a failure is recorded, since the ring is then surely broken).

The decision is the pure function :func:`should_abort`; the thread only gathers its inputs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery.fileio import write_atomic
from discovery.logconf import get_logger

log = get_logger("elastictrain.watchdog")


@dataclass(frozen=True, slots=True)
class WatchdogPolicy:
    failed_min_seconds: float = 0.5
    failed_factor: float = 3.0
    """With a failure recorded during this step, the ring is broken: abort after
    ``max(failed_min_seconds, failed_factor x typical step)``."""
    notified_min_seconds: float = 2.0
    notified_factor: float = 5.0
    """With only a host-change notice (which also comes on a healthy scale-up), wait longer."""
    poll_seconds: float = 0.1
    report_after_seconds: float = 5.0
    """A step that has waited this long without an abort although a failure or a host notice is known is logged
    once with the decision's inputs, so that a watchdog miss (a survivor left in a Gloo receive until the
    timeout) can be explained afterwards. Without either signal nothing is logged: a long validation at the end
    of an epoch is not a miss."""


def should_abort(
    *,
    now: float,
    step_started: float | None,
    typical_step: float,
    failure_ts: float | None,
    notified: bool,
    policy: WatchdogPolicy,
    peer_closed: Callable[[], bool] = lambda: False,
    progress_since: float | None = None,
) -> str | None:
    """Why the collectives of this step should be aborted now, or None.

    ``step_started`` is None between steps. ``failure_ts`` is the newest failure recorded by any worker;
    only a failure since this worker last made progress counts: ``progress_since`` is the end of its last
    completed step or of the rendezvous that formed its ring (default: the start of this step). A peer
    may fail while this worker is still computing and only then enter the broken collective, so the
    start of the step is too late a cut-off. ``notified``: a host-change notice is pending.
    ``peer_closed`` (asked only once the step is overdue): a Gloo connection of this ring was closed by its
    peer, i.e. a worker process is gone.
    """
    if step_started is None:
        return None
    waited = now - step_started
    overdue = waited >= max(policy.failed_min_seconds, policy.failed_factor * typical_step)
    if failure_ts is not None and failure_counts(failure_ts, step_started, progress_since):
        if overdue:
            return f"a peer failed {now - failure_ts:.1f}s ago and this step has waited {waited:.1f}s"
        return None
    if overdue and peer_closed():
        return f"a peer closed its connection of this ring and this step has waited {waited:.1f}s"
    if notified and waited >= max(policy.notified_min_seconds, policy.notified_factor * typical_step):
        return f"hosts changed and this step has waited {waited:.1f}s"
    return None


def failure_counts(failure_ts: float | None, step_started: float, progress_since: float | None) -> bool:
    """Whether a recorded failure concerns the current step: it came after this worker last made progress (see
    :func:`should_abort`)."""
    since = step_started if progress_since is None else min(progress_since, step_started)
    return failure_ts is not None and failure_ts >= since


class FailureMarker:
    """A tiny file in the run dir that says "a worker saw a collective fail at time T" (shared storage)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, host: str) -> None:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, f"{time.time()} {host}\n", durable=False)

    def last(self) -> float | None:
        try:
            return float(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


def ring_connections(exclude_local_ports: set[int], exclude_remote_ports: set[int]) -> set[tuple[Any, Any]]:
    """(local, remote) addresses of this process's established TCP connections outside the control plane.

    Taken right after a rendezvous, these are the Gloo connections of the new ring (Gloo connects every pair
    of ranks, so every survivor has a direct connection to a worker that dies).
    """
    import psutil

    return {
        (c.laddr, c.raddr)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED
        and c.raddr
        and c.laddr.port not in exclude_local_ports
        and c.raddr.port not in exclude_remote_ports
    }


def closed_by_peer(ring: set[tuple[Any, Any]]) -> bool:
    """Whether a connection of ``ring`` is no longer established: its peer closed it (CLOSE_WAIT), or reset it
    and the socket is gone (a send to a dead process draws a reset, so CLOSE_WAIT alone can be missed)."""
    import psutil

    established = {
        (c.laddr, c.raddr) for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED
    }
    return any(conn not in established for conn in ring)


def abort_connections(
    exclude_local_ports: set[int], exclude_remote_ports: set[int], only: set[tuple[Any, Any]] | None = None
) -> int:
    """Shut down this process's established TCP connections except the excluded ports; return how many.

    ``only``: restrict to these (local, remote) pairs, the ring's Gloo connections recorded after the
    rendezvous, so nothing else (tracking, etcd) is touched. ``shutdown`` (not ``close``) on a duplicate
    descriptor: the owner (Gloo) keeps its descriptor, sees the connection end, and fails its pending
    operation at once.
    """
    import psutil

    n = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status not in (psutil.CONN_ESTABLISHED, psutil.CONN_CLOSE_WAIT) or c.fd < 0 or not c.raddr:
            continue
        if c.laddr.port in exclude_local_ports or c.raddr.port in exclude_remote_ports:
            continue
        if only is not None and (c.laddr, c.raddr) not in only:
            continue
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(c.fd))
            s.shutdown(socket.SHUT_RDWR)
            s.close()
            n += 1
    return n


class CollectiveWatchdog:
    """The thread: the training loop calls :meth:`step_started` / :meth:`step_finished` around each step."""

    def __init__(
        self,
        marker: FailureMarker,
        notified: Callable[[], bool],
        excluded_ports: Callable[[], tuple],
        policy: WatchdogPolicy | None = None,
    ) -> None:
        self.marker = marker
        self.notified = notified
        self.excluded_ports = excluded_ports
        self.policy = policy or WatchdogPolicy()
        self._step_started: float | None = None
        self._progress: float | None = None
        """End of the last completed step, or of the rendezvous that formed the current ring."""
        self._typical = 1.0
        """Typical step seconds: an exponential average kept by the training thread (one float, no locking)."""
        self._steps = 0
        self._ring: set[tuple[Any, Any]] = set()
        self._reported: float | None = None
        """Start of the last step logged as overdue without an abort (once per step)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collective-watchdog", daemon=True)
        self.aborts = 0

    def start(self) -> CollectiveWatchdog:
        self._thread.start()
        return self

    def step_started(self) -> None:
        self._step_started = time.time()

    def step_finished(self) -> None:
        started, self._step_started = self._step_started, None
        self._progress = time.time()
        if started is not None:
            took = self._progress - started
            self._steps += 1
            self._typical = took if self._steps == 1 else 0.9 * self._typical + 0.1 * took

    def snapshot_ring(self) -> None:
        """Right after a rendezvous: remember this ring's Gloo connections (see :func:`closed_by_peer`)."""
        self._progress = time.time()
        try:
            self._ring = ring_connections(*self.excluded_ports())
        except Exception:  # psutil may be denied /proc on exotic systems; the other signals remain
            log.exception("could not list this ring's connections")
            self._ring = set()

    def idle(self) -> None:
        """Between steps (a reset, a rendezvous): nothing to abort."""
        self._step_started = None

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_seconds):
            try:
                self._check()
            except Exception:  # the watchdog must outlive any surprise; it is a safety net, not a dependency
                log.exception("collective watchdog check failed")

    def _check(self) -> None:
        started = self._step_started
        if started is None:
            return
        ring, now = self._ring, time.time()
        failure_ts, notified, progress = self.marker.last(), self.notified(), self._progress
        reason = should_abort(
            now=now,
            step_started=started,
            typical_step=self._typical,
            failure_ts=failure_ts,
            notified=notified,
            policy=self.policy,
            peer_closed=lambda: bool(ring) and closed_by_peer(ring),
            progress_since=progress,
        )
        if reason is None:
            signal = notified or failure_counts(failure_ts, started, progress)
            if signal and now - started >= self.policy.report_after_seconds and self._reported != started:
                self._reported = started
                log.warning(
                    "step overdue without an abort",
                    waited_seconds=round(now - started, 3),
                    typical_step_seconds=round(self._typical, 4),
                    failure_seconds_ago=None if failure_ts is None else round(now - failure_ts, 3),
                    last_progress_seconds_ago=None if progress is None else round(now - progress, 3),
                    notified=notified,
                    ring_connections=len(ring),
                )
            return
        local, remote = self.excluded_ports()
        n = abort_connections(local, remote, only=ring or None)
        self.aborts += 1
        self._step_started = None  # once per stuck step
        log.warning("aborting blocked collectives", reason=reason, connections=n)

    def stop(self) -> None:
        self._stop.set()
