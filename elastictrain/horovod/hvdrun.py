"""``python -m elastictrain.horovod.hvdrun ARGS``: ``horovodrun ARGS`` with a host discovery that costs a fork,
not a Python.

Horovod 0.28.1's elastic driver runs ``--host-discovery-script`` every second through
``safe_shell_exec.execute``, which starts a *spawned* multiprocessing middleman: a fresh Python
interpreter that re-imports the ``horovodrun`` script, every second, for the whole job (what that costs:
docs/decisions.md).

This entry point is horovodrun itself (same flags, same driver, same rendezvous) with seven repairs:

1. **Discovery by fork.** :func:`run_discovery_script` runs the script with ``subprocess`` in its own
   session, kills that session when the script outlives :data:`DISCOVERY_TIMEOUT_SECONDS`, and fails on a
   non-zero exit exactly as Horovod does (the driver fails the job on the first call and retries later
   ones). Parsing of the ``host:slots`` lines stays Horovod's.
2. **Dead slots are started again.** When the driver re-forms the job, it starts workers only for slots
   that were not in the previous assignment (``ElasticDriver._update_host_assignments``), whether or not
   the worker in that slot is still alive. A host whose worker died and that is discovered again before
   the next assignment (its blacklist cooldown ran out, as happens when the job fell below ``--min-np``
   and waited for hosts) therefore gets a rank but no process: the survivors wait in the rendezvous until
   the Gloo timeout, abort, and horovodrun then waits forever with no worker. :func:`install` makes the
   driver forget slots whose worker has exited before it computes the next assignment, so they are
   started again. An exit counts for its own process only: the late exit of a slot's older process does
   not mark the slot's live one dead.

3. **Every loopback address is this machine.** Horovod runs a host locally only when its address is one that
   an interface lists (``network.get_local_host_addresses``), and over ssh otherwise. Linux answers on all of
   ``127.0.0.0/8`` through ``lo`` while listing only ``127.0.0.1``, so a job of more logical hosts than this
   machine's four names (:func:`elastictrain.launcher.hosts.local_logical_hosts`: ``127.0.0.2``, ...) would
   ssh to itself. :func:`install` makes Horovod's check count every loopback address as local.

4. **The rendezvous server takes every connection.** Horovod's rendezvous is an HTTP key-value store in the
   driver (``RendezvousHTTPServer``), and each worker's Gloo store polls it for every missing key every 10 ms,
   a new TCP connection per request. Its listen backlog is Python's default of 5: at 32 workers the queue
   overflows, the kernel drops SYNs, and each dropped client waits for a SYN retransmit (1 s, then 3 s, 7 s, ...),
   which made one reset's rendezvous take a minute at 32 workers (``ListenOverflows`` in ``/proc/net/netstat``
   counted the drops). :func:`install` gives the server a backlog of :data:`RENDEZVOUS_BACKLOG`.

5. **A rendezvous that cannot complete is aborted.** When a worker of the current assignment exits (non-zero; its
   own exit, not an older process's of its slot), the driver writes :data:`ABORT_SCOPE`/:data:`ABORT_KEY` into its
   rendezvous store (:func:`abort_rendezvous`) before Horovod handles the exit. The workers' Gloo set-up, as patched by
   ``elastictrain/horovod/patch.py``, polls that key while it waits for a peer's address or connection, and then fails
   ``hvd.init`` at once instead of after the Gloo timeout (five times it for a pair's connection), so the survivors ask
   for the next ring (:func:`elastictrain.engine.collective.reset_horovod`). The store is cleared when the driver starts
   the next round (``RendezvousServer.init``), which Horovod does only once every worker of the round has left it, so a
   marker ends exactly the round whose worker is gone. An exit and the start of a round are ordered by one lock: an exit
   either comes first (its slot is started again, and the new round clears the marker) or after (its marker aborts the
   new round, which counts on the dead process). A marker written when the round has already formed is read by no one
   (the survivors' collectives fail on their own). A worker whose own Gloo set-up fails writes the same marker (the
   patched Horovod does), so a live worker that gave up holds no one either.

6. **No host change is lost.** The driver stamps each host-change notice with ``int(time.time())``, and a worker
   acts only on a notice stamped later than the last one it acted on. Two changes within one second (a host's key
   expires and its restarted agent registers it again a moment later, so the host is removed, then added) gave
   the second the same stamp: the workers dropped it, discovery did not change again, and the job stayed at the
   smaller size for good (the fault campaign: two returned hosts never got a worker again). :func:`install` stamps
   notices with :class:`NoticeClock`: wall-clock seconds as a float, strictly increasing.

7. **An added host is told again until the job takes it.** The driver tells rank 0 of a change once, when discovery
   sees it, and a worker empties its queue of notices when its reset ends (``State.on_reset``). A notice that arrived
   while the survivors were still in the reset of a round formed without the new host (rank 0 and another worker
   killed: their hosts' blacklist cooldown ends while the survivors' next ring forms) was dropped, and the job
   stayed at the smaller size for good. So was a notice to a rank 0 not yet registered to be told. :func:`install`
   makes the discovery loop, each pass that finds no new change, compare the slots the hosts allow now with the
   current round's (:func:`untold_change`) and, while the hosts allow slots that the round lacks, tell rank 0
   again (a notice that only removes slots is not told again: one that is lost leaves the job training at its
   size). Deciding holds the lock under which a round starts; the notice goes out on a thread of its own
   (:class:`Outbox`), never under that lock nor under the driver's hosts condition, so a rank 0 that does not reply
   holds neither discovery, nor a worker's exit, nor a round that waits for slots. A notice is dropped when a round
   has started since it was decided, and a round's start waits for a send in flight: a notice sent before a round
   that has the new host lands before that round's reset ends (which drops it, rightly), and after such a round
   starts none is sent. Every notice, the first one too, goes out in one attempt bounded by
   :data:`NOTICE_TIMEOUT_SECONDS` (:func:`send_notice`; Horovod's client waits without limit, so a stopped rank 0
   held the driver's discovery); a rank 0 whose process has exited is not told, and one whose notice failed is left
   alone for :data:`NOTICE_BACKOFF_SECONDS`.

The repairs replace private methods of Horovod 0.28.1's runner; on any other Horovod version this entry
point exits 2 with one line.

``elastictrain launch`` and the benchmarks start horovodrun this way.

Size: the driver's repairs and the entry that installs them, read side by side (each in ``docs/horovod.md``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from elastictrain.errors import ElastictrainError
from elastictrain.launcher.hosts import is_loopback

DISCOVERY_TIMEOUT_SECONDS = 30.0
"""A discovery script that hangs this long is killed (with everything it started) and counts as failed."""


def run_discovery_script(script: str, timeout: float = DISCOVERY_TIMEOUT_SECONDS) -> str:
    """The stdout of ``script`` run by ``/bin/sh``; RuntimeError on a non-zero exit or a timeout.

    stderr goes to horovodrun's stderr, as with Horovod's own executor.
    """
    proc = subprocess.Popen(
        script, shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, text=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"Failed to execute discovery script: {script}. Timed out after {timeout:g}s") from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"Failed to execute discovery script: {script}. Exit code: {proc.returncode}")
    return out


RENDEZVOUS_BACKLOG = 4096
"""Listen backlog of Horovod's rendezvous server (the kernel caps it at ``net.core.somaxconn``)."""

