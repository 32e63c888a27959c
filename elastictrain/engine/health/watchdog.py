"""Fast recovery from a dead peer without shortening Horovod's Gloo timeout.

After a worker dies, the survivors that share a Gloo connection with it fail at once. A survivor
waiting only on a *live* peer can block in a Gloo receive for the whole ``HOROVOD_GLOO_TIMEOUT_SECONDS``:
the peer that failed first keeps its old sockets open while it waits in the next rendezvous. Shortening
the timeout is not an answer: the same timeout bounds the rendezvous in which old workers wait for a new
one to start (import torch, init), so a short one breaks scale-up on a slow machine.

Instead each worker runs a watchdog thread. It aborts this process's Gloo connections, so the blocked
receive fails now and Horovod's elastic loop rolls back and re-forms the ring, only when both hold:

* a peer failure is known: another worker recorded one in the job's signals (the failure marker), a Gloo connection
  of this ring was closed by its peer (that worker's process is gone), or Horovod's driver notified this
  worker that a host was *removed* (a dead or partitioned host leaves discovery; its worker may still hold
  its sockets open); and
* this worker is stuck: it has been inside one step far longer than steps take (see
  :class:`WatchdogPolicy`; longer for a removal notice than for a recorded failure).

Horovod's state sync after a rendezvous (its broadcasts wait on every peer) is guarded like a step
(:meth:`CollectiveWatchdog.sync_started`): the ring's connections are taken when it begins, so a worker whose sync
fails shuts them down (:meth:`CollectiveWatchdog.ring_failed`) and peers blocked on it fail at once, and a worker
blocked in it aborts on a recorded failure or a closed ring connection (a removal notice alone never aborts a sync).

A notice that only adds hosts never aborts: Horovod sends one on a healthy scale-up, and it stays pending
until the next commit (:func:`removal_pending`). Local work that holds no collective (validation's forward
passes) is not a step (:meth:`CollectiveWatchdog.paused`).

The decision is the pure function :func:`should_abort`; the thread only gathers its inputs.

A peer that *hangs* (its process lives, but makes no progress) is no failure by these signals; the same thread
beats and judges for :mod:`elastictrain.engine.health.hang`, which turns it into one.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elastictrain.engine.health.hang import HangDetector
from elastictrain.engine.health.signals import IDLE, LOCAL, WAITING, Member, WorkerSignals
from elastictrain.logconf import get_logger

log = get_logger("elastictrain.engine.health.watchdog")


@dataclass(frozen=True, slots=True)
class WatchdogPolicy:
    failed_min_seconds: float = 0.5
    failed_factor: float = 3.0
    """With a failure recorded during this step (or a ring connection closed by its peer), the ring is broken:
    abort after ``max(failed_min_seconds, failed_factor x typical step)``."""
    removed_min_seconds: float = 2.0
    removed_factor: float = 5.0
    """With only a notice that a host was removed (also sent on a graceful drain), wait longer."""
    poll_seconds: float = 0.1
    report_after_seconds: float = 5.0
    """A step that has waited this long without an abort although a failure or a removal notice is known is logged
    once with the decision's inputs, so that a watchdog miss (a survivor left in a Gloo receive until the
    timeout) can be explained afterwards. Without either signal nothing is logged: a long validation at the end
    of an epoch is not a miss."""


def should_abort(
    *,
    now: float,
    step_started: float | None,
    typical_step: float,
    failure_ts: float | None,
    policy: WatchdogPolicy,
    host_removed: bool = False,
    peer_closed: Callable[[], bool] = lambda: False,
    peer_gone: Callable[[], str | None] = lambda: None,
    progress_since: float | None = None,
    syncing: bool = False,
) -> str | None:
    """Why the collectives of this step should be aborted now, or None.

    ``step_started`` is None between steps. ``failure_ts`` is the newest failure recorded by any worker;
    only a failure since this worker last made progress counts: ``progress_since`` is the end of its last
    completed step or of the rendezvous that formed its ring (default: the start of this step). A peer
    may fail while this worker is still computing and only then enter the broken collective, so the
    start of the step is too late a cut-off. ``host_removed``: a pending host-change notice says a host was
    removed (a notice that only adds hosts is no input at all). ``peer_closed`` (asked only once the step is
    overdue): a Gloo connection of this ring was closed by its peer, i.e. a worker process is gone. ``peer_gone``
    (asked only once a step, not the sync, is overdue): why a member of this ring is known gone (its process on this
    machine no longer runs), else None; Gloo does not always say so (see
    :func:`elastictrain.engine.health.hang.gone_peers`). The
    sync is never judged by it: the ring's members are gathered in the sync, and until then they are the last ring's,
    whose dead member caused this reset.
    ``syncing``: ``step_started`` is the start of the state sync, not of a step. A recorded failure or a closed
    ring connection aborts it as it would a step; a removal notice alone never does (a sync has no typical
    length, and the worker of a gracefully drained host still completes it).
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
    if overdue and not syncing and (gone := peer_gone()) is not None:
        return f"{gone} and this step has waited {waited:.1f}s"
    if host_removed and not syncing and waited >= max(policy.removed_min_seconds, policy.removed_factor * typical_step):
        return f"a host was removed and this step has waited {waited:.1f}s"
    return None


