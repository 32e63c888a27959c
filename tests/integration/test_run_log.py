"""What the run log says about resets, failures, starts and resumes, and that a finished run trains no more.

The real worker (``elastictrain.engine.compose.run``) runs in one process under real single-rank Horovod, with
scripted interruptions (``tests/integration/workers/scripted_trainer.py``): a ``HorovodInternalError``
inside a chosen step, a ``HostsUpdatedInterrupt`` at a chosen commit, and the world size and rank the
worker sees after each. That makes the exact moments reproducible which real kills hit only by chance.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.rundir import layout
from elastictrain.rundir.events import Done, E, EpochEnd, Event, Failure, Reset, Start, of_kind, read_events
from elastictrain.rundir.ledger import committed_samples, ledger_files
from tests.fixtures.elastic_job import job_config
from tests.fixtures.procs import VENV_BIN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 480  # batch 16: 30 steps per epoch at world size 1, 15 at 2, 10 at 3


def config(run_dir: Path, **overrides: Any) -> dict[str, Any]:
    base = {
        "data__num_samples": NUM_SAMPLES,
        "data__num_val_samples": 32,
        "training__epochs": 1,
        "checkpoint__every_steps": 1000,
        **overrides,
    }
    return job_config(run_dir, **base)


def run_worker(cfg: dict[str, Any], script: list[dict[str, Any]], timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tests.integration.workers.scripted_trainer", json.dumps(cfg), json.dumps(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def events(run_dir: Path, kind: type[E] = Event) -> list[E]:  # type: ignore[assignment]
    return of_kind(read_events(run_dir / layout.EVENTS), kind)


def test_a_host_notice_at_the_final_epoch_end_does_not_train_another_epoch(tmp_path):
    cfg = config(tmp_path / "run")
    proc = run_worker(cfg, [{"kind": "notice_at_epoch_end", "epoch": 1, "size": 1}])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    assert sorted(committed_samples(run / "ledger")) == [0], "trained into an epoch past training.epochs"
    assert max(e.step for e in events(run)) == 30
    assert len(events(run, EpochEnd)) == 1 and len(events(run, Done)) == 1


def test_a_completed_run_dir_started_again_trains_nothing_and_exits_0(tmp_path):
    cfg = config(tmp_path / "run")
    first = run_worker(cfg, [])
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_worker(cfg, [])
    assert again.returncode == 0, again.stderr[-3000:]
    run = tmp_path / "run"
    assert sorted(committed_samples(run / "ledger")) == [0]
    assert max(e.step for e in events(run)) == 30
    assert "run already complete" in again.stdout + again.stderr


@pytest.fixture(scope="module", params=[("commit", 1), ("none", 0)], ids=["commit", "none"])
def shrink_run(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess, int]:
    """One real run per rollback mode, shared: 3 workers; a host change at step 3 leaves 2; a worker dies in step 5,
    leaving 1. Commits every 3 steps: rollback ``commit`` redoes step 4 (1 step lost), ``none`` nothing."""
    rollback, lost = request.param
    run = tmp_path_factory.mktemp(f"shrink-{rollback}") / "run"
    script = [
        {"kind": "initial", "size": 3},
        {"kind": "notice", "step": 3, "size": 2},
        {"kind": "failure", "step": 5, "size": 1},
    ]
    return run, run_worker(config(run, elastic__rollback=rollback), script), lost


def test_failures_are_logged_and_a_shrink_after_a_reset_names_the_size_it_left(shrink_run):
    run, proc, lost = shrink_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(events(run, Start)) == 1
    failures = events(run, Failure)
    assert [f.reason for f in failures] == ["hosts_changed", "worker_failed"], failures
    assert "scripted: a peer died" in (failures[1].error or "")
    resets = [(r.old_size, r.new_size, r.reason, r.lost_steps) for r in events(run, Reset)]
    assert resets == [(3, 2, "hosts_changed", 0), (2, 1, "worker_failed", lost)], resets
    for failure, reset in zip(failures, events(run, Reset), strict=True):  # each failure before its reset
        assert failure.ts <= reset.ts
    per_epoch = committed_samples(run / "ledger")
    assert sorted(per_epoch[0]) == list(range(NUM_SAMPLES))


def test_elastictrain_audit_passes_on_a_real_run_and_fails_once_a_ledger_entry_is_duplicated(shrink_run, tmp_path):
    run, proc, _ = shrink_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def audit(run_dir: Path) -> subprocess.CompletedProcess:
        cmd = [str(VENV_BIN / "elastictrain"), "audit", "--run-dir", str(run_dir)]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)

    ok = audit(run)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "epoch 0  complete  expected 480  seen 480  duplicates 0  missing 0" in ok.stdout, ok.stdout
    assert "verdict  PASS: 1 epochs audited (1 complete, 0 partial)" in ok.stdout

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    newest = ledger_files(copy / "ledger")[-1]
    lines = newest.read_text().splitlines()
    entries = [json.loads(x) for x in lines if '"kind":"step"' in x]
    assert entries, lines
    twice = {**entries[0], "step": max(e["step"] for e in entries) + 1}  # one step's samples used again
    newest.write_text("\n".join([*lines, json.dumps(twice)]) + "\n")
    bad = audit(copy)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    dup = len(twice["ids"])
    assert f"seen {480 + dup}  duplicates {dup} (e.g. {min(twice['ids'])}" in bad.stdout, bad.stdout
    assert "verdict  FAIL" in bad.stdout and bad.stderr == ""


def test_a_failed_gradient_allreduce_with_rollback_none_costs_only_that_step(tmp_path):
    """The allreduce of step 8 fails after every backward pass enqueued its part (commits every 3 steps): the
    step's pending allreduces and gradients are dropped, nothing is rolled back, and the run ends with the
    parameters of a run without the failure."""
    from elastictrain.checkpoint import LocalStorage, load_latest

    params = {}
    for name, script in (("clean", []), ("failed", [{"kind": "allreduce_failure", "step": 8}])):
        run = tmp_path / name
        proc = run_worker(config(run, elastic__rollback="none", training__grad_accumulation=2), script)
        assert proc.returncode == 0, proc.stderr[-3000:]
        loaded = load_latest(LocalStorage.for_run_dir(run))
        assert loaded is not None
        params[name] = torch.cat([t.flatten().double() for t in loaded.state["model"].values()])
    failures, resets = events(run, Failure), events(run, Reset)
    assert [(f.reason, f.step) for f in failures] == [("worker_failed", 7)], failures
    assert "gradient allreduce" in (failures[0].error or "")
    assert [(r.reason, r.step, r.lost_steps) for r in resets] == [("worker_failed", 8, 0)], resets
    assert sorted(committed_samples(run / "ledger")[0]) == list(range(NUM_SAMPLES))
    assert torch.equal(params["clean"], params["failed"])


def test_rank0_moving_away_and_back_writes_no_second_start(tmp_path):
    cfg = config(tmp_path / "run")
    script = [
        {"kind": "initial", "size": 2},
        {"kind": "notice", "step": 3, "size": 2, "rank": 1},  # rank 0 is another process now
        {"kind": "notice", "step": 6, "size": 2, "rank": 0},  # and this one again
    ]
    proc = run_worker(cfg, script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    assert len(events(run, Start)) == 1, events(run, Start)
    from elastictrain.tools.status import read_status

    assert read_status(run)["attempts"] == 1


def test_a_resume_at_another_world_size_is_a_start_with_the_old_size_not_a_reset(tmp_path):
    run = tmp_path / "run"
    first = run_worker(config(run, training__max_steps=6), [{"kind": "initial", "size": 2}])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_worker(config(run, training__max_steps=12), [])
    assert second.returncode == 0, second.stderr[-3000:]
    starts = events(run, Start)
    assert len(starts) == 2
    assert starts[1].resumed_from_step == 6 and starts[1].resumed_world_size == 2, starts[1]
    assert starts[1].world_size == 1
    assert events(run, Reset) == [], events(run, Reset)
    assert max(e.step for e in events(run)) == 12


def test_launching_a_completed_run_dir_says_so_and_exits_0_without_starting_anything(tmp_path):
    run = tmp_path / "run"
    cfg = config(run)
    first = run_worker(cfg, [])
    assert first.returncode == 0, first.stderr[-3000:]
    before = (run / "events.jsonl").read_bytes()
    config_file = tmp_path / "job.yaml"
    config_file.write_text(json.dumps(cfg))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launch = subprocess.run(
        [sys.executable, "-m", "elastictrain.cli", "launch", "--config", str(config_file), "--min-np", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]
    assert "run complete" in launch.stdout and "epoch 1 of 1" in launch.stdout, launch.stdout
    assert (run / "events.jsonl").read_bytes() == before  # no worker ran
    assert not (run / "etcd").exists() and not (run / "launch.json").exists()
    # more epochs is not complete: the same check says so
    from elastictrain.config import config_from_dict
    from elastictrain.launcher.main import run_complete

    assert run_complete(config_from_dict({**cfg, "training": {**cfg["training"], "epochs": 2}})) is None
