"""Host registry: the membership store behind an abstract class, on etcd v3 or in memory.

Every method maps to one atomic etcd operation (named in its docstring), so an implementation over
another store knows exactly what it must provide. All methods are synchronous; ``EtcdRegistry``
runs the async ``aetcd`` client on a private event loop.

Size: the registry's contract and its two implementations (etcd, in memory), kept together so they stay alike.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from discovery.endpoints import EtcdAccess, parse_endpoints
from discovery.record import (
    DEFAULT_PREFIX,
    DRAINING,
    READY,
    HostRecord,
    MalformedRecord,
    check_drain_reason,
    check_name,
    drop_case_duplicates,
    host_key,
    hosts_prefix,
)
from elastictrain.errors import RegistryError as RegistryError
from elastictrain.errors import RegistryUnavailable as RegistryUnavailable

T = TypeVar("T")


class LeaseLost(RegistryError):
    """The lease expired or was revoked (or the store lost it); its keys are gone."""


class HostNotFound(RegistryError):
    """No key for the host."""


class BelowMinNp(RegistryError):
    """An eviction refused: the hosts discovery would still list as ready would hold fewer slots than min_np."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A host record as read, with what a compare-and-set needs."""

    record: HostRecord
    mod_revision: int
    """Revision of the last write of the key: the compare in :meth:`HostRegistry.compare_and_set`."""
    lease_id: int
    """Lease the key is attached to (0: none)."""


@dataclass(frozen=True, slots=True)
class Listing:
    """All hosts of a job: parsed entries sorted by host, and values that failed to parse."""

    entries: list[Entry] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    """One message per skipped value, naming the host and what is wrong."""

    @classmethod
    def of(cls, entries: list[Entry], malformed: list[str]) -> Listing:
        """A listing of parsed ``entries``, with hosts that differ only in case reduced to one
        (:func:`discovery.wire.drop_case_duplicates`, the rule ``discover.sh`` applies too)."""
        kept, duplicates = drop_case_duplicates(entries, lambda e: e.record.host)
        return cls(kept, [*malformed, *duplicates])


