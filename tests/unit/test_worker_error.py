"""A worker that raised leaves a typed record (elastictrain/rundir/worker_error.py) that the launcher reads back: its
own launch and attempt only, validated field by field, the worker's own exception before Horovod's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastictrain.rundir import layout
from elastictrain.rundir.worker_error import WorkerError, first_cause, read_worker_errors, record_worker_error

ENV = {"HOROVOD_HOSTNAME": "127.0.0.1", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_RANK": "1",
       "ELASTICTRAIN_LAUNCH_ID": "abc", "ELASTICTRAIN_ATTEMPT": "2"}  # fmt: skip


def test_a_recorded_exception_reads_back_as_the_launchers_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    path = record_worker_error(tmp_path, ValueError("bad batch at step 3\nsecond line"))
    assert path is not None and path.parent == tmp_path / layout.WORKER_ERRORS
    (err,) = read_worker_errors(tmp_path, launch_id="abc", attempt=2)
    assert (err.host, err.slot, err.rank, err.pid) == ("127.0.0.1", 0, 1, os.getpid())
    assert err.line() == "worker 127.0.0.1[0] failed: ValueError: bad batch at step 3"
    assert read_worker_errors(tmp_path, launch_id="abc", attempt=1) == [], "another attempt's records are not ours"
    assert read_worker_errors(tmp_path, launch_id="other", attempt=2) == []
    assert read_worker_errors(tmp_path / "nowhere", launch_id="abc", attempt=2) == []


def good() -> dict:
    return {"host": "h", "slot": 0, "rank": 0, "pid": 10, "launch_id": "abc", "attempt": 0, "ts": 1.0,
            "type": "ValueError", "message": "m"}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"host": "../x"},
        {"slot": -1},
        {"pid": "10"},
        {"ts": float("nan")},
        {"type": "a b"},
        {"message": "\x1b[2J"},
        {"rank": True},
        {"message": "x" * 600},
    ],
)
def test_a_damaged_or_hostile_record_is_skipped(tmp_path: Path, change: dict) -> None:
    folder = tmp_path / layout.WORKER_ERRORS
    folder.mkdir()
    (folder / "good.json").write_text(json.dumps(good()))
    (folder / "bad.json").write_text(json.dumps({**good(), **change}))
    (folder / "junk.json").write_text("{not json")
    (folder / "deep.json").write_text("[" * 15000)  # json.loads raises RecursionError, not ValueError
    (folder / "big.json").write_text(json.dumps({**good(), "pad": "x" * 20000}))
    (folder / "link.json").symlink_to(folder / "good.json")
    assert [e.message for e in read_worker_errors(tmp_path, launch_id="abc", attempt=0)] == ["m"]


def test_the_cause_is_the_earliest_error_of_the_workers_own_code() -> None:
    def err(ts: float, kind: str) -> WorkerError:
        return WorkerError.parse({**good(), "ts": ts, "type": kind})

    assert first_cause([]) is None
    assert first_cause([err(1, "HorovodInternalError"), err(3, "KeyError"), err(2, "ValueError")]).type == "ValueError"
    assert first_cause([err(2, "HorovodInternalError")]).type == "HorovodInternalError"
