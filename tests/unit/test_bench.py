"""The bench harness with fakes: alternation, goals and ratios, statistics, the JSON schema, the machine
description, result files, and the bookkeeping of steady throughput, commit share and goodput. Nothing
here times anything; the only processes started are stand-ins (a busy child, a fake zygote)."""

from __future__ import annotations

import io
import json
import math
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import bench
from bench import commit, goodput, hotjoin, runs, sigkill, stragglers
from bench.core import (
    SCHEMA,
    BenchContext,
    BenchError,
    Goal,
    Metric,
    Progress,
    Result,
    alternate,
    build_report,
    cpu_model,
    describe_machine,
    markdown_table,
    percentile,
    result_stem,
    summary,
    threads_per_worker,
    write_results,
)
from bench.cpu import TreeCpuMonitor, read_steal
from chaos.procs import wait_until
from elastictrain import envnames
from elastictrain.rundir.events import Commit, Eviction, Metrics, Reset, Straggler


def test_contenders_run_interleaved_a_b_b_a_and_each_gets_its_repeat_index() -> None:
    calls: list[tuple[str, int]] = []
    lines: list[str] = []
    out = alternate(
        [("a", lambda r: calls.append(("a", r)) or 10 + r), ("b", lambda r: calls.append(("b", r)) or 20 + r)],
        3,
        lines.append,
    )
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert out == {"a": [10, 11, 12], "b": [20, 21, 22]}
    assert lines == ["a 1/3", "b 1/3", "b 2/3", "a 2/3", "a 3/3", "b 3/3"]


def test_alternation_rejects_no_repeats_and_duplicate_names() -> None:
    with pytest.raises(ValueError, match="repeats"):
        alternate([("a", lambda r: r)], 0)
    with pytest.raises(ValueError, match="distinct"):
        alternate([("a", lambda r: r), ("a", lambda r: r)], 1)


def test_goals_compare_in_their_direction_and_report_the_ratio_to_the_target() -> None:
    at_least = Goal(">=", 0.97)
    assert at_least.met(0.98) is True and at_least.met(0.96) is False and at_least.met(0.97) is True
    assert at_least.ratio(0.485) == pytest.approx(0.5)
    at_most = Goal("<=", 5.0)
    assert at_most.met(0.9) is True and at_most.met(30.0) is False
    assert at_most.ratio(30.0) == pytest.approx(6.0)
    assert at_most.met(None) is None and at_most.met(math.nan) is None and at_most.ratio(None) is None
    assert str(at_least) == ">= 0.97"


def test_metric_dict_carries_goal_verdict_and_ratio_and_report_only_metrics_have_none() -> None:
    d = Metric("ratio", 0.5, "", Goal(">=", 1.0)).to_dict()
    assert d["met"] is False and d["ratio_to_goal"] == 0.5 and d["goal"] == ">= 1"
    r = Metric("samples/s", 812.3, "samples/s").to_dict()
    assert r["goal"] is None and r["met"] is None and r["ratio_to_goal"] is None


def test_summary_gives_median_and_nearest_rank_p95() -> None:
    s = summary([5.0, 1.0, 3.0, 2.0, 4.0], "s")
    assert s["median"] == 3.0 and s["p95"] == 5.0 and s["min"] == 1.0 and s["max"] == 5.0 and s["n"] == 5
    assert s["values"] == [5.0, 1.0, 3.0, 2.0, 4.0]  # measurement order kept
    assert percentile(list(range(1, 101)), 95) == 95
    assert summary([])["median"] is None
    with pytest.raises(ValueError):
        percentile([], 50)


def fake_machine() -> dict:
    return describe_machine(
        cpuinfo=lambda: "processor\t: 0\nmodel name\t: Fake CPU @ 2.0GHz\n",
        memory_bytes=lambda: 8 * 2**30,
        versions=lambda: {"torch": "2.14.1", "horovod": "0.28.1", "mlflow": "3.1"},
        gpus=lambda: [],
    )


def test_machine_description_names_cores_memory_cpu_versions_and_gpus() -> None:
    m = fake_machine()
    assert m["cpu_model"] == "Fake CPU @ 2.0GHz"
    assert m["memory_gib"] == 8.0
    assert m["torch"] == "2.14.1" and m["horovod"] == "0.28.1" and m["gpus"] == []
    assert m["cpu_count"] >= 1 and m["usable_cores"] >= 1 and m["python"] and m["hostname"]
    assert cpu_model("vendor_id: x\n") is None


def test_threads_per_worker_shares_the_cores_like_launch() -> None:
    assert threads_per_worker(2, cores=2) == 1
    assert threads_per_worker(1, cores=2) == 2
    assert threads_per_worker(3, cores=2) == 1


