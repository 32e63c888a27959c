"""The workers' signals contract (:class:`~elastictrain.engine.health.signals.WorkerSignals`), one suite over both
transports: :class:`FileSignals` in a folder and :class:`EtcdSignals` on a real etcd (``etcd_server``). Two objects
play two workers; what one writes the other reads within a deadline (etcd's reads come from a thread's mirror).
Then what only etcd promises: a dead worker's beat goes with its lease, and an etcd outage raises nothing and hides
stale beats until etcd answers again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from chaos.procs import wait_until
from discovery.kv import EtcdKeyValue
from elastictrain.engine.health.etcd_signals import BEATS, EtcdSignals, signals_prefix
from elastictrain.engine.health.signals import WAITING, Beat, FileSignals, Member, WorkerSignals
from tests.fixtures.etcd import EtcdServer

pytestmark = pytest.mark.integration

JOB = "signals"
DEADLINE = 15.0


@dataclass
class Pair:
    one: WorkerSignals
    two: WorkerSignals
    put_beat_raw: Callable[[str, bytes], None]
    """Write any bytes as the heartbeat named ``<host>-<slot>`` (an untrusted writer)."""


def _etcd(server: EtcdServer, *, lease_seconds: int = 300) -> EtcdSignals:
    store = EtcdKeyValue(server.endpoint, JOB, timeout_seconds=1.0)
    return EtcdSignals(store, signals_prefix("/elastictrain", JOB), lease_seconds=lease_seconds, poll_seconds=0.05)


@pytest.fixture(params=["files", "etcd"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    if request.param == "files":
        one, two = FileSignals.in_folder(tmp_path), FileSignals.in_folder(tmp_path)

        def put_raw(name: str, value: bytes) -> None:
            one.heartbeats.folder.mkdir(parents=True, exist_ok=True)
            (one.heartbeats.folder / f"{name}.json").write_bytes(value)

        yield Pair(one, two, put_raw)
        return
    server: EtcdServer = request.getfixturevalue("etcd_server")
    e1, e2 = _etcd(server).start(), _etcd(server).start()
    raw = EtcdKeyValue(server.endpoint, JOB)
    try:
        yield Pair(e1, e2, lambda name, value: raw.put(f"{e1.prefix}{BEATS}{name}", value))
    finally:
        for s in (e1, e2):
            s.stop()
        raw.close()


def beat(host: str, pid: int, *, slot: int = 0, ts: float | None = None) -> Beat:
    now = time.time() if ts is None else ts
    return Beat(pid=pid, host=host, slot=slot, boot_id="boot", created=1.0, ts=now, phase=WAITING, since=now, steps=2)


MEMBERS = [Member(0, "a", 0, 10), Member(1, "b", 0, 11), Member(2, "c", 1, 12)]


def test_a_beat_one_worker_writes_is_read_by_the_other_for_its_member(pair: Pair) -> None:
    a = beat("a", 10)
    pair.one.write_beat(a)
    assert wait_until(lambda: pair.two.read_beats(MEMBERS).get(("a", 0)), DEADLINE, what="a's beat") == a
    assert pair.two.all_beats() == [a]
    newer = replace(a, ts=a.ts + 1, phase="idle")
    pair.one.write_beat(newer)
    wait_until(lambda: pair.two.read_beats(MEMBERS).get(("a", 0)) == newer, DEADLINE, what="the newer beat")
    assert set(pair.two.read_beats(MEMBERS)) == {("a", 0)}, "members without a beat are left out"


def test_hostile_heartbeats_are_ignored_and_the_valid_ones_read(pair: Pair) -> None:
    pair.put_beat_raw("b-0", b"\x00garbage")
    pair.put_beat_raw("c-1", b'{"pid": "12", "host": "c", "slot": 1}')
    pair.put_beat_raw("d-0", beat("a", 10).to_json().encode())  # a's beat under another name
    pair.put_beat_raw("e-0", b"{" + b" " * 10_000 + b"}")
    pair.one.write_beat(beat("a", 10))  # written after them: once it is read, so were they
    wait_until(lambda: ("a", 0) in pair.two.read_beats(MEMBERS), DEADLINE, what="a's beat")
    assert set(pair.two.read_beats(MEMBERS)) == {("a", 0)}
    assert [b.host for b in pair.two.all_beats()] == ["a"]


def test_a_beat_is_removed_only_by_the_process_that_wrote_it(pair: Pair) -> None:
    pair.one.write_beat(beat("a", 10))
    wait_until(lambda: ("a", 0) in pair.two.read_beats(MEMBERS), DEADLINE, what="a's beat")
    pair.two.remove_beat("a", 0, 99)  # another process of slot a/0 closes: a's beat stays
    pair.one.write_beat(beat("b", 11))
    wait_until(lambda: ("b", 0) in pair.two.read_beats(MEMBERS), DEADLINE, what="b's beat")
    assert ("a", 0) in pair.two.read_beats(MEMBERS)
    pair.one.remove_beat("a", 0, 10)
    wait_until(lambda: ("a", 0) not in pair.two.read_beats(MEMBERS), DEADLINE, what="a's beat gone")
    assert ("b", 0) in pair.two.read_beats(MEMBERS)


def test_a_failure_recorded_by_one_worker_is_the_last_failure_of_the_other(pair: Pair) -> None:
    assert pair.two.last_failure() is None
    before = time.time()
    pair.one.record_failure("a")
    seen = wait_until(pair.two.last_failure, DEADLINE, what="the failure marker")
    assert before <= seen <= time.time()
    pair.two.record_failure("b")
    wait_until(lambda: (pair.one.last_failure() or 0) > seen, DEADLINE, what="the newer failure")


def test_the_newest_hung_verdict_is_read_by_every_worker_from_its_time_on(pair: Pair) -> None:
    found = time.time()
    pair.one.record_verdict("host b rank 1 (pid 11): no heartbeat for 5.0s; killed pid 11 (SIGKILL)", found)
    why = wait_until(lambda: pair.two.verdict_since(found), DEADLINE, what="the verdict")
    assert why == "host b rank 1 (pid 11): no heartbeat for 5.0s; killed pid 11 (SIGKILL)"
    assert pair.two.verdict_since(found + 1) is None, "a verdict before a failure's cut-off is not its cause"
    pair.two.record_verdict("host c: evicted", found + 2)
    wait_until(lambda: pair.one.verdict_since(found + 1) == "host c: evicted", DEADLINE, what="the newer verdict")


def test_a_dead_workers_beat_goes_with_its_lease(etcd_server: EtcdServer) -> None:
    dead, judge = _etcd(etcd_server, lease_seconds=2).start(), _etcd(etcd_server).start()
    try:
        dead.write_beat(beat("a", 10))
        wait_until(lambda: ("a", 0) in judge.read_beats(MEMBERS), DEADLINE, what="a's beat")
        dead.stop(revoke=False)  # as a SIGKILL leaves it: no revoke, no more keep-alives
        t0 = time.monotonic()
        wait_until(lambda: ("a", 0) not in judge.read_beats(MEMBERS), DEADLINE, what="the beat gone with the lease")
        assert time.monotonic() - t0 >= 1.0, "gone by the lease's TTL, not at once"
    finally:
        dead.stop()
        judge.stop()


def test_an_etcd_outage_raises_nothing_hides_stale_beats_and_ends_with_beats_again(etcd_server: EtcdServer) -> None:
    one, two = _etcd(etcd_server).start(), _etcd(etcd_server).start()
    try:
        one.write_beat(beat("a", 10))
        wait_until(lambda: ("a", 0) in two.read_beats(MEMBERS), DEADLINE, what="a's beat")
        etcd_server.pause()
        try:
            t0 = time.perf_counter()
            for _ in range(50):  # the worker's side never waits for etcd
                one.write_beat(beat("a", 10))
                one.record_failure("a")
                two.read_beats(MEMBERS)
                two.last_failure()
            assert time.perf_counter() - t0 < 0.5
            wait_until(lambda: two.read_beats(MEMBERS) == {}, DEADLINE, what="stale beats hidden")
        finally:
            etcd_server.resume()
        late = beat("a", 10)
        one.write_beat(late)
        wait_until(lambda: two.read_beats(MEMBERS).get(("a", 0)) == late, 30, what="beats after the outage")
        wait_until(two.last_failure, DEADLINE, what="the failure queued during the outage")
    finally:
        one.stop()
        two.stop()
