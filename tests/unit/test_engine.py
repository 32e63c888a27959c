"""The worker's engine in one process (``elastictrain.engine``): the loop, a resize, a failed step and a
rank-0 handover, driven through Horovod's own elastic loop over a scripted one-process world."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from horovod.runner.elastic.worker import HostUpdateResult

from elastictrain.checkpoint import LocalStorage, load_latest
from elastictrain.config import JobConfig
from elastictrain.engine.collective import LocalCollective
from elastictrain.engine.policy import ScaleRamp, lr_scale
from elastictrain.engine.reset import PAUSE_PARTS, PendingReset, pause_parts, plan_reset
from elastictrain.engine.sampler import ExactlyOncePlanner
from elastictrain.engine.services import Rank0Services
from elastictrain.engine.tracking import NullTracker
from elastictrain.engine.trainer import Trainer, run_trainer
from elastictrain.rundir.events import (
    Commit,
    Done,
    EpochEnd,
    Failure,
    Reset,
    Start,
    TrackingClosed,
    of_kind,
    read_events,
)
from elastictrain.rundir.ledger import ledger_files
from elastictrain.tools.audit import audit_run_dir
from tests.fixtures.engine import Act, ScriptedWorld, small_job

ADDED, REMOVED = HostUpdateResult.added, HostUpdateResult.removed
STEPS = 16  # 2 epochs x 64 samples / batch 8, in a world of one


def train(cfg: JobConfig, world: LocalCollective) -> tuple[int, Trainer]:
    trainer = Trainer.build(cfg, world)
    if isinstance(world, ScriptedWorld):
        world.state = trainer.state
    return run_trainer(trainer), trainer


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.parts.model.state_dict().items()}


def exactly_once(cfg: JobConfig) -> None:
    audit = audit_run_dir(cfg.run_path).audit
    assert (audit.lost, audit.duplicated, audit.epochs_checked) == (0, 0, cfg.training.epochs)


def test_the_loop_trains_to_completion_commits_checkpoints_and_reports(tmp_path):
    cfg = small_job(tmp_path / "run")
    code, trainer = train(cfg, LocalCollective())
    assert code == 0
    events = read_events(cfg.run_path / "events.jsonl")
    assert [type(e) for e in events[:1]] == [Start] and isinstance(events[-1], TrackingClosed)
    assert len(of_kind(events, Start)) == 1 and not of_kind(events, Reset)
    assert [e.epoch for e in of_kind(events, EpochEnd)] == [0, 1]
    assert of_kind(events, Done)[0].step == STEPS and of_kind(events, Done)[0].checkpointed
    assert {e.step for e in of_kind(events, Commit)} >= set(range(2, STEPS + 1, 2))
    exactly_once(cfg)
    loaded = load_latest(LocalStorage.for_run_dir(cfg.run_path), map_location="cpu")
    assert loaded is not None and loaded.step == STEPS
    for k, v in params(trainer).items():
        assert torch.equal(loaded.state["model"][k], v), k
    assert not trainer.services.is_open  # closed at the end


def test_a_scale_up_at_a_commit_rescales_the_lr_and_splits_the_batch_over_the_new_world(tmp_path):
    cfg = small_job(tmp_path / "run")
    world = ScriptedWorld({3: Act(notice=ADDED, world=(0, 2))})
    code, trainer = train(cfg, world)
    assert code == 0
    events = read_events(cfg.run_path / "events.jsonl")
    [failure], [reset] = of_kind(events, Failure), of_kind(events, Reset)
    assert (failure.reason, failure.step, failure.world_size) == ("hosts_changed", 4, 1)  # acted on at the commit
    assert (reset.old_size, reset.new_size, reset.step, reset.lost_steps) == (1, 2, 5, 0)
    assert world.sizes_at_step[:4] == [1, 1, 1, 1] and set(world.sizes_at_step[4:]) == {2}
    assert trainer.ramp.target == lr_scale(cfg.elastic, 2) != lr_scale(cfg.elastic, 1)
    # 8 samples per worker and step: 4 steps of 8, then the other 32 of epoch 0 and all 64 of epoch 1 by 16.
    assert of_kind(events, Done)[0].step == 4 + 2 + 4
    exactly_once(cfg)


@pytest.mark.parametrize("rollback", ["none", "commit"])
def test_a_failed_step_is_redone_and_the_job_ends_where_a_fault_free_one_does(tmp_path, rollback):
    clean_cfg = small_job(tmp_path / "clean", elastic={"rollback": rollback})
    _, clean = train(clean_cfg, LocalCollective())
    cfg = small_job(tmp_path / "run", elastic={"rollback": rollback})
    world = ScriptedWorld({7: Act(fail=True)})
    code, trainer = train(cfg, world)
    assert code == 0
    events = read_events(cfg.run_path / "events.jsonl")
    [failure], [reset] = of_kind(events, Failure), of_kind(events, Reset)
    assert failure.reason == "worker_failed" and "scripted" in (failure.error or "")
    # none: the live state is a whole step (step 6), nothing rolled back; commit: back to the commit at 6 as well
    assert (reset.step, reset.lost_steps, world.resets) == (7, 0, 1)
    assert of_kind(events, Done)[0].step == STEPS
    exactly_once(cfg)
    for k, v in params(clean).items():
        assert torch.allclose(params(trainer)[k], v, atol=1e-6), k


def test_rollback_commit_loses_the_steps_after_the_commit_and_none_loses_none(tmp_path):
    lost = {}
    for rollback in ("commit", "none"):
        cfg = small_job(tmp_path / rollback, elastic={"rollback": rollback, "commit_every_steps": 4})
        code, _ = train(cfg, ScriptedWorld({7: Act(fail=True)}))  # steps 5 and 6 done since the commit at 4
        assert code == 0
        [reset] = of_kind(read_events(cfg.run_path / "events.jsonl"), Reset)
        lost[rollback] = reset.lost_steps
        exactly_once(cfg)
    assert lost == {"commit": 2, "none": 0}


def test_rank0_moves_to_another_worker_and_back_and_services_follow(tmp_path):
    cfg = small_job(tmp_path / "run")
    world = ScriptedWorld({3: Act(notice=ADDED, world=(1, 2)), 6: Act(notice=ADDED, world=(0, 2))})
    code, trainer = train(cfg, world)
    assert code == 0
    events = read_events(cfg.run_path / "events.jsonl")
    # While this process was rank 1 (steps 5-6 at size 2), the other worker held rank 0: nothing written here.
    commits = [(e.step, e.epoch) for e in of_kind(events, Commit)]
    assert (4, 0) in commits and (6, 0) not in commits and (6, 1) in commits  # 6, 1: the epoch end, as rank 0
    assert len(of_kind(events, Start)) == 1  # the job started once; taking rank 0 back is a reset
    assert [r.new_size for r in of_kind(events, Reset)] == [2]  # the one reported by this process as rank 0
    assert len(ledger_files(cfg.run_path / "ledger")) == 2  # one per tenure as rank 0
    exactly_once(cfg)  # the steps trained while away were replayed from the synced step log
    assert isinstance(events[-1], TrackingClosed) and not trainer.services.is_open


def test_a_removal_notice_shrinks_the_world_without_a_failure(tmp_path):
    cfg = small_job(tmp_path / "run")
    world = ScriptedWorld({1: Act(world=(0, 2)), 2: Act(notice=ADDED), 5: Act(notice=REMOVED, world=(0, 1))})
    code, _ = train(cfg, world)
    assert code == 0
    resets = of_kind(read_events(cfg.run_path / "events.jsonl"), Reset)
    assert [(r.old_size, r.new_size, r.reason) for r in resets] == [(1, 2, "hosts_changed"), (2, 1, "hosts_removed")]
    exactly_once(cfg)


def test_each_reset_reports_the_parts_of_its_pause_and_they_add_up_to_the_recovery(tmp_path):
    cfg = small_job(tmp_path / "run")
    world = ScriptedWorld({3: Act(notice=ADDED, world=(0, 2)), 7: Act(fail=True), 9: Act(notice=REMOVED, world=(0, 1))})
    code, _ = train(cfg, world)
    assert code == 0
    resets = of_kind(read_events(cfg.run_path / "events.jsonl"), Reset)
    assert [r.reason for r in resets] == ["hosts_changed", "worker_failed", "hosts_removed"]
    for r in resets:
        parts = [getattr(r, f"{p}_seconds") for p in PAUSE_PARTS]
        assert all(p is not None and p >= 0 for p in parts), (r.reason, parts)
        assert sum(parts) == pytest.approx(r.recovery_seconds, abs=0.01), (r.reason, parts)
    assert resets[2].sync_seconds == 0.0, "Horovod skips the sync when hosts were only removed"


class CountingWorld(ScriptedWorld):
    """Records the name of every object collective (a round over the whole world each, whatever its size)."""

    def __init__(self, script: dict[int, Act]) -> None:
        super().__init__(script)
        self.rounds: list[str] = []

    def allgather_object(self, obj, name):
        self.rounds.append(f"allgather:{name}")
        return super().allgather_object(obj, name)

    def broadcast_object(self, obj, root, name):
        self.rounds.append(f"broadcast:{name}")
        return super().broadcast_object(obj, root, name)

    def broadcast_(self, tensors, root):
        self.rounds.append("broadcast:tensors")
        return super().broadcast_(tensors, root)


def test_a_reset_costs_three_collectives_from_its_rendezvous_to_its_first_step(tmp_path):
    """Each collective is a round over the whole world; at 32 workers sharing cores one costs about a step, so the
    sync and the training function's start must not add rounds per optimizer, per object or per host list."""
    cfg = small_job(tmp_path / "run")
    world = CountingWorld({7: Act(fail=True)})
    code, _ = train(cfg, world)
    assert code == 0
    # the job's start and the reset after the failure: each one sync, nothing else before the first step
    syncs = [r for r in world.rounds if r.startswith("allgather:sync.positions")]
    assert len(syncs) == 2
    per_sync = ["allgather:sync.positions", "broadcast:sync.meta", "broadcast:tensors"]
    assert [r for r in world.rounds if not r.startswith("allgather:val")] == per_sync * 2, world.rounds