def sample_report(tmp_path: Path) -> dict:
    ok = Result(
        "elastic_overhead",
        metrics=[Metric("samples/s ratio", 0.95, "", Goal(">=", 0.97))],
        contenders={"elastictrain": summary([950.0], "samples/s"), "plain_horovod": summary([1000.0], "samples/s")},
        detail={"nan": math.nan, "pair": (1, 2)},
        seconds=12.5,
    )
    failed = Result("discovery", status="error", error="EtcdError: etcd not healthy within 20s")
    return build_report(
        [ok, failed],
        machine=fake_machine(),
        quick=True,
        argv=["python", "-m", "bench", "--quick"],
        started=1_700_000_000.0,
        finished=1_700_000_100.0,
        load_before=[1.5, 1.0, 0.5],
        load_after=[2.0, 1.2, 0.6],
    )


def test_report_json_schema_is_strict_json_with_machine_load_and_every_measurement(tmp_path: Path) -> None:
    report = sample_report(tmp_path)
    text = json.dumps(report, allow_nan=False)  # NaN was cleaned to null
    back = json.loads(text)
    assert back["schema"] == SCHEMA and back["mode"] == "quick" and back["wall_seconds"] == 100.0
    assert back["load_average"] == {"before": [1.5, 1.0, 0.5], "after": [2.0, 1.2, 0.6]}
    assert set(back["machine"]) >= {"cpu_model", "usable_cores", "memory_gib", "torch", "horovod", "python", "gpus"}
    m = back["measurements"]["elastic_overhead"]
    assert set(m) == {"name", "status", "error", "seconds", "metrics", "contenders", "detail"}
    assert m["metrics"][0]["met"] is False and m["detail"] == {"nan": None, "pair": [1, 2]}
    assert m["contenders"]["plain_horovod"]["median"] == 1000.0
    assert back["measurements"]["discovery"]["status"] == "error"


def test_markdown_table_shows_every_metric_its_goal_verdict_and_errors(tmp_path: Path) -> None:
    md = markdown_table(sample_report(tmp_path))
    assert "| measurement | metric | value | goal | met | contenders (median) |" in md
    assert "| `elastic_overhead` | samples/s ratio | 0.95 | >= 0.97 | ❌ | elastictrain: 950 samples/s" in md
    assert "| `discovery` | error | EtcdError: etcd not healthy within 20s |" in md
    assert "Fake CPU" in md and "torch 2.14.1" in md


def test_results_are_written_as_date_host_json_and_md(tmp_path: Path) -> None:
    report = sample_report(tmp_path)
    stem = result_stem(1_700_000_000.0, "my host/1", quick=False)
    assert stem.endswith("-my_host_1") and stem[:4].isdigit()
    assert result_stem(1_700_000_000.0, "h", quick=True).endswith("-h-quick")
    j, md = write_results(report, tmp_path / "out", stem)
    assert j.name == f"{stem}.json" and md.name == f"{stem}.md"
    assert json.loads(j.read_text())["schema"] == SCHEMA and md.read_text().startswith("`python -m bench --quick`")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([j.name, md.name])  # no temp files


def test_only_selects_known_measurements_in_run_order_and_names_a_bad_one() -> None:
    assert bench.parse_only(None) == list(bench.MEASUREMENTS)
    assert bench.parse_only(None, quick=True) == [n for n in bench.MEASUREMENTS if n in bench.QUICK_RUN]
    assert set(bench.QUICK_RUN) < set(bench.MEASUREMENTS) and "peers" not in bench.QUICK_RUN
    assert bench.parse_only("peers", quick=True) == ["peers"], "--only still names any measurement"
    assert bench.parse_only("goodput,discovery") == ["discovery", "goodput"]
    with pytest.raises(ValueError, match=r"unknown measurement bogus \(choose from discovery, "):
        bench.parse_only("discovery,bogus")


def test_bad_only_flag_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--only", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown measurement nope" in err[0]


def test_a_failing_measurement_becomes_an_error_result_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(ctx: BenchContext) -> Result:
        raise BenchError("job ended early (exit 1):\nlong log")

    monkeypatch.setattr(goodput, "run", boom)
    ctx = BenchContext(quick=True, workdir=tmp_path, progress=lambda _m: None)
    r = bench.run_measurement("goodput", ctx)
    assert r.status == "error" and r.error == "BenchError: job ended early (exit 1):"
    assert "Traceback" in r.detail["traceback"]


