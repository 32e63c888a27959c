"""discovery.kv's etcd keys when etcd is gone: every call fails with the registry's one-line errors, as the
registry's own calls do (a collector or a signals thread catches RegistryError, never gRPC's)."""

from __future__ import annotations

import pytest

from discovery.kv import EtcdKeyValue
from discovery.registry import RegistryError, RegistryUnavailable
from elastictrain.launcher.processes import free_port


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.get_prefix("/elastictrain/job/outbox/", 10),
        lambda s: s.put("/elastictrain/job/outbox/k", b"v"),
        lambda s: s.get_keys(["/elastictrain/job/outbox/k"]),
        lambda s: s.delete_if("/elastictrain/job/outbox/k", 3),
    ],
    ids=["get_prefix", "put", "get_keys", "delete_if"],
)
def test_every_call_on_an_etcd_that_is_not_there_is_a_registry_error(call) -> None:
    store = EtcdKeyValue(f"http://127.0.0.1:{free_port()}", "job", timeout_seconds=1.0)
    try:
        with pytest.raises(RegistryError) as e:
            call(store)
        assert isinstance(e.value, RegistryUnavailable) or "failed" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        store.close()
