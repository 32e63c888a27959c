"""The outbox (workers' records for the launcher through etcd) over an in-memory store: what the collector writes,
in which order, exactly once across its own crashes, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from discovery.kv import MemoryKeyValue
from elastictrain.config import ConfigError
from elastictrain.rundir import layout, outbox
from elastictrain.rundir.ledger import SampleLedger, read_ledger
from elastictrain.rundir.outbox import Collector, Outbox, OutboxStateError, encode_chunk, open_outbox
from elastictrain.rundir.worker_error import read_worker_errors, record_worker_error

PREFIX = "/elastictrain/job/outbox/"


def sent(box: Outbox) -> None:
    assert box.flush(timeout=10), "the outbox did not reach the store"


def events_lines(run_dir: Path) -> list[str]:
    return (run_dir / layout.EVENTS).read_text().splitlines()


def test_records_of_two_writers_reach_the_run_dir_in_the_order_the_store_received_them(tmp_path: Path) -> None:
    store = MemoryKeyValue()
    a, b = Outbox(store, PREFIX, "hostA.1.1"), Outbox(store, PREFIX, "hostB.2.2")
    a.append(layout.EVENTS, b'{"n":1}\n')
    sent(a)
    b.append(layout.EVENTS, b'{"n":2}\n{"n":3}\n')
    sent(b)
    a.append(layout.EVENTS, b'{"n":4}\n')
    a.append(layout.CONFIG, b"job: j\n")
    sent(a)
    collector = Collector(store, PREFIX, tmp_path)
    assert collector.collect() == 4
    assert [json.loads(line)["n"] for line in events_lines(tmp_path)] == [1, 2, 3, 4]
    assert (tmp_path / layout.CONFIG).read_text() == "job: j\n"
    assert store.get_prefix(PREFIX, 100) == [], "applied chunks are deleted"
    assert collector.collect() == 0 and len(events_lines(tmp_path)) == 4
    a.close(), b.close()


def test_a_record_longer_than_a_chunk_is_applied_only_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outbox, "CHUNK_BYTES", 8)
    store = MemoryKeyValue()
    box = Outbox(store, PREFIX, "w.1.1")
    line = b'{"long":"' + b"x" * 30 + b'"}\n'
    box.append(layout.EVENTS, line)
    sent(box)
    chunks = store.get_prefix(PREFIX, 100)
    assert len(chunks) == -(-len(line) // 8) > 1
    # The writer died after its first chunks: the record is not applied, and stays for a later pass.
    last_key, last_raw, _ = chunks[-1]
    del store.data[last_key]
    collector = Collector(store, PREFIX, tmp_path)
    assert collector.collect() == 0 and not (tmp_path / layout.EVENTS).exists()
    store.put(last_key, last_raw)
    assert collector.collect() == 1
    assert (tmp_path / layout.EVENTS).read_bytes() == line
    box.close()


def test_a_collector_killed_between_writing_and_recording_repeats_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryKeyValue()
    box = Outbox(store, PREFIX, "w.1.1")
    box.append(layout.EVENTS, b'{"n":1}\n')
    sent(box)
    Collector(store, PREFIX, tmp_path).collect()
    box.append(layout.EVENTS, b'{"n":2}\n')
    sent(box)

    crashing = Collector(store, PREFIX, tmp_path)

    def crash() -> None:
        raise KeyboardInterrupt("killed after the append, before the state was saved")

    monkeypatch.setattr(crashing, "_save_state", crash)
    with pytest.raises(KeyboardInterrupt):
        crashing.collect()
    assert len(events_lines(tmp_path)) == 2, "the append happened"
    again = Collector(store, PREFIX, tmp_path)  # the restarted launcher: cuts the unrecorded tail, applies again
    assert again.collect() == 1
    assert [json.loads(line)["n"] for line in events_lines(tmp_path)] == [1, 2]
    box.close()


def test_chunks_applied_before_a_crash_that_came_before_their_delete_are_only_deleted(tmp_path: Path) -> None:
    store = MemoryKeyValue()
    box = Outbox(store, PREFIX, "w.1.1")
    box.append(layout.EVENTS, b'{"n":1}\n')
    sent(box)
    kept = dict(store.data)
    assert Collector(store, PREFIX, tmp_path).collect() == 1
    store.data.update(kept)  # as if the deletes never happened
    assert Collector(store, PREFIX, tmp_path).collect() == 0
    assert events_lines(tmp_path) == ['{"n":1}'] and store.data == {}
    box.close()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (PREFIX + "w.1.1/000000000000", b"not a header"),
        (PREFIX + "w.1.1/000000000000", b'{"v":1,"stream":"../../etc/passwd","more":false}\nroot\n'),
        (PREFIX + "w.1.1/000000000000", b'{"v":1,"stream":"events.jsonl","more":"yes"}\nx\n'),
        (PREFIX + "w.1.1/000000000000", b'{"v":2,"stream":"events.jsonl","more":false}\nx\n'),
        (PREFIX + "w.1.1/000000000000", encode_chunk(layout.EVENTS, False, b"x" * (outbox.CHUNK_BYTES + 1))),
        (PREFIX + "../w/000000000000", encode_chunk(layout.EVENTS, False, b"x\n")),
        (PREFIX + "w.1.1/12", encode_chunk(layout.EVENTS, False, b"x\n")),
        (PREFIX + "w.1.1/000000000000/extra", encode_chunk(layout.EVENTS, False, b"x\n")),
    ],
)
def test_a_chunk_that_is_not_one_is_refused_and_deleted_and_nothing_is_written(
    tmp_path: Path, key: str, value: bytes
) -> None:
    store = MemoryKeyValue()
    store.put(key, value)
    run_dir = tmp_path / "run"
    collector = Collector(store, PREFIX, run_dir)
    assert collector.collect() == 0
    assert collector.rejected == 1 and store.data == {}
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == []


def test_a_sequence_with_a_hole_waits_at_the_hole(tmp_path: Path) -> None:
    store = MemoryKeyValue()
    store.put(PREFIX + "w.1.1/000000000001", encode_chunk(layout.EVENTS, False, b'{"n":2}\n'))
    collector = Collector(store, PREFIX, tmp_path)
    assert collector.collect() == 0 and len(store.data) == 1
    store.put(PREFIX + "w.1.1/000000000000", encode_chunk(layout.EVENTS, False, b'{"n":1}\n'))
    assert collector.collect() == 2
    assert [json.loads(line)["n"] for line in events_lines(tmp_path)] == [1, 2]


def test_an_outage_delays_records_without_losing_or_repeating_one(tmp_path: Path) -> None:
    store = MemoryKeyValue()
    box = Outbox(store, PREFIX, "w.1.1")
    store.down = True
    for n in range(5):
        box.append(layout.EVENTS, json.dumps({"n": n}).encode() + b"\n")
    assert not box.flush(timeout=0.3), "nothing reaches a store that is down"
    assert box.put_errors >= 1
    store.down = False
    sent(box)
    keys = sorted(store.data)
    assert [k.rsplit("/", 1)[1] for k in keys] == [f"{i:012d}" for i in range(5)], "no hole, no repeat"
    Collector(store, PREFIX, tmp_path).collect()
    assert [json.loads(line)["n"] for line in events_lines(tmp_path)] == [0, 1, 2, 3, 4]
    box.close()


def test_ledger_tenures_are_numbered_by_the_collector_in_the_order_processes_held_rank_0(tmp_path: Path) -> None:
    store = MemoryKeyValue()
    run_dir = tmp_path / "run"
    (run_dir / layout.LEDGER).mkdir(parents=True)
    # A tenure written straight to the run_dir earlier (files mode) keeps its place.
    first = SampleLedger(run_dir / layout.LEDGER, "100", num_samples=6, drop_last=False)
    first.record(1, 0, [0, 1])
    first.close()
    a, b = Outbox(store, PREFIX, "a.1.1"), Outbox(store, PREFIX, "b.2.2")
    second = SampleLedger(run_dir / layout.LEDGER, "200", num_samples=6, drop_last=False, outbox=a)
    second.record(2, 0, [2, 3])
    second.record(3, 0, [9, 9])  # rolled back by the next tenure's restore
    sent(a)
    third = SampleLedger(run_dir / layout.LEDGER, "300", num_samples=6, drop_last=False, outbox=b)
    third.restore(2)
    third.record(3, 0, [4, 5])
    sent(b)
    assert not any(p.name.endswith("-200.jsonl") for p in (run_dir / layout.LEDGER).iterdir()), "the worker wrote none"
    collector = Collector(store, PREFIX, run_dir)
    assert collector.collect() == 6
    names = sorted(p.name for p in (run_dir / layout.LEDGER).iterdir())
    assert names == ["tenure-000001-100.jsonl", "tenure-000002-200.jsonl", "tenure-000003-300.jsonl"]
    ledger = read_ledger(run_dir / layout.LEDGER)
    assert ledger.committed == {0: [0, 1, 2, 3, 4, 5]} and ledger.num_samples == 6
    second.record(4, 0, [1])  # a late line of an earlier tenure still goes to that tenure's file
    sent(a)
    collector.collect()
    assert sorted(p.name for p in (run_dir / layout.LEDGER).iterdir()) == names
    a.close(), b.close()


def test_a_worker_error_goes_through_the_outbox_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_HOSTNAME", "hostA")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")
    monkeypatch.setenv("ELASTICTRAIN_LAUNCH_ID", "L1")
    monkeypatch.setenv("ELASTICTRAIN_ATTEMPT", "0")
    store = MemoryKeyValue()
    box = Outbox(store, PREFIX, "w.1.1")
    worker_dir, launcher_dir = tmp_path / "worker", tmp_path / "launcher"
    assert record_worker_error(worker_dir, RuntimeError("boom"), box) is not None
    assert not worker_dir.exists(), "nothing written on the worker's disk"
    Collector(store, PREFIX, launcher_dir).collect()
    (err,) = read_worker_errors(launcher_dir, launch_id="L1", attempt=0)
    assert err.type == "RuntimeError" and err.message == "boom"
    box.close()


def test_a_state_file_that_cannot_be_trusted_is_one_line(tmp_path: Path) -> None:
    (tmp_path / layout.OUTBOX_STATE).write_text(json.dumps({"v": 1, "files": {"/etc/passwd": 0}, "writers": {}}))
    with pytest.raises(OutboxStateError, match=r"^\S+\.outbox\.json: not an outbox state") as e:
        Collector(MemoryKeyValue(), PREFIX, tmp_path)
    assert "\n" not in str(e.value)


def test_the_outbox_carries_only_the_run_dirs_record_streams() -> None:
    box = Outbox(MemoryKeyValue(), PREFIX, "w.1.1")
    with pytest.raises(ValueError, match="carries no stream"):
        box.append("checkpoints/latest", b"x")
    box.close()


def test_files_mode_opens_no_outbox_and_etcd_mode_needs_the_jobs_etcd() -> None:
    assert open_outbox("files", {}) is None
    assert open_outbox("auto", {}) is None
    with pytest.raises(ConfigError, match=r"elastic\.outputs is etcd but ELASTICTRAIN_ETCD is not set"):
        open_outbox("etcd", {})


def test_a_pass_whose_fsync_fails_loses_nothing_and_the_next_pass_applies_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryKeyValue()
    box = Outbox(store, PREFIX, "w.1.1")
    box.append(layout.EVENTS, b'{"n":1}\n')
    sent(box)
    collector = Collector(store, PREFIX, tmp_path)
    real_fsync, failures = outbox.os.fsync, [1]

    def fsync_once(fd: int) -> None:
        if failures:
            failures.pop()
            raise OSError(5, "I/O error")
        real_fsync(fd)

    monkeypatch.setattr(outbox.os, "fsync", fsync_once)
    with pytest.raises(OSError):
        collector.collect()
    assert len(store.data) == 1, "the chunk stays in etcd"
    assert collector.collect() == 1
    assert events_lines(tmp_path) == ['{"n":1}'] and store.data == {}
    again = Collector(store, PREFIX, tmp_path)  # a restarted launcher keeps what was recorded
    assert again.collect() == 0 and events_lines(tmp_path) == ['{"n":1}']
    box.close()


def test_a_process_that_holds_rank_0_twice_writes_two_tenures(tmp_path: Path) -> None:
    store = MemoryKeyValue()
    run_dir = tmp_path / "run"
    p, q = Outbox(store, PREFIX, "p.1.1"), Outbox(store, PREFIX, "q.2.2")
    first = SampleLedger(run_dir / layout.LEDGER, "100", num_samples=4, drop_last=False, outbox=p)
    first.record(1, 0, [0])
    first.record(2, 0, [9])  # rolled back by q's restore
    sent(p)
    other = SampleLedger(run_dir / layout.LEDGER, "200", num_samples=4, drop_last=False, outbox=q)
    other.restore(1)
    other.record(2, 0, [1])
    sent(q)
    again = SampleLedger(run_dir / layout.LEDGER, "100", num_samples=4, drop_last=False, outbox=p)
    again.restore(2)
    again.record(3, 0, [2, 3])
    sent(p)
    Collector(store, PREFIX, run_dir).collect()
    names = sorted(f.name for f in (run_dir / layout.LEDGER).iterdir())
    assert names == ["tenure-000001-100.jsonl", "tenure-000002-200.jsonl", "tenure-000003-100.jsonl"]
    assert read_ledger(run_dir / layout.LEDGER).committed == {0: [0, 1, 2, 3]}
    p.close(), q.close()


def test_the_mlflow_run_id_reaches_the_launcher_and_a_worker_on_an_empty_disk_finds_it_there(tmp_path: Path) -> None:
    from elastictrain.engine.tracking import read_run_id

    store = MemoryKeyValue()
    box = Outbox(store, PREFIX, "w.1.1")
    box.append(layout.MLFLOW_RUN_ID, b"0123456789abcdef0123456789abcdef\n")
    sent(box)
    launcher_dir, empty_disk = tmp_path / "launcher", tmp_path / "worker"
    Collector(store, PREFIX, launcher_dir).collect()
    run_id = read_run_id(launcher_dir, {})
    assert run_id == "0123456789abcdef0123456789abcdef"
    assert read_run_id(empty_disk, {}) is None
    assert read_run_id(empty_disk, {"ELASTICTRAIN_MLFLOW_RUN_ID": run_id}) == run_id, "passed by the launcher"
    assert read_run_id(empty_disk, {"ELASTICTRAIN_MLFLOW_RUN_ID": "../../etc"}) is None, "validated"
    box.close()