def test_progress_lines_go_to_the_stream_with_elapsed_time_and_scope() -> None:
    stream, now = io.StringIO(), iter([100.0, 112.34])
    p = Progress(stream, clock=lambda: next(now))
    p.scope = "recovery"
    p("stock 1/3")
    assert stream.getvalue() == "[bench +  12.3s] recovery: stock 1/3\n"


def metrics_event(step: int, ts: float, sps: float, world_size: int = 2, step_seconds: float = 0.1) -> Metrics:
    return Metrics(
        step=step, epoch=0, ts=ts, samples_per_sec=sps, world_size=world_size, step_seconds=step_seconds, steps=10
    )


def test_steady_throughput_skips_warm_up_and_counts_the_whole_window() -> None:
    events = [metrics_event(10, 100.0, 50.0), metrics_event(20, 110.0, 64.0)]
    events += [metrics_event(30, 111.0, 640.0), metrics_event(40, 112.0, 640.0), metrics_event(50, 114.0, 320.0)]
    out = runs.steady_throughput(events, batch=32, warmup_steps=20)
    # steps 30 -> 50: 20 steps x 32 x 2 workers over 3 s (the slow interval with a checkpoint counts)
    assert out["samples_per_sec"] == pytest.approx(20 * 64 / 3.0)
    assert out["interval_median_samples_per_sec"] == 480.0 and out["steps_measured"] == 20
    with pytest.raises(BenchError, match="too short"):
        runs.steady_throughput(events[:3], batch=32, warmup_steps=20)


def test_commit_share_spreads_the_median_commit_over_the_default_interval() -> None:
    share = commit.commit_share(
        [
            {"commit_seconds": [0.001, 0.002, 0.003], "step_seconds_median": 0.1},
            {"commit_seconds": [0.002], "step_seconds_median": 0.3},
        ]
    )
    assert share["commit_seconds_median"] == 0.002 and share["step_seconds_median"] == 0.2
    assert share["percent_of_step_time"] == pytest.approx(100 * 0.002 / (10 * 0.2))
    assert share["percent_of_one_step"] == pytest.approx(1.0)


def test_own_goodput_subtracts_kill_downtime_scale_up_pauses_and_rolled_back_steps() -> None:
    events = [
        metrics_event(10, 5.0, 100.0, step_seconds=0.5),
        Reset(ts=31.0, lost_steps=4, recovery_seconds=0.8, step=20, epoch=0, world_size=2),  # after the kill at 30
        Reset(ts=50.0, lost_steps=0, recovery_seconds=6.0, step=40, epoch=0, world_size=3, old_size=2, new_size=3),
        metrics_event(50, 60.0, 100.0, step_seconds=0.5),
    ]
    own = goodput.own_goodput(events, kills=[30.0, 90.0], t0=0.0, t_end=100.0)
    # downtime: 1 s (kill -> reset) + 6 s (scale-up) + 10 s (the kill at 90 never recovered); lost 4 x 0.5 s
    assert own["downtime_seconds"] == pytest.approx(17.0) and own["lost_steps"] == 4
    assert own["goodput"] == pytest.approx((100 - 17 - 2) / 100)
    # the breakdown a profile reads: each kill's downtime (None: not recovered), each scale-up's pause
    assert own["kills"] == [
        {"t": 30.0, "down_seconds": pytest.approx(1.0), "lost_steps": 4},
        {"t": 90.0, "down_seconds": None, "lost_steps": None},
    ]
    assert own["other_resets"] == [{"t": 50.0, "down_seconds": 6.0, "sizes": [2, 3]}]


def test_the_next_step_after_a_sigkill_is_the_first_reset_at_or_after_it_below_the_broken_size() -> None:
    def reset(ts: float, new_size: int | None, lost: int = 0) -> Reset:
        return Reset(
            ts=ts, lost_steps=lost, recovery_seconds=0.5, step=int(ts), epoch=0, world_size=4, new_size=new_size
        )

    resets = [reset(9.0, 3), reset(12.0, 4), reset(15.0, 3, lost=2), reset(20.0, 2)]
    assert sigkill.next_step(resets, 11.0) == 1  # any reset: a scale-up counts
    assert sigkill.next_step(resets, 11.0, below=4) == 2  # the kill broke 4 workers: the scale-up to 4 does not
    assert sigkill.next_step(resets, 11.0, below=4, taken={2}) == 3  # an earlier kill's step is not this one's
    assert sigkill.next_step(resets, 21.0) is None  # not recovered
    assert not sigkill.is_next_step(reset(15.0, None), 11.0, below=4)  # no size: not known to be smaller
    assert sigkill.outcome(resets[2], 11.0) == {
        "seconds": 4.0,
        "lost_steps": 2,
        "step": 15,
        "new_size": 3,
        "worker_recovery_seconds": 0.5,
    }


