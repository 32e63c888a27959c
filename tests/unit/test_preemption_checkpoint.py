"""The just-in-time checkpoint of a preemption notice (``elastictrain.engine.health.preemption``): the pure decision,
rank 0's reader over an in-memory registry, and the trainer's hooks at a commit, in one process."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from horovod.runner.elastic.worker import HostUpdateResult

from discovery.notice import CheckpointPlan
from discovery.record import HostRecord
from discovery.registry import HostRegistry, InMemoryRegistry
from elastictrain.checkpoint import LocalStorage, load_latest
from elastictrain.engine.health.preemption import NEAR_SECONDS, PreemptionWatch, jit_action
from elastictrain.engine.trainer import Trainer, run_trainer
from elastictrain.rundir.events import Checkpoint, Commit, PreemptionCheckpoint, of_kind, read_events
from tests.fixtures.clock import FakeClock
from tests.fixtures.engine import ScriptedWorld, small_job
from tests.fixtures.procs import wait_until

NOW = 1_000_000.0
PLAN = CheckpointPlan(deadline=NOW + 100, slots_left=0, noticed=("a", "b"))


# -------------------------------------------------------------------------------------------- the decision
def test_no_plan_or_a_durable_commit_means_nothing_to_do() -> None:
    assert jit_action(None, now=NOW, committed_step=10, durable_step=None, in_flight_step=None) is None
    assert jit_action(PLAN, now=NOW, committed_step=10, durable_step=10, in_flight_step=None) is None


def test_far_from_the_end_the_save_runs_in_the_background_unless_this_step_is_being_written() -> None:
    action = jit_action(PLAN, now=NOW, committed_step=10, durable_step=5, in_flight_step=None)
    assert action is not None and not action.wait and action.seconds_left == 100
    assert jit_action(PLAN, now=NOW, committed_step=10, durable_step=5, in_flight_step=10) is None
    action = jit_action(PLAN, now=NOW, committed_step=10, durable_step=5, in_flight_step=5)
    assert action is not None and not action.wait  # an older step in flight: the writer skips or queues


@pytest.mark.parametrize("left", [NEAR_SECONDS, 1.0, 0.0, -5.0])
def test_near_or_past_the_end_rank0_waits_for_the_save(left: float) -> None:
    action = jit_action(PLAN, now=PLAN.deadline - left, committed_step=10, durable_step=5, in_flight_step=10)
    assert action is not None and action.wait and action.seconds_left == left


# -------------------------------------------------------------------------------------------- the reader
def record(host: str, slots: int = 1, notice: float | None = None) -> HostRecord:
    r = HostRecord(host=host, slots=slots, addr="10.0.0.1", registered_at=NOW - 60)
    return r.with_notice("aws-spot-terminate", notice) if notice is not None else r


def registry_of(*records: HostRecord) -> InMemoryRegistry:
    registry = InMemoryRegistry("job")
    lease = registry.grant_lease(3600)
    for r in records:
        assert registry.register(r, lease)
    return registry


def give_notice(registry: InMemoryRegistry, host: str, until: float) -> None:
    entry = registry.get(host)
    assert entry is not None
    assert registry.compare_and_set(entry, entry.record.with_notice("gcp-preempted", until))


def test_refresh_plans_a_checkpoint_only_when_the_notices_leave_too_few_slots() -> None:
    registry = registry_of(record("a"), record("b"), record("c"))
    watch = PreemptionWatch(lambda: registry, min_np=2)
    assert watch.refresh() is None and watch.reads == 1
    give_notice(registry, "a", NOW + 30)
    assert watch.refresh() is None, "two ready slots stay: a drain, nothing lost"
    give_notice(registry, "b", NOW + 20)
    plan = watch.refresh()
    assert plan == CheckpointPlan(deadline=NOW + 20, slots_left=1, noticed=("a", "b"))
    assert watch.plan == plan


class Flaky(InMemoryRegistry):
    """Its reads fail while ``down``; counts the connections opened and closed."""

    def __init__(self, *records: HostRecord) -> None:
        super().__init__("job")
        lease = self.grant_lease(3600)
        for r in records:
            self.register(r, lease)
        self.down = False
        self.closed = 0

    def list_hosts(self) -> Any:
        if self.down:
            raise ConnectionError("etcd unreachable")
        return super().list_hosts()

    def close(self) -> None:
        self.closed += 1


def test_a_failed_read_keeps_the_last_plan_and_opens_a_new_connection_next_time() -> None:
    registry = Flaky(record("a", notice=NOW + 30))
    opened: list[HostRegistry] = []

    def connect() -> HostRegistry:
        opened.append(registry)
        return registry

    watch = PreemptionWatch(connect, min_np=1)
    plan = watch.refresh()
    assert plan is not None and plan.noticed == ("a",)
    registry.down = True
    assert watch.refresh() == plan and watch.reads == 1
    assert registry.closed == 1
    registry.down = False
    assert watch.refresh() == plan and watch.reads == 2 and len(opened) == 2


def test_a_hostile_record_is_skipped_and_the_valid_ones_still_plan() -> None:
    registry = registry_of(record("a", notice=NOW + 30))
    registry.put_raw("b", b'{"slots": "many", "notice": "' + b"x" * 10_000 + b'"}')
    plan = PreemptionWatch(lambda: registry, min_np=1).refresh()
    assert plan is not None and plan.noticed == ("a",)


def test_the_thread_reads_only_while_this_worker_holds_rank0() -> None:
    registry = registry_of(record("a", notice=NOW + 30))
    rank0 = threading.Event()
    asked = []

    def active() -> bool:
        asked.append(1)
        return rank0.is_set()

    watch = PreemptionWatch(lambda: registry, min_np=1, active=active, period=0.01).start()
    try:
        wait_until(lambda: len(asked) >= 5, 10, interval=0.01, what="five cycles of the thread")
        assert watch.reads == 0 and watch.plan is None
        rank0.set()
        wait_until(lambda: watch.plan is not None, 10, interval=0.01, what="the plan read by the thread")
    finally:
        watch.stop()
    assert watch.plan is not None and watch.plan.noticed == ("a",)


# -------------------------------------------------------------------------------------------- the trainer's hooks
class NoticeWorld(ScriptedWorld):
    """At optimizer step ``at``, every host gets a notice ending at ``until`` (by the fake clock); ``read``: the
    watch's thread reads it before the next commit (else only the host removal that follows makes rank 0 read)."""

    def __init__(
        self,
        registry: InMemoryRegistry,
        watch: PreemptionWatch,
        at: int,
        until: float,
        read: bool,
        update: HostUpdateResult = HostUpdateResult.removed,
    ) -> None:
        super().__init__()
        self.registry, self.watch, self.at, self.until, self.read = registry, watch, at, until, read
        self.update = update

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        super()._before_step(optimizer, args, kwargs)
        if self.optimizer_steps != self.at:
            return
        give_notice(self.registry, "h1", self.until)
        if self.read:
            self.watch.refresh()
        else:  # the drain reaches Horovod's driver first: a removal notice, acted on at the next commit
            assert self.state is not None
            self.state.on_hosts_updated(NOW, self.update)


