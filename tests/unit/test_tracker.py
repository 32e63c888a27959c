"""MlflowTracker against a fake store: the caller never waits, one run per job, no point twice."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from chaos.procs import wait_until
from elastictrain.config import config_from_dict
from elastictrain.engine.tracking import (
    MetricPoint,
    MlflowTracker,
    NullTracker,
    OpenedRun,
    make_tracker,
    read_run_id,
    resolve_tracking_uri,
)
from elastictrain.rundir import layout


class FakeStore:
    """Runs and their points, shared by the backends of successive trackers (like a real store)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail_requests = False
        self.fail_open = False
        self.batches: list[tuple[list[MetricPoint], dict[str, str], dict[str, str]]] = []
        self.open_calls: list[str | None] = []

    def points(self, run_id: str, key: str) -> list[int]:
        return [p.step for p in self.runs[run_id]["metrics"] if p.key == key]


class FakeBackend:
    def __init__(self, store: FakeStore) -> None:
        self.store = store

    def open_run(self, *, existing_run_id: str | None, job: str, run_dir: str, experiment: str) -> OpenedRun:
        self.store.open_calls.append(existing_run_id)
        if self.store.fail_open:
            raise ConnectionError("store unreachable")
        run = self.store.runs.get(existing_run_id or "")
        if run is None:
            run = next(
                (
                    r
                    for r in self.store.runs.values()
                    if r["tags"].get("elastictrain.job") == job and r["tags"].get("elastictrain.run_dir") == run_dir
                ),
                None,
            )
        if run is None:
            run_id = uuid.uuid4().hex
            run = self.store.runs[run_id] = {
                "id": run_id,
                "metrics": [],
                "params": {},
                "artifacts": [],
                "status": "RUNNING",
                "tags": {"elastictrain.job": job, "elastictrain.run_dir": run_dir},
            }
            return OpenedRun(run_id=run_id, resumed=False)
        marks: dict[str, int] = {}
        for p in run["metrics"]:
            marks[p.key] = max(marks.get(p.key, -1), p.step)
        run["status"] = "RUNNING"
        return OpenedRun(run_id=run["id"], resumed=True, high_water=marks, params=dict(run["params"]))

    def log_batch(self, run_id: str, metrics: list[MetricPoint], params: dict[str, str], tags: dict[str, str]) -> None:
        self.store.gate.wait(30)
        if self.store.fail_requests:
            raise ConnectionError("connection refused")
        assert len(metrics) <= 1000 and len(params) <= 100 and len(tags) <= 100
        self.store.batches.append((metrics, params, tags))
        run = self.store.runs[run_id]
        run["metrics"].extend(metrics)
        for k, v in params.items():
            assert k not in run["params"], f"param {k} logged twice"
            run["params"][k] = v
        run["tags"].update(tags)

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None) -> None:
        self.store.runs[run_id]["artifacts"].append((path, artifact_path))

    def finish(self, run_id: str, status: str) -> None:
        self.store.runs[run_id]["status"] = status


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


def tracker(store: FakeStore, run_dir: Path, **kw) -> MlflowTracker:
    kw.setdefault("retry_backoff_seconds", (0.01, 0.05))
    return MlflowTracker(run_dir=run_dir, job="job1", backend_factory=lambda: FakeBackend(store), **kw)


def test_points_params_tags_and_artifacts_reach_the_store_and_the_run_is_finished(
    store: FakeStore, tmp_path: Path
) -> None:
    t = tracker(store, tmp_path)
    t.log_params({"training.base_lr": 0.1, "job": "job1"})
    t.set_tags({"hosts": "a,b", "torch": "2.14"})
    for step in range(1, 11):
        t.log_metrics({"loss": 1.0 / step, "accuracy": None, "world_size": 2}, step=step)
    t.log_artifact(tmp_path / "config.yaml", "config")
    assert t.wait_started(10) is not None
    t.close()
    run = store.runs[t.run_id]
    assert store.points(t.run_id, "loss") == list(range(1, 11))
    assert store.points(t.run_id, "accuracy") == []
    assert run["params"] == {"training.base_lr": "0.1", "job": "job1"}
    assert run["tags"]["hosts"] == "a,b"
    assert run["artifacts"] == [(str(tmp_path / "config.yaml"), "config")]
    assert run["status"] == "FINISHED"
    assert t.dropped == 0


