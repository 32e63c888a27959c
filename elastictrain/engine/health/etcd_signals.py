"""The workers' signals (:class:`~elastictrain.engine.health.signals.WorkerSignals`) in etcd, under the job's prefix.

Keys: ``<prefix>/<job>/signals/beats/<host>-<slot>`` (a :class:`~elastictrain.engine.health.signals.Beat`, under this
process's lease: a dead worker's beat goes when the lease runs out), ``.../signals/marks/failure`` and
``.../signals/marks/verdict`` (the run_dir files' one-line values). One daemon thread (:meth:`EtcdSignals.pump`) makes
every etcd call: the methods of the interface only queue a write or read the mirror that thread refreshes, so none
waits on etcd (:meth:`EtcdSignals.remove_beat`, at close, waits a bounded moment). An etcd outage fails no worker:
writes are retried on the next cycle, and a mirror of heartbeats older than :data:`MIRROR_STALE_SECONDS` reads as no
heartbeat at all, which the detectors never judge. Everything read is bounded and checked like the files.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from discovery import kv
from discovery.kv import KeyValue
from discovery.registry import LeaseLost, RegistryError
from discovery.wire import check_name
from elastictrain.engine.health.signals import (
    MAX_BEAT_BYTES,
    MAX_BEAT_FILES,
    MAX_MARK_BYTES,
    Beat,
    Member,
    failure_line,
    parse_failure,
    parse_verdict,
    verdict_line,
)
from elastictrain.logconf import get_logger

log = get_logger("elastictrain.engine.health.etcd_signals")

LEASE_SECONDS = 300
"""TTL of a worker's heartbeat lease, at least; longer than any silence the detectors wait for (see :func:`lease_ttl`),
so a stopped worker's beat stays to be judged."""
POLL_SECONDS = 0.25
"""How often the thread writes what is queued and reads the failure marker and the verdict."""
BEATS_REFRESH_SECONDS = 1.0
"""How often the thread reads the job's heartbeats while the detectors ask for them."""
WANTED_SECONDS = 5.0
"""Heartbeats are read while a detector asked for them within this many seconds (else only written)."""
MIRROR_STALE_SECONDS = 3.0
"""Heartbeats read longer ago than this (etcd does not answer) are not given to the detectors."""
REMOVE_WAIT_SECONDS = 1.0
"""How long :meth:`EtcdSignals.remove_beat` waits for the thread to delete the beat."""
TIMEOUT_SECONDS = 2.0
"""Bound of each etcd call."""
BEATS, FAILURE, VERDICT = "beats/", "marks/failure", "marks/verdict"


def signals_prefix(prefix: str, job: str) -> str:
    """``<prefix>/<job>/signals/``: every signal key of ``job`` starts with this (beside ``hosts/``)."""
    return f"{prefix.rstrip('/')}/{check_name('job', job)}/signals/"


def lease_ttl(hang_seconds: float | None) -> int:
    """The heartbeat lease's TTL: :data:`LEASE_SECONDS`, or twice a longer ``elastic.hang_seconds``."""
    if hang_seconds is None or not math.isfinite(hang_seconds):
        return LEASE_SECONDS
    return max(LEASE_SECONDS, math.ceil(2 * hang_seconds))


class SignalStore(KeyValue, Protocol):
    """The etcd operations the signals need: the plain keys (:class:`discovery.kv.KeyValue`) and the registry's
    leases (one round trip each); all raise ``RegistryError`` on failure."""

    def grant_lease(self, ttl_seconds: int) -> int: ...

    def keep_alive(self, lease_id: int) -> float: ...

    def revoke_lease(self, lease_id: int) -> None: ...


@dataclass(slots=True)
class _Remove:
    host: str
    slot: int
    pid: int
    done: threading.Event


