"""report: goodput from hand-written events equals the hand-computed figure; the PNG has the marks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastictrain.rundir import layout
from elastictrain.rundir.events import Event, encode, parse_event
from elastictrain.rundir.report import build_figure, kept_step_seconds, main, summarize
from tests.fixtures.procs import dead_pid

T0 = 1_000_000.0


def ev(t: float, event: str, step: int, world_size: int = 2, epoch: int = 0, **fields: Any) -> Event:
    return parse_event({"ts": T0 + t, "event": event, "step": step, "epoch": epoch, "world_size": world_size, **fields})


# Two workers, one dies at t=25 (step 25; steps 21..25 never logged); the commit was at step 20.
# Training goes on at one worker at 2 s/step. Kept step time: 10*1 + 10*1 + 10*2 = 40 s of 60 s.
RUN_WITH_A_RESET = [
    ev(0, "start", 0, hosts=["a", "b"], resumed_from_step=None, attempt=0),
    ev(10, "metrics", 10, loss=2.0, samples_per_sec=64.0, steps=10, step_seconds=1.0),
    ev(10, "commit", 10, commit_seconds=0.01),
    ev(20, "metrics", 20, loss=1.5, samples_per_sec=64.0, steps=10, step_seconds=1.0),
    ev(20, "commit", 20, commit_seconds=0.01),
    ev(21, "checkpoint", 20, path="checkpoints/step-00000020", stall_seconds=0.5, write_seconds=2.0, ok=True),
    ev(25, "failure", 25, reason="worker_failed", error="HorovodInternalError"),
    ev(
        40,
        "reset",
        21,
        world_size=1,
        old_size=2,
        new_size=1,
        reason="worker_failed",
        recovery_seconds=15.0,
        lost_steps=5,
        hosts=["a"],
    ),
    ev(
        58,
        "checkpoint",
        30,
        world_size=1,
        path="checkpoints/step-00000030",
        stall_seconds=0.25,
        write_seconds=1.0,
        ok=True,
    ),
    ev(60, "metrics", 30, world_size=1, loss=1.0, samples_per_sec=16.0, steps=10, step_seconds=2.0),
    ev(60, "done", 30, world_size=1, final_loss=1.0, val_accuracy=None, wall_seconds=60.0),
]


def test_goodput_of_a_run_with_a_reset_is_kept_step_time_over_wall_time() -> None:
    s = summarize(RUN_WITH_A_RESET)
    assert s["wall_seconds"] == pytest.approx(60.0)
    assert s["productive_seconds"] == pytest.approx(40.0)
    assert s["goodput"] == pytest.approx(40.0 / 60.0)
    assert s["state"] == "done" and s["step"] == 30 and s["final_loss"] == 1.0
    assert [
        (r["reason"], r["old_size"], r["new_size"], r["recovery_seconds"], r["lost_steps"]) for r in s["resets"]
    ] == [("worker_failed", 2, 1, 15.0, 5)]
    assert s["lost_steps"] == 5 and s["recovery_seconds"]["max"] == 15.0
    assert s["checkpoints"]["count"] == 2
    assert s["checkpoints"]["stall_seconds"]["median"] == pytest.approx(0.375)
    assert s["checkpoints"]["stall_seconds"]["max"] == pytest.approx(0.5)
    assert s["marks"] == {"start": [0.0], "failure": [25.0], "reset": [40.0], "checkpoint": [21.0, 58.0]}


def test_logged_steps_that_were_rolled_back_do_not_count_as_productive() -> None:
    # Logged up to step 20, rolled back to the commit at step 10, steps 11..20 re-run at 1.5 s/step.
    events = [
        ev(0, "start", 0, hosts=["a", "b"], resumed_from_step=None),
        ev(10, "metrics", 10, steps=10, step_seconds=1.0, loss=2.0),
        ev(20, "metrics", 20, steps=10, step_seconds=1.0, loss=1.8),
        ev(22, "failure", 20, reason="worker_failed", error=""),
        ev(30, "reset", 11, world_size=1, old_size=2, new_size=1, reason="worker_failed", lost_steps=10),
        ev(45, "metrics", 20, world_size=1, steps=10, step_seconds=1.5, loss=1.7),
        ev(50, "done", 20, world_size=1, final_loss=1.7),
    ]
    assert kept_step_seconds(events) == (pytest.approx(25.0), 10)
    s = summarize(events)
    assert s["goodput"] == pytest.approx(25.0 / 50.0)
    assert s["resets"][0]["recovery_seconds"] == pytest.approx(8.0)  # no field: failure -> reset time
    assert s["rerun_steps_logged"] == 10


def test_a_relaunch_from_a_checkpoint_counts_its_lost_steps_and_the_downtime() -> None:
    events = [
        ev(0, "start", 0, resumed_from_step=None),
        ev(10, "metrics", 10, steps=10, step_seconds=1.0),
        ev(20, "metrics", 20, steps=10, step_seconds=1.0),
        ev(21, "checkpoint", 20, stall_seconds=0.1, ok=True),
        ev(30, "metrics", 30, steps=10, step_seconds=1.0),  # then the whole job was preempted
        ev(100, "start", 20, resumed_from_step=20, attempt=1),
        ev(110, "metrics", 30, steps=10, step_seconds=1.0),
        ev(110, "done", 30),
    ]
    s = summarize(events)
    assert s["relaunches"] == [{"t": 100.0, "resumed_from_step": 20, "lost_steps": 10}]
    assert s["lost_steps"] == 10 and s["starts"] == 2
    assert s["goodput"] == pytest.approx(30.0 / 110.0)
    assert s["marks"]["start"] == [0.0, 100.0]


def test_a_run_still_going_is_measured_to_its_last_event() -> None:
    s = summarize(RUN_WITH_A_RESET[:4])
    assert s["state"] == "running" and s["wall_seconds"] == pytest.approx(20.0)
    assert s["goodput"] == pytest.approx(1.0)


def test_the_timeline_draws_every_mark_on_each_of_its_three_axes() -> None:
    summary = summarize(RUN_WITH_A_RESET)
    fig = build_figure(RUN_WITH_A_RESET, summary)
    assert len(fig.axes) == 3
    for ax in fig.axes:
        marks: dict[str, int] = {}
        for line in ax.get_lines():
            gid = line.get_gid() or ""
            if gid.startswith("mark-"):
                marks[gid[5:]] = marks.get(gid[5:], 0) + 1
        assert marks == {"start": 1, "failure": 1, "reset": 1, "checkpoint": 2}
        xs = sorted(line.get_xdata()[0] for line in ax.get_lines() if (line.get_gid() or "").startswith("mark-"))
        assert xs == pytest.approx([0.0, 21 / 60, 25 / 60, 40 / 60, 58 / 60])
    assert fig.get_suptitle() == "goodput 66.7% · 1 resets · 5 lost steps"


def write_events(run_dir: Path, events: list[Event | dict[str, Any]], tail: str = "") -> None:
    """``events`` as lines: typed events as the writer encodes them, dicts as they are (damaged lines)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [encode(e).decode() if isinstance(e, Event) else json.dumps(e) + "\n" for e in events]
    (run_dir / layout.EVENTS).write_text("".join(lines) + tail)


