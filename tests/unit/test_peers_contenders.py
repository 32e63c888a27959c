"""The peer benchmark's rule on each contender's log shape around one SIGKILL (synthetic logs, no processes): what is
kept, redone, thrown away, what goodput credits (compute, never the waits), and whether the survivors lived."""

from __future__ import annotations

import pytest

from bench.peers import (
    Line,
    goodput,
    kill_figures,
    losses_after,
    replay,
    steady_step_seconds,
    survival,
)


def steps(
    writer: str, first: int, count: int, t: float, *, dt: float = 1.0, world: int = 3, committed: bool = True
) -> list[Line]:
    """``count`` steps of one process from step ``first``, back to back from time ``t``, each ``dt`` long."""
    return [Line(writer, first + i, 0, t + i * dt, t + (i + 1) * dt, world, committed) for i in range(count)]


def together(writers: str | tuple[str, ...], first: int, count: int, t: float, **kw: object) -> list[Line]:
    return [ln for w in writers for ln in steps(w, first, count, t, **kw)]  # type: ignore[arg-type]


KILL = 20.2  # every log: processes a, b, c train steps 1-20 in [0, 20); c is SIGKILLed at 20.2


def test_a_wait_inside_a_kept_step_earns_only_the_steady_step_time():
    # Step 11 is kept but began 5 s before its compute (a quorum, a heartbeat timeout): it earns 1 s, not 6.
    lines = [*steps("a", 1, 10, 0.0), Line("a", 11, 0, 10.0, 16.0, 1), *steps("a", 12, 4, 16.0)]
    assert steady_step_seconds(lines) == pytest.approx(1.0)
    assert goodput(lines, 0.0, 20.0) == pytest.approx(15 / 20)
    # the cap may be given (the contender's fault-free step time from another run)
    assert goodput(lines, 0.0, 20.0, step_seconds=0.5) == pytest.approx(7.5 / 20)


def test_elastictrain_survivors_go_on_at_two_and_the_killed_host_rejoins_without_losing_a_step():
    # rollback: none; a and b keep their pids and state, step 21-25 at world 2 after a 1.8 s recovery; c's host
    # returns through hot join as c2 at step 26.
    lines = together("abc", 1, 20, 0.0)
    lines += together("ab", 21, 5, 21.0, world=2) + together(("a", "b", "c2"), 26, 5, 26.0)
    rep = replay(lines)
    assert not rep.redone and not rep.thrown_away
    assert survival(lines, KILL, "c", 31.0) == {
        "world_before": 3,
        "survivors": 2,
        "lived": 2,
        "steps_at_smaller_world": 5,
        "survived": True,
    }
    assert goodput(lines, 0.0, 31.0) == pytest.approx(30 / 31)


def test_stock_horovod_survivors_roll_back_to_the_last_commit_and_redo_the_steps_after_it():
    # commit every 10: step 20 was committed, so the kill at 20.2 during step 21 loses nothing; a kill at 15.2
    # (steps 11-15 done since the commit at 10) makes the survivors restore step 10 and redo 11-15 at world 2.
    lines = together("abc", 1, 15, 0.0) + together("ab", 11, 10, 45.2, world=2)
    rep = replay(lines)
    assert {ln.step for ln in rep.redone} == set(range(11, 16))
    assert losses_after(rep, [15.2], 55.2) == [{"redone": 5, "thrown_away": 0}]
    assert survival(lines, 15.2, "c", 55.2)["survived"] is True
    # kept: steps 1-10 (10 s) and 11-20 again (10 s); the 30 s Gloo timeout earns nothing
    assert goodput(lines, 0.0, 55.2) == pytest.approx(20 / 55.2)


def test_torchrun_restarts_every_worker_from_its_checkpoint_so_no_survivor_lives():
    # checkpoint at step 10; the kill at 15.2 stops every worker; new processes resume from step 10 at 25.
    lines = together("abc", 1, 15, 0.0) + together(("a2", "b2", "c2"), 11, 10, 25.0)
    rep = replay(lines)
    assert {ln.step for ln in rep.redone} == set(range(11, 16))
    got = survival(lines, 15.2, "c", 35.0)
    assert got["survivors"] == 2 and got["lived"] == 0 and got["survived"] is False


