"""Invariant checks of the chaos runner, with fake events, ledgers and checkpoint results (no processes)."""

from __future__ import annotations

from chaos import faults
from chaos import invariants as inv
from chaos.scenarios import config_hash, soak_schedule
from elastictrain.rundir.events import Event, parse_event
from elastictrain.tools.audit import audit_samples


def ev(ts: float, event: str, step: int = 0, **fields: object) -> Event:
    return parse_event({"ts": ts, "event": event, "step": step, "epoch": 0, "world_size": 3, **fields})


def test_a_job_is_complete_only_when_the_launcher_exits_0_and_the_last_lifecycle_event_is_done() -> None:
    done = [ev(1, "start"), ev(2, "metrics", 5), ev(3, "done", 10)]
    assert inv.check_completed(0, done).ok
    assert not inv.check_completed(1, done).ok
    assert not inv.check_completed(0, [*done, ev(4, "start", 10)]).ok, "a start after done: it ran again"
    assert not inv.check_completed(0, [ev(1, "start"), ev(2, "stopped", 4)]).ok


def test_every_sample_exactly_once_counts_lost_and_duplicated_ids_per_epoch() -> None:
    good = {0: [3, 1, 0, 2], 1: [2, 0, 3, 1]}
    audit = audit_samples(good, num_samples=4, epochs=2)
    assert (audit.lost, audit.duplicated, audit.epochs_checked) == (0, 0, 2)
    assert inv.check_exactly_once(audit).ok

    bad = audit_samples({0: [0, 1, 1, 2, 3], 1: [0, 1, 2]}, num_samples=4, epochs=2)
    assert (bad.lost, bad.duplicated) == (1, 1)
    assert bad.per_epoch == {0: (0, 1), 1: (1, 0)}
    check = inv.check_exactly_once(bad)
    assert not check.ok and "1 lost, 1 duplicated" in check.detail


def test_samples_of_an_epoch_past_the_last_or_out_of_range_ids_count_as_duplicated() -> None:
    audit = audit_samples({0: [0, 1, 7], 1: [0]}, num_samples=2, epochs=1)
    assert audit.duplicated == 2 and audit.lost == 0
    assert not inv.check_exactly_once(None).ok, "no ledger is a failure, not a pass"


def test_final_loss_compares_the_last_metrics_event_within_the_stated_tolerance() -> None:
    events = [ev(1, "metrics", 115, loss=9.0), ev(2, "metrics", 120, loss=1.05), ev(3, "done", 120, final_loss=None)]
    assert inv.final_loss(events) == (120, 1.05)
    assert inv.check_final_loss((120, 1.05), (120, 1.0)).ok  # 0.05 <= 0.1 + 0.1
    assert not inv.check_final_loss((120, 1.5), (120, 1.0)).ok
    assert not inv.check_final_loss((120, 0.5), (120, 1.0)).ok, "a doubled stretch of training lowers the loss"
    assert not inv.check_final_loss((115, 1.0), (120, 1.0)).ok, "a different final step is not the same training"
    assert not inv.check_final_loss((120, float("nan")), (120, 1.0)).ok
    assert not inv.check_final_loss((120, 1.0), None).ok


def test_latest_checkpoint_must_load_and_no_committed_checkpoint_may_fail_verification() -> None:
    ok = inv.check_checkpoints("step-00000120", "step-00000120", {"step-00000110": None, "step-00000120": None})
    assert ok.ok and ok.value == 0
    abandoned = {"step-00000130": "step-00000130: no manifest.json (incomplete save)", "step-00000120": None}
    assert inv.check_checkpoints("step-00000120", "step-00000120", abandoned).ok, "a save cut before its commit point"
    corrupt = {"step-00000120": "step-00000120: state.pt SHA-256 does not match the manifest (corrupted)"}
    c = inv.check_checkpoints("step-00000120", "step-00000110", corrupt)
    assert not c.ok and c.value == 1
    assert not inv.check_checkpoints(None, None, {}).ok


def test_one_mlflow_run_matching_the_run_id_file() -> None:
    assert inv.check_one_mlflow_run(["abc"], "abc").ok
    assert not inv.check_one_mlflow_run(["abc", "def"], "abc").ok
    assert not inv.check_one_mlflow_run(["abc"], "zzz").ok
    assert not inv.check_one_mlflow_run(None, None).ok


def test_no_process_left() -> None:
    assert inv.check_no_leftovers([]).ok
    c = inv.check_no_leftovers(["123 elastictrain train"])
    assert not c.ok and "123" in c.detail