ABORT_SCOPE = "elastictrain_abort"
ABORT_KEY = "ring"
"""Where the driver's rendezvous store holds an abort marker (``/ABORT_SCOPE/ABORT_KEY``; the value says why). The
patched Gloo set-up asks for exactly this path: ``ABORT_PATH`` in ``elastictrain/horovod/patch.py``."""


def abort_rendezvous(server: Any, reason: str) -> None:
    """Write the abort marker into Horovod's ``RendezvousServer`` ``server`` (its HTTP key-value store)."""
    httpd = server._httpd
    with httpd.cache_lock:
        httpd.cache.setdefault(ABORT_SCOPE, {})[ABORT_KEY] = reason.encode()


HOROVOD_VERSION = "0.28.1"
"""The only Horovod whose elastic driver :func:`install` knows: it replaces private methods of that release."""


class UnsupportedHorovod(ElastictrainError, RuntimeError):
    """The installed Horovod is not :data:`HOROVOD_VERSION`; the repairs would patch names that may differ."""


class _SlotProcesses:
    """Which process runs in each slot, and which slots' processes have exited (keyed by process, not by slot).

    Every start of a worker in a slot gets a new generation; an exit marks the slot dead only when it is the
    exit of the slot's current process, so the late exit of an older one leaves a live successor alone. Exits
    come from one thread per worker, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = itertools.count(1)
        self._current: dict[tuple[str, int], int] = {}
        self._exited: set[tuple[str, int]] = set()

    def started(self, slot: tuple[str, int]) -> int:
        with self._lock:
            generation = self._current[slot] = next(self._generation)
            self._exited.discard(slot)
            return generation

    def exited(self, slot: tuple[str, int], generation: int) -> bool:
        """Record the exit of ``slot``'s process ``generation``; whether that was the slot's current process."""
        with self._lock:
            if self._current.get(slot) == generation:
                self._exited.add(slot)
                return True
            return False

    def dead(self) -> set[tuple[str, int]]:
        with self._lock:
            return set(self._exited)


class LocalAddresses(set[str]):
    """This machine's interface addresses, and every loopback address (``in`` says so for ``127.0.0.0/8``)."""

    def __contains__(self, address: object) -> bool:
        return super().__contains__(address) or (isinstance(address, str) and is_loopback(address))