def test_torchft_heal_whose_commit_fails_counts_nothing_and_the_survivors_live_at_two():
    # a and b fail step 21 (their allreduce lost c; should_commit false, counters stay 20), then train 21-25 as a
    # quorum of two. c restarts as c2 from its checkpoint (step 20), joins at 26.5 and heals to the peers' step 25:
    # its counter moves to 25 although that step's should_commit fails (a peer's error), for all three. The
    # script logs TorchFT's commit outcome, not "the counter moved", so the healing step is thrown away.
    lines = together("abc", 1, 20, 0.0)
    lines += together("ab", 20, 1, 20.0, committed=False)
    lines += together("ab", 21, 5, 21.5, world=2)
    lines += together(("a", "b"), 25, 1, 26.5, committed=False) + steps("c2", 25, 1, 26.5, committed=False)
    lines += together(("a", "b", "c2"), 26, 4, 27.5)
    rep = replay(lines)
    assert not rep.redone
    assert sorted({ln.step for ln in rep.kept}) == list(range(1, 30))
    assert {(ln.writer, ln.step) for ln in rep.thrown_away} == {("a", 20), ("b", 20), ("a", 25), ("b", 25), ("c2", 25)}
    assert losses_after(rep, [KILL], 31.5) == [{"redone": 0, "thrown_away": 2}]
    assert survival(lines, KILL, "c", 31.5)["steps_at_smaller_world"] == 5
    assert survival(lines, KILL, "c", 31.5)["survived"] is True
    # 29 kept steps of 1 s in 31.5 s; the two failed steps and the waits earn nothing
    assert goodput(lines, 0.0, 31.5) == pytest.approx(29 / 31.5)


def test_torchft_0_2_0_every_group_crashing_is_not_survival():
    # meta-pytorch/torchft#304: a peer's death made every group's DDP hook assert; all restart with new pids.
    lines = together("abc", 1, 20, 0.0) + together(("a2", "b2", "c2"), 1, 10, 30.0)
    got = survival(lines, KILL, "c", 40.0)
    assert got["lived"] == 0 and got["survived"] is False


def test_per_kill_figures_give_every_kill_and_p50_p95_max():
    kills = [
        {"recovery_seconds": r, "redone": n, "thrown_away": t}
        for r, n, t in ((1.0, 0, 1), (2.0, 0, 0), (9.0, 14, 0), (1.5, 535, 0), (None, 0, 0))
    ]
    got = kill_figures(kills)
    assert got["recovery"]["values"] == [1.0, 2.0, 9.0, 1.5]  # a kill with no step after it has no recovery
    assert got["recovery"]["median"] == pytest.approx(1.75)
    assert got["recovery"]["p95"] == 9.0 and got["recovery"]["max"] == 9.0
    assert got["redone"]["values"] == [0, 0, 14, 535, 0]
    assert got["redone"]["median"] == 0 and got["redone"]["max"] == 535
    assert got["thrown_away"]["max"] == 1
    assert kill_figures([])["recovery"]["n"] == 0


def _kill(survived: bool, recovery: float = 1.0, redone: int = 0) -> dict:
    return {
        "ts": 0.0,
        "host": "h",
        "pid": 1,
        "recovery_seconds": recovery,
        "redone": redone,
        "thrown_away": 0,
        "survival": {"survivors": 2, "lived": 2 if survived else 0, "steps_at_smaller_world": 3, "survived": survived},
    }


def _trial(*kills: dict) -> dict:
    return {"kills": list(kills), "scale_up": {"pause_seconds": 1.0}, "samples_per_sec": 100.0}


def test_a_contender_whose_survivors_never_live_gets_words_in_the_table_not_a_goodput():
    from bench.peers import summarize

    crashed = summarize("torchft", [_trial(_kill(False, 9.0, 535))], {"goodput": 0.093, "kills": [_kill(False)]})
    assert crashed["never_survived"] is True
    assert crashed["goodput"] is None and crashed["goodput_as_measured"] == 0.093
    assert crashed["survives_kills"].startswith("no:")
    assert [k["phase"] for k in crashed["per_kill"]] == ["trial", "goodput"]
    assert crashed["kills"]["redone"]["max"] == 535

    lived = summarize("torchft-hb1s", [_trial(_kill(True))], {"goodput": 0.8, "kills": [_kill(True)]})
    assert lived["goodput"] == 0.8 and lived["survives_kills"].startswith("yes:")
    # torchrun restarts every worker by design: its goodput stands, and the words say why nobody survived
    restarts = summarize("torchrun", [_trial(_kill(False))], {"goodput": 0.5, "kills": [_kill(False)]})
    assert restarts["goodput"] == 0.5 and "by design" in restarts["survives_kills"]


def test_a_second_kill_counts_as_survivors_only_the_processes_still_stepping():
    # c was killed at 20.2 and has not returned; b is killed at 26.2: a alone was spared, and it lived at world 1.
    lines = together("abc", 1, 20, 0.0) + together("ab", 21, 5, 21.0, world=2) + steps("a", 26, 4, 27.0, world=1)
    got = survival(lines, 26.2, "b", 31.0)
    assert got == {"world_before": 2, "survivors": 1, "lived": 1, "steps_at_smaller_world": 4, "survived": True}


def test_the_exactly_once_words_give_clean_epochs_and_a_sampler_its_own_docs_call_lossy():
    from bench.peers import once_in_words, summarize

    clean = {"missing": 0, "duplicated": 0}
    audited = {0: clean, 1: {"missing": 32, "duplicated": 0}}
    ft = summarize("torchft", [], {"goodput": 0.8, "kills": [], "exactly_once": False, "epochs_audited": audited})
    assert once_in_words(ft).startswith("1 of 2 epochs; lossy by its docs: its train_ddp.py")
    et = summarize(
        "elastictrain", [], {"goodput": 0.9, "kills": [], "exactly_once": True, "epochs_audited": {0: clean}}
    )
    assert once_in_words(et) == "1 of 1 epochs"