class EtcdSignals:
    """:class:`~elastictrain.engine.health.signals.WorkerSignals` in etcd (see the module). Build with
    :meth:`from_env` (the launcher's variables) or over any :class:`SignalStore`; :meth:`start` runs the thread
    (tests may call :meth:`pump` themselves instead)."""

    def __init__(
        self,
        store: SignalStore,
        prefix: str,
        *,
        lease_seconds: int = LEASE_SECONDS,
        poll_seconds: float = POLL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.prefix = prefix
        """The job's signals prefix (:func:`signals_prefix`)."""
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.clock = clock
        self.ops: Counter[str] = Counter()
        """etcd calls made, by operation (``put``, ``range``, ``keepalive``, ...), and ``errors``."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._beat: Beat | None = None
        self._failure: bytes | None = None
        self._verdict: bytes | None = None
        self._removes: list[_Remove] = []
        self._own_failure: float | None = None
        self._own_verdict: tuple[float, str] | None = None
        self._lease = 0
        self._lease_refreshed = 0.0
        self._beats: dict[tuple[str, int], Beat] = {}
        self._beats_read: float | None = None
        self._beats_wanted: float | None = None
        self._failure_read: float | None = None
        self._verdict_read: tuple[float, str] | None = None
        self._marks_read = -math.inf

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, hang_seconds: float | None = None) -> EtcdSignals:
        """The signals of the job the environment names (``ELASTICTRAIN_ETCD``, ``_JOB``, ``_ETCD_PREFIX`` and the
        TLS/auth variables, as discover.sh reads them). Raises ``ConfigError`` (one line) when they are unusable."""
        store, prefix, job = kv.from_env(env, timeout_seconds=TIMEOUT_SECONDS)
        return cls(store, signals_prefix(prefix, job), lease_seconds=lease_ttl(hang_seconds))

    def beat_key(self, host: str, slot: int) -> str:
        return f"{self.prefix}{BEATS}{check_name('host', host)}-{int(slot)}"

    # -- the thread
    def start(self) -> EtcdSignals:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="etcd-signals", daemon=True)
            self._thread.start()
        return self

    def stop(self, revoke: bool = True) -> None:
        """Stop the thread (after one last cycle) and, with ``revoke``, revoke the lease (this worker's beat goes);
        then close the connection. Once only: later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(REMOVE_WAIT_SECONDS + 2 * TIMEOUT_SECONDS)
            self._thread = None
        if revoke and self._lease:
            with contextlib.suppress(RegistryError):
                self._call("revoke", lambda: self.store.revoke_lease(self._lease))
            self._lease = 0
        with contextlib.suppress(Exception):
            self.store.close()

    def _run(self) -> None:
        logged = -math.inf
        while not self._stop.is_set():
            try:
                self.pump()
            except Exception:  # the thread must outlive any surprise: it is best effort, not a dependency
                if time.monotonic() - logged >= 60.0:  # once a minute, not on every cycle
                    logged = time.monotonic()
                    log.exception("etcd signals cycle failed")
            self._wake.wait(self.poll_seconds)
            self._wake.clear()
        with contextlib.suppress(Exception):
            self.pump()  # what was queued last (a remove at close)

    def pump(self) -> None:
        """One cycle: write what is queued (the newest beat, a failure, a verdict, removals), keep the lease alive,
        read the marks every :attr:`poll_seconds` and the heartbeats every :data:`BEATS_REFRESH_SECONDS` while
        wanted. A failed write stays queued unless a newer one replaced it."""
        now = self.clock()
        with self._lock:
            beat, failure, verdict, removes = self._beat, self._failure, self._verdict, self._removes
            self._beat = self._failure = self._verdict = None
            self._removes = []
            wanted = self._beats_wanted is not None and now - self._beats_wanted < WANTED_SECONDS
        try:
            if beat is not None:
                self._write_beat(beat)
                beat = None
            if failure is not None:
                self._put(FAILURE, failure)
                failure = None
            if verdict is not None:
                self._put(VERDICT, verdict)
                verdict = None
            while removes:
                self._remove(removes[0])
                removes.pop(0).done.set()
            if self._lease and now - self._lease_refreshed >= self.lease_seconds / 3:
                self._keep_alive(now)
        except RegistryError as e:
            log.debug("etcd signals: write failed", error=str(e)[:200])
        finally:
            with self._lock:  # what failed goes again, unless newer came meanwhile
                self._beat = self._beat or beat
                self._failure = self._failure or failure
                self._verdict = self._verdict or verdict
                self._removes = removes + self._removes
        with contextlib.suppress(RegistryError):
            if now - self._marks_read >= self.poll_seconds * 0.9:
                self._read_marks(now)
            if wanted and (self._beats_read is None or now - self._beats_read >= BEATS_REFRESH_SECONDS * 0.9):
                self._read_beats(now)

    def _call(self, op: str, fn: Callable[[], Any]) -> Any:
        self.ops[op] += 1
        try:
            return fn()
        except RegistryError:
            self.ops["errors"] += 1
            raise

    def _put(self, name: str, value: bytes) -> None:
        self._call("put", lambda: self.store.put(self.prefix + name, value))

    def _write_beat(self, beat: Beat) -> None:
        data = beat.to_json().encode()
        try:
            key = self.beat_key(beat.host, beat.slot)
        except ValueError:
            return  # not a host name: no key to write (readers would refuse it anyway)
        if len(data) > MAX_BEAT_BYTES:
            return  # readers would refuse it
        if not self._lease:
            self._lease = self._call("grant", lambda: self.store.grant_lease(self.lease_seconds))
            self._lease_refreshed = self.clock()
        try:
            self._call("put", lambda: self.store.put(key, data, self._lease))
        except RegistryError as e:
            if "lease not found" not in str(e):
                raise
            self._lease = 0  # expired (this worker was stopped longer than the TTL, or etcd lost it): a new one
            raise

    def _keep_alive(self, now: float) -> None:
        try:
            self._call("keepalive", lambda: self.store.keep_alive(self._lease))
            self._lease_refreshed = now
        except LeaseLost:
            self._lease = 0  # the next beat grants a new one

    def _remove(self, r: _Remove) -> None:
        key = self.beat_key(r.host, r.slot)
        found = self._call("get", lambda: self.store.get_keys([key])).get(key)
        if found is not None:
            beat = Beat.parse(found[0])
            if beat is not None and beat.pid == r.pid:
                self._call("delete", lambda: self.store.delete_if(key, found[1]))

    def _read_marks(self, now: float) -> None:
        keys = (self.prefix + FAILURE, self.prefix + VERDICT)
        found = self._call("get", lambda: self.store.get_keys(keys))
        failure, verdict = found.get(keys[0]), found.get(keys[1])
        with self._lock:
            self._failure_read = None if failure is None else parse_failure(failure[0])
            too_big = verdict is None or len(verdict[0]) > MAX_MARK_BYTES
            self._verdict_read = None if verdict is None or too_big else parse_verdict(verdict[0])
            self._marks_read = now

    def _read_beats(self, now: float) -> None:
        start = self.prefix + BEATS
        rows = self._call("range", lambda: self.store.get_prefix(start, MAX_BEAT_FILES))
        beats: dict[tuple[str, int], Beat] = {}
        for key, value, _ in rows[:MAX_BEAT_FILES]:
            beat = Beat.parse(value)
            if beat is not None and key == f"{start}{beat.host}-{beat.slot}":
                beats[(beat.host, beat.slot)] = beat
        with self._lock:
            self._beats, self._beats_read = beats, now

    # -- WorkerSignals
    def write_beat(self, beat: Beat) -> None:
        with self._lock:
            self._beat = beat
        self._wake.set()

    def read_beats(self, members: Sequence[Member]) -> dict[tuple[str, int], Beat]:
        beats = self._fresh_beats()
        out = {}
        for m in members:
            b = beats.get((m.host, m.slot))
            if b is not None:
                out[(m.host, m.slot)] = b
        return out

    def all_beats(self) -> list[Beat]:
        return list(self._fresh_beats().values())

    def _fresh_beats(self) -> dict[tuple[str, int], Beat]:
        now = self.clock()
        with self._lock:
            first = self._beats_wanted is None or now - self._beats_wanted >= WANTED_SECONDS
            self._beats_wanted = now
            fresh = self._beats_read is not None and now - self._beats_read <= MIRROR_STALE_SECONDS
            beats = self._beats if fresh else {}
        if first:
            self._wake.set()  # read them now, not at the next poll
        return beats

    def remove_beat(self, host: str, slot: int, pid: int) -> None:
        check_name("host", host)
        r = _Remove(host, int(slot), pid, threading.Event())
        with self._lock:
            if self._beat is not None and (self._beat.host, self._beat.slot, self._beat.pid) == (host, slot, pid):
                self._beat = None  # a queued beat of the process that closes is not written after its removal
            self._removes.append(r)
        self._wake.set()
        if self._thread is not None:
            r.done.wait(REMOVE_WAIT_SECONDS)

    def record_failure(self, host: str) -> None:
        now = time.time()
        with self._lock:
            self._own_failure = now
            self._failure = failure_line(now, host).encode()[:MAX_MARK_BYTES]
        self._wake.set()

    def last_failure(self) -> float | None:
        with self._lock:
            known = [t for t in (self._own_failure, self._failure_read) if t is not None]
        return max(known) if known else None

    def record_verdict(self, why: str, at: float | None = None) -> None:
        when = time.time() if at is None else at
        line = verdict_line(when, why)
        with self._lock:
            parsed = parse_verdict(line.encode())
            if parsed is not None and (self._own_verdict is None or parsed[0] >= self._own_verdict[0]):
                self._own_verdict = parsed
            self._verdict = line.encode()[:MAX_MARK_BYTES]
        self._wake.set()

    def verdict_since(self, ts: float) -> str | None:
        with self._lock:
            known = [v for v in (self._own_verdict, self._verdict_read) if v is not None]
        newest = max(known, key=lambda v: v[0]) if known else None
        return newest[1] if newest is not None and newest[0] >= ts else None
