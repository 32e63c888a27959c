"""The memory-across-resets tool's pure parts: drift, verdict, table, result names, the run-log tail (no processes)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import pytest

from chaos.resets import (
    Sample,
    add_arguments,
    drift,
    epochs_for,
    fd_kind,
    free_result_path,
    markdown_table,
    run,
    verdict,
)

MIB = 2**20


def sample(reset: int, pid: int = 7, *, rss: float = 400, fds: int = 20, threads: int = 7, world: int = 4) -> Sample:
    return Sample(
        reset=reset,
        ts=1000.0 + reset,
        pid=pid,
        host=f"h{pid}",
        world_size=world,
        rss=round(rss * MIB),
        uss=round(rss * MIB / 10),
        fds=fds,
        threads=threads,
        maps=800,
    )


def cycles(n: int, pid: int = 7, *, grow_mib_per_reset: float = 0.0, fds_every: int = 0) -> list[Sample]:
    """Samples of ``n`` resets alternating down (3 workers, 4 fds fewer) and up, as a kill-and-rejoin run has."""
    out = [sample(0, pid)]
    for r in range(1, n + 1):
        up = r % 2 == 0
        extra = r // fds_every if fds_every else 0
        out.append(
            sample(
                r,
                pid,
                rss=400 + grow_mib_per_reset * r + (0 if up else 3),
                fds=(20 if up else 16) + extra,
                world=4 if up else 3,
            )
        )
    return out


def test_flat_survivors_have_no_drift_and_meet_the_goal() -> None:
    d = drift(cycles(200) + cycles(200, pid=8), first=10, window=5)
    assert set(d) == {7, 8}
    a = d[7]
    assert (a.first, a.last, a.world_size) == (10, 200, 4)
    assert a.rss_pct == 0 and a.fds_delta == 0 and a.threads_delta == 0 and a.rss_bytes_per_reset == 0
    assert verdict(d, max_rss_pct=2.0, survivors=2)


def test_drift_compares_samples_at_the_same_world_size_only() -> None:
    """Down samples hold 3 MiB more and 4 fds fewer: mixing them in would read as a change."""
    d = drift(cycles(21), first=10, window=1)[7]  # the last sample (21) is a down one
    assert d.world_size == 3 and (d.first, d.last) == (11, 21)
    assert d.rss_pct == 0 and d.fds_delta == 0


def test_a_run_stopped_early_compares_each_survivor_over_the_resets_it_reached() -> None:
    """As in the 129-of-210 run: a survivor crashed at reset 129 and the other two were sampled once more, at a
    world of 2 that the run never held otherwise. Their drift still covers resets 10 to 128 at 4 workers (one
    sample at 2 is no comparison), and the table says which resets each row covers and that the run stopped."""
    grow = 0.1
    samples = [s for pid in (7, 8, 9) for s in cycles(128, pid, grow_mib_per_reset=grow)]
    samples += [sample(129, 7, rss=900, world=2), sample(129, 8, rss=900, world=2)]  # 9 is gone
    d = drift(samples, first=10, window=5)
    assert {pid: (x.first, x.last, x.world_size) for pid, x in d.items()} == {
        7: (10, 128, 4),
        8: (10, 128, 4),
        9: (10, 128, 4),
    }
    assert d[7].rss_pct == d[9].rss_pct > 2.0  # the growth shows; the odd last sample neither hides nor adds to it
    report = {
        "resets_asked": 210,
        "seed": 3,
        "fault": "term",
        "date": "2026-12-04T14:40:43Z",
        "host": "vm",
        "resets": 129,
        "wall_seconds": 296.5,
        "first": 10,
        "window": 5,
        "max_rss_drift_pct": 2.0,
        "ok": False,
        "survivors": [asdict(x) for x in d.values()],
        "error": "survivor 9 on h9 is gone after reset 129",
    }
    text = markdown_table(report)
    assert "129 of 210 resets (stopped early, see below)" in text
    assert "from reset 10 to the last reset it reached" in text
    assert sum("| 10→128 (4 workers) |" in line for line in text.splitlines()) == 3
    assert text.rstrip().endswith("Stopped early: survivor 9 on h9 is gone after reset 129")


def test_growth_per_reset_shows_as_rss_percent_and_slope() -> None:
    d = drift(cycles(200, grow_mib_per_reset=0.1), first=10, window=5)[7]
    # medians of resets 10..18 (14 -> 401.4 MiB) and 192..200 (196 -> 419.6 MiB)
    assert abs(d.rss_pct - 100 * (419.6 - 401.4) / 401.4) < 0.01
    assert abs(d.rss_bytes_per_reset - 0.1 * MIB) < 1
    assert not d.ok(2.0) and d.ok(5.0)
    assert not verdict({7: d}, max_rss_pct=2.0, survivors=1)


def test_one_fd_more_every_ten_resets_is_not_flat() -> None:
    d = drift(cycles(200, fds_every=10), first=10, window=5)[7]
    assert d.fds_delta == 18 and d.rss_pct == 0
    assert not verdict({7: d}, max_rss_pct=2.0, survivors=1)


def test_one_odd_sample_does_not_move_the_median_of_a_window() -> None:
    s = cycles(40)
    s = [sample(x.reset, fds=x.fds + 3, threads=x.threads + 1, world=x.world_size) if x.reset == 38 else x for x in s]
    d = drift(s, first=10, window=5)[7]
    assert d.fds_delta == 0 and d.threads_delta == 0


def test_a_survivor_missing_or_with_no_sample_past_the_first_reset_fails_the_verdict() -> None:
    d = drift([*cycles(200), sample(3, pid=9)], first=10, window=5)
    assert 9 not in d
    assert not verdict(d, max_rss_pct=2.0, survivors=2)


def test_the_table_has_a_row_per_survivor_and_says_whether_the_goal_was_met() -> None:
    d = drift(cycles(200, grow_mib_per_reset=0.1) + cycles(200, pid=8), first=10, window=5)
    report = {
        "resets_asked": 200,
        "seed": 3,
        "fault": "kill",
        "date": "2026-12-04T13:00:00Z",
        "host": "vm",
        "resets": 200,
        "wall_seconds": 700.4,
        "first": 10,
        "window": 5,
        "max_rss_drift_pct": 2.0,
        "ok": verdict(d, max_rss_pct=2.0, survivors=2),
        "survivors": [asdict(d[7]), asdict(d[8])],
        "error": None,
    }
    text = markdown_table(report)
    assert "200 resets in 700 s" in text and "NOT met" in text
    rows = [line for line in text.splitlines() if line.startswith("| 7 ") or line.startswith("| 8 ")]
    assert len(rows) == 2
    assert "+4.53%" in rows[0] and "+102.4 KiB/reset" in rows[0] and "| 20→20 |" in rows[0]
    assert "+0.00%" in rows[1]


def test_a_result_never_replaces_an_existing_file(tmp_path: Path) -> None:
    assert free_result_path(tmp_path, "2026-12-04-vm-resets") == tmp_path / "2026-12-04-vm-resets.json"
    (tmp_path / "2026-12-04-vm-resets.json").write_text("{}")
    assert free_result_path(tmp_path, "2026-12-04-vm-resets") == tmp_path / "2026-12-04-vm-resets-2.json"
    (tmp_path / "2026-12-04-vm-resets-2.md").write_text("")
    assert free_result_path(tmp_path, "2026-12-04-vm-resets") == tmp_path / "2026-12-04-vm-resets-3.json"


def test_fds_are_counted_by_kind() -> None:
    assert fd_kind("socket:[123456]") == "socket"
    assert fd_kind("pipe:[99]") == "pipe"
    assert fd_kind("anon_inode:[eventpoll]") == "anon_inode:[eventpoll]"
    assert fd_kind("/dev/shm/torch_123_456") == "/dev/shm/*"
    assert fd_kind("/runs/r2/ledger/tenure-000001-4242.jsonl") == "/runs/r2/ledger/tenure-######-####.jsonl"


def test_the_job_outlasts_the_resets() -> None:
    assert epochs_for(200) * 60 * 0.08 >= 2 * 200 * 6
    assert epochs_for(1) >= 4


def test_the_command_line_defaults_and_a_run_too_short_to_measure_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.resets, args.first, args.window, args.fault, args.max_rss_drift_pct) == (200, 10, 5, "term", 2.0)
    assert run(parser.parse_args(["--resets", "12"])) == 2  # fewer than --first + --window: nothing started
    assert "--resets 12 must be >= --first + --window" in capsys.readouterr().err


def test_an_out_file_that_exists_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (tmp_path / "r.md").write_text("kept\n")
    assert run(parser.parse_args(["--out", str(tmp_path / "r.json")])) == 2
    assert "exists" in capsys.readouterr().err and (tmp_path / "r.md").read_text() == "kept\n"
