"""status: what a run is doing, from events.jsonl, checkpoints/latest and (optionally) etcd."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from elastictrain.rundir import layout
from elastictrain.tools.status import main, read_status
from tests.fixtures.procs import dead_pid

T0 = 1_000_000.0


def ev(t: float, event: str, step: int, world_size: int = 2, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + t, "event": event, "step": step, "epoch": 0, "world_size": world_size, **fields}


EVENTS = [
    ev(0, "start", 0, hosts=["a", "b"], resumed_from_step=None, attempt=0),
    ev(10, "metrics", 10, loss=2.0, samples_per_sec=64.0, steps=10, step_seconds=1.0),
    ev(25, "failure", 25, reason="worker_failed", error="x"),
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
    ev(50, "metrics", 30, world_size=1, loss=1.0, samples_per_sec=16.0, steps=10, step_seconds=2.0),
]


def make_run_dir(tmp_path: Path, *, checkpoint: bool) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / layout.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in EVENTS) + '{"ts": 3, "ev')
    (run_dir / "mlflow_run_id").write_text("abc123\n")
    if checkpoint:
        folder = run_dir / layout.CHECKPOINTS / "step-00000020"
        folder.mkdir(parents=True)
        files = {"state.pt": {"sha256": "0" * 64, "bytes": 0}}  # status reads the manifest, hashes nothing
        manifest = {"step": 20, "epoch": 0, "world_size": 2, "created_at": T0 + 21, "files": files}
        (folder / "manifest.json").write_text(json.dumps({**manifest, "state_file": "state.pt"}))
        (run_dir / layout.CHECKPOINTS / layout.LATEST).write_text("step-00000020")
    return run_dir


def test_status_shows_size_hosts_step_throughput_resets_and_the_latest_checkpoint(tmp_path: Path) -> None:
    st = read_status(make_run_dir(tmp_path, checkpoint=True), now=T0 + 81)
    assert (st["state"], st["step"], st["world_size"], st["hosts"]) == ("running", 30, 1, ["a"])
    assert st["samples_per_sec"] == 16.0 and st["failures"] == 1 and st["attempts"] == 1
    assert [(r["reason"], r["old_size"], r["new_size"], r["recovery_seconds"]) for r in st["resets"]] == [
        ("worker_failed", 2, 1, 15.0)
    ]
    assert st["checkpoint"]["name"] == "step-00000020" and st["checkpoint"]["step"] == 20
    assert st["checkpoint"]["age_seconds"] == pytest.approx(60.0)
    assert st["last_event"]["age_seconds"] == pytest.approx(31.0)
    assert st["mlflow_run_id"] == "abc123"


def test_status_json_for_scripts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_run_dir(tmp_path, checkpoint=False)
    assert main(["--run-dir", str(run_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["world_size"] == 1 and st["checkpoint"] is None and len(st["resets"]) == 1


def test_status_table_for_people(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--run-dir", str(make_run_dir(tmp_path, checkpoint=True))]) == 0
    out = capsys.readouterr().out
    assert "world size" in out and "16.0 samples/s" in out and "step-00000020 (step 20" in out
    assert "reset 1: step 21 worker_failed 2->1 recovered in 15.0s, 5 steps lost" in out


def test_status_with_etcd_lists_the_registered_hosts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def hosts(etcd: str, job: str, prefix: str) -> list[dict[str, Any]]:
        calls.append((etcd, job, prefix))
        return [{"host": "a", "slots": 1, "state": "ready", "addr": "10.0.0.1", "pid": 1, "registered_at": T0}]

    run_dir = make_run_dir(tmp_path, checkpoint=False)
    assert main(["--run-dir", str(run_dir), "--etcd", "http://127.0.0.1:2379", "--job", "j"], hosts_reader=hosts) == 0
    assert calls == [("http://127.0.0.1:2379", "j", "/elastictrain")]
    assert "a                        slots=1 ready" in capsys.readouterr().out


def test_status_with_etcd_down_shows_the_rest_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def down(etcd: str, job: str, prefix: str) -> list[dict[str, Any]]:
        raise ConnectionError("etcd unreachable")

    run_dir = make_run_dir(tmp_path, checkpoint=False)
    assert (
        main(["--run-dir", str(run_dir), "--json", "--etcd", "http://127.0.0.1:1", "--job", "j"], hosts_reader=down)
        == 1
    )
    st = json.loads(capsys.readouterr().out)
    assert st["step"] == 30 and "etcd unreachable" in st["registered_hosts_error"]


def test_status_of_a_fresh_run_dir_with_only_a_checkpoint(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path, checkpoint=True)
    (run_dir / layout.EVENTS).unlink()
    st = read_status(run_dir, now=time.time())
    assert st["state"] == "not_started" and st["checkpoint"]["step"] == 20


def test_status_reads_the_checkpoint_as_the_loader_does_a_latest_outside_the_checkpoints_is_no_checkpoint(
    tmp_path: Path,
) -> None:
    run_dir = make_run_dir(tmp_path, checkpoint=True)
    (run_dir / layout.CHECKPOINTS / layout.LATEST).write_text("../../etc")
    ck = read_status(run_dir, now=T0 + 81)["checkpoint"]
    assert ck["name"] is None and "not a checkpoint folder" in ck["error"]


def test_status_names_a_malformed_manifest_of_the_latest_checkpoint(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path, checkpoint=True)
    (run_dir / layout.CHECKPOINTS / "step-00000020" / "manifest.json").write_text('{"step": 21}')
    ck = read_status(run_dir, now=T0 + 81)["checkpoint"]
    assert ck["name"] == "step-00000020" and "is not the folder's step 20" in ck["error"]


@pytest.mark.parametrize(
    "args", [["--run-dir", "MISSING"], ["--run-dir", "EMPTY"], ["--run-dir", "EMPTY", "--job", "j"]]
)
def test_status_on_a_bad_run_dir_or_flags_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    (tmp_path / "EMPTY").mkdir()
    argv = [str(tmp_path / a) if a in ("MISSING", "EMPTY") else a for a in args]
    assert main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_finished_run_stays_done_when_bookkeeping_events_follow_done(tmp_path):
    import json

    from elastictrain.tools.status import main

    lines = [
        {"ts": 1.0, "event": "start", "step": 0, "epoch": 0, "world_size": 2},
        {"ts": 2.0, "event": "done", "step": 9, "epoch": 1, "world_size": 2},
        {"ts": 3.0, "event": "tracking_closed", "step": 9, "epoch": 1, "world_size": 2, "dropped": 0},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--run-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(buf.getvalue())["state"] == "done"


def test_status_skips_a_well_formed_line_with_wrong_types_and_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = make_run_dir(tmp_path, checkpoint=False)
    lines = (run_dir / layout.EVENTS).read_text().splitlines(keepends=True)
    bad = json.dumps({"ts": "late", "event": "metrics", "step": 99, "epoch": 0, "world_size": 2}) + "\n"
    (run_dir / layout.EVENTS).write_text("".join([lines[0], bad, *lines[1:]]))
    assert main(["--run-dir", str(run_dir), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 30
    (warning,) = captured.err.splitlines()
    assert warning.startswith("elastictrain status: warning: events.jsonl line 2: ts must be a finite number")


def _write_launch(run_dir: Path, **fields: Any) -> None:
    (run_dir / "launch.json").write_text(json.dumps({"launch_id": "x", "job": "j", **fields}))


def test_a_running_run_whose_launch_pids_are_all_gone_is_stopped_no_live_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    run_dir = make_run_dir(tmp_path, checkpoint=False)
    dead = dead_pid()
    _write_launch(
        run_dir,
        pid=dead,
        host=socket.gethostname(),
        etcd_pid=None,
        agents={"a": dead},
        horovodrun_pid=None,
        create_times={str(dead): 1.0},
    )
    assert main(["--run-dir", str(run_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "stopped (no live process)" and st["live"] is False
    assert main(["--run-dir", str(run_dir)]) == 0
    assert "stopped (no live process)" in capsys.readouterr().out


def test_a_reused_pid_does_not_count_as_a_live_launch_process(tmp_path: Path) -> None:
    import os
    import socket

    run_dir = make_run_dir(tmp_path, checkpoint=False)
    # This test's own pid is alive, but it was created at another time than launch.json says: a reused pid.
    _write_launch(run_dir, pid=os.getpid(), host=socket.gethostname(), agents={}, create_times={str(os.getpid()): 5.0})
    st = read_status(run_dir, now=T0 + 81)
    assert st["state"] == "stopped (no live process)" and st["live"] is False


def test_a_running_run_with_a_live_launcher_stays_running(tmp_path: Path) -> None:
    import os
    import socket

    import psutil

    run_dir = make_run_dir(tmp_path, checkpoint=False)
    me = os.getpid()
    _write_launch(
        run_dir, pid=me, host=socket.gethostname(), agents={}, create_times={str(me): psutil.Process().create_time()}
    )
    st = read_status(run_dir, now=T0 + 81)
    assert st["state"] == "running" and st["live"] is True


def test_launch_json_from_another_host_leaves_liveness_unknown(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path, checkpoint=False)
    dead = dead_pid()
    _write_launch(run_dir, pid=dead, host="another-host.invalid", agents={}, create_times={str(dead): 1.0})
    st = read_status(run_dir, now=T0 + 81)
    assert st["state"] == "running" and st["live"] is None
    assert "another-host.invalid" in st["liveness"]


def test_without_launch_json_liveness_is_unknown(tmp_path: Path) -> None:
    st = read_status(make_run_dir(tmp_path, checkpoint=False), now=T0 + 81)
    assert st["state"] == "running" and st["live"] is None


def test_launch_json_as_the_launcher_writes_it_round_trips_to_live_then_no_live_process(tmp_path: Path) -> None:
    """The real ``Launcher._write_state`` in a child process: live while it runs, no live process once it exits."""
    import subprocess
    import sys

    run_dir = make_run_dir(tmp_path, checkpoint=False)
    script = (
        "import sys, types\n"
        "from elastictrain.launcher.supervisor import Launcher\n"
        "la = Launcher.__new__(Launcher)\n"
        "ns = types.SimpleNamespace\n"
        "la.__dict__.update(launch_id='x', cfg=ns(job='j'), etcd_endpoint='http://127.0.0.1:1',\n"
        "    opts=ns(embedded=True, hosts=['localhost']), etcd=None, agents={}, hvd_proc=None, attempt=0,\n"
        "    run_dir=__import__('pathlib').Path(sys.argv[1]))\n"
        "la._write_state()\n"
        "print('written', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "written\n"
        st = read_status(run_dir, now=T0 + 81)
        assert (st["state"], st["live"]) == ("running", True)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    st = read_status(run_dir, now=T0 + 81)
    assert (st["state"], st["live"]) == ("stopped (no live process)", False)