def test_each_fault_is_matched_with_the_first_reset_after_it_and_before_the_next_fault() -> None:
    chaos = [
        {"ts": 10.0, "action": "kill-worker", "pid": 1},
        {"ts": 20.0, "action": "preempt-host", "host": "vm"},
        {"ts": 30.0, "action": "freeze-worker", "pid": 2},
        {"ts": 35.0, "action": "freeze-worker", "phase": "end", "pid": 2},
        {"ts": 40.0, "action": "kill-worker", "skipped": "no live worker"},
    ]
    events = [
        ev(11.0, "reset", 30, reason="worker_failed", recovery_seconds=0.8, lost_steps=3),
        ev(15.0, "reset", 35, reason="hosts_added", recovery_seconds=6.0, lost_steps=0),
        ev(22.0, "reset", 50, reason="hosts_removed", recovery_seconds=1.5, lost_steps=0),
    ]
    recs = inv.recoveries(chaos, events)
    assert [(r.action, r.reset_reason, r.recovery_seconds, r.lost_steps) for r in recs] == [
        ("kill-worker", "worker_failed", 0.8, 3),
        ("preempt-host", "hosts_removed", 1.5, 0),
        ("freeze-worker", None, None, None),
    ]
    assert recs[0].seconds_to_reset == 1.0
    assert inv.check_recovered(recs).ok, "a freeze shorter than the Gloo timeout need not cause a reset"
    check = inv.check_recovered(recs, required=inv.RESET_EXPECTED | {"freeze-worker"})
    assert not check.ok and "freeze-worker: no reset" in check.detail
    assert inv.check_recovered(recs, expect_reset=False).ok is None
    assert inv.recovery_stats(recs, {"kill-worker"}) == {"count": 1, "p50": 0.8, "p95": 0.8}


def test_a_drain_is_matched_with_its_hosts_removed_reset_not_an_earlier_faults_grow_back() -> None:
    chaos = [{"ts": 10.0, "action": "preempt-host", "host": "vm"}]
    events = [
        ev(11.0, "reset", 30, reason="hosts_changed", recovery_seconds=7.3, lost_steps=0),
        ev(12.0, "reset", 35, reason="hosts_removed", recovery_seconds=0.4, lost_steps=0),
    ]
    (rec,) = inv.recoveries(chaos, events)
    assert (rec.reset_reason, rec.recovery_seconds) == ("hosts_removed", 0.4)


def test_a_killed_job_recovers_at_the_relaunch_start_that_resumed_from_a_checkpoint() -> None:
    chaos = [{"ts": 10.0, "action": "kill-job"}]
    events = [
        ev(30.0, "start", 40, resumed_from_step=40),
        ev(40.0, "reset", 45, reason="hosts_added", recovery_seconds=5.0, lost_steps=0),
    ]
    (rec,) = inv.recoveries(chaos, events)
    assert (rec.reset_reason, rec.recovery_seconds) == ("relaunch", 20.0)


def test_faults_at_the_same_moment_share_the_reset_that_follows_them_but_an_outage_keeps_its_own_window() -> None:
    chaos = [
        {"ts": 10.0, "action": "kill-host", "host": "a"},
        {"ts": 10.1, "action": "kill-host", "host": "b"},
        {"ts": 30.0, "action": "etcd-outage"},
        {"ts": 60.0, "action": "kill-worker"},
    ]
    events = [
        ev(17.5, "reset", 20, reason="worker_failed", recovery_seconds=7.5, lost_steps=2),
        ev(61.0, "reset", 50, reason="worker_failed", recovery_seconds=1.0, lost_steps=1),
    ]
    recs = inv.recoveries(chaos, events)
    assert [(r.action, r.recovery_seconds) for r in recs] == [
        ("kill-host", 7.5),
        ("kill-host", 7.5),
        ("etcd-outage", None),  # not charged with the later kill's reset
        ("kill-worker", 1.0),
    ]


def test_a_graceful_fault_may_not_roll_back_a_step() -> None:
    drained = inv.Recovery("preempt-host", 1.0, "hosts_removed", 1.0, 1.0, 0)
    killed = inv.Recovery("preempt-host", 1.0, "worker_failed", 1.0, 1.0, 4)
    assert inv.check_no_step_lost([drained]).ok
    assert not inv.check_no_step_lost([drained, killed]).ok


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 21)]
    assert inv.percentile(values, 50) == 10.0
    assert inv.percentile(values, 95) == 19.0
    assert inv.percentile([], 95) is None