def test_the_run_id_is_persisted_and_reused_by_the_next_tracker_of_the_job(store: FakeStore, tmp_path: Path) -> None:
    first = tracker(store, tmp_path)
    run_id = first.wait_started(10)
    first.close(status="KILLED")
    assert read_run_id(tmp_path) == run_id
    assert (tmp_path / layout.MLFLOW_RUN_ID).read_text() == f"{run_id}\n"
    second = tracker(store, tmp_path)
    assert second.wait_started(10) == run_id
    second.close()
    assert store.open_calls == [None, run_id]
    assert len(store.runs) == 1 and store.runs[run_id]["status"] == "FINISHED"


def test_a_lost_run_id_file_finds_the_run_by_its_tags_instead_of_creating_another(
    store: FakeStore, tmp_path: Path
) -> None:
    first = tracker(store, tmp_path)
    run_id = first.wait_started(10)
    first.close()
    (tmp_path / layout.MLFLOW_RUN_ID).unlink()
    second = tracker(store, tmp_path)
    assert second.wait_started(10) == run_id
    second.close()
    assert len(store.runs) == 1 and read_run_id(tmp_path) == run_id


def test_steps_re_run_after_a_rollback_are_not_logged_twice(store: FakeStore, tmp_path: Path) -> None:
    t = tracker(store, tmp_path)
    for step in range(1, 11):
        t.log_metrics({"loss": 1.0, "lr": 0.1}, step=step)
    for step in range(6, 13):  # rolled back to the commit at step 5, re-run
        t.log_metrics({"loss": 2.0, "lr": 0.1}, step=step)
    t.log_metrics({"recovery_seconds": 3.0}, step=6)  # a new metric may start at any step
    t.close()
    assert store.points(t.run_id, "loss") == list(range(1, 13))
    assert store.points(t.run_id, "lr") == list(range(1, 13))
    assert store.points(t.run_id, "recovery_seconds") == [6]
    assert t.skipped_duplicates == 2 * 5
    assert t.dropped == 0


def test_a_resumed_tracker_reads_the_high_water_marks_from_the_store(store: FakeStore, tmp_path: Path) -> None:
    first = tracker(store, tmp_path)
    for step in range(1, 21):
        first.log_metrics({"loss": 1.0}, step=step)
    first.close()
    resumed = tracker(store, tmp_path)  # resumed from a checkpoint at step 12
    for step in range(13, 26):
        resumed.log_metrics({"loss": 0.5, "samples_per_sec": 100.0}, step=step)
    resumed.close()
    assert store.points(first.run_id, "loss") == list(range(1, 26))
    assert store.points(first.run_id, "samples_per_sec") == list(range(13, 26))


def test_a_new_rank0_backfills_the_run_log_points_a_killed_rank0_never_sent_once(
    store: FakeStore, tmp_path: Path
) -> None:
    """Rank 0 sent loss up to step 10, then was SIGKILLed with steps 20 and 30 (and a checkpoint, a validation)
    still in its flush window. events.jsonl has them; the next rank 0 (which resumed from the commit at 25
    and re-ran step 30) must put each of them in the store exactly once."""

    killed = tracker(store, tmp_path)
    for step in range(1, 11):
        killed.log_metrics({"loss": 1.0 / step}, step=step)
    killed.close(status=None)
    run_id = killed.run_id

    def metrics(ts: float, step: int, loss: float) -> dict:
        fields = {"loss": loss, "lr": 0.1, "samples_per_sec": 50.0, "step_seconds": 0.2, "commit_seconds": 0.01}
        return {"ts": ts, "event": "metrics", "step": step, "epoch": 0, "world_size": 2, "steps": 10, **fields}

    log = [
        {"ts": 100.0, "event": "start", "step": 0, "epoch": 0, "world_size": 2},
        metrics(110.0, 10, 0.1),
        metrics(120.0, 20, 0.05),
        {"ts": 121.0, "event": "checkpoint", "step": 20, "epoch": 0, "world_size": 2, "stall_seconds": 0.3},
        metrics(130.0, 30, 0.04),
        {"ts": 131.0, "event": "epoch_end", "step": 30, "epoch": 0, "world_size": 2, "val_loss": 0.7,
         "val_accuracy": None},
        # the next rank 0: a failure, the reset at the commit of step 25, step 30 run again
        {"ts": 132.0, "event": "failure", "step": 25, "epoch": 0, "world_size": 2, "reason": "worker_failed"},
        {"ts": 135.0, "event": "reset", "step": 25, "epoch": 0, "world_size": 1, "recovery_seconds": 3.0},
        metrics(140.0, 30, 0.045),
    ]  # fmt: skip
    (tmp_path / layout.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in log) + '{"ts": 141, "ev')

    new = tracker(store, tmp_path)
    new.log_metrics({"recovery_seconds": 3.0}, step=25)  # what it logs live meanwhile
    new.log_metrics({"loss": 0.045}, step=30)
    new.log_metrics({"loss": 0.03}, step=40)
    assert new.wait_started(10) == run_id
    new.close(status=None)
    assert store.points(run_id, "loss") == [*range(1, 11), 20, 30, 40]
    for key in ("lr", "samples_per_sec", "step_seconds", "commit_seconds", "world_size"):
        assert store.points(run_id, key) == [10, 20, 30], key
    assert store.points(run_id, "checkpoint_stall_seconds") == [20]
    assert store.points(run_id, "val_loss") == [30] and store.points(run_id, "val_accuracy") == []
    assert store.points(run_id, "recovery_seconds") == [25]
    loss20 = next(p for p in store.runs[run_id]["metrics"] if p.key == "loss" and p.step == 20)
    assert (loss20.value, loss20.timestamp_ms) == (0.05, 120_000)
    loss30 = [p.value for p in store.runs[run_id]["metrics"] if p.key == "loss" and p.step == 30]
    assert loss30 == [0.04], "the first value of a step wins, as when the sender was alive"
    assert new.backfilled == 2 + 5 * 3 + 1 + 1 + 1 and new.dropped == 0

    again = tracker(store, tmp_path)  # a later rank 0: everything is in the store already
    assert again.wait_started(10) == run_id
    again.close()
    assert again.backfilled == 0
    assert store.points(run_id, "loss") == [*range(1, 11), 20, 30, 40]


