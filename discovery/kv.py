"""Plain keys of one job in etcd, beside its host records: what the workers and the launcher exchange through it.

:class:`KeyValue` is the few operations they need, one etcd round trip each; :class:`EtcdKeyValue` provides them on the
registry's connection (endpoints, TLS, auth, timeouts, failover: :class:`~discovery.registry.EtcdRegistry`), and
:class:`MemoryKeyValue` in memory for unit tests. Every method raises :class:`~discovery.registry.RegistryError` (one
line) on failure. :func:`from_env` opens the job the environment names, as ``discover.sh`` reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from discovery.registry import EtcdRegistry, RegistryError


class KeyValue(Protocol):
    """The key operations beside the registry's (all raise ``RegistryError`` on failure)."""

    def put(self, key: str, value: bytes, lease_id: int = 0) -> None:
        """Put (with the lease when not 0)."""

    def get_prefix(self, prefix: str, limit: int) -> list[tuple[str, bytes, int]]:
        """Range over ``prefix``, at most ``limit`` keys: (key, value, mod_revision), by key."""

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[bytes, int]]:
        """Txn of one Range per key: the keys that exist, as (value, mod_revision)."""

    def delete_if(self, key: str, mod_revision: int) -> bool:
        """Txn: delete ``key`` if its mod_revision is still ``mod_revision``."""

    def close(self) -> None: ...


class EtcdKeyValue(EtcdRegistry):
    """:class:`KeyValue` on etcd, with the registry's leases (``grant_lease``, ``keep_alive``, ``revoke_lease``)."""

    def put(self, key: str, value: bytes, lease_id: int = 0) -> None:
        self._run(lambda c: c.put(key.encode(), value, lease=lease_id or None), "Put")

    def get_prefix(self, prefix: str, limit: int) -> list[tuple[str, bytes, int]]:
        from aetcd import rpc, utils

        start = prefix.encode()
        request = rpc.RangeRequest(key=start, range_end=utils.prefix_range_end(start), limit=limit)

        async def get(c: Any) -> list[tuple[str, bytes, int]]:
            await c.connect()
            try:
                reply = await c.kvstub.Range(request, timeout=c._timeout, metadata=c.metadata)
            except Exception as e:
                from aetcd.exceptions import _handle_exception

                _handle_exception(e)
            return [(kv.key.decode(errors="replace"), bytes(kv.value), int(kv.mod_revision)) for kv in reply.kvs]

        return self._run(get, "Range over prefix")

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[bytes, int]]:
        async def txn(c: Any) -> dict[str, tuple[bytes, int]]:
            _, replies = await c.transaction(
                compare=[], success=[c.transactions.get(k.encode()) for k in keys], failure=[]
            )
            out = {}
            for reply in replies:
                for value, kv in reply:
                    out[kv.key.decode(errors="replace")] = (bytes(value), int(kv.mod_revision))
            return out

        return self._run(txn, "Txn of Ranges")

    def delete_if(self, key: str, mod_revision: int) -> bool:
        async def txn(c: Any) -> bool:
            ok, _ = await c.transaction(
                compare=[c.transactions.mod(key.encode()) == mod_revision],
                success=[c.transactions.delete(key.encode())],
                failure=[],
            )
            return bool(ok)

        return self._run(txn, "compare-and-delete Txn")


class MemoryKeyValue:
    """:class:`KeyValue` in memory (unit tests): revisions grow by one per change; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.data: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.down = False
        self.puts = 0
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            raise RegistryError("etcd unreachable (test)")

    def put(self, key: str, value: bytes, lease_id: int = 0) -> None:
        with self._lock:
            self._check()
            self.revision += 1
            self.puts += 1
            self.data[key] = (bytes(value), self.revision)

    def get_prefix(self, prefix: str, limit: int) -> list[tuple[str, bytes, int]]:
        with self._lock:
            self._check()
            found = sorted((k, v, r) for k, (v, r) in self.data.items() if k.startswith(prefix))
            return found[:limit]

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[bytes, int]]:
        with self._lock:
            self._check()
            return {k: self.data[k] for k in keys if k in self.data}

    def delete_if(self, key: str, mod_revision: int) -> bool:
        with self._lock:
            self._check()
            if key in self.data and self.data[key][1] == mod_revision:
                del self.data[key]
                self.revision += 1
                return True
            return False

    def close(self) -> None:
        pass


def from_env(env: Mapping[str, str], *, timeout_seconds: float = 2.0) -> tuple[EtcdKeyValue, str, str]:
    """The etcd of the job the environment names (``ELASTICTRAIN_ETCD``, ``_JOB``, ``_ETCD_PREFIX`` and the TLS/auth
    variables, as discover.sh reads them): ``(store, prefix, job)``. Raises ``ConfigError`` (one line) when they are
    unusable."""
    from discovery.discover import DiscoverConfig
    from elastictrain import envnames

    cfg = DiscoverConfig.from_env(env)
    store = EtcdKeyValue(env[envnames.ETCD], cfg.job, cfg.prefix, timeout_seconds=timeout_seconds, access=cfg.access)
    return store, cfg.prefix, cfg.job