def test_the_table_prints_every_check_and_fails_when_one_breaks() -> None:
    checks = [inv.Check("job completed", True, "exit 0"), inv.Check("goodput", None, "0.8")]
    table = inv.format_table("scenario x", checks)
    assert table.splitlines()[0] == "scenario x" and table.endswith("PASS")
    assert inv.passed(checks)
    broken = [*checks, inv.Check("one MLflow run", False, "2 runs")]
    assert inv.format_table("x", broken).endswith("FAIL") and not inv.passed(broken)


def test_goodput_check_is_informational_without_a_minimum() -> None:
    assert inv.check_goodput(0.7).ok is None
    assert inv.check_goodput(0.9, 0.85).ok
    assert not inv.check_goodput(0.8, 0.85).ok
    assert not inv.check_goodput(None).ok


def test_the_loop_schedule_is_a_pure_function_of_its_seed() -> None:
    a = faults.LoopPlan(seed=4, mtbf=10, actions=("kill-worker", "freeze-worker"), duration=300)
    b = faults.LoopPlan(seed=4, mtbf=10, actions=("kill-worker", "freeze-worker"), duration=300)
    c = faults.LoopPlan(seed=5, mtbf=10, actions=("kill-worker", "freeze-worker"), duration=300)
    assert a.schedule == b.schedule != c.schedule
    assert all(0 < t < 300 for t, _ in a.schedule) and len(a.schedule) > 10
    fixed = faults.LoopPlan(seed=1, mtbf=60, actions=("kill-worker",), duration=200, fixed=True)
    assert fixed.schedule == [(60.0, "kill-worker"), (120.0, "kill-worker"), (180.0, "kill-worker")]


def test_the_loop_rejects_unknown_actions() -> None:
    import pytest

    with pytest.raises(ValueError, match="unknown"):
        faults.LoopPlan(seed=1, mtbf=1, actions=("rm-rf",), duration=10)


def test_the_soak_kills_every_interval_and_runs_each_other_action_once() -> None:
    schedule = soak_schedule(1200, 60)
    kills = [t for t, a in schedule if a == "kill-worker"]
    assert kills == [60.0 * k for k in range(1, 21)]
    others = [a for _, a in schedule if a != "kill-worker"]
    assert sorted(others) == sorted(set(others)) and len(others) == 5
    assert [t for t, _ in schedule] == sorted(t for t, _ in schedule)


def test_the_reference_cache_key_ignores_the_job_name_and_run_dir_only() -> None:
    cfg = {"job": "a", "run_dir": "/x", "training": {"seed": 1}}
    assert config_hash(cfg, ()) == config_hash({**cfg, "job": "b", "run_dir": "/y"}, ())
    assert config_hash(cfg, ()) != config_hash({**cfg, "training": {"seed": 2}}, ())
    assert config_hash(cfg, ()) != config_hash(cfg, ("--gloo-timeout-seconds", "5"))


def test_the_chaos_log_writes_one_timestamped_json_line_per_fault(tmp_path) -> None:
    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    log.log("kill-worker", job="j", pid=5)
    log.log("freeze-worker", job="j", phase="end")
    lines = faults.read_chaos(tmp_path / "chaos.jsonl")
    assert [x["action"] for x in lines] == ["kill-worker", "freeze-worker"]
    assert all(isinstance(x["ts"], float) for x in lines) and list(lines[0])[:2] == ["ts", "action"]


def test_a_checkpoint_temp_file_names_its_writer_pid(tmp_path) -> None:
    step = tmp_path / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / ".state.pt.tmp-4242-deadbeef").write_bytes(b"x")
    (step / "manifest.json").write_text("{}")
    (temp,) = faults.checkpoint_temp_files(tmp_path)
    assert faults.writer_pid(temp) == 4242


def test_orphan_writer_checks_fail_when_latest_moved_back_or_the_writer_survived():
    ok = {"writer_pid": 7, "writer_died_seconds": 0.05, "latest_before": "step-00000040",
          "latest_after": "step-00000040", "latest_before_kept": True}  # fmt: skip
    assert all(c.ok for c in inv.check_orphan_writer(ok))
    moved_back = {**ok, "writer_died_seconds": None, "latest_after": "step-00000030", "latest_before_kept": False}
    died, forward = inv.check_orphan_writer(moved_back)
    assert (died.ok, forward.ok) == (False, False)
    newer = {**ok, "latest_after": "step-00000050", "latest_before_kept": False}  # pruned by keep_last: fine
    assert all(c.ok for c in inv.check_orphan_writer(newer))
    assert [c.ok for c in inv.check_orphan_writer(None)] == [False]