def removal_pending(host_messages: queue.Queue) -> bool:
    """Whether a pending host-change notice (Horovod's ``State._host_messages``: ``(timestamp, update)``) says
    that a host was removed. Read without consuming: the training loop acts on the notices at its commit."""
    try:
        pending = list(host_messages.queue)
    except RuntimeError:  # the deque changed while copied; the next poll sees it
        return False
    return any(int(update) & HOST_REMOVED for _ts, update in pending)


HOST_REMOVED = 1
"""``horovod.runner.elastic.worker.HostUpdateResult.removed`` (kept as a number: this module imports no Horovod)."""


def failure_counts(failure_ts: float | None, step_started: float, progress_since: float | None) -> bool:
    """Whether a recorded failure concerns the current step: it came after this worker last made progress (see
    :func:`should_abort`)."""
    since = step_started if progress_since is None else min(progress_since, step_started)
    return failure_ts is not None and failure_ts >= since


Pair = tuple[Any, Any]
"""(local, remote) address of a TCP connection, as psutil lists it."""


@dataclass(frozen=True, slots=True)
class RingSocket:
    """A Gloo connection of this ring: the descriptor that held it at the snapshot, and its socket's inode.

    Gloo may close the descriptor and the number may go to another socket; the inode tells them apart.
    """

    fd: int
    inode: int


Ring = dict[Pair, RingSocket]

_TCP_PEER_CLOSED = {7, 8, 9, 11}
"""Linux ``tcpi_state`` values of a socket whose peer ended the connection while this process holds it: CLOSE
(reset, or closed both ways), CLOSE_WAIT, LAST_ACK, CLOSING. A connection this process shut down first is in
FIN_WAIT1/2 instead."""


@contextlib.contextmanager
def _held(ring_socket: RingSocket) -> Iterator[socket.socket | None]:
    """A duplicate of the ring socket's descriptor while that descriptor still holds the same socket, else None.

    The duplicate keeps the socket alive while it is inspected, so the check cannot race with Gloo closing it.
    """
    try:
        fd = os.dup(ring_socket.fd)
    except OSError:  # closed by this process
        yield None
        return
    try:
        if os.fstat(fd).st_ino != ring_socket.inode:  # closed, and the number reused
            os.close(fd)
            yield None
            return
        s = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        yield None
        return
    try:
        yield s
    finally:
        s.close()


def _address(addr: Any) -> tuple[str, int]:
    return (addr[0], addr[1])


def ring_connections(exclude_local_ports: set[int], exclude_remote_ports: set[int]) -> Ring:
    """This process's established TCP connections outside the control plane, each with its descriptor and inode.

    Taken right after a rendezvous, these are the Gloo connections of the new ring (Gloo connects every pair
    of ranks, so every survivor has a direct connection to a worker that dies). An entry is kept only when its
    descriptor, duplicated, still holds a socket of that same address pair.
    """
    import psutil

    ring: Ring = {}
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        if c.laddr.port in exclude_local_ports or c.raddr.port in exclude_remote_ports:
            continue
        with contextlib.suppress(OSError):
            fd = os.dup(c.fd)
            try:
                s = socket.socket(fileno=fd)
            except OSError:
                os.close(fd)
                continue
            with s:
                if _address(s.getsockname()) == _address(c.laddr) and _address(s.getpeername()) == _address(c.raddr):
                    ring[(c.laddr, c.raddr)] = RingSocket(c.fd, os.fstat(s.fileno()).st_ino)
    return ring


