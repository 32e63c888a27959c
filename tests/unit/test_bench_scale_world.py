"""The pure parts of ``python -m bench --only scale_world``: what each kill aims at, rank 0's host from the run's
output, the per-size figures and their growth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scale_world


def test_kills_aim_at_rank0_first_then_hot_and_cold_hosts_in_turn():
    assert scale_world.victims(4) == ["rank0", "hot", "cold", "hot"]
    assert scale_world.victims(1) == ["rank0"]


def test_min_np_is_half_the_world_and_never_below_two():
    assert [scale_world.min_np(n) for n in (2, 4, 8, 32)] == [2, 2, 4, 16]


def test_rank0_host_is_read_from_its_latest_log_line(tmp_path: Path):
    def line(prefix: str, rec: dict | str) -> str:
        return f"{prefix}<stderr>:{rec if isinstance(rec, str) else json.dumps(rec)}\n"

    log = tmp_path / "horovodrun.log"
    log.write_text(
        line("[0]", {"event": "metrics", "rank": 0, "host": "a"})
        + line("[3]", {"event": "metrics", "rank": 1, "host": "b"})
        + line("[2]", {"event": "training", "rank": 0, "host": "c"})  # rank 0 moved to c after a reset
        + line("[1]", "not json {")
        + "Process 0 exit with status code 137.\n"
        + line("[1]", {"event": "x", "rank": 0, "host": 7})  # a host that is not a string is no answer
    )
    assert scale_world.rank0_host(log) == "c"
    assert scale_world.rank0_host(tmp_path / "missing.log") is None


def _run(size: int, kill: float, hot: float, cold: float, rendezvous: float, sync: float) -> dict:
    parts = {"detect": 0.5, "rendezvous": rendezvous, "sync": sync, "prologue": 0.2, "first_step": 0.3}
    kills = [
        {"kill_to_step": kill, "down_parts": parts, "up_kind": kind, "up_pause": pause, "up_parts": parts}
        for kind, pause in (("hot", hot), ("cold", cold), ("hot", hot * 2))
    ]
    memory = {"hot_worker_mib": 200.0, "cold_worker_mib": 400.0, "zygote_mib": 250.0}
    return {"startup_seconds": 10.0 * size, "step_seconds": 0.1 * size, "kills": kills, "memory": memory}


def test_figures_take_medians_per_size_and_our_share_leaves_horovods_rendezvous_out():
    f = scale_world.figures(_run(4, kill=1.0, hot=1.0, cold=8.0, rendezvous=0.4, sync=0.1))
    assert f["kill_to_step_median"] == f["kill_to_step_max"] == 1.0
    assert f["hot_up_median"] == 1.5 and f["cold_up_median"] == 8.0
    assert f["kill_own_share"] == pytest.approx(0.5 + 0.1 + 0.2)  # detect + sync + prologue
    assert f["kill_rendezvous"] == 0.4
    assert f["kill_own_share_steps"] == pytest.approx(0.8 / 0.4)  # in steps of this world (0.1 s x 4)


def test_growth_divides_the_largest_size_by_the_smallest_and_skips_missing_figures():
    small = scale_world.figures(_run(4, kill=1.0, hot=1.0, cold=8.0, rendezvous=0.4, sync=0.1))
    large = scale_world.figures(_run(32, kill=3.0, hot=2.0, cold=30.0, rendezvous=2.0, sync=0.3))
    large["zygote_pss_mib"] = None
    g = scale_world.growth({32: large, 4: small})
    assert g["kill_to_step_median"] == pytest.approx(3.0)
    assert g["kill_rendezvous"] == pytest.approx(5.0)
    assert g["kill_own_share"] == pytest.approx((0.5 + 0.3 + 0.2) / 0.8)
    assert g["zygote_pss_mib"] is None


def test_a_size_that_fails_is_reported_and_the_others_keep_their_figures(monkeypatch, tmp_path: Path):
    from bench.core import BenchContext
    from chaos.procs import HarnessError

    def one_size(workdir, size, kills, log):
        if size == 8:
            raise HarnessError("timed out after 280s waiting for 127.0.0.5 back at 8 workers\nlog tail")
        run = _run(size, kill=1.0, hot=1.0, cold=8.0, rendezvous=0.4, sync=0.1)
        for k in run["kills"]:
            k["collateral"] = 0
        run["kills"][0]["collateral"] = 2
        return run

    monkeypatch.setattr(scale_world, "one_size", one_size)
    ctx = BenchContext(quick=True, workdir=tmp_path, progress=lambda _m: None)
    result = scale_world.run(ctx, sizes=(4, 8), kills=3)
    assert result.detail["failed"] == {"8": "timed out after 280s waiting for 127.0.0.5 back at 8 workers"}
    assert list(result.contenders) == ["4"]
    [collateral] = [m for m in result.metrics if m.name.startswith("kills (all sizes)")]
    assert collateral.value == 1.0 and "of 3" in collateral.note