def test_a_fresh_run_is_not_backfilled_from_an_old_run_log(store: FakeStore, tmp_path: Path) -> None:

    line = {"ts": 1.0, "event": "metrics", "step": 10, "epoch": 0, "world_size": 1, "loss": 1.0}
    (tmp_path / layout.EVENTS).write_text(json.dumps(line) + "\n")
    t = tracker(store, tmp_path)
    t.close()
    assert store.points(t.run_id, "loss") == [] and t.backfilled == 0


def test_params_are_logged_once_and_a_changed_value_becomes_a_tag(store: FakeStore, tmp_path: Path) -> None:
    first = tracker(store, tmp_path)
    first.log_params({f"p{i}": i for i in range(150)})  # more than one request's worth
    first.close()
    second = tracker(store, tmp_path)
    second.log_params({"p1": 1, "p2": 99, "new": "x"})
    second.close()
    run = store.runs[first.run_id]
    assert len(run["params"]) == 151 and run["params"]["p2"] == "2" and run["params"]["new"] == "x"
    assert run["tags"]["elastictrain.param_changed.p2"] == "2 -> 99"


def test_with_a_flush_interval_points_logged_meanwhile_go_as_one_request_and_close_cuts_the_wait(
    store: FakeStore, tmp_path: Path
) -> None:
    t = tracker(store, tmp_path, flush_interval_seconds=600)
    t.log_metrics({"loss": 1.0}, step=1)
    wait_until(lambda: len(store.batches) == 1, 10, what="the first request")
    for step in range(2, 51):  # the sender now waits out its interval: these gather in the queue
        t.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step=step)
    t.close(timeout=10)  # would drop all 49 if close did not interrupt the 600 s wait
    assert t.dropped == 0
    assert store.points(t.run_id, "loss") == list(range(1, 51))
    assert len(store.batches) == 2, "everything logged during the interval went in one request"


def test_a_handover_close_sends_what_is_queued_and_leaves_the_run_open_for_the_next_rank0(
    store: FakeStore, tmp_path: Path
) -> None:
    old = tracker(store, tmp_path)
    old.log_metrics({"loss": 1.0}, step=1)
    old.close(status=None)  # rank 0 moved to another process
    assert store.runs[old.run_id]["status"] == "RUNNING"
    new = tracker(store, tmp_path)
    new.log_metrics({"loss": 0.5}, step=2)
    new.close()
    assert new.run_id == old.run_id
    assert store.points(old.run_id, "loss") == [1, 2]
    assert store.runs[old.run_id]["status"] == "FINISHED"


def test_a_stalled_store_never_blocks_the_caller_and_drops_are_counted(store: FakeStore, tmp_path: Path) -> None:
    store.gate.clear()  # every request hangs until released
    t = tracker(store, tmp_path, queue_size=5)
    with capture_logs() as logs:
        for step in range(1, 101):  # would hang here if a call waited on the store
            t.log_metrics({"loss": 1.0, "lr": 0.1}, step=step)
        assert t.dropped > 0
        store.gate.set()
        t.close()
    sent = len(store.points(t.run_id, "loss")) + len(store.points(t.run_id, "lr"))
    assert sent + t.dropped == 200
    assert any(e["event"] == "tracking_points_dropped" and e["reason"] == "queue_full" for e in logs)


