"""The fault campaign's pure parts: the seeded plan, the figures from a synthetic run, the log read as it grows, and
the heartbeats it aims by; its command line (bad flags: exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from chaos.campaign import (
    AT_MIN_NP,
    AT_RENDEZVOUS,
    AT_STARTUP,
    CELLS,
    CHECKPOINT,
    HANG_PRIMER,
    HANG_SECONDS,
    JOB,
    PHASES,
    SIGKILL,
    SIGSTOP,
    STEP,
    RunLog,
    campaign_config,
    figures,
    plan,
    read_beats,
    refigure,
)
from elastictrain.engine.health.signals import STARTUP, Beat, Heartbeats
from elastictrain.rundir.events import Commit, Metrics, Reset, Start, encode
from tests.fixtures.procs import REPO


def test_the_plan_is_seeded_has_every_cell_and_spreads_one_relaunch_per_hundred_faults() -> None:
    a, b = plan(300, 7), plan(300, 7)
    assert a == b and a != plan(300, 8)
    assert len(a) == 300 and [p.index for p in a] == list(range(300))
    cells = Counter((p.phase, p.kind) for p in a)
    assert set(cells) == {(c.phase, c.kind) for c in CELLS}, "every phase x kind at least once"
    assert cells[(STEP, JOB)] == 3
    relaunches = [p.index for p in a if p.kind == JOB]
    assert relaunches[0] > 20 and relaunches[-1] < 280, "spread over the run, not bunched at an end"
    assert all(p.rank0 for p in a if p.phase == CHECKPOINT), "the writer is rank 0's"
    assert not any(p.rank0 for p in a if p.phase in (AT_STARTUP, AT_MIN_NP)), "a worker in start-up holds no rank"
    assert any(p.rank0 for p in a) and not all(p.rank0 for p in a if p.phase == STEP)


def test_a_short_plan_still_covers_every_phase_and_a_tiny_one_takes_distinct_cells() -> None:
    short = plan(24, 1)
    assert {p.phase for p in short} == set(PHASES)
    tiny = plan(5, 3)
    assert len({(p.phase, p.kind) for p in tiny}) == 5 and not any(p.kind == JOB for p in tiny)
    with pytest.raises(ValueError):
        plan(0, 1)


def test_the_job_outlasts_the_plan() -> None:
    for n in (16, 300):
        cfg = campaign_config(n)
        assert cfg["training"]["epochs"] * 60 >= n * 89
        assert (cfg["elastic"]["min_np"], cfg["elastic"]["max_np"]) == (2, 4)


def _record(ts: float, phase: str = STEP, kind: str = SIGKILL, hit: str = STEP, **extra: object) -> dict:
    return {"index": 0, "role": "aimed", "phase": phase, "kind": kind, "hit": hit, "fault_ts": ts, **extra}


def _steps(*ts: float) -> list[Metrics]:
    return [Metrics(step=int(t), epoch=0, world_size=4, ts=t) for t in ts]


def test_figures_time_each_fault_to_the_next_completed_step_and_count_lost_steps_and_hangs() -> None:
    events = [
        *_steps(1, 2, 3, 9.5),
        Reset(step=10, epoch=0, world_size=3, ts=11.2, new_size=3, lost_steps=2),
        *_steps(12, 13, 14),
        *_steps(60, 61),  # 46 s with no step after the fault at 14.5: a hang
        Commit(step=70, epoch=0, world_size=4, ts=70.0),
        Start(step=70, epoch=0, world_size=4, ts=200.0, resumed_from_step=70),
        *_steps(250, 251, 300),  # a relaunch: 150 s to the next step after the fault at 100.5 is within its bound
    ]
    records = [
        _record(10.0),
        _record(14.5, kind="SIGKILL (rank 0)"),
        _record(100.5, kind=JOB),
        _record(251.0, phase=AT_MIN_NP, hit=AT_MIN_NP, returned_ts=290.0, index=3),
    ]
    f = figures(records, events)
    rows = {(r["phase"], r["kind"]): r for r in f["rows"]}
    kill = rows[(STEP, SIGKILL)]
    assert kill["count"] == 1 and kill["hit"] == 1 and kill["recovery_max_s"] == pytest.approx(1.2)
    assert kill["lost_steps_total"] == 2 and kill["hangs"] == 0
    assert rows[(STEP, "SIGKILL (rank 0)")]["hangs"] == 1
    assert rows[(STEP, JOB)]["hangs"] == 0 and rows[(STEP, JOB)]["recovery_max_s"] == pytest.approx(149.5)
    assert rows[(AT_MIN_NP, SIGKILL)]["recovery_max_s"] == pytest.approx(10.0), "timed from the hosts' return"
    # the 46-s stretch is one hang (the late fault inside it is not counted again); the relaunch's and the min-np
    # wait's stretches are by design
    assert f["hangs"] == 1 and f["faults_in_hangs"] == 1
    assert f["longest_stretch_without_a_step_s"] == pytest.approx(46.0)
    assert f["faults"] == 4 and f["cells"] == 4
    assert f["sigkill_recovery"]["count"] == 3 and f["sigkill_recovery"]["max_s"] == pytest.approx(46.0 - 0.5)
    off = f["sigkill_recovery_off_min_np"]
    assert off["count"] == 2 and off["max_s"] == pytest.approx(46.0 - 0.5), "all but the boundary's kill"
    boundary = figures([_record(10.0, index=5, role="primer"), _record(251.0, index=5, phase=AT_MIN_NP)], events)
    assert boundary["sigkill_recovery"]["count"] == 2 and boundary["sigkill_recovery_off_min_np"]["count"] == 0
    primers_only = [_record(10.0, index=5, role="primer")]  # the boundary's last kill never came (its wait ran out)
    assert figures(primers_only, events)["sigkill_recovery_off_min_np"]["count"] == 1
    assert figures(primers_only, events, {5: AT_MIN_NP})["sigkill_recovery_off_min_np"]["count"] == 0
    assert [r["phase"] for r in f["rows"]] == sorted((r["phase"] for r in f["rows"]), key=PHASES.index)
    assert HANG_SECONDS < 46


def test_a_fault_never_followed_by_a_step_is_a_hang_and_two_late_faults_in_one_stretch_are_one() -> None:
    f = figures([_record(5.0)], _steps(1, 2))
    assert f["hangs"] == 1 and f["rows"][0]["recovery_median_s"] is None
    two = figures([_record(2.5, role="primer"), _record(2.6)], _steps(1, 2, 80))
    assert two["hangs"] == 1 and two["faults_in_hangs"] == 2


def test_the_event_log_is_read_as_it_grows_including_a_line_written_in_two_parts(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = RunLog(path)
    assert tail.poll() == []
    first, second = (encode(e) for e in _steps(1.0, 2.0))
    path.write_bytes(first + second[:10])
    assert [e.ts for e in tail.poll()] == [1.0]
    with path.open("ab") as f:
        f.write(second[10:] + b'{"not": "an event"}\n')
    assert [e.ts for e in tail.poll()] == [1.0, 2.0]
    assert [e.ts for e in tail.since(1.5)] == [2.0]


def test_heartbeats_are_read_untrusted(tmp_path: Path) -> None:
    Heartbeats(tmp_path).write(Beat(10, "a", 0, "boot", 1.0, 5.0, STARTUP, 5.0, 0))
    (tmp_path / "b-0.json").write_bytes(b"{broken")
    (tmp_path / "c-0.json").write_text(json.dumps({"pid": -1}))
    beats = read_beats(tmp_path)
    assert list(beats) == [("a", 0)] and beats[("a", 0)].phase == STARTUP
    assert read_beats(tmp_path / "missing") == {}


@pytest.mark.parametrize("args", [["--faults", "0", "--seed", "1"], ["--faults", "x", "--seed", "1"], ["--seed", "1"]])
def test_bad_flags_exit_2_with_one_line(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "chaos", "campaign", *args], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert len((r.stdout + r.stderr).strip().splitlines()) == 1, r.stdout + r.stderr


def test_the_plan_can_be_printed_without_a_job() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "chaos", "campaign", "--faults", "20", "--seed", "2", "--plan"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 20


def _hang_after_a_primer() -> tuple[list[dict], list]:
    events = [*_steps(1, 2), *_steps(12.5, 13), *_steps(20.3)]
    records = [
        _record(2.5, index=4, role="primer"),  # starts a reset ...
        _record(2.6, index=4, phase=AT_RENDEZVOUS, kind=SIGSTOP, hit=AT_RENDEZVOUS),  # ... in which one is stopped
        _record(20.0, index=5),
    ]
    return records, events


def test_the_primer_of_a_hang_waits_for_the_hangs_verdict_and_is_no_sigkill_figure() -> None:
    f = figures(*_hang_after_a_primer())
    rows = {(r["phase"], r["kind"]): r for r in f["rows"]}
    assert rows[(STEP, HANG_PRIMER)]["recovery_max_s"] == pytest.approx(10.0)
    assert rows[(STEP, SIGKILL)]["count"] == 1 and rows[(STEP, SIGKILL)]["recovery_max_s"] == pytest.approx(0.3)
    assert f["sigkill_recovery"]["count"] == 1 and f["sigkill_recovery"]["max_s"] == pytest.approx(0.3)
    assert f["sigkill_recovery_off_min_np"]["count"] == 1


def test_refigure_computes_a_run_dirs_figures_again_from_its_own_logs(tmp_path: Path) -> None:
    records, events = _hang_after_a_primer()
    run = tmp_path / "run"
    run.mkdir()
    (run / "chaos.jsonl").write_text("".join(json.dumps({"action": "campaign-fault", **r}) + "\n" for r in records))
    (run / "events.jsonl").write_bytes(b"".join(encode(e) for e in events))
    old = {"figures": {}, "checks": [{"name": "job completed", "ok": True, "detail": "exit 0"}]}
    report = {"command": "x", "date": "d", "machine_line": "m", "wall_seconds": 1.0, "planned": 2, "injected": 2,
              "skipped": 0, "not_reached": 0, "returns_missed": [], "stuck": [], **old}  # fmt: skip
    (run / "campaign.json").write_text(json.dumps(report))
    assert refigure(run, tmp_path / "out" / "r.json", out=lambda text: None) == 0
    again = json.loads((run / "campaign.json").read_text())
    assert again["refigured"] and again["figures"]["sigkill_recovery"]["count"] == 1
    assert [c["name"] for c in again["checks"]] == ["job completed", f"no hang (no step for > {HANG_SECONDS:g} s)"]
    assert HANG_PRIMER in (tmp_path / "out" / "r.md").read_text()