def run_with_notice(
    tmp_path: Path, *, left: float, read: bool, update: HostUpdateResult = HostUpdateResult.removed
) -> tuple[list[Any], Trainer]:
    cfg = small_job(tmp_path / "run", checkpoint={"every_steps": 1000, "every_epochs": None})
    registry = registry_of(record("h1"))
    clock = FakeClock(NOW)
    watch = PreemptionWatch(lambda: registry, min_np=1, clock=clock)
    world = NoticeWorld(registry, watch, at=5, until=NOW + left, read=read, update=update)
    trainer = Trainer.build(cfg, world)
    world.state, trainer.preemption = trainer.state, watch
    assert run_trainer(trainer) == 0
    return read_events(cfg.run_path / "events.jsonl"), trainer


def test_a_notice_far_from_its_end_saves_each_commit_in_the_background(tmp_path: Path) -> None:
    events, _ = run_with_notice(tmp_path, left=100, read=True)
    jit = of_kind(events, PreemptionCheckpoint)
    assert jit, "no just-in-time checkpoint"
    assert jit[0].step == 6, "the first commit after the notice was read"
    seen = {(e.waited, e.checkpointed, tuple(e.hosts or ()), e.deadline) for e in jit}
    assert seen == {(False, None, ("h1",), NOW + 100)}
    saved = {e.step for e in of_kind(events, Checkpoint)}
    assert 6 in saved and saved <= {e.step for e in of_kind(events, Commit)}


def test_a_notice_near_its_end_makes_rank0_wait_for_the_commit_to_be_durable(tmp_path: Path) -> None:
    events, _ = run_with_notice(tmp_path, left=10, read=True)
    jit = of_kind(events, PreemptionCheckpoint)
    assert [(e.step, e.waited, e.checkpointed) for e in jit[:2]] == [(6, True, True), (8, True, True)]
    assert [e.seconds_left for e in jit[:1]] == [10.0]


def test_a_host_removal_before_the_thread_read_makes_rank0_read_and_save_the_last_commit(tmp_path: Path) -> None:
    events, trainer = run_with_notice(tmp_path, left=10, read=False)
    jit = of_kind(events, PreemptionCheckpoint)
    assert jit and (jit[0].step, jit[0].waited, jit[0].checkpointed) == (6, True, True)
    assert trainer.preemption is not None and trainer.preemption.reads >= 1
    commits_before = [e.step for e in of_kind(events, Commit) if e.ts <= jit[0].ts]
    assert max(commits_before) == 6, "the checkpoint is of the commit the removal interrupted"
    loaded = load_latest(LocalStorage.for_run_dir(trainer.cfg.run_path), map_location="cpu")
    assert loaded is not None and loaded.step >= 6


def test_a_scale_up_costs_rank0_no_read_of_the_notices_on_the_training_thread(tmp_path: Path) -> None:
    """Only hosts leaving (or notices already seen) make rank 0 read etcd at the interrupted commit."""
    _, trainer = run_with_notice(tmp_path, left=10, read=False, update=HostUpdateResult.added)
    assert trainer.preemption is not None and trainer.preemption.reads == 0
