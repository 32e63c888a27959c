"""EtcdSignals over an in-memory store (a fake clock, :meth:`EtcdSignals.pump` driven by the test): hostile values are
ignored, an outage neither raises nor leaves stale beats to be judged, a lost lease is replaced, no call of the
interface touches the store, and ``elastic.signals`` picks the transport."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from discovery.registry import LeaseLost, RegistryUnavailable
from elastictrain import envnames
from elastictrain.config import etcd_transport, load_config
from elastictrain.engine.health import transport
from elastictrain.engine.health.etcd_signals import (
    BEATS_REFRESH_SECONDS,
    FAILURE,
    LEASE_SECONDS,
    MIRROR_STALE_SECONDS,
    VERDICT,
    EtcdSignals,
    lease_ttl,
    signals_prefix,
)
from elastictrain.engine.health.signals import (
    MAX_BEAT_BYTES,
    WAITING,
    Beat,
    FileSignals,
    Member,
)
from elastictrain.engine.health.transport import open_signals
from elastictrain.errors import ConfigError
from tests.fixtures.clock import FakeClock

PREFIX = signals_prefix("/elastictrain", "job")
MEMBERS = [Member(0, "a", 0, 10), Member(1, "b", 0, 11)]


class MemStore:
    """A :class:`~elastictrain.engine.health.etcd_signals.SignalStore` in a dict; ``down`` makes every call fail,
    ``gate`` (when set) makes every call wait for it."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[bytes, int, int]] = {}
        self.leases: set[int] = set()
        self.revision = 0
        self.down = False
        self.calls = 0
        self.gate: threading.Event | None = None

    def _check(self) -> None:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait()
        if self.down:
            raise RegistryUnavailable("etcd at http://127.0.0.1:1 did not answer: down")

    def grant_lease(self, ttl_seconds: int) -> int:
        self._check()
        self.revision += 1
        lease = 1000 + self.revision
        self.leases.add(lease)
        return lease

    def keep_alive(self, lease_id: int) -> float:
        self._check()
        if lease_id not in self.leases:
            raise LeaseLost(f"lease {lease_id:x} not found")
        return 10.0

    def revoke_lease(self, lease_id: int) -> None:
        self._check()
        self.expire(lease_id)

    def expire(self, lease_id: int) -> None:
        self.leases.discard(lease_id)
        for k in [k for k, v in self.keys.items() if v[2] == lease_id]:
            del self.keys[k]

    def put(self, key: str, value: bytes, lease_id: int = 0) -> None:
        self._check()
        if lease_id and lease_id not in self.leases:
            raise RegistryUnavailable("etcd failed Put: requested lease not found")
        self.revision += 1
        self.keys[key] = (value, self.revision, lease_id)

    def get_prefix(self, prefix: str, limit: int) -> list[tuple[str, bytes, int]]:
        self._check()
        rows = sorted((k, v[0], v[1]) for k, v in self.keys.items() if k.startswith(prefix))
        return rows[:limit]

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[bytes, int]]:
        self._check()
        return {k: self.keys[k][:2] for k in keys if k in self.keys}

    def delete_if(self, key: str, mod_revision: int) -> bool:
        self._check()
        if key in self.keys and self.keys[key][1] == mod_revision:
            del self.keys[key]
            return True
        return False

    def close(self) -> None:
        pass


def beat(host: str = "a", pid: int = 10, *, ts: float = 1000.0) -> Beat:
    return Beat(pid=pid, host=host, slot=0, boot_id="boot", created=1.0, ts=ts, phase=WAITING, since=ts, steps=3)


def signals(store: MemStore, clock: FakeClock) -> EtcdSignals:
    return EtcdSignals(store, PREFIX, clock=clock)


def read_now(s: EtcdSignals, clock: FakeClock) -> dict[tuple[str, int], Beat]:
    """Ask for the beats (so that the next cycle reads them), run a cycle, and read the mirror."""
    s.read_beats(MEMBERS)
    clock.advance(BEATS_REFRESH_SECONDS)
    s.pump()
    return s.read_beats(MEMBERS)


def test_a_beat_written_by_one_worker_is_read_by_another_once_the_thread_has_cycled() -> None:
    store, clock = MemStore(), FakeClock()
    writer, reader = signals(store, clock), signals(store, clock)
    writer.write_beat(beat("a", 10))
    assert store.calls == 0, "write_beat itself never calls etcd"
    writer.pump()
    value, _, lease = store.keys[f"{PREFIX}beats/a-0"]
    assert lease in store.leases and Beat.parse(value) == beat("a", 10)
    assert read_now(reader, clock) == {("a", 0): beat("a", 10)}