def test_a_hang_is_matched_with_its_worker_hung_reset_and_must_beat_the_gloo_timeout() -> None:
    chaos = [{"ts": 10.0, "action": "hang-worker", "pid": 41, "pids": [41, 42]}]
    detected = [
        ev(21.0, "reset", 30, reason="worker_hung", recovery_seconds=11.2, lost_steps=0),
        ev(24.0, "reset", 35, reason="hosts_added", recovery_seconds=2.0, lost_steps=0),
    ]
    (rec,) = inv.recoveries(chaos, detected)
    assert (rec.reset_reason, rec.recovery_seconds, rec.seconds_to_reset) == ("worker_hung", 11.2, 11.0)
    assert inv.check_recovered([rec]).ok, "a hang must be followed by a reset: it is in RESET_EXPECTED"
    check = inv.check_hang_detected([rec], 15)
    assert check.ok and "reset worker_hung 11.0s after the SIGSTOP, recovery 11.20s" in check.detail
    waited_out = [ev(26.0, "reset", 30, reason="worker_failed", recovery_seconds=16.0, lost_steps=1)]
    assert not inv.check_hang_detected(inv.recoveries(chaos, waited_out), 15).ok, "the Gloo timeout fired first"
    slow = [ev(21.0, "reset", 30, reason="worker_hung", recovery_seconds=15.5, lost_steps=0)]
    assert not inv.check_hang_detected(inv.recoveries(chaos, slow), 15).ok
    assert not inv.check_hang_detected(inv.recoveries(chaos, []), 15).ok
    assert not inv.check_hang_detected([], 15).ok, "no hang recorded"


def test_the_hung_processes_must_be_gone_once_the_job_has_ended() -> None:
    assert inv.check_processes_gone([41, 42], ["7 etcd", "410 elastictrain train"], name="gone").ok
    check = inv.check_processes_gone([41, 42], ["42 python -c helper"], name="gone")
    assert not check.ok and "42 python -c helper" in check.detail
    assert not inv.check_processes_gone([], [], name="gone").ok


def test_a_slowed_host_must_be_drained_and_no_other_one() -> None:
    fault = {"ts": 10.0, "action": "slow-worker", "host": "vm", "pid": 5}
    end = {"ts": 30.0, "action": "slow-worker", "phase": "end", "stopped_fraction": 0.6, "target_stopped_fraction": 0.6}
    named = ev(14.0, "straggler", 40, host="vm", slow=True, ratio=2.1)
    drain = ev(15.0, "eviction", 41, host="vm", action="drain", reason="straggler", ratio=2.1, cooldown_seconds=10.0)
    check = inv.check_evicted(fault, [named, drain], end)
    assert check.ok, check.detail
    assert "vm drained 5.0s after the slowdown began (step 41, ratio 2.1)" in check.detail
    assert "1 straggler event(s)" in check.detail and "stopped 0.6 of the time" in check.detail
    early = ev(9.0, "eviction", 10, host="vm", action="drain")
    kept = ev(15.0, "eviction", 41, host="vm", action="keep", reason="not faster without it")
    assert not inv.check_evicted(fault, [early, kept]).ok, "a keep, or a drain before the slowdown, is no eviction"
    other = ev(16.0, "eviction", 44, host="localhost", action="drain")
    c = inv.check_evicted(fault, [drain, other])
    assert not c.ok and "also drained: localhost" in c.detail
    assert not inv.check_evicted(None, [drain]).ok


def test_a_slowed_hosts_drain_counts_as_its_recovery_and_its_return_is_reported() -> None:
    chaos = [{"ts": 10.0, "action": "slow-worker", "host": "vm"}, {"ts": 30.0, "action": "slow-worker", "phase": "end"}]
    drain = ev(15.0, "eviction", 41, host="vm", action="drain", cooldown_seconds=10.0)
    events = [
        drain,
        ev(16.0, "reset", 42, reason="hosts_removed", recovery_seconds=0.5, lost_steps=0, hosts=["a", "b", "c"]),
        ev(27.0, "reset", 60, reason="hosts_added", recovery_seconds=3.0, lost_steps=0, hosts=["a", "b", "c", "vm"]),
    ]
    (rec,) = inv.recoveries(chaos, events)
    assert (rec.reset_reason, rec.lost_steps) == ("hosts_removed", 0)
    assert inv.check_recovered([rec]).ok, "a slowdown need not cause a reset in general"
    assert inv.check_recovered([rec], required=inv.RESET_EXPECTED | {"slow-worker"}).ok
    assert inv.check_no_step_lost([rec]).ok
    back = inv.check_readmitted(chaos[0], events)
    assert back.ok is None and "back 12.0s after the drain (cool-down 10.0s)" in back.detail
    assert "not back before the end" in inv.check_readmitted(chaos[0], events[:2]).detail
    assert inv.check_readmitted(chaos[0], events[1:]).detail == "no eviction"