def test_sigkill_signals_every_process_back_to_back_and_skips_one_already_gone() -> None:
    sent: list[tuple[int, int]] = []

    class Proc:
        def __init__(self, pid: int, gone: bool = False) -> None:
            self.pid, self.gone = pid, gone

        def send_signal(self, sig: int) -> None:
            if self.gone:
                raise psutil.NoSuchProcess(self.pid)
            sent.append((self.pid, sig))

    before = time.time()
    t = sigkill.sigkill([Proc(1), Proc(2, gone=True), Proc(3)])
    assert before <= t <= time.time()
    assert sent == [(1, signal.SIGKILL), (3, signal.SIGKILL)]


def test_goodput_job_runs_both_features_and_the_victim_is_a_seeded_draw_in_rank_order() -> None:
    assert goodput.job_config(Path("/r"))["elastic"]["rollback"] == "none"
    assert goodput.GOAL.target == 0.95
    draws = [goodput.victim_rank(random.Random(goodput.SEED), ranks) for ranks in ([2, 0, 1], [0, 1, 2], [1, 2, 0])]
    assert len(set(draws)) == 1, "the order workers are found in must not change the victim"
    rng = random.Random(3)
    assert {goodput.victim_rank(rng, [4, 7]) for _ in range(50)} == {4, 7}


def test_warm_zygotes_forked_finds_the_children_not_the_zygote_and_close_kills_both_by_pid(tmp_path: Path) -> None:
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    fake = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], text=True)  # a "zygote" with one "forked worker"
    zygotes = hotjoin.WarmZygotes("job", sockets, {"h1": fake})
    try:
        kids = wait_until(lambda: zygotes.forked("h1"), 30, what="the forked child")
        assert [k.pid for k in kids] != [fake.pid] and all(k.ppid() == fake.pid for k in kids)
        assert zygotes.forked("h2") == [] and zygotes.alive() == {"h1": True}
        assert zygotes.env == {envnames.JOB: "job", envnames.ZYGOTE_DIR: str(sockets)}
    finally:
        zygotes.close()
    assert fake.returncode is not None and all(gone(k) for k in kids) and not sockets.exists()


def gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # killed; reaping an orphan is init's business
    except psutil.NoSuchProcess:
        return True


def test_cpu_monitor_windows_between_the_nearest_samples_inside() -> None:
    mon = TreeCpuMonitor(pid=1)
    mon.samples = [(10.0, 1.0, 0, 100), (11.0, 2.5, 5, 300), (12.0, 4.0, 5, 500), (13.0, 9.0, 50, 700)]
    assert mon.between(10.5, 12.5) == {"seconds": 1.0, "cpu_seconds": 1.5, "steal_fraction": 0.0}
    assert mon.between(10.0, 13.0) == {"seconds": 3.0, "cpu_seconds": 8.0, "steal_fraction": 50 / 600}
    assert mon.between(11.5, 12.5) is None  # one sample inside: no window


def test_cpu_monitor_counts_a_busy_child_and_keeps_it_after_it_exits(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    busy = f"import os\nwhile not os.path.exists({str(stop)!r}): pass\n"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])"]
    )
    mon = TreeCpuMonitor(parent.pid, interval=0.05).start()
    try:
        wait_until(lambda: mon.samples and mon.samples[-1][1] > 0.3, 60, what="the busy grandchild's CPU")
        stop.touch()
        parent.wait(timeout=30)
        used, n = mon.samples[-1][1], len(mon.samples)
        wait_until(lambda: len(mon.samples) > n, 10, what="a sample taken after the tree exited")
        assert mon.samples[-1][1] >= used  # the exited processes' CPU stays counted
    finally:
        stop.touch()
        mon.stop()
        parent.kill()
        parent.wait()
    steal, total = read_steal()
    assert total > 0 and 0 <= steal <= total


def test_stragglers_window_throughput_counts_the_intervals_closed_after_the_first_event_in_the_window() -> None:
    events = [Metrics(step=s, epoch=0, ts=100.0 + s / 2, world_size=4, steps=2) for s in range(2, 22, 2)]  # 2 steps/s
    w = stragglers.window_throughput(events, 101.0, 105.5, batch=16)
    # events at 101 .. 105 (steps 2 .. 10): 4 intervals of 2 steps x 16 x 4 workers over 4 s
    assert w is not None and w["samples"] == 4 * 2 * 16 * 4 and w["seconds"] == pytest.approx(4.0)
    assert w["samples_per_sec"] == pytest.approx(128.0) and w["steps"] == 8 and w["world_sizes"] == [4]
    assert stragglers.window_throughput(events, 101.0, 101.4) is None  # one event: no window
    assert stragglers.metrics_samples(metrics_event(4, 1.0, 0.0, world_size=3), batch=16) == 10 * 16 * 3