def closed_by_peer(ring: Ring) -> bool:
    """Whether the peer of a connection of ``ring`` closed or reset it (its process is gone).

    A connection this process closed itself (its descriptor gone or holding another socket) or shut down
    (FIN_WAIT) is no evidence of a dead peer.
    """
    for ring_socket in ring.values():
        with _held(ring_socket) as s:
            if s is None:
                continue
            with contextlib.suppress(OSError):
                if s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in _TCP_PEER_CLOSED:
                    return True
    return False


def abort_connections(ring: Ring) -> int:
    """Shut down the connections of ``ring`` that this process still holds; return how many.

    Only the ring's Gloo connections recorded after the rendezvous are touched (never tracking or etcd), and
    each only while its descriptor still holds the recorded socket (same inode). ``shutdown`` (not ``close``)
    on a duplicate descriptor: the owner (Gloo) keeps its descriptor, sees the connection end, and fails its
    pending operation at once. An empty ring shuts down nothing.
    """
    n = 0
    for ring_socket in ring.values():
        with _held(ring_socket) as s:
            if s is None:
                continue
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
    return n


class CollectiveWatchdog:
    """The thread: the training loop calls :meth:`step_started` / :meth:`step_finished` around each step."""

    def __init__(
        self,
        signals: WorkerSignals,
        host_removed: Callable[[], bool],
        excluded_ports: Callable[[], tuple],
        policy: WatchdogPolicy | None = None,
        hang: HangDetector | None = None,
    ) -> None:
        self.signals = signals
        self.hang = hang
        self.host_removed = host_removed
        self.excluded_ports = excluded_ports
        self.policy = policy or WatchdogPolicy()
        self._step_started: float | None = None
        self._syncing = False
        """Whether ``_step_started`` is the start of the state sync (:meth:`sync_started`) rather than of a step."""
        self._progress: float | None = None
        """End of the last completed step, or of the rendezvous that formed the current ring."""
        self._typical = 1.0
        """Typical step seconds: an exponential average kept by the training thread (one float, no locking)."""
        self._steps = 0
        self._ring: Ring = {}
        self._reported: float | None = None
        """Start of the last step logged as overdue without an abort (once per step)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collective-watchdog", daemon=True)
        self.aborts = 0

    def start(self) -> CollectiveWatchdog:
        self._thread.start()
        return self

    def step_started(self) -> None:
        self._syncing = False
        self._step_started = time.time()
        if self.hang is not None:
            self.hang.set_phase(LOCAL)

    def grads_ready(self) -> None:
        """This step's own work is done: from here it waits on the other workers."""
        if self.hang is not None:
            self.hang.set_phase(WAITING)

    def set_members(self, me: int, members: list[Member]) -> None:
        """After each rendezvous: this ring's ranks, hosts and pids (whose heartbeats a hang is judged by)."""
        if self.hang is not None:
            self.hang.set_ring(me, members)

    def step_finished(self) -> None:
        if self.hang is not None:
            self.hang.step_done()
        started, self._step_started = self._step_started, None
        self._progress = time.time()
        if started is not None:
            took = self._progress - started
            self._steps += 1
            self._typical = took if self._steps == 1 else 0.9 * self._typical + 0.1 * took

    def sync_started(self) -> None:
        """Horovod's state sync begins (after a rendezvous, before the training function): take this ring's
        connections now and guard the sync like a step until :meth:`sync_finished`.

        The sync's collectives wait on every peer. A worker whose sync fails must be able to shut the new ring's
        connections down (:meth:`ring_failed`; a snapshot taken only after the sync would be empty then), and a
        worker blocked in the sync on a live peer must abort when a failure is known."""
        self.snapshot_ring()
        self._syncing = True
        self._step_started = time.time()

    def sync_finished(self) -> None:
        """The sync returned or raised: between steps again (the sync is no step: it sets no typical step time)."""
        self._step_started = None
        self._syncing = False

    def snapshot_ring(self) -> None:
        """Right after a rendezvous: remember this ring's Gloo connections (see :func:`closed_by_peer`)."""
        self._progress = time.time()
        try:
            self._ring = ring_connections(*self.excluded_ports())
        except Exception:  # psutil may be denied /proc on exotic systems; the other signals remain
            log.exception("could not list this ring's connections")
            self._ring = {}

    def idle(self) -> None:
        """Between steps (a reset, a rendezvous): nothing to abort."""
        self._step_started = None
        self._syncing = False
        if self.hang is not None:
            self.hang.set_phase(IDLE)

    def ring_failed(self) -> int:
        """Called first when a collective of this ring failed in this worker: stand down, and shut the ring's
        connections down (returns how many).

        Horovod keeps a failed worker's Gloo context, and so its sockets, open until the next rendezvous
        completes; a peer blocked on this worker would wait for the Gloo timeout, and that rendezvous
        waits for the blocked peer. Shut down, the connections end at once, and every peer connected to this
        worker (all of them: Gloo connects every pair) fails its pending operation now. Sockets of a newer
        ring are safe: each is checked by inode (the ring is emptied here and taken again after the
        rendezvous)."""
        self.idle()
        ring, self._ring = self._ring, {}
        n = abort_connections(ring)
        log.info("collective failed: shut this ring's connections down", connections=n)
        return n

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside a step, around local work that holds no collective however long it takes (validation's
        forward passes): not part of the step; the step's clock starts again after it."""
        self.idle()
        try:
            yield
        finally:
            self.step_started()

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_seconds):
            try:
                self._check()
            except Exception:  # the watchdog must outlive any surprise; it is a safety net, not a dependency
                log.exception("collective watchdog check failed")

    def _check(self) -> None:
        started, syncing = self._step_started, self._syncing
        if self.hang is not None:
            now = time.time()
            self.hang.tick(now, None if started is None or syncing else now - started, self._typical)
        if started is None:
            return
        ring, now = self._ring, time.time()
        failure_ts, removed, progress = self.signals.last_failure(), self.host_removed(), self._progress
        reason = should_abort(
            now=now,
            step_started=started,
            typical_step=self._typical,
            failure_ts=failure_ts,
            policy=self.policy,
            host_removed=removed,
            peer_closed=lambda: bool(ring) and closed_by_peer(ring),
            peer_gone=self.hang.gone if self.hang is not None else lambda: None,
            progress_since=progress,
            syncing=syncing,
        )
        if reason is None:
            signal = removed or failure_counts(failure_ts, started, progress)
            if signal and now - started >= self.policy.report_after_seconds and self._reported != started:
                self._reported = started
                log.warning(
                    "step overdue without an abort",
                    waited_seconds=round(now - started, 3),
                    typical_step_seconds=round(self._typical, 4),
                    failure_seconds_ago=None if failure_ts is None else round(now - failure_ts, 3),
                    last_progress_seconds_ago=None if progress is None else round(now - progress, 3),
                    host_removed=removed,
                    syncing=syncing,
                    ring_connections=len(ring),
                )
            return
        n = abort_connections(ring)
        self.aborts += 1
        self._step_started = None  # once per stuck step
        log.warning("aborting blocked collectives", reason=reason, connections=n)

    def stop(self) -> None:
        """End the thread (waited for, so that it writes no heartbeat after) and retire this worker's heartbeat."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_SECONDS)
        if self.hang is not None:
            self.hang.retire()


STOP_JOIN_SECONDS = 5.0
"""At most this long :meth:`CollectiveWatchdog.stop` waits for the thread's current check."""


class NullWatchdog:
    """No watchdog: a worker in one process (:class:`~elastictrain.engine.collective.LocalCollective`) has no
    ring to abort. Every call of :class:`CollectiveWatchdog`'s loop interface does nothing."""

    def step_started(self) -> None:
        pass

    def step_finished(self) -> None:
        pass

    def grads_ready(self) -> None:
        pass

    def set_members(self, me: int, members: list[Member]) -> None:
        pass

    def sync_started(self) -> None:
        pass

    def sync_finished(self) -> None:
        pass

    def snapshot_ring(self) -> None:
        pass

    def idle(self) -> None:
        pass

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        pass