class HostRegistry(abc.ABC):
    """Membership of one job's hosts under ``<prefix>/<job>/hosts/<host>``.

    An agent calls :meth:`grant_lease`, then :meth:`register` under that lease, then
    :meth:`keep_alive` every heartbeat; a dead agent's key disappears when its lease runs out.
    State changes (drain, undrain, an eviction and its readmission) go through :meth:`compare_and_set` so that
    concurrent writers (the agent, an operator, an evicting rank 0) never overwrite each other blindly.
    """

    def __init__(self, job: str, prefix: str = DEFAULT_PREFIX) -> None:
        self.job = check_name("job", job)
        self.prefix = prefix

    def key(self, host: str) -> str:
        return host_key(self.prefix, self.job, host)

    @abc.abstractmethod
    def grant_lease(self, ttl_seconds: int) -> int:
        """Create a lease that expires ``ttl_seconds`` after its last keep-alive; return its id.

        Atomic operation: LeaseGrant.
        """

    @abc.abstractmethod
    def keep_alive(self, lease_id: int) -> float:
        """Refresh the lease; return the TTL it now has. Call once per heartbeat.

        Atomic operation: one LeaseKeepAlive round trip. Raises :class:`LeaseLost` when the lease
        no longer exists (expired, revoked, or the store lost its data).
        """

    @abc.abstractmethod
    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease, deleting every key attached to it in the same step.

        Atomic operation: LeaseRevoke. Revoking an unknown lease is not an error.
        """

    @abc.abstractmethod
    def register(self, record: HostRecord, lease_id: int) -> bool:
        """Create the host's key under ``lease_id`` unless the key exists; return whether it did.

        Atomic operation: create-if-absent, a Txn comparing the key's create_revision with 0 whose
        success branch is a Put with the lease attached.
        """

    @abc.abstractmethod
    def get(self, host: str) -> Entry | None:
        """The host's entry, or ``None`` when there is no key.

        Atomic operation: Range on one key. Raises :class:`discovery.record.MalformedRecord` when
        the value does not parse.
        """

    @abc.abstractmethod
    def list_hosts(self) -> Listing:
        """Every host of the job, malformed values reported rather than raised.

        Atomic operation: one Range over the prefix (a consistent snapshot).
        """

    @abc.abstractmethod
    def compare_and_set(self, entry: Entry, record: HostRecord, *, unchanged: Sequence[Entry] = ()) -> bool:
        """Replace the value read as ``entry`` with ``record``, keeping the key's lease, provided the keys read as
        ``unchanged`` (other hosts a decision counted on) are still as read.

        Atomic operation: compare-and-set, a Txn comparing the mod_revision of the key and of every key of
        ``unchanged`` with the one read, whose success branch is a Put with ``entry.lease_id``. Returns False
        when any of them changed (or vanished) since it was read; the caller re-reads and decides again.
        """

    @abc.abstractmethod
    def delete(self, host: str) -> bool:
        """Delete the host's key; return whether it existed. The lease stays (its agent notices).

        Atomic operation: DeleteRange on one key.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The registry is unusable afterwards."""

    def __enter__(self) -> HostRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def set_state(registry: HostRegistry, host: str, state: str, attempts: int = 5) -> tuple[str, str]:
    """Set a host's state as an operator does (``hosts drain`` / ``undrain``), with compare-and-set, re-reading
    on conflict up to ``attempts`` times.

    The result is never a timed eviction: ``drain_reason`` and ``drain_until`` are cleared (``evictions`` is
    kept), so ``undrain`` of an evicted host readmits it at once and ``drain`` of one keeps it draining until
    an ``undrain``. Returns ``(old_state, new_state)``. Raises :class:`HostNotFound` or :class:`RegistryError`.
    """
    for _ in range(attempts):
        entry = registry.get(host)
        if entry is None:
            raise HostNotFound(f"no host {host!r} in job {registry.job!r}")
        wanted = entry.record.with_state(state)
        if entry.record == wanted:
            return state, state
        if registry.compare_and_set(entry, wanted):
            return entry.record.state, state
    raise RegistryError(f"host {host!r} changed concurrently {attempts} times; try again")


def evict(
    registry: HostRegistry,
    host: str,
    *,
    reason: str,
    cooldown_seconds: float,
    now: float,
    min_np: int,
    attempts: int = 5,
) -> HostRecord:
    """Drain a ready host for ``cooldown_seconds`` (a straggler, a hung worker); return its record as it is now.

    Call from the process that decided the eviction (rank 0), any number of times: the host is set, with
    compare-and-set (re-reading on conflict up to ``attempts`` times, keeping the key's lease), to
    ``state=draining, drain_reason=reason, drain_until=now + cooldown_seconds, evictions + 1``. Discovery
    stops listing it at once, so Horovod removes it as it removes a host on a spot notice; the host's own
    agent marks it ``ready`` again once the wall clock reaches ``drain_until``, whether or not the evicting
    process still runs. ``now`` is the caller's Unix time (``time.time()``).

    A host already draining is returned unchanged: the same eviction asked again (several workers may ask at
    once), another eviction not yet readmitted by its agent, or a drain that is not an eviction (an operator's,
    SIGTERM's, a cordon's: those are never turned into a timed one).

    The job never falls below ``min_np`` through an eviction: the other hosts that discovery lists now (ready, not
    draining for any reason) must hold at least ``min_np`` slots, else :class:`BelowMinNp` is raised and nothing is
    written. The write is conditional on enough of those hosts' keys (:func:`floor_hosts`) being unchanged since they
    were counted, so one of them that starts draining meanwhile (a spot notice, another eviction) makes it count
    again. ``min_np=0`` checks nothing.

    Raises ``ValueError`` for a ``reason`` that is not a token of 1 to 32 of ``[a-z0-9_-]`` or a
    ``cooldown_seconds`` that is not finite and > 0, :class:`BelowMinNp` as above, and :class:`HostNotFound` or
    :class:`RegistryError` as :func:`set_state` does.
    """
    if not check_drain_reason(reason):
        raise ValueError("drain_reason of an eviction must not be empty")
    if not 0 < cooldown_seconds < float("inf"):
        raise ValueError(f"cooldown_seconds must be finite and > 0, got {cooldown_seconds!r}")
    for _ in range(attempts):
        listed = {e.record.host: e for e in registry.list_hosts().entries} if min_np > 0 else {}
        entry = listed[host] if host in listed else registry.get(host)
        if entry is None:
            raise HostNotFound(f"no host {host!r} in job {registry.job!r}")
        if entry.record.state == DRAINING:
            return entry.record
        ready = [e for h, e in listed.items() if h != host and e.record.state == READY]
        slots = sum(e.record.slots for e in ready)
        if slots < min_np:
            plural = "" if slots == 1 else "s"
            raise BelowMinNp(f"evicting host {host!r} would leave {slots} ready slot{plural} < min_np {min_np}")
        evicted = entry.record.evicted_until(reason, now + cooldown_seconds)
        if registry.compare_and_set(entry, evicted, unchanged=floor_hosts(ready, min_np)):
            return evicted
    raise RegistryError(f"host {host!r} changed concurrently {attempts} times; try again")


MAX_GUARDED_HOSTS = 100
"""Most hosts an eviction's write is conditional on: etcd refuses a Txn of more than 128 operations by default
(``--max-txn-ops``), compares included."""


def floor_hosts(ready: Sequence[Entry], min_np: int) -> list[Entry]:
    """The fewest of ``ready`` whose slots reach ``min_np`` (the largest first, then by name), at most
    :data:`MAX_GUARDED_HOSTS`: while they stay as read, the floor holds whatever the other hosts do. A floor that
    needs more hosts than that is guarded by the first of them and was checked for the rest when they were read."""
    chosen: list[Entry] = []
    slots = 0
    for e in sorted(ready, key=lambda e: (-e.record.slots, e.record.host)):
        if slots >= min_np or len(chosen) == MAX_GUARDED_HOSTS:
            break
        chosen.append(e)
        slots += e.record.slots
    return chosen


# --------------------------------------------------------------------------------------------------
# In memory (unit tests)


class InMemoryRegistry(HostRegistry):
    """A registry in a dict with etcd's semantics, its leases expiring by an injected clock.

    Tests drive time with ``clock`` (e.g. a ``FakeClock``), simulate an outage with
    ``available = False``, the loss of etcd's data with :meth:`lose_everything`, and garbage values
    with :meth:`put_raw`. Several registries may share one store (``store=other.store``).
    """

    def __init__(
        self,
        job: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        clock: Callable[[], float] = time.monotonic,
        store: _MemStore | None = None,
    ) -> None:
        super().__init__(job, prefix)
        self.clock = clock
        self.store = store if store is not None else _MemStore()
        self.available = True

    # -- test hooks
    def put_raw(self, host: str, value: bytes, lease_id: int = 0) -> None:
        """Write any bytes under the host's key (to test readers against garbage)."""
        self._check()
        self.store.put(self.key(host), value, lease_id)

    def lose_everything(self) -> None:
        """Forget all keys and leases, as an etcd restarted on an empty data dir would."""
        self.store.keys.clear()
        self.store.leases.clear()

    # -- HostRegistry
    def grant_lease(self, ttl_seconds: int) -> int:
        self._check()
        lease_id = next(self.store.lease_ids)
        self.store.leases[lease_id] = _MemLease(ttl_seconds, self.clock() + ttl_seconds)
        return lease_id

    def keep_alive(self, lease_id: int) -> float:
        self._check()
        lease = self.store.leases.get(lease_id)
        if lease is None:
            raise LeaseLost(f"lease {lease_id:x} not found")
        lease.expires_at = self.clock() + lease.ttl
        return float(lease.ttl)

    def revoke_lease(self, lease_id: int) -> None:
        self._check()
        self.store.drop_lease(lease_id)

    def register(self, record: HostRecord, lease_id: int) -> bool:
        self._check()
        if lease_id not in self.store.leases:
            raise LeaseLost(f"lease {lease_id:x} not found")
        key = self.key(record.host)
        if key in self.store.keys:
            return False
        self.store.put(key, record.to_json(), lease_id)
        return True

    def get(self, host: str) -> Entry | None:
        self._check()
        item = self.store.keys.get(self.key(host))
        if item is None:
            return None
        value, mod_revision, lease_id = item
        return Entry(HostRecord.from_json(host, value), mod_revision, lease_id)

    def list_hosts(self) -> Listing:
        self._check()
        start = hosts_prefix(self.prefix, self.job)
        entries: list[Entry] = []
        malformed: list[str] = []
        for key in sorted(k for k in self.store.keys if k.startswith(start)):
            value, mod_revision, lease_id = self.store.keys[key]
            try:
                record = HostRecord.from_json(key[len(start) :], value)
            except MalformedRecord as e:
                malformed.append(str(e))
                continue
            entries.append(Entry(record, mod_revision, lease_id))
        return Listing.of(entries, malformed)

    def compare_and_set(self, entry: Entry, record: HostRecord, *, unchanged: Sequence[Entry] = ()) -> bool:
        self._check()
        for read in (entry, *unchanged):
            item = self.store.keys.get(self.key(read.record.host))
            if item is None or item[1] != read.mod_revision:
                return False
        self.store.put(self.key(record.host), record.to_json(), entry.lease_id)
        return True

    def delete(self, host: str) -> bool:
        self._check()
        return self.store.keys.pop(self.key(host), None) is not None

    def _check(self) -> None:
        if not self.available:
            raise RegistryUnavailable("in-memory registry marked unavailable")
        self.store.expire(self.clock())


@dataclass(slots=True)
class _MemLease:
    ttl: int
    expires_at: float


@dataclass(slots=True)
class _MemStore:
    keys: dict[str, tuple[bytes, int, int]] = field(default_factory=dict)  # value, mod_revision, lease
    leases: dict[int, _MemLease] = field(default_factory=dict)
    revision: int = 1
    lease_ids: itertools.count = field(default_factory=lambda: itertools.count(0x1000))

    def put(self, key: str, value: bytes, lease_id: int) -> None:
        self.revision += 1
        self.keys[key] = (value, self.revision, lease_id)

    def drop_lease(self, lease_id: int) -> None:
        if self.leases.pop(lease_id, None) is not None:
            self.revision += 1
            for key in [k for k, v in self.keys.items() if v[2] == lease_id]:
                del self.keys[key]

    def expire(self, now: float) -> None:
        for lease_id in [i for i, lease in self.leases.items() if lease.expires_at <= now]:
            self.drop_lease(lease_id)


# --------------------------------------------------------------------------------------------------
# etcd v3 (aetcd)


MAX_RECEIVE_BYTES = 64 << 20
"""Largest etcd answer a client takes (a Range over many keys)."""


class EtcdRegistry(HostRegistry):
    """The registry on etcd v3 through ``aetcd``, with a synchronous facade.

    Each call is bounded by ``timeout_seconds``; a timeout or a connection failure raises
    :class:`RegistryUnavailable`, after which the next call reconnects (to the next endpoint when
    several are given). ``access`` adds TLS (``https://`` endpoints: the CA file, a client
    certificate) and etcd's user authentication; the password is read from its file at each
    connection, and an auth token etcd no longer knows (it restarted) is renewed by logging in again.
    """

    def __init__(
        self,
        endpoints: str,
        job: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        timeout_seconds: float = 2.0,
        access: EtcdAccess | None = None,
    ) -> None:
        super().__init__(job, prefix)
        self.endpoints = parse_endpoints(endpoints)
        self.access = (access or EtcdAccess()).check(self.endpoints)
        self.timeout_seconds = timeout_seconds
        self._endpoint_index = 0
        self._loop = asyncio.new_event_loop()
        self._client: Any = None

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._endpoint_index].url

    def _connect(self) -> Any:
        if self._client is None:
            endpoint = self.endpoints[self._endpoint_index]
            try:
                password = self.access.password()
            except ValueError as e:
                raise RegistryError(str(e)) from None
            self._client = _client_class()(
                host=endpoint.host,
                port=endpoint.port,
                username=self.access.user,
                password=password,
                timeout=max(1, round(self.timeout_seconds)),
                # Reconnect soon after an outage instead of gRPC's default backoff of up to 2 min.
                options={
                    "grpc.initial_reconnect_backoff_ms": 100,
                    "grpc.max_reconnect_backoff_ms": 1000,
                    # A Range over the outbox returns up to rundir.outbox.COLLECT_KEYS chunks (gRPC's default is 4 MiB).
                    "grpc.max_receive_message_length": MAX_RECEIVE_BYTES,
                },
                tls=self.access if endpoint.tls else None,
            )
        return self._client

    def _reset(self, *, next_endpoint: bool = True) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing a broken channel may fail in many ways
                self._loop.run_until_complete(asyncio.wait_for(client.close(), 1.0))
        if next_endpoint:
            self._endpoint_index = (self._endpoint_index + 1) % len(self.endpoints)

    def _run(self, make: Callable[[Any], Coroutine[Any, Any, T]], what: str) -> T:
        import aetcd

        for attempt in (1, 2):
            client = self._connect()
            try:
                return self._loop.run_until_complete(asyncio.wait_for(make(client), self.timeout_seconds))
            except (TimeoutError, asyncio.TimeoutError, aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError) as e:
                endpoint = self.endpoint
                self._reset()
                raise RegistryUnavailable(f"etcd at {endpoint} did not answer {what}: {_describe(e)}") from None
            except aetcd.exceptions.UnauthenticatedError as e:
                # An auth token etcd no longer knows (it restarted, or the token expired): log in again, once.
                self._reset(next_endpoint=False)
                if attempt == 2:
                    raise RegistryError(f"etcd at {self.endpoint} refused {what}: {_describe(e)}") from None
            except aetcd.ClientError as e:
                if not client.connected:  # the log-in itself failed: drop the half-open channel
                    self._reset(next_endpoint=False)
                raise RegistryError(f"etcd at {self.endpoint} failed {what}: {_describe(e)}") from None
            except OSError as e:  # a TLS file vanished or became unreadable
                self._reset(next_endpoint=False)
                raise RegistryError(f"etcd at {self.endpoint}: cannot read a TLS file: {e}") from None
        raise AssertionError("unreachable")

    def grant_lease(self, ttl_seconds: int) -> int:
        lease = self._run(lambda c: c.lease(ttl_seconds), "LeaseGrant")
        return int(lease.id)

    def keep_alive(self, lease_id: int) -> float:
        reply = self._run(lambda c: c.refresh_lease(lease_id), "LeaseKeepAlive")
        if reply is None or reply.TTL <= 0:
            raise LeaseLost(f"lease {lease_id:x} not found")
        return float(reply.TTL)

    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._run(lambda c: c.revoke_lease(lease_id), "LeaseRevoke")
        except RegistryError as e:
            # Revoking an expired lease answers "lease not found": the work is already done.
            if isinstance(e, RegistryUnavailable) or "not found" not in str(e):
                raise

    def register(self, record: HostRecord, lease_id: int) -> bool:
        key = self.key(record.host).encode()

        async def txn(c: Any) -> bool:
            ok, _ = await c.transaction(
                compare=[c.transactions.create(key) == 0],
                success=[c.transactions.put(key, record.to_json(), lease=lease_id)],
                failure=[],
            )
            return bool(ok)

        try:
            return self._run(txn, "create-if-absent Txn")
        except RegistryError as e:
            if "lease not found" in str(e):
                raise LeaseLost(f"lease {lease_id:x} not found") from None
            raise

    def get(self, host: str) -> Entry | None:
        kv = self._run(lambda c: c.get(self.key(host).encode()), "Range")
        if kv is None:
            return None
        return Entry(HostRecord.from_json(host, kv.value), int(kv.mod_revision), int(kv.lease))

    def list_hosts(self) -> Listing:
        start = hosts_prefix(self.prefix, self.job)
        result = self._run(lambda c: c.get_prefix(start.encode()), "Range over prefix")
        entries: list[Entry] = []
        malformed: list[str] = []
        for kv in sorted(result, key=lambda kv: kv.key):
            host = kv.key.decode(errors="replace")[len(start) :]
            try:
                record = HostRecord.from_json(host, kv.value)
            except MalformedRecord as e:
                malformed.append(str(e))
                continue
            entries.append(Entry(record, int(kv.mod_revision), int(kv.lease)))
        return Listing.of(entries, malformed)

    def compare_and_set(self, entry: Entry, record: HostRecord, *, unchanged: Sequence[Entry] = ()) -> bool:
        key = self.key(record.host).encode()

        async def txn(c: Any) -> bool:
            ok, _ = await c.transaction(
                compare=[
                    c.transactions.mod(self.key(read.record.host).encode()) == read.mod_revision
                    for read in (entry, *unchanged)
                ],
                success=[c.transactions.put(key, record.to_json(), lease=entry.lease_id or None)],
                failure=[],
            )
            return bool(ok)

        try:
            return self._run(txn, "compare-and-set Txn")
        except RegistryError as e:
            if "lease not found" in str(e):  # the lease expired between read and write
                return False
            raise

    def delete(self, host: str) -> bool:
        result = self._run(lambda c: c.delete(self.key(host).encode()), "DeleteRange")
        return result is not None

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._reset()
        finally:
            self._loop.close()


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_CLIENT_CLASS: Any = None


