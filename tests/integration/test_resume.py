"""Preemption of the whole job and SIGTERM to the workers, with real horovodrun, checkpoints and MLflow."""

from __future__ import annotations

import signal

import pytest

from chaos.jobs import ElasticJob
from elastictrain.checkpoint import LocalStorage, load_latest
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Commit, Done, Start, Stopped, TrackingClosed, of_kind, read_events
from elastictrain.rundir.ledger import committed_samples
from tests.fixtures.elastic_job import assert_exactly_once, job_config
from tests.fixtures.procs import kill_tree, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOSTS = local_logical_hosts()


def test_full_job_killed_mid_epoch_resumes_at_the_checkpoint_in_the_same_mlflow_run(jobs, tmp_path):
    cfg = job_config(
        tmp_path / "run", training__epochs=1, data__num_samples=1536, tracking__mlflow=True, checkpoint__every_steps=9
    )
    first = ElasticJob(tmp_path / "a", cfg, HOSTS[:2])
    jobs.append(first.start())
    wait_until(
        lambda: (load_latest(LocalStorage.for_run_dir(first.run_dir)) or None) is not None and first.step() >= 14,
        180,
        what="a checkpoint and step 14",
    )
    kill_tree(first.proc.pid, signal.SIGKILL)  # every worker and horovodrun at once: a preemption
    first.proc.wait(timeout=30)
    killed_at = first.step()
    ckpt = load_latest(LocalStorage.for_run_dir(first.run_dir))
    assert ckpt is not None and 0 < ckpt.step <= killed_at

    second = ElasticJob(tmp_path / "b", cfg, HOSTS[:2])
    jobs.append(second.start())
    assert second.wait_exit() == 0, second.tail()

    starts = of_kind(read_events(second.events_path), Start)
    assert starts[-1].resumed_from_step == ckpt.step  # the step counter continues from the checkpoint
    assert_exactly_once(second, 1536, 1)  # across both runs, via the ledger's restore marker

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{second.run_dir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), "a (step, loss) point was logged twice"
    assert max(steps) > killed_at  # points from after the resume are in the same run
    run = runs[0]
    # Rank 0 waits for the tracking run before the first step of each attempt: both start events link to it.
    assert [e.run_id for e in of_kind(read_events(second.events_path), Start)] == [run.info.run_id] * 2
    assert run.data.tags["horovod"] == "0.28.1" and run.data.tags["torch"].startswith("2.")
    assert run.data.params["training.epochs"] == "1"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "report.png", "report.json"} <= artifacts, artifacts
    assert (second.run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = of_kind(read_events(second.events_path), Done)
    assert done and isinstance(done[-1].final_loss, float)


@pytest.mark.parametrize("rollback", ["commit", "none"])
def test_sigterm_to_the_workers_checkpoints_the_last_commit_before_they_exit(jobs, tmp_path, rollback):
    """``commit``: the last in-memory commit. ``none``: the live state is the commit, so the last completed step,
    with its samples in the ledger."""
    cfg = job_config(
        tmp_path / "run",
        training__epochs=3,
        checkpoint__every_steps=1000,
        checkpoint__every_epochs=None,
        elastic__rollback=rollback,
    )
    job = ElasticJob(tmp_path / "t", cfg, HOSTS[:2])
    jobs.append(job.start())
    job.wait_step(7)
    for w in job.workers():
        w.send_signal(signal.SIGTERM)
    job.wait_exit()
    stopped = job.events(Stopped)
    assert stopped and stopped[-1].checkpointed is True, job.tail()
    last_commit = max(e.step for e in job.events(Commit))
    ckpt = load_latest(LocalStorage.for_run_dir(job.run_dir))
    assert ckpt is not None
    assert ckpt.step == (last_commit if rollback == "commit" else stopped[-1].step), (ckpt.step, last_commit)
    ledger = committed_samples(job.run_dir / "ledger")
    assert sum(len(ids) for ids in ledger.values()) == ckpt.state["counters"]["samples"]


def test_tracking_server_stopped_mid_training_costs_points_not_the_job(jobs, tmp_path, mlflow_server):
    cfg = job_config(
        tmp_path / "run",
        training__epochs=1,
        tracking__mlflow=True,
        tracking__tracking_uri=mlflow_server.uri,
        training__log_every_steps=2,
    )
    job = ElasticJob(tmp_path / "m", cfg, HOSTS[:2])
    jobs.append(job.start())
    job.wait_step(10)
    mlflow_server.stop()
    assert job.wait_exit() == 0, job.tail()
    assert job.events(Done)
    closed = job.events(TrackingClosed)
    assert closed and (closed[-1].dropped or 0) > 0, closed
