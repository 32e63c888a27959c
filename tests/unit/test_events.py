"""events.jsonl: typed events, the writer never blocks the caller, lines are whole, readers validate each line."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from elastictrain.rundir import layout
from elastictrain.rundir.events import (
    EVENT_TYPES,
    Checkpoint,
    Commit,
    Done,
    EpochEnd,
    Event,
    EventError,
    EventKind,
    EventLog,
    Failure,
    Lifecycle,
    Metrics,
    NullEventLog,
    Reset,
    Start,
    Stopped,
    TrackingClosed,
    checkpoint_event,
    encode,
    lifecycle,
    open_event_log,
    parse_event,
    read_events,
    training_completed,
    training_completed_in,
)

HEAD = {"epoch": 0, "world_size": 2}


def test_emitted_events_are_written_as_one_json_object_per_line_with_the_common_fields(tmp_path: Path) -> None:
    log = EventLog(tmp_path / layout.EVENTS)
    log.emit(Start(ts=100.0, step=0, epoch=0, world_size=2, hosts=["a", "b"], resumed_from_step=None))
    log.emit(Commit(ts=101.5, step=10, epoch=0, world_size=2, commit_seconds=0.5))
    log.close()
    lines = (tmp_path / layout.EVENTS).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "ts": 100.0,
            "event": "start",
            "step": 0,
            "epoch": 0,
            "world_size": 2,
            "hosts": ["a", "b"],
            "resumed_from_step": None,
            "resumed_world_size": None,
            "config_hash": None,
            "run_id": None,
            "attempt": None,
        },
        {"ts": 101.5, "event": "commit", "step": 10, "epoch": 0, "world_size": 2, "commit_seconds": 0.5},
    ]


# Lines exactly as the untyped writer (before the dataclasses) wrote them for the engine's events.
OLD_LINES = [
    b'{"ts":1.5,"event":"start","step":0,"epoch":0,"world_size":2,"hosts":["a","b"],"resumed_from_step":null,'
    b'"resumed_world_size":null,"config_hash":"c0ffee","run_id":"r1","attempt":0}\n',
    b'{"ts":2.0,"event":"metrics","step":10,"epoch":0,"world_size":2,"steps":10,"loss":1.25,"lr":0.1,'
    b'"samples_per_sec":640.0,"step_seconds":0.05,"commit_seconds":0.001}\n',
    b'{"ts":3.0,"event":"failure","step":10,"epoch":0,"world_size":2,"reason":"worker_failed","error":"x"}\n',
    b'{"ts":4.0,"event":"reset","step":10,"epoch":0,"world_size":1,"recovery_seconds":1.0,"hosts":["a"],'
    b'"old_size":2,"new_size":1,"reason":"worker_failed","lost_steps":0}\n',
    b'{"ts":5.0,"event":"epoch_end","step":20,"epoch":0,"world_size":1,"epoch_seconds":4.0,"val_loss":0.5,'
    b'"val_accuracy":0.9,"val_top5":1.0}\n',
    b'{"ts":6.0,"event":"checkpoint","step":20,"epoch":1,"world_size":1,"path":"/r/checkpoints/step-00000020",'
    b'"stall_seconds":0.01,"write_seconds":0.2,"total_seconds":0.3,"bytes":1024,"pruned":[],"ok":true}\n',
    b'{"ts":7.0,"event":"done","step":20,"epoch":1,"world_size":1,"final_loss":0.5,"val_accuracy":0.9,'
    b'"checkpointed":true}\n',
    b'{"ts":8.0,"event":"tracking_closed","step":20,"epoch":1,"world_size":1,"run_id":"r1","dropped":0}\n',
]


def test_old_lines_read_back_typed_and_are_written_again_byte_for_byte() -> None:
    events = [parse_event(json.loads(line)) for line in OLD_LINES]
    assert [type(e) for e in events] == [Start, Metrics, Failure, Reset, EpochEnd, Checkpoint, Done, TrackingClosed]
    reset = events[3]
    assert isinstance(reset, Reset) and (reset.old_size, reset.new_size, reset.hosts) == (2, 1, ["a"])
    epoch_end = events[4]
    assert isinstance(epoch_end, EpochEnd) and epoch_end.val_metrics == {"val_top5": 1.0}
    assert [encode(e) for e in events] == OLD_LINES


def test_a_line_from_an_older_writer_without_a_newer_field_reads_it_as_none() -> None:
    e = parse_event({"ts": 1, "event": "start", "step": 0, **HEAD, "hosts": ["a"]})
    assert isinstance(e, Start) and e.resumed_world_size is None and e.attempt is None and e.ts == 1.0


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ([1, 2], "not a JSON object"),
        ({"no_event": 1}, "event must be a string"),
        ({"ts": 1, "event": "teleported", "step": 0, **HEAD}, "unknown event"),
        ({"ts": "soon", "event": "metrics", "step": 0, **HEAD}, "ts must be a finite number"),
        ({"ts": 1, "event": "metrics", "step": True, **HEAD}, "step must be an integer"),
        ({"ts": 1, "event": "metrics", "step": 1, "epoch": 0}, "world_size must be an integer"),
        ({"ts": 1, "event": "reset", "step": 1, **HEAD, "new_size": "two"}, "reset.new_size has the wrong type"),
        ({"ts": 1, "event": "metrics", "step": 1, **HEAD, "loss": True}, "metrics.loss has the wrong type"),
        ({"ts": 1, "event": "start", "step": 1, **HEAD, "hosts": ["a", 2]}, "start.hosts has the wrong type"),
        ({"ts": 1, "event": "epoch_end", "step": 1, **HEAD, "val_top5": "high"}, r"a val_\* field is not a number"),
    ],
)
def test_a_damaged_record_is_rejected_with_the_reason(record: object, why: str) -> None:
    with pytest.raises(EventError, match=why):
        parse_event(record)


def test_every_event_kind_round_trips_through_a_line() -> None:
    for cls in EVENT_TYPES.values():
        e = cls(ts=1.25, step=3, epoch=1, world_size=2)
        assert parse_event(json.loads(encode(e))) == e


def test_the_checkpointer_reports_become_typed_events_at_the_saved_step() -> None:
    fields = {"path": "p", "step": 40, "stall_seconds": 0.1, "write_seconds": 1.0, "total_seconds": 1.2}
    e = checkpoint_event("checkpoint", {**fields, "bytes": 9, "pruned": ["step-1"], "ok": True}, step=45, **HEAD)
    assert isinstance(e, Checkpoint) and (e.step, e.bytes, e.pruned) == (40, 9, ["step-1"])
    failed = checkpoint_event("checkpoint_failed", {"step": None, "error": "disk", "failures": 2}, step=45, **HEAD)
    assert failed.step == 45 and failed.name == "checkpoint_failed"
    with pytest.raises(ValueError, match="not a checkpointer event"):
        checkpoint_event("done", {}, step=1, **HEAD)


def test_lifecycle_is_decided_by_the_last_start_done_or_stopped() -> None:
    def ev(cls: type[Event], ts: float) -> Event:
        return cls(ts=ts, step=int(ts), **HEAD)

    assert lifecycle([]) is Lifecycle.NOT_STARTED
    assert lifecycle([ev(Metrics, 1)]) is Lifecycle.RUNNING
    assert lifecycle([ev(Start, 1), ev(Failure, 2), ev(Reset, 3)]) is Lifecycle.RUNNING
    done = [ev(Start, 1), ev(Done, 2), ev(TrackingClosed, 3)]
    assert lifecycle(done) is Lifecycle.DONE and training_completed(done)
    assert not training_completed([*done, ev(Start, 4)]), "a start after done: it runs again"
    assert lifecycle([ev(Start, 1), ev(Stopped, 2)]) is Lifecycle.STOPPED
    assert not training_completed([ev(Start, 1), ev(Stopped, 2)])


def test_every_kind_has_a_dataclass_a_when_and_a_documented_field_each() -> None:
    assert set(EVENT_TYPES) == set(EventKind)
    for kind, cls in EVENT_TYPES.items():
        assert cls.KIND is kind and cls.WHEN
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        for f in dataclasses.fields(cls):
            assert f.name in ("ts", "step", "epoch", "world_size") or "doc" in f.metadata, f"{kind}.{f.name}"


def test_close_drains_every_queued_event_in_order(tmp_path: Path) -> None:
    log = EventLog(tmp_path / layout.EVENTS)
    for i in range(2000):
        log.emit(Metrics(step=i, epoch=0, world_size=1))
    log.close()
    log.close()  # twice is harmless
    assert [e.step for e in read_events(tmp_path / layout.EVENTS)] == list(range(2000))


def test_emit_returns_while_the_disk_is_stalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    log = EventLog(tmp_path / layout.EVENTS)
    real_write = log._write
    monkeypatch.setattr(log, "_write", lambda line: (release.wait(30), real_write(line)))
    for i in range(100):  # would hang here if emit waited for the writer
        log.emit(Commit(step=i, epoch=0, world_size=1, commit_seconds=0.01))
    assert not log.flush(timeout=0.05)
    release.set()
    assert log.flush(timeout=10)
    log.close()
    assert len(read_events(tmp_path / layout.EVENTS)) == 100


def test_lines_from_concurrent_threads_never_interleave(tmp_path: Path) -> None:
    log = EventLog(tmp_path / layout.EVENTS)
    payload = "x" * 5000

    def emit_many(tid: int) -> None:
        for i in range(200):
            log.emit(Failure(step=i, epoch=tid, world_size=4, reason="worker_failed", error=payload))

    threads = [threading.Thread(target=emit_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    lines = (tmp_path / layout.EVENTS).read_text().splitlines()
    assert len(lines) == 800
    assert all(json.loads(line)["error"] == payload for line in lines)


def test_non_finite_floats_are_written_as_null(tmp_path: Path) -> None:
    log = EventLog(tmp_path / layout.EVENTS)
    nan, inf = float("nan"), float("inf")
    log.emit(Metrics(step=1, epoch=0, world_size=1, loss=nan, lr=inf))
    log.emit(EpochEnd(step=1, epoch=0, world_size=1, val_loss=nan, val_metrics={"val_top5": nan}))
    log.close()
    text = (tmp_path / layout.EVENTS).read_text()
    assert "NaN" not in text and "Infinity" not in text
    metrics, epoch_end = read_events(tmp_path / layout.EVENTS)
    assert isinstance(metrics, Metrics) and metrics.loss is None and metrics.lr is None
    assert isinstance(epoch_end, EpochEnd) and epoch_end.val_loss is None
    assert epoch_end.val_metrics == {"val_top5": None}


def test_an_event_that_happened_earlier_keeps_its_own_time(tmp_path: Path) -> None:
    log = EventLog(tmp_path / layout.EVENTS)
    log.emit(Failure(step=1, epoch=0, world_size=2, ts=42.5, reason="worker_failed", error=""))
    log.emit(Reset(step=1, epoch=0, world_size=1, ts=100.0))
    log.close()
    assert [(e.name, e.ts) for e in read_events(tmp_path / layout.EVENTS)] == [("failure", 42.5), ("reset", 100.0)]


def test_reader_skips_a_torn_final_line_silently(tmp_path: Path) -> None:
    path = tmp_path / layout.EVENTS
    path.write_text('{"ts":1,"event":"start","step":0,"epoch":0,"world_size":1}\n{"ts":2,"event":"met')
    reports: list[tuple[int, str]] = []
    assert [e.name for e in read_events(path, lambda line, why: reports.append((line, why)))] == ["start"]
    assert reports == []


def test_a_relaunch_after_a_torn_line_appends_readable_events(tmp_path: Path) -> None:
    path = tmp_path / layout.EVENTS
    path.write_text('{"ts":1,"event":"start","step":0,"epoch":0,"world_size":1}\n{"ts":2,"event":"met')
    log = EventLog(path)  # the relaunched rank 0
    log.emit(Start(step=0, epoch=0, world_size=2, attempt=1))
    log.close()
    reports: list[tuple[int, str]] = []
    events = read_events(path, lambda line, why: reports.append((line, why)))
    assert [(e.name, e.world_size) for e in events] == [("start", 1), ("start", 2)]
    assert reports == [(2, "not JSON")], "the torn line is no longer the last: it is reported"


def test_reader_skips_blank_and_non_event_lines_and_reports_each(tmp_path: Path) -> None:
    path = tmp_path / layout.EVENTS
    path.write_text('\n[1,2]\n{"no_event": 1}\n{"ts":1,"event":"done","step":5,"epoch":0,"world_size":1}\n\n')
    reports: list[tuple[int, str]] = []
    assert [e.name for e in read_events(path, lambda line, why: reports.append((line, why)))] == ["done"]
    assert reports == [(2, "not a JSON object"), (3, "event must be a string")]


def test_reader_raises_file_not_found_for_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path / layout.EVENTS)


def test_ranks_other_than_zero_write_nothing(tmp_path: Path) -> None:
    log = open_event_log(tmp_path, rank=1)
    assert isinstance(log, NullEventLog)
    log.emit(Start(step=0, epoch=0, world_size=2))
    assert log.flush()
    log.close()
    assert not (tmp_path / layout.EVENTS).exists()
    rank0 = open_event_log(tmp_path / "new", rank=0)
    assert isinstance(rank0, EventLog)
    rank0.emit(Start(step=0, epoch=0, world_size=2))
    rank0.close()
    assert len(read_events(tmp_path / "new" / layout.EVENTS)) == 1
    rank0.emit(Done(step=0, epoch=0, world_size=2))  # after close: ignored, never raises


def test_training_completed_in_a_file_reads_its_last_lifecycle_event(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    assert not training_completed_in(p)
    head = '"step": 1, "epoch": 0, "world_size": 2'
    start, done = (f'{{"ts": 1, "event": "{kind}", {head}}}\n' for kind in ("start", "done"))
    p.write_text(start + done + f'{{"ts": 2, "event": "tracking_closed", {head}}}\n')
    assert training_completed_in(p)
    p.write_text(done + start + '{"torn')
    assert not training_completed_in(p)