def test_pause_parts_split_the_recovery_at_the_marks_and_leave_unseen_parts_out():
    marks = {"caught": 11.0, "reset": 14.5, "sync_start": 14.5, "sync_end": 15.0, "prologue_end": 15.25}
    assert pause_parts(10.0, marks, 16.0) == {
        "detect": 1.0,
        "rendezvous": 3.5,
        "sync": 0.5,
        "prologue": 0.25,
        "first_step": 0.75,
    }
    # a sync from before the reset (the job's start) is not this reset's: skipped, 0
    skipped = {"caught": 11.0, "reset": 12.0, "sync_start": 5.0, "sync_end": 6.0, "prologue_end": 12.5}
    assert pause_parts(10.0, skipped, 13.0)["sync"] == 0.0
    assert pause_parts(10.0, skipped, 13.0)["prologue"] == 0.5
    # a worker started during the reset saw neither the failure nor Horovod's reset
    joined = pause_parts(10.0, {"sync_start": 14.0, "sync_end": 14.5, "prologue_end": 15.0}, 16.0)
    assert joined["detect"] is None and joined["rendezvous"] is None and joined["first_step"] == 1.0


def test_pause_parts_add_up_to_the_pause_when_the_sync_is_guarded_before_its_first_mark():
    """The watchdog takes the new ring's connections between Horovod's reset and the sync's first mark
    (:func:`elastictrain.engine.watch.guard_sync`): that time is the sync's, not nobody's (the 8-worker test once
    found parts 0.06 s short of ``recovery_seconds``)."""
    marks = {"caught": 11.0, "reset": 14.5, "sync_start": 14.6, "sync_end": 15.0, "prologue_end": 15.25}
    parts = pause_parts(10.0, marks, 16.0)
    assert parts["sync"] == 0.5
    assert sum(parts.values()) == 6.0