def test_report_command_writes_a_png_and_report_json_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    write_events(run_dir, RUN_WITH_A_RESET, tail='{"ts": 1000061, "event": "sto')  # torn final line
    assert main(["--run-dir", str(run_dir)]) == 0
    png = (run_dir / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 500 and height > 400
    saved = json.loads((run_dir / "report.json").read_text())
    assert saved["goodput"] == pytest.approx(40.0 / 60.0) and len(saved["resets"]) == 1
    out = capsys.readouterr().out
    assert "goodput" in out and "66.7%" in out and "reset 1:" in out


def test_report_command_json_and_custom_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    write_events(run_dir, RUN_WITH_A_RESET)
    out_png = tmp_path / "timeline.png"
    assert main(["--run-dir", str(run_dir), "--out", str(out_png), "--json"]) == 0
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(capsys.readouterr().out)["png"] == str(out_png)


@pytest.mark.parametrize("setup", ["missing", "no_events_file", "empty_events"])
def test_report_command_on_a_bad_run_dir_says_so_in_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str
) -> None:
    run_dir = tmp_path / "run"
    if setup != "missing":
        run_dir.mkdir()
    if setup == "empty_events":
        (run_dir / layout.EVENTS).write_text("")
    assert main(["--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(run_dir) in err


@pytest.mark.parametrize(
    "bad",
    [
        {"ts": "soon", "event": "metrics", "step": 10, "epoch": 0, "world_size": 2},
        {"event": "metrics", "step": 10, "epoch": 0, "world_size": 2},
        {"ts": T0 + 5, "event": "reset", "step": "ten", "epoch": 0, "world_size": 2},
        {"ts": T0 + 5, "event": "metrics", "step": 10, "epoch": 0, "world_size": [2]},
        {"ts": T0 + 5, "event": 7, "step": 10, "epoch": 0, "world_size": 2},
    ],
)
def test_report_skips_a_well_formed_line_with_wrong_types_and_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: dict[str, Any]
) -> None:
    run_dir = tmp_path / "run"
    write_events(run_dir, [RUN_WITH_A_RESET[0], bad, *RUN_WITH_A_RESET[1:]])
    assert main(["--run-dir", str(run_dir), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["goodput"] == pytest.approx(40.0 / 60.0), "the other events count as before"
    (warning,) = captured.err.splitlines()
    assert warning.startswith("elastictrain report: warning: ") and "line 2: " in warning and "skipped" in warning


def test_report_leaves_no_temp_file_in_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_events(run_dir, RUN_WITH_A_RESET)
    assert main(["--run-dir", str(run_dir), "--json"]) == 0
    assert sorted(p.name for p in run_dir.iterdir()) == [layout.EVENTS, "report.json", "report.png"]


def test_report_of_a_running_job_whose_processes_are_all_gone_says_stopped_no_live_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The events stop mid-run (everything SIGKILLed); launch.json names only dead pids of this host."""
    import socket

    run_dir = tmp_path / "run"
    write_events(run_dir, RUN_WITH_A_RESET[:-1])  # no done: the events alone say running
    dead = dead_pid()
    launch = {"pid": dead, "host": socket.gethostname(), "agents": {"a": dead}, "create_times": {str(dead): 1.0}}
    (run_dir / "launch.json").write_text(json.dumps(launch))
    assert main(["--run-dir", str(run_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["state"] == "stopped (no live process)" and summary["live"] is False
    assert json.loads((run_dir / "report.json").read_text())["state"] == "stopped (no live process)"
    assert main(["--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "stopped (no live process)" in out and "no live process: pids" in out


def test_report_of_a_finished_run_stays_done_when_bookkeeping_events_follow_done(tmp_path: Path) -> None:
    closed = ev(61, "tracking_closed", 30, world_size=1, run_id="r", dropped=0)
    assert summarize([*RUN_WITH_A_RESET, closed])["state"] == "done"