@pytest.mark.parametrize(
    "value",
    [
        b"garbage",
        b"\xff\xfe",
        b"[1, 2]",
        json.dumps({**json.loads(beat("a").to_json()), "pid": "10"}).encode(),  # a wrong type
        json.dumps({**json.loads(beat("a").to_json()), "ts": None}).encode(),
        json.dumps({**json.loads(beat("a").to_json()), "phase": "dancing"}).encode(),
        json.dumps({**json.loads(beat("a").to_json()), "pad": "x" * MAX_BEAT_BYTES}).encode(),  # too big
        beat("b").to_json().encode(),  # host b's beat under a's key
    ],
    ids=["garbage", "not-utf8", "not-an-object", "pid-str", "ts-null", "bad-phase", "huge", "misnamed"],
)
def test_a_hostile_heartbeat_value_in_etcd_is_ignored(value: bytes) -> None:
    store, clock = MemStore(), FakeClock()
    store.put(f"{PREFIX}beats/a-0", value)
    reader = signals(store, clock)
    assert read_now(reader, clock) == {}
    assert reader.all_beats() == []


@pytest.mark.parametrize(
    "value", [b"garbage", b"nan host", b"inf host", b"-5 host", b"1e3" + b"0" * 500, b"\xff"], ids=repr
)
def test_a_hostile_failure_marker_or_verdict_is_ignored(value: bytes) -> None:
    store, clock = MemStore(), FakeClock()
    store.put(PREFIX + FAILURE, value)
    store.put(PREFIX + VERDICT, value if value != b"-5 host" else b"x" * 1000)
    reader = signals(store, clock)
    reader.pump()
    assert reader.last_failure() is None
    assert reader.verdict_since(0.0) is None


def test_failures_and_verdicts_travel_between_workers_and_the_newest_verdict_counts() -> None:
    store, clock = MemStore(), FakeClock()
    one, two = signals(store, clock), signals(store, clock)
    one.record_failure("a")
    assert one.last_failure() is not None, "a worker knows its own failure at once"
    one.pump()
    clock.advance(1.0)
    two.pump()
    assert two.last_failure() == one.last_failure()
    one.record_verdict("host b rank 1 (pid 11): no heartbeat for 5.0s\nsecond line", at=2000.0)
    one.pump()
    clock.advance(1.0)
    two.pump()
    assert two.verdict_since(2000.0) == "host b rank 1 (pid 11): no heartbeat for 5.0s"
    assert two.verdict_since(2000.1) is None
    two.record_verdict("later", at=3000.0)
    assert two.verdict_since(2500.0) == "later"


def test_an_outage_raises_nothing_hides_stale_beats_and_writes_the_newest_beat_after_it() -> None:
    store, clock = MemStore(), FakeClock()
    writer, reader = signals(store, clock), signals(store, clock)
    writer.write_beat(beat("a", 10, ts=1.0))
    writer.pump()
    assert ("a", 0) in read_now(reader, clock)
    store.down = True
    writer.write_beat(beat("a", 10, ts=2.0))
    writer.write_beat(beat("a", 10, ts=3.0))
    writer.record_failure("a")
    writer.pump()  # fails: queued again
    reader.pump()
    assert ("a", 0) in reader.read_beats(MEMBERS), "a mirror read just now still counts"
    clock.advance(MIRROR_STALE_SECONDS + 0.1)
    reader.pump()
    assert reader.read_beats(MEMBERS) == {} and reader.all_beats() == [], "stale beats are no beats: none is judged"
    store.down = False
    writer.pump()
    assert Beat.parse(store.keys[f"{PREFIX}beats/a-0"][0]).ts == 3.0, "the newest beat, once etcd answers"
    assert PREFIX + FAILURE in store.keys
    assert read_now(reader, clock)[("a", 0)].ts == 3.0