class NoticeClock:
    """Stamps of host-change notices (repair 6): ``time.time()``, but always at least :data:`NOTICE_STEP_SECONDS`
    after the previous stamp, so that no two notices share one and a clock stepped back cannot hide a notice."""

    def __init__(self, now: Any = None) -> None:
        self._now = now if now is not None else time.time
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self._last = max(float(self._now()), self._last + NOTICE_STEP_SECONDS)
            return self._last


NOTICE_STEP_SECONDS = 0.001


def untold_change(current: Mapping[str, Iterable[Any]], allowed: Mapping[str, Iterable[Any]]) -> int:
    """Repair 7's rule: how the slots ``allowed`` by the hosts now (``{host: [SlotInfo]}``, as Horovod's driver
    assigns them) differ from the ``current`` round's, as Horovod's ``HostUpdateResult`` flags (0: no change;
    ``removed``; ``added``; both). Slots are compared as ``(host, local_rank)``: ranks that would only be numbered
    otherwise are no change to tell."""
    from horovod.runner.elastic.worker import HostUpdateResult

    def slots(assignments: Mapping[str, Iterable[Any]]) -> set[tuple[str, int]]:
        return {(host, s.local_rank) for host, host_slots in assignments.items() for s in host_slots}

    now, then = slots(allowed), slots(current)
    return int((HostUpdateResult.added if now - then else 0) | (HostUpdateResult.removed if then - now else 0))


NOTICE_TIMEOUT_SECONDS = 2.0
"""How long the driver's notice thread waits for rank 0 to take a host-change notice (Horovod's own client waits
without limit); also the longest a round's start waits for a send in flight (repair 7)."""

NOTICE_BACKOFF_SECONDS = 5.0
"""After a failed notice, how long the driver leaves that rank 0 alone (it is likely dead or stopped; the watchdog or
its exit ends that soon, and a new rank 0 is told)."""


def send_notice(client: Any, timestamp: float, update: int, timeout: float | None = None) -> None:
    """Horovod's ``WorkerNotificationClient.notify_hosts_updated`` (its request, its signed wire format, the first
    of the worker's vetted addresses) in one attempt of at most ``timeout`` seconds (default
    :data:`NOTICE_TIMEOUT_SECONDS`) for the connection and for the reply. Raises ``OSError`` (``TimeoutError``
    included) or the wire's error on a bad reply."""
    import socket

    from horovod.runner.elastic.worker import HostsUpdatedRequest

    timeout = NOTICE_TIMEOUT_SECONDS if timeout is None else timeout

    address = next(iter(client.addresses().values()))[0]
    with socket.create_connection(tuple(address), timeout=timeout) as sock:
        sock.settimeout(timeout)
        with sock.makefile("rb") as rfile, sock.makefile("wb") as wfile:
            client._wire.write(HostsUpdatedRequest(timestamp, update), wfile)
            client._wire.read(rfile)


@dataclass(frozen=True, slots=True)
class Notice:
    """A host-change notice decided for the rank 0 of round ``round`` (repair 7)."""

    round: int
    slot: tuple[str, int]
    client: Any
    """Horovod's ``WorkerNotificationClient`` of that rank 0."""
    update: int
    """``HostUpdateResult`` flags."""