# ------------------------------------------------------------------------------------- the reset plan (pure)
ELASTIC = small_job(Path("/nonexistent"), elastic={"lr_ramp_steps": 10}).elastic


def test_a_start_jumps_to_the_new_size_scale_and_reports_no_reset():
    plan = plan_reset(
        step=0, committed_size=0, new_size=4, ramp=ScaleRamp(1, 1, 0, 0), failure=None, lost_steps=0,
        elastic=ELASTIC, now=5.0,
    )  # fmt: skip
    assert plan.starting and plan.reset is None
    assert plan.ramp == ScaleRamp(lr_scale(ELASTIC, 4), lr_scale(ELASTIC, 4), 0, 0)


def test_a_resize_ramps_from_where_the_lr_stands_and_reports_the_failure_time():
    ramp = ScaleRamp(2.0, 4.0, 0, 10)  # halfway at step 5: 3.0
    plan = plan_reset(
        step=5, committed_size=4, new_size=2, ramp=ramp, failure=("worker_failed", 1.5), lost_steps=1,
        elastic=ELASTIC, now=9.0,
    )  # fmt: skip
    assert not plan.starting
    assert plan.reset == PendingReset(4, 2, "worker_failed", 1.5, 1)
    assert plan.ramp == ScaleRamp(3.0, lr_scale(ELASTIC, 2), 5, 10)


def test_a_resize_without_a_recorded_failure_is_a_host_change_timed_now():
    plan = plan_reset(
        step=5, committed_size=2, new_size=3, ramp=ScaleRamp(1, 1, 0, 0), failure=None, lost_steps=0,
        elastic=ELASTIC, now=9.0,
    )  # fmt: skip
    assert plan.reset == PendingReset(2, 3, "hosts_changed", 9.0, 0)