def test_a_torchft_group_still_in_its_epoch_holds_that_epoch_open_and_a_dead_host_does_not():
    from bench.peers import audit

    def ln(writer: str, step: int, epoch: int, ids: list[int], t: float, world: int = 2) -> Line:
        return Line(writer, step, epoch, t, t + 0.5, world, True, tuple(ids))

    # each group its own shard of 4 samples (a: 0-1, b: 2-3), 1 id a step; b restarted and lags one step behind
    lines = [ln("a-1", 1, 0, [0], 1.0), ln("b-2", 1, 0, [2], 1.0), ln("a-1", 2, 0, [1], 2.0), ln("b-9", 2, 0, [2], 2.0)]
    lines.append(ln("a-1", 3, 1, [0], 3.0))
    assert audit([*lines, ln("b-9", 3, 0, [3], 3.0)], 4) == {}  # b is still in epoch 0: not complete
    done = [*lines, ln("b-9", 3, 0, [3], 3.0), ln("a-1", 4, 1, [1], 4.0), ln("b-9", 4, 1, [2], 4.0)]
    assert audit(done, 4) == {0: {"seen": 5, "missing": 0, "duplicated": 1, "unlogged": 0, "recovered": 0}}
    # a host that died in epoch 0 and never came back does not hold it open
    gone = [ln("a-1", 1, 0, [0, 1], 1.0), ln("c-3", 1, 0, [2, 3], 1.0), ln("a-1", 2, 1, [0], 3.0, world=1)]
    assert audit(gone, 4) == {0: {"seen": 4, "missing": 0, "duplicated": 0, "unlogged": 0, "recovered": 0}}


def test_the_run_puts_every_kill_and_the_words_in_the_table(monkeypatch, tmp_path):
    """``run`` with each contender's jobs replaced by their results: the markdown table names, per contender, whether
    it survives a kill, its goodput or why none, and every kill's p50 / p95 / max."""
    from bench import peers
    from bench.core import BenchContext, markdown_table
    from elastictrain.launcher import hosts as hosts_module

    def fake_trial(name: str, *_a: object) -> dict:
        crashed = name == "torchft"
        return _trial(_kill(not crashed, 5.0 if crashed else 1.0, 535 if crashed else 0), _kill(not crashed))

    def fake_goodput(name: str, *_a: object) -> dict:
        audited = {0: {"missing": 0, "duplicated": 0}}
        return {"goodput": 0.5, "kills": [_kill(name != "torchft")], "exactly_once": True, "epochs_audited": audited}

    monkeypatch.setattr(hosts_module, "local_logical_hosts", lambda: ["h1", "h2", "h3", "h4"])
    monkeypatch.setattr(peers, "trial", fake_trial)
    monkeypatch.setattr(peers, "goodput_run", fake_goodput)
    monkeypatch.setattr(peers, "peers_blocked", lambda: None)
    monkeypatch.setattr(peers, "peer_versions", lambda: {"torch": "2.14.1", "torchft": "torchft-nightly==2026.10.26"})
    result = peers.run(BenchContext(quick=True, workdir=tmp_path, progress=lambda _m: None))
    per = result.detail["per_contender"]
    assert per["torchft"]["goodput"] is None and per["torchft-hb1s"]["goodput"] == 0.5
    assert [k["phase"] for k in per["torchft"]["per_kill"]] == ["trial", "trial", "goodput"]
    report = {
        "machine": {},
        "load_average": {},
        "mode": "quick",
        "date": "2026-12-06",
        "wall_seconds": 1.0,
        "measurements": {"peers": result.to_dict()},
    }
    table = markdown_table(report)
    assert "torchft: goodput — none: it did not survive a kill" in table
    assert "torchft: survives a kill? no: in none of 3 kills" in table
    assert "torchft: every kill's SIGKILL → next step (s) p50 / p95 / max = 1.00 / 5.00 / 5.00" in table
    assert "redone p50 / p95 / max = 0 / 535 / 535" in table
    assert "torchrun: survives a kill? restarts every worker by design" in table
    assert "torchft-hb1s: survives a kill? yes" in table
    assert "lossy by its docs" in table


def test_survivors_that_go_on_while_another_host_returns_survived_without_a_smaller_world():
    # b was down; c is killed at 20.2 just as b's host returns: a and b2 go on at world 2, never smaller
    lines = together("ac", 1, 20, 0.0, world=2) + together(("a", "b2"), 21, 5, 21.0, world=2)
    got = survival(lines, KILL, "c", 26.0)
    assert got == {"world_before": 2, "survivors": 1, "lived": 1, "steps_at_smaller_world": 0, "survived": True}