def test_a_lost_lease_is_replaced_and_the_beat_written_again() -> None:
    store, clock = MemStore(), FakeClock()
    s = signals(store, clock)
    s.write_beat(beat("a", 10, ts=1.0))
    s.pump()
    first = store.keys[f"{PREFIX}beats/a-0"][2]
    store.expire(first)  # etcd dropped it (this worker was stopped longer than the TTL)
    assert f"{PREFIX}beats/a-0" not in store.keys
    s.write_beat(beat("a", 10, ts=2.0))
    s.pump()  # the put fails: lease not found
    s.pump()
    value, _, lease = store.keys[f"{PREFIX}beats/a-0"]
    assert lease != first and lease in store.leases and Beat.parse(value).ts == 2.0


def test_the_lease_is_kept_alive_every_third_of_its_ttl() -> None:
    store, clock = MemStore(), FakeClock()
    s = signals(store, clock)
    s.write_beat(beat())
    s.pump()
    assert s.ops["keepalive"] == 0
    clock.advance(LEASE_SECONDS / 3)
    s.pump()
    assert s.ops["keepalive"] == 1


def test_remove_beat_drops_only_the_beat_of_that_pid() -> None:
    store, clock = MemStore(), FakeClock()
    s = signals(store, clock)
    s.write_beat(beat("a", 10))
    s.pump()
    s.remove_beat("a", 0, 99)
    s.pump()
    assert f"{PREFIX}beats/a-0" in store.keys, "another process's beat stays"
    s.remove_beat("a", 0, 10)
    s.pump()
    assert f"{PREFIX}beats/a-0" not in store.keys


def test_no_call_of_the_interface_waits_for_etcd() -> None:
    store, clock = MemStore(), FakeClock()
    store.gate = threading.Event()  # every etcd call blocks until the test ends
    s = signals(store, clock).start()
    try:
        t0 = time.perf_counter()
        for i in range(100):
            s.write_beat(beat(ts=float(i)))
            s.record_failure("a")
            s.record_verdict("why")
            s.read_beats(MEMBERS)
            s.all_beats()
            s.last_failure()
            s.verdict_since(0.0)
        assert time.perf_counter() - t0 < 1.0
    finally:
        store.gate.set()
        s.stop()


def test_the_lease_outlives_every_silence_the_detectors_wait_for() -> None:
    assert lease_ttl(None) == LEASE_SECONDS
    assert lease_ttl(5.0) == LEASE_SECONDS
    assert lease_ttl(400.0) == 800


def test_the_transport_is_chosen_by_elastic_signals_and_the_environment() -> None:
    with_etcd = {envnames.ETCD: "http://127.0.0.1:2379", envnames.JOB: "job"}
    assert etcd_transport("elastic.signals", "files", with_etcd) == "files"
    assert etcd_transport("elastic.signals", "etcd", with_etcd) == "etcd"
    assert etcd_transport("elastic.signals", "auto", with_etcd) == "etcd"
    assert etcd_transport("elastic.signals", "auto", {}) == "files"
    with pytest.raises(ConfigError, match=r"^elastic.signals is etcd but ELASTICTRAIN_ETCD is not set"):
        etcd_transport("elastic.signals", "etcd", {})
    with pytest.raises(ConfigError, match=r"^elastic.outputs must be one of auto, files, etcd, got 'disk'"):
        etcd_transport("elastic.outputs", "disk", with_etcd)


def test_a_bad_elastic_signals_value_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"job: j\nrun_dir: {tmp_path}\n")
    assert load_config(path).elastic.signals == "files", "the default keeps today's files"
    with pytest.raises(ConfigError, match=r"elastic\.signals"):
        load_config(path, ["elastic.signals=nfs"])


def test_open_signals_gives_files_by_default_and_one_etcd_object_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "_OPENED", {})
    monkeypatch.setattr(EtcdSignals, "start", lambda self: self)  # no thread: a unit test opens no connection
    path = tmp_path / "job.yaml"
    path.write_text(f"job: j\nrun_dir: {tmp_path / 'run'}\n")
    assert isinstance(open_signals(load_config(path)), FileSignals)
    cfg = load_config(path, ["elastic.signals=etcd", "elastic.hang_seconds=400"])
    env = {envnames.ETCD: "http://127.0.0.1:1", envnames.JOB: "other", envnames.ETCD_PREFIX: "/p"}
    first = open_signals(cfg, env)
    assert isinstance(first, EtcdSignals) and first.prefix == "/p/other/signals/" and first.lease_seconds == 800
    assert open_signals(cfg, env) is first
    with pytest.raises(ConfigError):
        open_signals(cfg, {envnames.ETCD: "not a url", envnames.JOB: "j"})