def test_failed_requests_drop_their_points_and_the_sender_keeps_going(store: FakeStore, tmp_path: Path) -> None:
    t = tracker(store, tmp_path)
    assert t.wait_started(10)
    store.fail_requests = True
    with capture_logs() as logs:
        for step in range(1, 11):
            t.log_metrics({"loss": 1.0}, step=step)
        t.close(timeout=10)
    assert t.dropped == 10
    assert any(e["event"] == "tracking_points_dropped" and e["reason"] == "request_failed" for e in logs)
    assert any(e["event"] == "tracking_closed" and e["dropped"] == 10 for e in logs)


def test_an_unreachable_store_at_start_costs_drops_not_a_hang(store: FakeStore, tmp_path: Path) -> None:
    store.fail_open = True
    t = tracker(store, tmp_path)
    for step in range(1, 6):
        t.log_metrics({"loss": 1.0}, step=step)
    t.log_params({"a": 1})
    assert t.wait_started(0.1) is None
    t.close(timeout=5)
    assert t.run_id is None and t.dropped == 6
    assert len(store.open_calls) >= 1 and read_run_id(tmp_path) is None


def test_the_store_coming_back_after_start_up_failures_opens_the_run(store: FakeStore, tmp_path: Path) -> None:
    store.fail_open = True
    t = tracker(store, tmp_path)
    t.log_metrics({"loss": 1.0}, step=1)
    while len(store.open_calls) < 2:
        threading.Event().wait(0.01)
    store.fail_open = False
    assert t.wait_started(10) is not None
    t.close()
    assert store.points(t.run_id, "loss") == [1] and t.dropped == 0


def test_close_gives_up_after_its_timeout_and_counts_what_was_left(store: FakeStore, tmp_path: Path) -> None:
    t = tracker(store, tmp_path)
    assert t.wait_started(10)
    store.gate.clear()
    for step in range(1, 51):
        t.log_metrics({"loss": 1.0}, step=step)
    t.close(timeout=0.2)  # returns although the store is still hanging
    assert t.dropped >= 1
    t.log_metrics({"loss": 1.0}, step=99)  # after close: counted, never raises
    store.gate.set()


def test_non_numbers_are_skipped_with_a_warning(store: FakeStore, tmp_path: Path) -> None:
    t = tracker(store, tmp_path)
    with capture_logs() as logs:
        t.log_metrics({"loss": "abc", "lr": 0.1}, step=1)  # type: ignore[dict-item]
    t.close()
    assert store.points(t.run_id, "lr") == [1] and store.points(t.run_id, "loss") == []
    assert any(e["event"] == "tracking_metric_not_a_number" for e in logs)


def test_null_tracker_and_factory(tmp_path: Path) -> None:
    cfg = config_from_dict({"job": "j", "run_dir": str(tmp_path)})
    assert isinstance(make_tracker(cfg, rank=1), NullTracker)
    off = config_from_dict({"job": "j", "run_dir": str(tmp_path), "tracking": {"mlflow": False}})
    null = make_tracker(off, rank=0)
    assert isinstance(null, NullTracker)
    null.log_params({"a": 1})
    null.log_metrics({"loss": 1.0}, step=1)
    null.set_tags({"x": 1})
    null.log_artifact("nothing")
    assert null.wait_started(0) is None and null.dropped == 0 and null.run_id is None
    null.close()


def test_the_tracking_uri_comes_from_config_then_env_then_the_run_dir(tmp_path: Path) -> None:
    assert resolve_tracking_uri("http://cfg:5000", tmp_path, env={"MLFLOW_TRACKING_URI": "http://env"}) == (
        "http://cfg:5000"
    )
    assert resolve_tracking_uri(None, tmp_path, env={"MLFLOW_TRACKING_URI": "http://env"}) == "http://env"
    assert resolve_tracking_uri(None, tmp_path, env={}) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"


def test_a_new_sqlite_store_appears_only_when_its_schema_is_complete(tmp_path):
    from elastictrain.engine.tracking import _create_sqlite_store_atomically

    db = tmp_path / "run" / "mlflow.db"
    _create_sqlite_store_atomically(f"sqlite:///{db}")
    assert db.exists()
    assert [p.name for p in db.parent.iterdir() if p.name.startswith(".")] == []  # no temp file left
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    assert client.search_experiments()  # a usable store with its schema
    before = db.stat().st_mtime_ns
    _create_sqlite_store_atomically(f"sqlite:///{db}")  # an existing store is left alone
    assert db.stat().st_mtime_ns == before
