"""events.jsonl: the writer never blocks the caller, lines are whole, readers tolerate a torn tail."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from elastictrain.events import EVENTS_FILE, EventLog, NullEventLog, encode_event, open_event_log, read_events


def test_emitted_events_are_written_as_one_json_object_per_line_with_the_common_fields(tmp_path: Path) -> None:
    clock = iter([100.0, 101.5])
    log = EventLog(tmp_path / EVENTS_FILE, clock=lambda: next(clock))
    log.emit("start", step=0, epoch=0, world_size=2, hosts=["a", "b"], resumed_from_step=None)
    log.emit("metrics", step=10, epoch=0, world_size=2, loss=0.5, steps=10)
    log.close()
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "ts": 100.0,
            "event": "start",
            "step": 0,
            "epoch": 0,
            "world_size": 2,
            "hosts": ["a", "b"],
            "resumed_from_step": None,
        },
        {"ts": 101.5, "event": "metrics", "step": 10, "epoch": 0, "world_size": 2, "loss": 0.5, "steps": 10},
    ]


def test_close_drains_every_queued_event_in_order(tmp_path: Path) -> None:
    log = EventLog(tmp_path / EVENTS_FILE)
    for i in range(2000):
        log.emit("metrics", step=i, epoch=0, world_size=1)
    log.close()
    log.close()  # twice is harmless
    assert [e["step"] for e in read_events(tmp_path / EVENTS_FILE)] == list(range(2000))


def test_emit_returns_while_the_disk_is_stalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    log = EventLog(tmp_path / EVENTS_FILE)
    real_write = log._write
    monkeypatch.setattr(log, "_write", lambda line: (release.wait(30), real_write(line)))
    for i in range(100):  # would hang here if emit waited for the writer
        log.emit("commit", step=i, epoch=0, world_size=1, commit_seconds=0.01)
    assert not log.flush(timeout=0.05)
    release.set()
    assert log.flush(timeout=10)
    log.close()
    assert len(read_events(tmp_path / EVENTS_FILE)) == 100


def test_lines_from_concurrent_threads_never_interleave(tmp_path: Path) -> None:
    log = EventLog(tmp_path / EVENTS_FILE)
    payload = "x" * 5000

    def emit_many(tid: int) -> None:
        for i in range(200):
            log.emit("metrics", step=i, epoch=tid, world_size=4, payload=payload)

    threads = [threading.Thread(target=emit_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert len(lines) == 800
    assert all(json.loads(line)["payload"] == payload for line in lines)


def test_non_finite_floats_are_written_as_null(tmp_path: Path) -> None:
    log = EventLog(tmp_path / EVENTS_FILE)
    log.emit("metrics", step=1, epoch=0, world_size=1, loss=float("nan"), lr=float("inf"), hist=[1.0, float("nan")])
    log.close()
    text = (tmp_path / EVENTS_FILE).read_text()
    assert "NaN" not in text and "Infinity" not in text
    (ev,) = read_events(tmp_path / EVENTS_FILE)
    assert ev["loss"] is None and ev["lr"] is None and ev["hist"] == [1.0, None]


def test_a_field_may_not_shadow_a_common_field() -> None:
    with pytest.raises(ValueError, match="reserved"):
        encode_event("metrics", ts=1.0, step=1, epoch=0, world_size=1, fields={"ts": 3.0})


def test_an_event_that_happened_earlier_keeps_its_own_time(tmp_path: Path) -> None:
    log = EventLog(tmp_path / EVENTS_FILE, clock=lambda: 100.0)
    log.emit("failure", step=1, epoch=0, world_size=2, ts=42.5, reason="worker_failed", error="")
    log.emit("reset", step=1, epoch=0, world_size=1)
    log.close()
    assert [(e["event"], e["ts"]) for e in read_events(tmp_path / EVENTS_FILE)] == [("failure", 42.5), ("reset", 100.0)]


def test_reader_skips_a_torn_final_line(tmp_path: Path) -> None:
    path = tmp_path / EVENTS_FILE
    path.write_text('{"ts":1,"event":"start","step":0,"epoch":0,"world_size":1}\n{"ts":2,"event":"met')
    assert [e["event"] for e in read_events(path)] == ["start"]


def test_a_relaunch_after_a_torn_line_appends_readable_events(tmp_path: Path) -> None:
    path = tmp_path / EVENTS_FILE
    path.write_text('{"ts":1,"event":"start","step":0,"epoch":0,"world_size":1}\n{"ts":2,"event":"met')
    log = EventLog(path)  # the relaunched rank 0
    log.emit("start", step=0, epoch=0, world_size=2, attempt=1)
    log.close()
    assert [(e["event"], e["world_size"]) for e in read_events(path)] == [("start", 1), ("start", 2)]


def test_reader_skips_blank_and_non_event_lines(tmp_path: Path) -> None:
    path = tmp_path / EVENTS_FILE
    path.write_text('\n[1,2]\n{"no_event": 1}\n{"ts":1,"event":"done","step":5,"epoch":0,"world_size":1}\n\n')
    assert [e["event"] for e in read_events(path)] == ["done"]


def test_reader_raises_file_not_found_for_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path / EVENTS_FILE)


def test_ranks_other_than_zero_write_nothing(tmp_path: Path) -> None:
    log = open_event_log(tmp_path, rank=1)
    assert isinstance(log, NullEventLog)
    log.emit("start", step=0, epoch=0, world_size=2)
    assert log.flush()
    log.close()
    assert not (tmp_path / EVENTS_FILE).exists()
    rank0 = open_event_log(tmp_path / "new", rank=0)
    assert isinstance(rank0, EventLog)
    rank0.emit("start", step=0, epoch=0, world_size=2)
    rank0.close()
    assert len(read_events(tmp_path / "new" / EVENTS_FILE)) == 1
    rank0.emit("late", step=0, epoch=0, world_size=2)  # after close: ignored, never raises