class Outbox:
    """Host-change notices to rank 0, sent by a thread of their own (started when a notice comes, gone when none is
    left), so that no one who posts waits for rank 0. A notice not yet sent when another comes for the same round and
    rank 0 is merged into it (the flags of both); one for another round replaces it (a round's start makes older
    notices moot)."""

    def __init__(self, send: Callable[[Notice], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._pending: Notice | None = None
        self._sending = False

    def post(self, notice: Notice) -> None:
        with self._lock:
            old = self._pending
            if old is not None and (old.round, old.slot) == (notice.round, notice.slot):
                notice = replace(notice, update=notice.update | old.update)
            self._pending = notice
            if self._sending:
                return
            self._sending = True
        try:
            threading.Thread(target=self._run, name="host-change-notices", daemon=True).start()
        except BaseException:  # no sender runs: the next post must start one
            with self._lock:
                self._sending = False
            raise

    def _run(self) -> None:
        while True:
            with self._lock:
                notice, self._pending = self._pending, None
                if notice is None:
                    self._sending = False
                    return
            try:
                self._send(notice)
            except Exception:  # the sender reports its own failures; this keeps the outbox working
                logging.exception("host-change notice failed")


class _BackOff:
    """Slots whose last notice failed, each left alone for ``seconds`` (monotonic clock)."""

    def __init__(self, seconds: float, clock: Any = time.monotonic) -> None:
        self._seconds = seconds
        self._clock = clock
        self._until: dict[tuple[str, int], float] = {}

    def ready(self, slot: tuple[str, int]) -> bool:
        return self._clock() >= self._until.get(slot, 0.0)

    def failed(self, slot: tuple[str, int]) -> None:
        self._until[slot] = self._clock() + self._seconds


def install() -> None:
    """Apply the seven repairs to Horovod's runner (in this process). Idempotent.

    Raises :class:`UnsupportedHorovod` on any Horovod but :data:`HOROVOD_VERSION`.
    """
    import horovod

    found = getattr(horovod, "__version__", "unknown")
    if found != HOROVOD_VERSION:
        raise UnsupportedHorovod(
            f"elastictrain.horovod.hvdrun needs Horovod {HOROVOD_VERSION} (it repairs that release's elastic driver); "
            f"found Horovod {found}"
        )
    from horovod.runner.elastic import discovery
    from horovod.runner.elastic import driver as driver_module
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.worker import HostUpdateResult
    from horovod.runner.http.http_server import RendezvousHTTPServer
    from horovod.runner.util import network

    RendezvousHTTPServer.request_queue_size = RENDEZVOUS_BACKLOG

    if not getattr(network, "_elastictrain_repaired", False):
        interface_addresses = network.get_local_host_addresses

        def get_local_host_addresses() -> LocalAddresses:
            return LocalAddresses(interface_addresses())

        network.get_local_host_addresses = get_local_host_addresses
        network._elastictrain_repaired = True

    def _execute_discovery_script(self: discovery.HostDiscoveryScript) -> str:
        return run_discovery_script(self._discovery_script)

    discovery.HostDiscoveryScript._execute_discovery_script = _execute_discovery_script
    if not isinstance(driver_module._epoch_time_s, NoticeClock):
        driver_module._epoch_time_s = NoticeClock()
    if getattr(ElasticDriver, "_elastictrain_repaired", False):
        return
    init = ElasticDriver.__init__
    update_assignments = ElasticDriver._update_host_assignments

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._elastictrain_slots = _SlotProcesses()
        self._elastictrain_round = threading.Lock()  # an exit, a notice vs. the start of a round (repairs 2, 5, 7)
        self._elastictrain_rounds = 0  # rounds started (under the round lock)
        self._elastictrain_sending = threading.Lock()  # a notice's send vs. the start of a round; before the round lock
        self._elastictrain_quiet = _BackOff(NOTICE_BACKOFF_SECONDS)
        self._elastictrain_outbox = Outbox(lambda notice: send_if_current(self, notice))
        init(self, *args, **kwargs)

    def _start_worker_process(self: Any, slot_info: Any) -> None:
        # Horovod 0.28.1's own method, with the exit recorded for this process only.
        slot = (slot_info.hostname, slot_info.local_rank)
        generation = self._elastictrain_slots.started(slot)
        create_worker_fn = self._create_worker_fn
        shutdown_event = self._shutdown
        host_event = self._host_manager.get_host_event(slot_info.hostname)

        def run_worker() -> None:
            exit_code, timestamp = create_worker_fn(slot_info, [shutdown_event, host_event])
            # Recorded before Horovod's registry sees the exit, so before any re-assignment it can trigger.
            with self._elastictrain_round:
                current = self._elastictrain_slots.exited(slot, generation)
                assigned = any(s.local_rank == slot[1] for s in self._host_assignments.get(slot[0], ()))
                if current and assigned and exit_code != 0:
                    abort_rendezvous(self._rendezvous, f"{slot[0]}[{slot[1]}] exited with code {exit_code}")
            self._handle_worker_exit(slot_info, exit_code, timestamp)

        thread = threading.Thread(target=run_worker, daemon=True)
        thread.start()
        self._results.expect(thread)

    def _update_host_assignments(self: Any, current_hosts: Any) -> Any:
        with self._elastictrain_sending, self._elastictrain_round:  # a round starts after a send in flight (repair 7)
            self._elastictrain_rounds += 1
            gone = self._elastictrain_slots.dead()
            if gone:
                live = {
                    host: [s for s in slots if (host, s.local_rank) not in gone]
                    for host, slots in self._host_assignments.items()
                }
                self._host_assignments = {host: slots for host, slots in live.items() if slots}
            return update_assignments(self, current_hosts)

    def tell_rank0(self: Any, update: Any) -> None:
        """Post ``update`` for the current round's rank 0 (the caller holds the round lock; sent by the outbox's
        thread: :func:`send_if_current`); repair 7."""
        rank0 = self.get_coordinator_info()
        if rank0 is None:
            return
        slot = (rank0.hostname, rank0.local_rank)
        client = self.get_worker_client(rank0)
        if client is None or slot in self._elastictrain_slots.dead() or not self._elastictrain_quiet.ready(slot):
            return
        self._elastictrain_outbox.post(Notice(self._elastictrain_rounds, slot, client, update))

    def send_if_current(self: Any, notice: Notice) -> None:
        """On the outbox's thread: send ``notice`` unless a round has started since it was decided, its rank 0's
        process has exited, or its last notice failed within the back-off. Holds only the sending lock (a round that
        starts meanwhile waits for this one attempt), never the round lock or the hosts condition while it sends."""
        with self._elastictrain_sending:
            with self._elastictrain_round:
                slot = notice.slot
                moot = notice.round != self._elastictrain_rounds or slot in self._elastictrain_slots.dead()
                if moot or not self._elastictrain_quiet.ready(slot):
                    return
            try:
                send_notice(notice.client, driver_module._epoch_time_s(), notice.update)
            except Exception as e:  # refused, timed out, a bad reply: told again after the back-off
                self._elastictrain_quiet.failed(slot)
                logging.warning(f"host-change notice to {slot[0]}[{slot[1]}] failed ({type(e).__name__}: {e})")

    def allowed_slots(self: Any, current_hosts: Any) -> Any:
        """The assignment the hosts allow now (none below the minimum), as Horovod's driver computes it."""
        if current_hosts.count_available_slots() < self._min_num_proc:
            return {}
        return self._get_host_assignments(current_hosts)[0]

    def _notify_workers_host_changes(self: Any, current_hosts: Any, update_res: Any) -> None:
        # Horovod 0.28.1's own rule (no notice when the slots would not change), sent by tell_rank0.
        allowed = allowed_slots(self, current_hosts)
        with self._elastictrain_round:
            if allowed != self.host_assignments:
                tell_rank0(self, update_res)

    def tell_again(self: Any) -> None:
        """Repair 7: tell rank 0 again of slots that the hosts allow and the current round lacks."""
        allowed = allowed_slots(self, self._host_manager.current_hosts)
        with self._elastictrain_round:
            update = HostUpdateResult(untold_change(self._host_assignments, allowed))
            if update & HostUpdateResult.added:
                tell_rank0(self, update)

    def _discover_hosts(self: Any) -> None:
        # Horovod 0.28.1's own loop, which also tells again what the job has not acted on (repair 7).
        first_update = True
        while not self._shutdown.is_set():
            self._wait_hosts_cond.acquire()
            try:
                update_res = self._host_manager.update_available_hosts()
                if update_res != HostUpdateResult.no_update:
                    self._notify_workers_host_changes(self._host_manager.current_hosts, update_res)
                    self._wait_hosts_cond.notify_all()
                elif not first_update:
                    tell_again(self)
            except BaseException as e:
                if first_update:
                    # Misconfiguration, fail the job immediately
                    self._shutdown.set()
                    self._wait_hosts_cond.notify_all()
                    raise
                # Transient error, retry until timeout
                logging.warning(str(e))
            finally:
                self._wait_hosts_cond.release()
            first_update = False
            self._shutdown.wait(driver_module.DISCOVER_HOSTS_FREQUENCY_SECS)

    ElasticDriver.__init__ = __init__
    ElasticDriver._start_worker_process = _start_worker_process
    ElasticDriver._update_host_assignments = _update_host_assignments
    ElasticDriver._notify_workers_host_changes = _notify_workers_host_changes
    ElasticDriver._discover_hosts = _discover_hosts
    ElasticDriver._elastictrain_repaired = True


def main() -> int:
    try:
        install()
    except UnsupportedHorovod as e:
        sys.stderr.write(f"{e}\n")
        raise SystemExit(2) from None
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"
    run_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