def test_stragglers_seconds_lost_are_the_reference_rate_seconds_not_delivered() -> None:
    assert stragglers.seconds_lost(samples=800.0, seconds=10.0, reference_rate=100.0) == pytest.approx(2.0)
    assert stragglers.seconds_lost(samples=1000.0, seconds=10.0, reference_rate=100.0) == pytest.approx(0.0)


def test_stragglers_steps_until_named_counts_from_the_step_at_the_slowdown_to_the_naming() -> None:
    events = [
        metrics_event(40, 100.0, 50.0, world_size=4),
        Commit(step=45, epoch=0, ts=102.0, world_size=4),
        Straggler(step=46, epoch=0, ts=102.5, world_size=4, host="b", slow=True, ratio=2.0),  # before: not it
        Straggler(step=90, epoch=0, ts=120.0, world_size=4, host="a", slow=False),
        Straggler(step=97, epoch=0, ts=124.0, world_size=4, host="a", slow=True, ratio=1.6, window_steps=100),
    ]
    got = stragglers.steps_until_named(events, 102.1, "a")
    assert got == {
        "start_step": 45,
        "named_step": 97,
        "steps": 52,
        "seconds": pytest.approx(21.9),
        "ratio": 1.6,
        "window_steps": 100,
        "named_before": False,
    }
    assert stragglers.steps_until_named(events, 102.1, "c") is None
    assert stragglers.step_at(events, 99.0) == 0
    # "b" was named by noise before the slowdown and not cleared: named at 0 steps, flagged
    assert stragglers.named_hosts(events) == {"a", "b"} and stragglers.named_hosts(events[:4]) == {"b"}
    before = stragglers.steps_until_named(events, 110.0, "b")
    assert before is not None and before["steps"] == 0 and before["named_before"] is True


def test_stragglers_false_positives_name_hosts_and_the_highest_slowest_ratio() -> None:
    clean = [Metrics(step=2, epoch=0, ts=1.0, world_size=3, slowest_host="a", slowest_ratio=1.12)]
    clean += [Metrics(step=4, epoch=0, ts=2.0, world_size=3, slowest_host="b", slowest_ratio=1.21)]
    assert stragglers.false_positives(clean) == {"hosts_named": [], "evictions": [], "max_slowest_ratio": 1.21}
    noisy = [*clean, Straggler(step=5, epoch=0, ts=3.0, world_size=3, host="b", slow=True)]
    noisy += [Eviction(step=6, epoch=0, ts=3.5, world_size=3, host="b", action="drain")]
    assert stragglers.false_positives(noisy)["hosts_named"] == ["b"]
    assert stragglers.false_positives(noisy)["evictions"] == ["b"]
    assert stragglers.false_positives([])["max_slowest_ratio"] is None


def test_stragglers_jobs_run_the_evict_policy_with_the_default_window_and_hang_bound() -> None:
    cfg = stragglers.job_config(Path("/r"), "j")
    assert cfg["elastic"]["stragglers"] == "evict" and cfg["elastic"]["max_np"] == stragglers.WORKERS == 4
    assert "window_steps" not in cfg["elastic"] and "hang_seconds" not in cfg["elastic"]
    assert stragglers.GOAL_NAMED_STEPS.target == 100 and stragglers.GOAL_HANG_SECONDS.target == 15


def test_the_help_gives_each_measurements_last_recorded_time_per_mode(tmp_path: Path) -> None:
    run = {"mode": "quick", "measurements": {"discovery": {"seconds": 12.0}, "bogus": {"seconds": 3.0}}}
    (tmp_path / "2026-12-01-vm-quick.json").write_text(json.dumps(run))
    later = {"mode": "quick", "measurements": {"discovery": {"seconds": 90.0}}}
    (tmp_path / "2026-12-02-vm-quick.json").write_text(json.dumps(later))
    (tmp_path / "2026-12-03-vm.json").write_text(json.dumps({"mode": "full", "measurements": {"discovery": {}}}))
    (tmp_path / "notes.json").write_text("[1, 2]")
    times = bench.recorded_times(tmp_path)
    assert times == {"discovery": {"quick": (90.0, "2026-12-02-vm-quick.json")}}
    text = bench.describe_measurements(times)
    assert "discovery (in --quick; last run: quick 1.5 min, full not timed)" in text
    assert "peers (--quick --only; last run: quick not timed, full not timed)" in text