def test_a_failure_at_the_same_size_keeps_the_ramp_and_a_plain_restart_is_nothing():
    same = plan_reset(
        step=5, committed_size=2, new_size=2, ramp=ScaleRamp(1, 1, 0, 0), failure=("worker_failed", 3.0),
        lost_steps=2, elastic=ELASTIC, now=9.0,
    )  # fmt: skip
    assert same.ramp is None and same.reset == PendingReset(2, 2, "worker_failed", 3.0, 2)
    nothing = plan_reset(
        step=5, committed_size=2, new_size=2, ramp=ScaleRamp(1, 1, 0, 0), failure=None, lost_steps=0,
        elastic=ELASTIC, now=9.0,
    )  # fmt: skip
    assert nothing.reset is None and nothing.ramp is None and not nothing.starting


def test_rank0_services_wait_for_the_checkpoint_writer_at_the_start_only(tmp_path, monkeypatch):
    """At the job's start everyone waits anyway; a worker that takes rank 0 after a reset must not make the others
    wait while its checkpoint writer's fork server imports torch."""
    from elastictrain.engine import services

    waits: list[bool] = []
    real = services.Checkpointer

    def recording(*args, **kwargs):
        waits.append(kwargs["wait_for_writer"])
        return real(*args, **kwargs)

    monkeypatch.setattr(services, "Checkpointer", recording)
    cfg = small_job(tmp_path / "run")
    code, _ = train(cfg, ScriptedWorld({3: Act(notice=ADDED, world=(1, 2)), 6: Act(notice=ADDED, world=(0, 2))}))
    assert code == 0 and waits == [True, False]


def test_rank0_opens_the_mlflow_run_while_the_parts_are_built_and_its_start_event_links_it(tmp_path, monkeypatch):
    """The MLflow open (import, a new store's schema: seconds) overlaps the build instead of holding every rank
    at the start; the start event carries the run id."""
    from elastictrain.engine import trainer as trainer_module
    from tests.fixtures.procs import wait_until

    cfg = small_job(tmp_path / "run", tracking={"mlflow": True})
    run_id_file = cfg.run_path / "mlflow_run_id"
    real = trainer_module.build_parts

    def slow_build(*args, **kwargs):
        parts = real(*args, **kwargs)
        wait_until(run_id_file.exists, 60, interval=0.05, what="the MLflow run to open during the build")
        return parts

    monkeypatch.setattr(trainer_module, "build_parts", slow_build)
    code, _ = train(cfg, LocalCollective())
    assert code == 0
    [start] = of_kind(read_events(cfg.run_path / "events.jsonl"), Start)
    assert start.run_id == run_id_file.read_text().strip()


def test_a_worker_that_takes_rank0_before_the_first_sync_tracks_to_mlflow(tmp_path):
    """Ranks can move between the build and the first sync (a reset): the new rank 0 opens a real tracker."""
    cfg = small_job(tmp_path / "run", tracking={"mlflow": True})
    world = LocalCollective(rank=1, size=2)
    trainer = Trainer.build(cfg, world)
    world.resize(0, 1)
    world.reset()
    assert run_trainer(trainer) == 0
    [start] = of_kind(read_events(cfg.run_path / "events.jsonl"), Start)
    assert start.run_id is not None and start.run_id == (cfg.run_path / "mlflow_run_id").read_text().strip()


class _RecordingTracker(NullTracker):
    def __init__(self) -> None:
        self.closed_with: list[str | None] = []

    def close(self, status: str | None = "FINISHED", timeout: float = 30.0) -> None:
        self.closed_with.append(status)


def test_a_tracker_started_early_is_used_by_rank0_or_left_open_for_the_process_that_takes_rank0(tmp_path):
    cfg = small_job(tmp_path / "run")
    planner = ExactlyOncePlanner(64, 0)
    services = Rank0Services(cfg, planner, lambda kind, detail: None)
    early = _RecordingTracker()
    services.prepare(early)
    services.open(step=0, total_steps=None, wait_for_tracking=False)
    assert services.tracker is early and early.closed_with == []
    services.close("FINISHED", step=0, epoch=0, world_size=1)
    assert early.closed_with == ["FINISHED"]

    other = Rank0Services(cfg, planner, lambda kind, detail: None)
    early = _RecordingTracker()
    other.prepare(early)
    other.hand_over()  # rank 0 moved before this process opened its services: the run is not this one's to end
    other.close("FINISHED", step=0, epoch=0, world_size=1)
    assert early.closed_with == [None]
