"""Registry semantics on the in-memory store, driven by a fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from discovery.record import DRAINING, READY, HostRecord, MalformedRecord
from discovery.registry import (
    BelowMinNp,
    Entry,
    HostNotFound,
    InMemoryRegistry,
    LeaseLost,
    RegistryError,
    RegistryUnavailable,
    evict,
    set_state,
)
from tests.fixtures.clock import FakeClock


def rec(host: str = "node-a", slots: int = 2, state: str = READY) -> HostRecord:
    return HostRecord(host=host, slots=slots, addr="127.0.0.1", state=state, pid=42, registered_at=1.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> InMemoryRegistry:
    return InMemoryRegistry("job1", clock=clock)


def test_registered_host_is_listed_under_its_key(registry: InMemoryRegistry) -> None:
    lease = registry.grant_lease(10)
    assert registry.register(rec(), lease)
    assert registry.key("node-a") == "/elastictrain/job1/hosts/node-a"
    (entry,) = registry.list_hosts().entries
    assert entry.record == rec()
    assert entry.lease_id == lease


def test_register_does_not_overwrite_an_existing_key(registry: InMemoryRegistry) -> None:
    first, second = registry.grant_lease(10), registry.grant_lease(10)
    assert registry.register(rec(slots=2), first)
    assert not registry.register(rec(slots=8), second)
    entry = registry.get("node-a")
    assert entry is not None and entry.record.slots == 2 and entry.lease_id == first


def test_host_disappears_when_its_lease_is_not_kept_alive(registry: InMemoryRegistry, clock: FakeClock) -> None:
    lease = registry.grant_lease(10)
    registry.register(rec(), lease)
    clock.advance(9)
    assert registry.keep_alive(lease) == 10
    clock.advance(9.9)
    assert registry.get("node-a") is not None
    clock.advance(0.1)
    assert registry.get("node-a") is None
    with pytest.raises(LeaseLost):
        registry.keep_alive(lease)


def test_revoking_a_lease_deletes_its_keys_only(registry: InMemoryRegistry) -> None:
    a, b = registry.grant_lease(10), registry.grant_lease(10)
    registry.register(rec("node-a"), a)
    registry.register(rec("node-b"), b)
    registry.revoke_lease(a)
    registry.revoke_lease(a)  # revoking twice is fine
    assert [e.record.host for e in registry.list_hosts().entries] == ["node-b"]


def test_register_under_a_lost_lease_fails(registry: InMemoryRegistry) -> None:
    lease = registry.grant_lease(10)
    registry.revoke_lease(lease)
    with pytest.raises(LeaseLost):
        registry.register(rec(), lease)


def test_compare_and_set_keeps_the_lease_and_fails_on_a_stale_read(registry: InMemoryRegistry) -> None:
    lease = registry.grant_lease(10)
    registry.register(rec(), lease)
    read = registry.get("node-a")
    assert read is not None
    assert registry.compare_and_set(read, read.record.with_state(DRAINING))
    assert not registry.compare_and_set(read, read.record.with_state(READY)), "stale mod_revision must lose"
    now = registry.get("node-a")
    assert now is not None and now.record.state == DRAINING and now.lease_id == lease
    registry.revoke_lease(lease)
    assert registry.get("node-a") is None, "the rewritten key still belongs to the lease"


def test_set_state_drains_and_undrains(registry: InMemoryRegistry) -> None:
    registry.register(rec(), registry.grant_lease(10))
    assert set_state(registry, "node-a", DRAINING) == (READY, DRAINING)
    assert set_state(registry, "node-a", DRAINING) == (DRAINING, DRAINING)
    assert set_state(registry, "node-a", READY) == (DRAINING, READY)
    with pytest.raises(HostNotFound):
        set_state(registry, "node-x", DRAINING)


def test_delete_removes_the_key_but_not_the_lease(registry: InMemoryRegistry) -> None:
    lease = registry.grant_lease(10)
    registry.register(rec(), lease)
    assert registry.delete("node-a")
    assert not registry.delete("node-a")
    assert registry.keep_alive(lease) == 10


def test_malformed_values_are_reported_not_raised_when_listing(registry: InMemoryRegistry) -> None:
    registry.register(rec("good"), registry.grant_lease(10))
    registry.put_raw("garbage", b"{not json")
    registry.put_raw("noslots", b'{"addr": "x"}')
    registry.put_raw("badstate", b'{"slots": 1, "state": "zombie"}')
    listing = registry.list_hosts()
    assert [e.record.host for e in listing.entries] == ["good"]
    assert len(listing.malformed) == 3
    assert any("garbage" in m and "not JSON" in m for m in listing.malformed)
    with pytest.raises(MalformedRecord):
        registry.get("garbage")


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        (b'{"slots": 1, "addr": "10.0.0.1", "registered_at": NaN}', "registered_at must be a finite Unix time"),
        (b'{"slots": 1, "addr": "10.0.0.1", "registered_at": Infinity}', "registered_at must be a finite Unix time"),
        (b'{"slots": 1, "addr": "10.0.0.1", "registered_at": -Infinity}', "registered_at must be a finite Unix time"),
        (b'{"slots": 1, "addr": "10.0.0.1", "registered_at": "yesterday"}', "registered_at must be a finite"),
        (b'{"slots": 1, "addr": "\\u001b[2J\\u001b[31mpwned"}', "invalid address"),
        (b'{"slots": 1, "addr": "a b"}', "invalid address"),
        (b'{"slots": 1, "addr": 7}', "invalid address"),
        (b'{"slots": 100000000000000000000000, "addr": "10.0.0.1"}', "slots must be an integer in [1, 4096]"),
        (b'{"slots": 4097, "addr": "10.0.0.1"}', "slots must be an integer in [1, 4096]"),
        (b'{"slots": 1, "addr": "10.0.0.1", "pid": "12; rm"}', "pid must be an integer"),
    ],
)
def test_hostile_values_are_skipped_with_a_message_that_stays_on_one_line(
    registry: InMemoryRegistry, value: bytes, complaint: str
) -> None:
    registry.register(rec("good"), registry.grant_lease(10))
    registry.put_raw("evil", value)
    listing = registry.list_hosts()
    assert [e.record.host for e in listing.entries] == ["good"]
    (message,) = listing.malformed
    assert complaint in message and "evil" in message
    assert message.isprintable(), "no newline, escape or other control character reaches a terminal"


def test_a_value_at_the_bounds_is_accepted(registry: InMemoryRegistry) -> None:
    registry.put_raw("big", b'{"slots": 4096, "addr": "fe80::1%eth0", "registered_at": 1.7e9, "pid": 4194304}')
    (entry,) = registry.list_hosts().entries
    assert (entry.record.slots, entry.record.addr) == (4096, "fe80::1%eth0")


def test_hosts_that_differ_only_in_case_are_listed_once_with_a_warning(registry: InMemoryRegistry) -> None:
    lease = registry.grant_lease(10)
    for host in ("node1", "NODE1", "Node1", "node2"):
        assert registry.register(rec(host), lease)
    listing = registry.list_hosts()
    assert [e.record.host for e in listing.entries] == ["NODE1", "node2"], "the first key in byte order wins"
    assert len(listing.malformed) == 2
    assert all("differs from 'NODE1' only in case" in m for m in listing.malformed)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"addr": "x\ny"},
        {"slots": 10**23},
        {"slots": 0},
        {"registered_at": float("nan")},
        {"registered_at": float("inf")},
    ],
)
def test_an_agent_cannot_write_a_record_readers_would_refuse(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        HostRecord(**{"host": "h", "slots": 1, "addr": "10.0.0.1", **kwargs})


def test_jobs_and_prefixes_do_not_see_each_other(registry: InMemoryRegistry, clock: FakeClock) -> None:
    other_job = InMemoryRegistry("job2", clock=clock, store=registry.store)
    other_prefix = InMemoryRegistry("job1", "/other", clock=clock, store=registry.store)
    registry.register(rec("node-a"), registry.grant_lease(10))
    assert other_job.list_hosts().entries == []
    assert other_prefix.list_hosts().entries == []


def test_an_unavailable_store_raises_a_typed_error(registry: InMemoryRegistry) -> None:
    registry.available = False
    with pytest.raises(RegistryUnavailable):
        registry.list_hosts()


def test_losing_everything_drops_keys_and_leases(registry: InMemoryRegistry) -> None:
    lease = registry.grant_lease(10)
    registry.register(rec(), lease)
    registry.lose_everything()
    assert registry.get("node-a") is None
    with pytest.raises(LeaseLost):
        registry.keep_alive(lease)


def test_record_round_trips_through_json() -> None:
    r = rec(state=DRAINING)
    assert HostRecord.from_json(r.host, r.to_json()) == r
    assert b'"host"' not in r.to_json(), "the key names the host"


@pytest.mark.parametrize("bad", ["", "a:b", "a/b", "-x", "h o", "..", ".hidden", "caf\u00e9", "x" * 254, "a\nb"])
def test_invalid_host_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid host name"):
        rec(bad)


# -- evictions: the record's fields and evict() -------------------------------------------------------


def test_a_value_written_before_the_eviction_fields_parses_with_their_defaults() -> None:
    r = HostRecord.from_json("node-a", b'{"slots": 2, "addr": "10.0.0.1", "state": "draining", "pid": 3}')
    assert (r.drain_reason, r.drain_until, r.evictions) == ("", 0.0, 0)
    assert not r.evicted, "an untimed drain (an operator's) is not an eviction"


def test_eviction_fields_round_trip_through_compact_json() -> None:
    evicted = replace(rec(state=DRAINING), drain_reason="straggler", drain_until=1.7e9 + 300, evictions=2)
    raw = evicted.to_json()
    assert b" " not in raw and b'"drain_reason":"straggler"' in raw and b'"evictions":2' in raw
    assert HostRecord.from_json("node-a", raw) == evicted and evicted.evicted


@pytest.mark.parametrize(
    ("field", "value", "complaint"),
    [
        ("drain_reason", "7", "drain_reason must be at most 32 of [a-z0-9_-]"),
        ("drain_reason", '"Straggler"', "drain_reason must be at most 32 of [a-z0-9_-]"),
        ("drain_reason", '"slow host"', "drain_reason must be at most 32 of [a-z0-9_-]"),
        ("drain_reason", '"\\u001b[31mred"', "drain_reason must be at most 32 of [a-z0-9_-]"),
        ("drain_reason", '"' + "x" * 33 + '"', "drain_reason must be at most 32 of [a-z0-9_-]"),
        ("drain_reason", "null", "drain_reason must be at most 32"),
        ("drain_until", "NaN", "drain_until must be a finite Unix time >= 0"),
        ("drain_until", "Infinity", "drain_until must be a finite Unix time >= 0"),
        ("drain_until", "-1", "drain_until must be a finite Unix time >= 0"),
        ("drain_until", "1e300", "drain_until must be a finite Unix time >= 0"),
        ("drain_until", '"soon"', "drain_until must be a finite Unix time >= 0"),
        ("drain_until", "true", "drain_until must be a finite Unix time >= 0"),
        ("evictions", "-1", "evictions must be an integer in [0, 2**31)"),
        ("evictions", "1.5", "evictions must be an integer in [0, 2**31)"),
        ("evictions", "100000000000000000000000", "evictions must be an integer in [0, 2**31)"),
        ("evictions", "false", "evictions must be an integer in [0, 2**31)"),
        ("evictions", '"2"', "evictions must be an integer in [0, 2**31)"),
    ],
)
def test_malformed_eviction_fields_are_rejected_with_a_one_line_message_naming_the_field(
    registry: InMemoryRegistry, field: str, value: str, complaint: str
) -> None:
    registry.put_raw("evil", f'{{"slots": 1, "addr": "10.0.0.1", "state": "draining", "{field}": {value}}}'.encode())
    listing = registry.list_hosts()
    assert listing.entries == []
    (message,) = listing.malformed
    assert complaint in message and "'evil'" in message
    assert message.isprintable()
    with pytest.raises(MalformedRecord, match=field):
        registry.get("evil")


def test_eviction_fields_at_their_bounds_are_accepted(registry: InMemoryRegistry) -> None:
    reason = "a-" + "z" * 29 + "_"
    registry.put_raw(
        "edge", f'{{"slots": 1, "drain_reason": "{reason}", "drain_until": 0, "evictions": 2147483647}}'.encode()
    )
    (entry,) = registry.list_hosts().entries
    assert (entry.record.drain_reason, entry.record.drain_until, entry.record.evictions) == (reason, 0.0, 2**31 - 1)


@pytest.mark.parametrize(
    "kwargs",
    [{"drain_reason": "Hung"}, {"drain_reason": "x" * 33}, {"drain_until": float("nan")}, {"drain_until": -1.0},
     {"evictions": -1}, {"evictions": 2**31}, {"evictions": True}],
)  # fmt: skip
def test_a_writer_cannot_build_an_eviction_readers_would_refuse(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        HostRecord(**{"host": "h", "slots": 1, "addr": "10.0.0.1", **kwargs})


NOW = 1.7e9


@pytest.fixture
def live(registry: InMemoryRegistry) -> int:
    """node-a registered ready under a 10 s lease; returns the lease."""
    lease = registry.grant_lease(10)
    registry.register(rec(), lease)
    return lease


def test_evict_drains_for_the_cooldown_counts_and_keeps_the_lease(registry: InMemoryRegistry, live: int) -> None:
    r = evict(registry, "node-a", reason="straggler", cooldown_seconds=300, now=NOW, min_np=0)
    assert (r.state, r.drain_reason, r.drain_until, r.evictions) == (DRAINING, "straggler", NOW + 300, 1)
    entry = registry.get("node-a")
    assert entry is not None and entry.record == r and entry.lease_id == live
    assert (entry.record.slots, entry.record.pid, entry.record.registered_at) == (2, 42, 1.0), "the rest is kept"


def test_evict_is_idempotent_while_the_eviction_is_in_force(registry: InMemoryRegistry, live: int) -> None:
    first = evict(registry, "node-a", reason="straggler", cooldown_seconds=300, now=NOW, min_np=0)
    revision = registry.store.revision
    for late in (0.0, 1.0, 299.0):  # several workers ask for the same eviction at once
        assert evict(registry, "node-a", reason="straggler", cooldown_seconds=300, now=NOW + late, min_np=0) == first
    assert registry.store.revision == revision, "nothing written"


def test_evict_never_overwrites_another_drain(registry: InMemoryRegistry, live: int) -> None:
    set_state(registry, "node-a", DRAINING)  # an operator's drain: never turned into a timed one
    operator = evict(registry, "node-a", reason="straggler", cooldown_seconds=300, now=NOW, min_np=0)
    assert (operator.state, operator.drain_reason, operator.drain_until, operator.evictions) == (DRAINING, "", 0.0, 0)
    set_state(registry, "node-a", READY)
    hung = evict(registry, "node-a", reason="hung", cooldown_seconds=60, now=NOW, min_np=0)
    assert evict(registry, "node-a", reason="straggler", cooldown_seconds=300, now=NOW, min_np=0) == hung, (
        "another eviction"
    )
    entry = registry.get("node-a")
    assert entry is not None and (entry.record.drain_reason, entry.record.evictions) == ("hung", 1)


def test_evict_counts_every_eviction_across_readmissions(registry: InMemoryRegistry, live: int) -> None:
    for n in (1, 2, 3):
        assert evict(registry, "node-a", reason="straggler", cooldown_seconds=10, now=NOW, min_np=0).evictions == n
        assert set_state(registry, "node-a", READY) == (DRAINING, READY)  # `hosts undrain`, or its agent readmits
        entry = registry.get("node-a")
        assert entry is not None
        assert (entry.record.drain_reason, entry.record.drain_until, entry.record.evictions) == ("", 0.0, n)


def test_operator_drain_of_an_evicted_host_drops_its_cooldown(registry: InMemoryRegistry, live: int) -> None:
    evict(registry, "node-a", reason="hung", cooldown_seconds=10, now=NOW, min_np=0)
    assert set_state(registry, "node-a", DRAINING) == (DRAINING, DRAINING)
    entry = registry.get("node-a")
    assert entry is not None and not entry.record.evicted and entry.record.evictions == 1


def test_evict_rereads_on_a_concurrent_write(registry: InMemoryRegistry, live: int) -> None:
    real = registry.compare_and_set
    calls: list[Entry] = []

    def racing(entry: Entry, record: HostRecord, **kwargs: object) -> bool:
        if not calls:  # someone else writes between our read and our write
            registry.store.put(registry.key("node-a"), rec(slots=4).to_json(), live)
        calls.append(entry)
        return real(entry, record, **kwargs)  # type: ignore[arg-type]

    registry.compare_and_set = racing  # type: ignore[method-assign]
    r = evict(registry, "node-a", reason="straggler", cooldown_seconds=5, now=NOW, min_np=0)
    assert len(calls) == 2 and r.slots == 4 and r.evictions == 1


def test_evict_refuses_unknown_hosts_bad_reasons_and_cooldowns(registry: InMemoryRegistry, live: int) -> None:
    with pytest.raises(HostNotFound):
        evict(registry, "node-x", reason="straggler", cooldown_seconds=5, now=NOW, min_np=0)
    for reason in ("", "Slow", "x" * 33):
        with pytest.raises(ValueError, match="drain_reason"):
            evict(registry, "node-a", reason=reason, cooldown_seconds=5, now=NOW, min_np=0)
    for cooldown in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cooldown_seconds must be finite and > 0"):
            evict(registry, "node-a", reason="hung", cooldown_seconds=cooldown, now=NOW, min_np=0)
    registry.compare_and_set = lambda entry, record, **kw: False  # type: ignore[method-assign]
    with pytest.raises(RegistryError, match="changed concurrently 5 times"):
        evict(registry, "node-a", reason="hung", cooldown_seconds=5, now=NOW, min_np=0)


def three_hosts(registry: InMemoryRegistry) -> int:
    """node-a, node-b and node-c, one slot each, ready under one 10 s lease; returns the lease."""
    lease = registry.grant_lease(10)
    for host in ("node-a", "node-b", "node-c"):
        registry.register(rec(host, slots=1), lease)
    return lease


def test_evict_refuses_to_leave_fewer_ready_slots_than_min_np_counting_only_ready_hosts(
    registry: InMemoryRegistry,
) -> None:
    three_hosts(registry)
    set_state(registry, "node-c", DRAINING)  # a spot notice: node-c is on its way out
    with pytest.raises(BelowMinNp, match="would leave 1 ready slot < min_np 2"):
        evict(registry, "node-a", reason="straggler", cooldown_seconds=300, now=NOW, min_np=2)
    entry = registry.get("node-a")
    assert entry is not None and entry.record.state == READY, "nothing written"
    assert evict(registry, "node-a", reason="straggler", cooldown_seconds=300, now=NOW, min_np=1).state == DRAINING


def test_evict_reads_again_when_another_host_drains_between_its_read_and_its_write(
    registry: InMemoryRegistry,
) -> None:
    lease = three_hosts(registry)
    real = registry.compare_and_set
    calls: list[Entry] = []

    def racing(entry: Entry, record: HostRecord, **kwargs: object) -> bool:
        if not calls:  # node-c drains (its agent got a notice) after our listing counted it ready
            registry.store.put(registry.key("node-c"), rec("node-c", slots=1, state=DRAINING).to_json(), lease)
        calls.append(entry)
        return real(entry, record, **kwargs)  # type: ignore[arg-type]

    registry.compare_and_set = racing  # type: ignore[method-assign]
    with pytest.raises(BelowMinNp):
        evict(registry, "node-a", reason="hung", cooldown_seconds=5, now=NOW, min_np=2)
    entry = registry.get("node-a")
    assert len(calls) == 1 and entry is not None and entry.record.state == READY


def test_evict_guards_only_as_many_ready_hosts_as_the_floor_needs(registry: InMemoryRegistry) -> None:
    """etcd refuses a Txn of more than 128 operations (--max-txn-ops): at 300 ready hosts the write is conditional on
    the fewest hosts whose slots reach min_np (the largest first), not on all of them."""
    lease = registry.grant_lease(10)
    for i in range(300):
        registry.register(rec(f"node-{i:03d}", slots=1 if i else 4), lease)
    real = registry.compare_and_set
    guarded: list[list[str]] = []

    def counting(entry: Entry, record: HostRecord, **kwargs: object) -> bool:
        guarded.append([e.record.host for e in kwargs.get("unchanged", ())])  # type: ignore[attr-defined]
        return real(entry, record, **kwargs)  # type: ignore[arg-type]

    registry.compare_and_set = counting  # type: ignore[method-assign]
    assert evict(registry, "node-299", reason="hung", cooldown_seconds=5, now=NOW, min_np=6).state == DRAINING
    assert guarded == [["node-000", "node-001", "node-002"]], "4 + 1 + 1 slots reach min_np 6"
