"""MlflowTracker against real MLflow: the sqlite store in the run dir and a real ``mlflow server``."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from elastictrain.config import config_from_dict
from elastictrain.engine.tracking import SENDER_ENV, TAG_JOB, MlflowTracker, make_tracker, read_run_id
from elastictrain.rundir import layout
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.procs import wait_until

pytestmark = pytest.mark.integration

METRICS = ("loss", "lr", "world_size", "samples_per_sec")


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cwd of its own (MLflow must not put mlflow.db or mlruns/ there) and restored env vars."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key, value in SENDER_ENV.items():
        monkeypatch.setenv(key, value)
    return cwd


def log_steps(tracker: MlflowTracker, steps: range, world_size: int = 2) -> None:
    for step in steps:
        tracker.log_metrics(
            {"loss": 1.0 / step, "lr": 0.1, "world_size": world_size, "samples_per_sec": 100.0 + step}, step=step
        )


def assert_one_run_without_duplicate_points(uri: str, job: str, run_id: str, steps: list[int]) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("elastictrain")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_JOB}` = '{job}'")
    assert [r.info.run_id for r in runs] == [run_id]
    for key in METRICS:
        logged = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert logged == steps, key


def run_resumed_job(cfg_data: dict, uri: str) -> str:
    """Attempt 1 logs steps 1..10, rolls back to step 5 and re-logs 6..12, and is killed; attempt 2
    resumes from a checkpoint at step 8 (steps 9..20 again); both log the config as params."""
    cfg = config_from_dict(cfg_data)
    first = make_tracker(cfg, rank=0)
    assert isinstance(first, MlflowTracker) and first.tracking_uri == uri
    first.log_params(cfg.flat())
    first.set_tags({"hosts": "a,b", "elastictrain.attempt": 0})
    log_steps(first, range(1, 11))
    log_steps(first, range(6, 13), world_size=1)
    run_id = first.wait_started(60)
    assert run_id is not None
    first.close(status="KILLED")
    assert first.dropped == 0 and first.skipped_duplicates == 5 * len(METRICS)

    second = make_tracker(cfg, rank=0)
    assert second.wait_started(60) == run_id
    second.log_params(cfg.flat())
    second.set_tags({"hosts": "a", "elastictrain.attempt": 1})
    log_steps(second, range(9, 21))
    second.close()
    assert second.dropped == 0
    assert read_run_id(cfg.run_path) == run_id
    assert_one_run_without_duplicate_points(uri, cfg.job, run_id, list(range(1, 21)))
    return run_id


def test_the_sqlite_store_lives_in_the_run_dir_and_a_resumed_job_keeps_its_run_without_duplicates(
    tmp_path: Path, isolated_env: Path
) -> None:
    run_dir = tmp_path / "run"
    uri = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    run_id = run_resumed_job({"job": "sqlite-job", "run_dir": str(run_dir)}, uri)

    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["training.base_lr"] == "0.1" and run.data.tags["hosts"] == "a"
    assert (run_dir / "mlflow.db").is_file() and (run_dir / layout.MLFLOW_RUN_ID).is_file()
    assert list(isolated_env.iterdir()) == []  # nothing in the cwd: no mlflow.db, no mlruns/

    tracker = MlflowTracker(run_dir=run_dir, job="sqlite-job", tracking_uri=uri)
    config = tmp_path / "config.yaml"
    config.write_text("job: sqlite-job\n")
    tracker.log_artifact(config)
    tracker.close()
    assert [f.path for f in MlflowClient(tracking_uri=uri).list_artifacts(run_id)] == ["config.yaml"]
    assert list((run_dir / "mlartifacts").rglob("config.yaml"))


def test_a_resumed_job_on_a_tracking_server_keeps_its_run_without_duplicates(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    run_dir = tmp_path / "run"
    data = {"job": "server-job", "run_dir": str(run_dir), "tracking": {"tracking_uri": mlflow_server.uri}}
    run_resumed_job(data, mlflow_server.uri)
    assert not (run_dir / "mlflow.db").exists()


def test_tracking_server_stopped_mid_training_never_blocks_a_step_and_the_drops_are_reported(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    from mlflow import MlflowClient

    tracker = MlflowTracker(run_dir=tmp_path / "run", job="outage-job", tracking_uri=mlflow_server.uri, queue_size=20)
    run_id = tracker.wait_started(60)
    assert run_id is not None
    log_steps(tracker, range(1, 21))
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    wait_until(lambda: len(client.get_metric_history(run_id, "loss")) == 20, timeout=30, what="first points stored")

    mlflow_server.stop()
    with capture_logs() as logs:
        log_steps(tracker, range(21, 521))  # 500 "steps" with the server gone: every call returns
        tracker.close(timeout=30)
    assert tracker.dropped > 0
    assert any(e["event"] == "tracking_points_dropped" for e in logs)
    closed = [e for e in logs if e["event"] == "tracking_closed"]
    assert closed and closed[0]["dropped"] == tracker.dropped


def test_a_new_rank0_backfills_from_the_run_log_what_a_killed_rank0_never_sent_to_the_store(tmp_path: Path) -> None:
    """The first rank 0 sent steps 1..10 and was killed with 11..20 in its flush window; its EventLog wrote all
    20. The next rank 0 opens the same sqlite store: every step is there once, with the run log's values."""
    from mlflow import MlflowClient

    from elastictrain.rundir.events import Checkpoint, EventLog, Metrics

    run_dir = tmp_path / "run"
    cfg = config_from_dict({"job": "backfill-job", "run_dir": str(run_dir)})
    killed = make_tracker(cfg, rank=0)
    assert isinstance(killed, MlflowTracker)
    log_steps(killed, range(1, 11))
    run_id = killed.wait_started(60)
    killed.close(status=None)  # what reached the store before the SIGKILL

    run_log = EventLog(run_dir / "events.jsonl")
    for step in range(1, 21):
        run_log.emit(
            Metrics(
                step=step,
                epoch=0,
                world_size=2,
                ts=1_700_000_000.0 + step,
                loss=1.0 / step,
                lr=0.1,
                samples_per_sec=100.0 + step,
                step_seconds=0.5,
                commit_seconds=0.01,
                steps=1,
            )
        )
        if step == 15:
            run_log.emit(Checkpoint(step=15, epoch=0, world_size=2, stall_seconds=0.25, write_seconds=1.0, ok=True))
    run_log.close()

    new = make_tracker(cfg, rank=0)
    assert isinstance(new, MlflowTracker)
    log_steps(new, range(18, 26))  # the new rank 0 resumed from the commit at 17: 18..20 again, then on
    assert new.wait_started(60) == run_id
    new.close()
    uri = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    assert_one_run_without_duplicate_points(uri, cfg.job, run_id, list(range(1, 26)))
    # loss, lr, world_size, samples_per_sec for 11..20; step_seconds, commit_seconds for 1..20; one stall
    assert new.dropped == 0 and new.backfilled == 4 * 10 + 2 * 20 + 1
    client = MlflowClient(tracking_uri=uri)
    loss = {m.step: (m.value, m.timestamp) for m in client.get_metric_history(run_id, "loss")}
    assert loss[15] == (1.0 / 15, (1_700_000_000 + 15) * 1000), "backfilled with the run log's value and time"
    for key in ("step_seconds", "commit_seconds"):  # the first rank 0 never sent these: all 20 from the log
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, 21)), key
    assert [m.step for m in client.get_metric_history(run_id, "checkpoint_stall_seconds")] == [15]