def _client_class() -> Any:
    """``aetcd.Client`` that can also speak TLS (aetcd 1.0 opens plaintext channels only); built on first use."""
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        import aetcd  # deferred: grpc takes ~100 ms to import
        import grpc
        from aetcd import rpc, watcher

        class Client(aetcd.Client):
            """Opens a TLS channel when given ``tls``; logs in with the user name and password when given.

            Replaces ``aetcd.Client.connect`` as a whole (aetcd 1.0 has no hook for the channel) and leaves
            the same attributes set; a failed log-in closes its channel.
            """

            def __init__(self, *args: Any, tls: EtcdAccess | None = None, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self._tls = tls

            @property
            def connected(self) -> bool:
                return bool(self._connected.is_set())

            async def connect(self) -> None:
                if self._connected.is_set():
                    return
                target = f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"
                options = list(self._options.items())
                if self._tls is not None:
                    credentials = grpc.ssl_channel_credentials(
                        root_certificates=_read(self._tls.cacert),
                        private_key=_read(self._tls.key),
                        certificate_chain=_read(self._tls.cert),
                    )
                    channel = rpc.secure_channel(target, credentials, options=options)
                else:
                    channel = rpc.insecure_channel(target, options=options)
                metadata = None
                try:
                    if self._username is not None:
                        request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                        reply = await rpc.AuthStub(channel).Authenticate(request, timeout=self._timeout)
                        metadata = (("token", reply.token),)
                except BaseException as e:
                    await channel.close()
                    if isinstance(e, rpc.AioRpcError):
                        aetcd.exceptions._handle_exception(e)
                    raise
                self.channel, self.metadata = channel, metadata
                self.auth_stub = rpc.AuthStub(channel)
                self.kvstub = rpc.KVStub(channel)
                self.clusterstub = rpc.ClusterStub(channel)
                self.leasestub = rpc.LeaseStub(channel)
                self.maintenancestub = rpc.MaintenanceStub(channel)
                self._watcher = watcher.Watcher(rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata)
                self._connected.set()

        _CLIENT_CLASS = Client
    return _CLIENT_CLASS


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()
