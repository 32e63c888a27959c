"""The peer benchmark's shared rule over the common per-step log, on synthetic logs (no processes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from bench.peers import (
    PEERS_DIR,
    Begin,
    Line,
    StepLogReader,
    audit,
    first_step_after,
    goodput,
    losses_after,
    pause,
    replay,
    samples_per_second,
    unended,
)


def steps(
    writer: str, first: int, count: int, t: float, *, dt: float = 1.0, world: int = 1, **kw: object
) -> list[Line]:
    """``count`` steps of one process from step ``first``, back to back from time ``t``, each ``dt`` long."""
    return [
        Line(writer, first + i, 0, t + i * dt, t + (i + 1) * dt, world, **kw)  # type: ignore[arg-type]
        for i in range(count)
    ]


def test_goodput_of_a_fault_free_log_is_the_time_in_steps():
    lines = steps("a", 1, 10, 0.0, dt=1.0)
    assert goodput(lines, 0.0, 10.0) == pytest.approx(1.0)
    assert goodput(lines, 0.0, 20.0) == pytest.approx(0.5)  # 10 s without steps after them


def test_steps_redone_after_a_rollback_are_not_kept():
    # Steps 1-10 in [0, 10); a kill at 10; 5 s down; the job restarts from step 5 and redoes 6-10, then 11-15.
    before = steps("a", 1, 10, 0.0)
    after = steps("b", 6, 10, 15.0)
    rep = replay(before + after)
    assert [ln.step for ln in rep.redone] == [6, 7, 8, 9, 10]
    assert rep.rollbacks == [(15.0, 5)]
    # kept: steps 1-5 (5 s) and 6-15 again (10 s) of a 25 s window
    assert goodput(before + after, 0.0, 25.0) == pytest.approx(15 / 25)


def test_lines_of_one_step_from_several_processes_count_once_and_discard_nothing():
    a = steps("a", 1, 10, 0.0, world=2)
    b = steps("b", 1, 10, 0.01, world=2)  # the same steps, a collective apart
    rep = replay(a + b)
    assert not rep.redone
    # 10 steps of 1 s each; the first step's extra 0.01 s is b's lag that a waited for in the collective: no credit
    assert goodput(a + b, 0.0, 10.01) == pytest.approx(10 / 10.01)


def test_a_process_whose_own_counter_goes_back_redoes_the_steps_after_its_restored_state():
    # One process (a Horovod survivor): steps 1-10, a reset restores the commit of step 5, it redoes 6-10 and goes on.
    a = steps("a", 1, 10, 0.0) + steps("a", 6, 10, 12.0)
    rep = replay(a)
    assert sorted(ln.step for ln in rep.redone) == [6, 7, 8, 9, 10]
    assert rep.rollbacks == [(12.0, 5)]  # the redo of step 6 began after step 10 ended


def torchft_split_heal() -> list[Line]:
    """TorchFT, three replica groups, each with its own step counter. Steps 1-10 together; group c is killed at
    10.2; group a survives but fails its step (``should_commit`` false, its counter stays at 10) until 15; groups b
    and c restart at step 0 and, without a, train steps 1-3 in a quorum of their own from 12 to 15; at 15 a joins
    them again, the quorum's highest step is a's 10, so b and c heal from a and all three go on at 11 and 12."""
    together = [ln for w in "abc" for ln in steps(w, 1, 10, 0.0, world=3)]
    stuck = steps("a", 10, 1, 10.0, dt=5.0, world=1, committed=False)
    alone = [ln for w in ("b2", "c2") for ln in steps(w, 1, 3, 12.0, world=2)]
    healed = [ln for w in ("a", "b2", "c2") for ln in steps(w, 11, 2, 15.0, world=3)]
    return together + stuck + alone + healed


def test_torchft_groups_that_trained_on_their_own_and_healed_from_a_peer_lose_their_own_steps_not_the_peers():
    lines = torchft_split_heal()
    rep = replay(lines)
    assert sorted({ln.step for ln in rep.kept}) == list(range(1, 13))
    assert {(ln.writer, ln.step) for ln in rep.redone} == {(w, s) for w in ("b2", "c2") for s in (1, 2, 3)}
    assert rep.rollbacks == [(15.0, 3)]  # lost when b and c healed: the restarted groups' 3 steps
    assert len(rep.thrown_away) == 1
    # kept: [0, 10] and [15, 17]; the restarted groups' [12, 15] was lost (the old rule kept it and lost [0, 10])
    assert goodput(lines, 0.0, 17.0) == pytest.approx(12 / 17)
    assert losses_after(rep, [10.2], 17.0) == [{"redone": 3, "thrown_away": 1}]


def test_at_the_end_a_live_group_at_the_highest_step_holds_the_state_that_the_others_will_heal_to():
    # The same log cut at 15, before the heal: a still holds step 10 (it is failing its step, not dead); b and c
    # are at step 3 of a quorum of their own. When they meet, TorchFT heals everyone to the highest step, a's.
    lines = [ln for ln in torchft_split_heal() if ln.t1 <= 15.0]
    rep = replay(lines)
    assert sorted({ln.step for ln in rep.kept}) == list(range(1, 11))
    assert {ln.writer for ln in rep.redone} == {"b2", "c2"}
    assert goodput(lines, 0.0, 15.0) == pytest.approx(10 / 15)


def test_a_replica_group_that_joins_and_heals_to_the_peers_step_discards_nothing():
    # A 4th TorchFT group starts at step 0 and heals in its first quorum: its first line is step 21.
    lines = [ln for w in "abc" for ln in steps(w, 1, 20, 0.0, world=3)]
    lines += [ln for w in "abcd" for ln in steps(w, 21, 5, 20.5, world=4)]
    rep = replay(lines)
    assert not rep.redone and not rep.rollbacks
    assert goodput(lines, 0.0, 25.5) == pytest.approx(25 / 25.5)


def test_a_healed_group_whose_step_began_before_the_peers_previous_step_ended_continues_the_peers_state():
    # The joining group's first step starts (t0) while the others still run step 20 and ends with theirs, at 21.
    lines = [ln for w in "abc" for ln in steps(w, 1, 21, 0.0, world=3)]
    lines += [Line("d", 21, 0, 19.5, 21.0, 4), *steps("d", 22, 3, 21.0, world=4)]
    lines += [ln for w in "abc" for ln in steps(w, 22, 3, 21.0, world=4)]
    rep = replay(lines)
    assert not rep.redone
    assert sorted({ln.step for ln in rep.kept}) == list(range(1, 25))


def test_every_group_restarting_from_step_0_loses_every_step_before():
    # TorchFT 0.2.0 here: a peer's death makes every surviving group's DDP comm hook fail (``assert fut._fut``), so
    # every group restarts at step 0 with fresh weights; no group holds the state to heal from.
    before = [ln for w in "abc" for ln in steps(w, 1, 30, 0.0, world=3)]
    after = [ln for w in ("a2", "b2", "c2") for ln in steps(w, 1, 20, 40.0, world=3)]
    rep = replay(before + after)
    assert {ln.step for ln in rep.redone} == set(range(1, 31))
    assert rep.rollbacks == [(40.0, 30)]
    assert goodput(before + after, 0.0, 60.0) == pytest.approx(20 / 60)


def test_thrown_away_steps_are_never_kept():
    good = steps("a", 1, 5, 0.0)
    bad = steps("a", 5, 1, 5.0, committed=False)  # should_commit failed: the step's work is discarded
    rep = replay(good + bad)
    assert len(rep.thrown_away) == 1 and not rep.redone
    assert goodput(good + bad, 0.0, 6.0) == pytest.approx(5 / 6)


def test_goodput_clips_steps_to_the_window():
    assert goodput(steps("a", 1, 10, 0.0), 2.5, 7.5) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        goodput([], 1.0, 1.0)


def test_recovery_ends_at_the_first_committed_step_begun_after_the_kill():
    lines = steps("a", 1, 5, 0.0) + steps("a", 6, 1, 4.5, committed=False) + steps("b", 6, 3, 9.0)
    first = first_step_after(lines, 4.6)
    assert first is not None and first.step == 6 and first.t1 == 10.0


def test_scale_up_pause_is_the_longest_gap_less_a_normal_one():
    before = steps("a", 1, 20, 0.0, world=3)
    after = steps("a", 21, 5, 23.0, world=4)  # listed at 20.5; 3 s without a step, then at 4 workers
    got = pause(before + after, 20.5, 4)
    assert got is not None
    assert got["longest_gap_seconds"] == pytest.approx(4.0)
    assert got["pause_seconds"] == pytest.approx(3.0)
    assert pause(before, 20.5, 4) is None


def test_audit_finds_missing_and_repeated_samples_per_completed_epoch():
    def ln(step: int, epoch: int, ids: list[int]) -> Line:
        return Line("a", step, epoch, step, step + 1, 1, True, tuple(ids))

    once = [ln(1, 0, [0, 1]), ln(2, 0, [2, 3]), ln(3, 1, [1])]
    assert audit(once, 4) == {0: {"seen": 4, "missing": 0, "duplicated": 0, "unlogged": 0, "recovered": 0}}
    skipped = [ln(1, 0, [0, 1]), ln(2, 0, [1, 2]), ln(3, 1, [0])]
    assert audit(skipped, 4) == {0: {"seen": 4, "missing": 1, "duplicated": 1, "unlogged": 0, "recovered": 0}}


def test_audit_counts_the_batch_of_a_process_that_died_after_its_step_was_summed_and_before_its_line():
    """The full peers run: a worker SIGKILLed between its step's allreduce and its line; the survivors' lines of that
    step say world 3, so three took part, and the step log lacks one batch of ids."""

    def ln(writer: str, step: int, epoch: int, ids: list[int], world: int) -> Line:
        return Line(writer, step, epoch, step, step + 0.5, world, True, tuple(ids))

    lines = [ln(w, 1, 0, [i], 3) for w, i in (("a", 0), ("b", 1), ("c", 2))]
    lines += [ln("a", 2, 0, [3], 3), ln("b", 2, 0, [4], 3)]  # c died after the sum: no line, id 5 unlogged
    lines += [ln("a", 3, 1, [0], 2), ln("b", 3, 1, [1], 2)]
    assert audit(lines, 6) == {0: {"seen": 5, "missing": 1, "duplicated": 0, "unlogged": 1, "recovered": 0}}
    # its begin line, written before the step, still gives the ids it trained on: the epoch is exactly once
    begins = [Begin("c", 1.6, (5,))]
    assert audit(lines, 6, begins) == {0: {"seen": 6, "missing": 0, "duplicated": 0, "unlogged": 1, "recovered": 1}}


def test_a_begin_line_whose_step_was_not_kept_at_that_world_is_not_counted():
    """Stock Horovod: c dies in step 2 before the sum; a and b roll back and redo step 2 at world 2. c's begin line
    of step 2 was never trained on: the kept step 2 says world 2, so nothing is unlogged and the line is ignored."""

    def ln(writer: str, step: int, epoch: int, ids: list[int], world: int, t: float) -> Line:
        return Line(writer, step, epoch, t, t + 0.5, world, True, tuple(ids))

    lines = [ln(w, 1, 0, [i], 3, 1.0) for w, i in (("a", 0), ("b", 1), ("c", 2))]
    lines += [ln("a", 2, 0, [3, 5], 2, 5.0), ln("b", 2, 0, [4], 2, 5.0)]
    lines += [ln("a", 3, 1, [0], 2, 6.0), ln("b", 3, 1, [1], 2, 6.0)]
    got = audit(lines, 6, [Begin("c", 1.6, (5,))])
    assert got == {0: {"seen": 6, "missing": 0, "duplicated": 0, "unlogged": 0, "recovered": 0}}
    assert unended(lines, [Begin("c", 1.6, (5,)), Begin("a", 1.0, (0,))]) == {2: [Begin("c", 1.6, (5,))]}


def test_samples_per_second_counts_kept_samples_after_the_window_start():
    lines = [Line("a", i, 0, i - 1.0, float(i), 1, True, tuple(range(32))) for i in range(1, 11)]
    assert samples_per_second(lines, 2.0, 10.0) == pytest.approx(32.0)


def test_the_writer_of_bench_peers_writes_what_the_reader_parses(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("peers_steplog", PEERS_DIR / "steplog.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_steplog"] = module
    spec.loader.exec_module(module)
    writer = module.StepLogWriter(tmp_path, "host-1")
    for step in (1, 2):
        writer.started([step, step + 10])
        writer.ended(step=step, epoch=0, world=2, ids=[step, step + 10])
    writer.started([3, 13])  # killed in step 3: only its begin line
    reader = StepLogReader(tmp_path)
    lines = reader.read()
    assert [(b.writer, b.ids) for b in reader.begins] == [("host-1", (1, 11)), ("host-1", (2, 12)), ("host-1", (3, 13))]
    assert [b.t0 for b in reader.begins[:2]] == [ln.t0 for ln in lines]
    assert unended(lines, reader.begins) == {3: [reader.begins[2]]}
    assert [(ln.writer, ln.step, ln.ids, ln.world) for ln in lines] == [
        ("host-1", 1, (1, 11), 2),
        ("host-1", 2, (2, 12), 2),
    ]
    assert all(ln.t0 <= ln.t1 for ln in lines)


def test_without_the_peers_environment_torchrun_and_torchft_are_blocked_with_the_fix(monkeypatch, tmp_path: Path):
    from bench import peers

    monkeypatch.setattr(peers, "PEERS_VENV", peers.REPO / "no-such-peers-venv")
    reason = peers.peers_blocked()
    assert reason is not None and "make peers-env" in reason
