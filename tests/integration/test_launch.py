"""``elastictrain launch`` end to end: embedded etcd, local agents, real horovodrun and real workers.

Scenarios: a short job runs to completion; a full preemption (every agent and worker SIGKILLed, the
agents brought back) is relaunched and resumes from the checkpoint in the same MLflow run; SIGTERM
to the launcher stops the job with exit 143, a checkpoint of the last commit and no process left;
bad flags, a missing config and an unreachable etcd fail with one line and exit 2, starting nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from elastictrain.hotjoin.protocol import CHECKER_NAME
from elastictrain.launcher.decisions import EXIT_STOPPED
from elastictrain.launcher.processes import is_worker
from elastictrain.rundir import layout
from elastictrain.rundir.events import (
    Checkpoint,
    Commit,
    Done,
    Metrics,
    Reset,
    Start,
    Stopped,
    of_kind,
)
from elastictrain.tools.live_view import STATUS_KIND
from tests.fixtures.etcd import ETCD_BIN, EtcdServer
from tests.fixtures.launch import (
    ELASTICTRAIN,
    HOSTS,
    Launch,
    events,
    job_processes,
    launch_state,
    needs_horovod,
    start_agents,
)
from tests.fixtures.procs import REPO, ProcessGroup, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def write_config(tmp_path: Path, job: str, *, max_steps: int, mlflow: bool = False) -> Path:
    cfg = {
        "job": job,
        "run_dir": str(tmp_path / "run"),
        "device": "cpu",
        "model": {"name": "small_cnn", "num_classes": 10},
        "data": {
            "kind": "synthetic",
            "image_size": 16,
            "batch_size": 16,
            "num_samples": max(8192, 32 * (max_steps + 10)),  # one epoch holds max_steps at 2 x 16
            "num_val_samples": 64,
            "augment": False,
        },
        "training": {"epochs": 1, "max_steps": max_steps, "base_lr": 0.05, "log_every_steps": 5},
        "elastic": {"commit_every_steps": 5, "min_np": 2, "max_np": 2, "base_world_size": 2},
        "checkpoint": {"every_steps": 10, "every_epochs": None, "keep_last": 2},
        "tracking": {"mlflow": mlflow, "experiment": "launch-test", "progress_bar": False},
        "discovery": {"ttl_seconds": 3, "heartbeat_seconds": 0.5},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# -------------------------------------------------------------------------------------------- scenarios
@needs_horovod
def test_launch_with_embedded_etcd_runs_a_short_job_to_completion(
    procs: ProcessGroup, tmp_path: Path, no_leftovers: list[Launch]
) -> None:
    config = write_config(tmp_path, "launch-ok", max_steps=10)
    launch = Launch(procs, config, tmp_path, "--status-every", "1")
    no_leftovers.append(launch)
    assert launch.wait(timeout=120) == 0, launch.log()
    evs = events(launch.run_dir)
    statuses = [json.loads(line) for line in launch.log_path.read_text().splitlines() if line.startswith("{")]
    live = [v for v in statuses if v.get("kind") == STATUS_KIND]
    assert live, f"no JSON status line on a non-terminal stdout; log: {launch.log()}"
    assert all(set(v) >= {"state", "step", "world_size", "samples_per_sec", "loss", "eta_seconds"} for v in live)
    assert any(v["step"] is not None and v["world_size"] == 2 for v in live), live
    assert [e.step for e in of_kind(evs, Done)] == [10]
    assert {e.world_size for e in of_kind(evs, Start)} == {2}
    out = launch.log_path.read_text(errors="replace")  # all of it: the status lines push the command out of log()
    assert "-m elastictrain.horovod.hvdrun -np 2 --min-np 2 --max-np 2 --host-discovery-script" in out, (
        "the command is printed"
    )
    assert "ELASTICTRAIN_ATTEMPT=0" in out and "training completed" in out
    assert not (launch.run_dir / layout.LAUNCH_STATE).exists()


def _hosts_listed(reg) -> int:
    from discovery.registry import RegistryError

    try:
        return len(reg.list_hosts().entries)
    except RegistryError:
        return -1


@needs_horovod
@pytest.mark.timeout(300)
def test_a_killed_embedded_etcd_is_started_again_with_its_data_and_the_job_completes(
    procs: ProcessGroup, tmp_path: Path, no_leftovers: list[Launch]
) -> None:
    from discovery.registry import EtcdRegistry

    config = write_config(tmp_path, "launch-etcd-back", max_steps=400)
    launch = Launch(procs, config, tmp_path)
    no_leftovers.append(launch)
    wait_until(lambda: any(isinstance(e, Metrics) for e in events(launch.run_dir)), 120, what="a step")
    state = launch_state(launch.run_dir)
    assert state is not None and state["etcd_pid"]
    old = psutil.Process(int(state["etcd_pid"]))
    old.kill()
    killed_at = time.time()
    old.wait(10)

    def back() -> int | None:
        now = launch_state(launch.run_dir) or {}
        pid = now.get("etcd_pid")
        return pid if pid and pid != old.pid and psutil.pid_exists(pid) else None

    new_pid = wait_until(back, 60, interval=0.1, what="the launcher to start etcd again")
    reg = EtcdRegistry(state["etcd"], "launch-etcd-back", timeout_seconds=2.0)
    try:  # the same endpoint; the agents' keys are there (kept in its data, or registered again)
        wait_until(lambda: _hosts_listed(reg) == 2, 30, interval=0.2, what="both hosts in etcd")
    finally:
        reg.close()
    assert launch.wait(timeout=240) == 0, launch.log()
    assert any(isinstance(e, Metrics) and e.ts > killed_at for e in events(launch.run_dir)), "trained after it"
    assert "embedded etcd exited" in launch.log_path.read_text() and f"(pid {new_pid})" in launch.log_path.read_text()


@needs_horovod
@pytest.mark.timeout(420)  # two attempts of an 800-step job with MLflow; 200 s seen on a loaded 2-core machine
def test_full_preemption_relaunches_and_resumes_from_the_checkpoint_in_the_same_mlflow_run(
    procs: ProcessGroup, tmp_path: Path, no_leftovers: list[Launch]
) -> None:
    # Long enough that the first MLflow run and a checkpoint exist well before the end (steps take ~0.03 s).
    steps = 800
    config = write_config(tmp_path, "launch-preempt", max_steps=steps, mlflow=True)
    # Rank 0 waits for the MLflow run at a start for at most half the Gloo timeout (the others wait in a
    # collective meanwhile): 30 s, not 7.5, so that a loaded machine still links the run in the start event.
    launch = Launch(procs, config, tmp_path, "--wait-hosts-seconds", "60", "--gloo-timeout-seconds", "60")
    no_leftovers.append(launch)
    run_dir = launch.run_dir

    def checkpointed_step() -> int | None:
        steps = [e.step for e in of_kind(events(run_dir), Checkpoint)]
        return max(steps) if steps else None

    wait_until(checkpointed_step, 120, interval=0.1, what=f"a first checkpoint; launcher log: {launch.log()}")
    wait_until((run_dir / "mlflow_run_id").exists, 60, interval=0.1, what="the MLflow run of the first attempt")
    first_run_id = (run_dir / "mlflow_run_id").read_text().strip()
    state = launch_state(run_dir)
    assert state is not None
    assert not of_kind(events(run_dir), Done), "the job finished before the preemption"

    # Full preemption: every machine goes away, agents and workers at once.
    victims = [psutil.Process(pid) for pid in state["agents"].values()]
    victims += [p for p in job_processes(state["launch_id"]) if is_worker(p)]
    assert len(victims) == 4, [v.cmdline() for v in victims]
    for v in victims:
        v.kill()
    step_at_preemption = max(e.step for e in events(run_dir))
    wait_until(lambda: "relaunch 1 when hosts return" in launch.log(), 60, interval=0.2, what="the relaunch decision")

    # The machines come back: new agents under the same host names (the launcher starts no agents again).
    start_agents(procs, state, tmp_path / "agents.log")
    assert launch.wait(timeout=180) == 0, launch.log()

    evs = events(run_dir)
    starts = of_kind(evs, Start)
    assert [s.attempt for s in starts] == [0, 1], starts
    assert [s.run_id for s in starts] == [first_run_id] * 2, "each attempt's start event links its MLflow run"
    resumed = starts[1].resumed_from_step
    assert isinstance(resumed, int) and 10 <= resumed <= step_at_preemption, (resumed, step_at_preemption)
    assert starts[1].step == resumed, "the relaunch continued from the checkpoint's step"
    assert [e.step for e in of_kind(evs, Done)] == [steps]
    assert (run_dir / "mlflow_run_id").read_text().strip() == first_run_id
    with contextlib.closing(sqlite3.connect(run_dir / "mlflow.db")) as db:
        assert db.execute("select run_uuid from runs").fetchall() == [(first_run_id,)], "one MLflow run for the job"
        (last_step,) = db.execute("select max(step) from metrics where key = 'loss'").fetchone()
    assert last_step == steps, "the relaunched attempt logs into the first attempt's run"


@needs_horovod
def test_sigterm_to_the_launcher_checkpoints_the_last_commit_exits_143_and_leaves_no_process(
    procs: ProcessGroup, tmp_path: Path, no_leftovers: list[Launch]
) -> None:
    config = write_config(tmp_path, "launch-stop", max_steps=100_000)
    launch = Launch(procs, config, tmp_path, "--stop-timeout", "45")
    no_leftovers.append(launch)
    run_dir = launch.run_dir

    def commits() -> list[int]:
        return [e.step for e in of_kind(events(run_dir), Commit)]

    wait_until(lambda: any(s >= 15 for s in commits()), 120, interval=0.1, what=f"commits; log: {launch.log()}")
    state = launch_state(run_dir)
    assert state is not None
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.wait(timeout=90) == EXIT_STOPPED, launch.log()
    assert "stopped by SIGTERM" in launch.log()

    evs = events(run_dir)
    stopped = of_kind(evs, Stopped)
    assert stopped and stopped[-1].checkpointed is True, stopped
    last_commit = max(commits())
    from elastictrain.checkpoint import LocalStorage, load_latest

    loaded = load_latest(LocalStorage.for_run_dir(run_dir), map_location="cpu")
    assert loaded is not None, "no verified checkpoint"
    # The state inside (not the manifest's label, see the report on elastic.py) is the last commit's. With
    # elastic.rollback none (the default) the live state is the commit: the last step completed before the stop.
    step = loaded.state["counters"]["step"]
    assert step == stopped[-1].step and step >= last_commit, (loaded.path, loaded.state["counters"], last_commit)
    assert not job_processes(state["launch_id"]), "a process of the job remains"


@needs_horovod
def test_a_second_launch_is_refused_and_a_sigkilled_launcher_takes_every_process_with_it(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    config = write_config(tmp_path, "launch-lock", max_steps=100_000)
    launch = Launch(procs, config, tmp_path)
    run_dir = launch.run_dir
    wait_until(lambda: bool(of_kind(events(run_dir), Commit)), 120, interval=0.1,
               what=f"a first commit; log: {launch.log()}")  # fmt: skip
    state = launch_state(run_dir)
    assert state is not None and state["horovodrun_pid"], state
    before = (run_dir / layout.LAUNCH_STATE).read_text(), sorted(p.name for p in (run_dir / "etcd").rglob("*"))

    # A second launcher on the same run_dir: one line, exit 2, and the running job is untouched.
    second = subprocess.run(
        [str(ELASTICTRAIN), "launch", "--config", str(config), "--hosts", HOSTS],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert second.returncode == 2 and second.stdout == "", second
    (line,) = second.stderr.strip().splitlines()
    assert f"is driven by a live launcher (pid {launch.proc.pid} on " in line, line
    assert (
        (run_dir / layout.LAUNCH_STATE).read_text(),
        sorted(p.name for p in (run_dir / "etcd").rglob("*")),
    ) == before
    assert launch.proc.poll() is None and psutil.pid_exists(state["etcd_pid"])

    # The launcher is SIGKILLed (OOM, a force-deleted pod): etcd, agents, horovodrun and workers end too.
    mine = job_processes(state["launch_id"])
    assert len([p for p in mine if is_worker(p)]) == 2 and len(mine) >= 5, [p.cmdline() for p in mine]
    launch.proc.kill()
    launch.wait(timeout=10)
    wait_until(lambda: not job_processes(state["launch_id"]), 30, interval=0.2,
               what="every process of the SIGKILLed launcher to end")  # fmt: skip
    # A process whose environment can no longer be read may still be releasing its memory (no command line
    # yet not a zombie): wait for the tree to be gone rather than look once.
    wait_until(lambda: not launch.left_behind(), 30, interval=0.2,
               what="no process of the launcher's tree left")  # fmt: skip


@needs_horovod
def test_a_relaunch_never_wipes_the_data_dir_of_a_live_etcd(tmp_path: Path, procs: ProcessGroup) -> None:
    """An etcd left running on run_dir/etcd (its launcher died where no parent-death signal reached it)."""
    if not os.access(ETCD_BIN, os.X_OK):
        pytest.skip(f"etcd binary not found at {ETCD_BIN}")
    config = write_config(tmp_path, "launch-orphan-etcd", max_steps=10)
    run_dir = tmp_path / "run"
    orphan = EtcdServer(run_dir / "etcd", tmp_path / "orphan-etcd.log")
    orphan.start()
    try:
        launch = Launch(procs, config, tmp_path)
        assert launch.wait(timeout=60) == 2, launch.log()
        assert "is in use by a running etcd" in launch.log()
        assert orphan.healthy() and (run_dir / "etcd" / "member" / "snap" / "db").exists()
    finally:
        orphan.kill()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-np", "3", "--max-np", "2"], "--max-np (2) must be >= --min-np (3)"),
        (["--config-missing"], "config file not found"),
        (["--etcd", "http://127.0.0.1:{port}"], "unreachable"),
    ],
)
def test_bad_flags_missing_config_or_unreachable_etcd_fail_with_one_line_and_start_nothing(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    config = write_config(tmp_path, "launch-bad", max_steps=1)
    if flags == ["--config-missing"]:
        config, flags = tmp_path / "missing.yaml", []
    flags = [f.format(port=free_port()) for f in flags]
    t0 = time.monotonic()
    out = subprocess.run(
        [str(ELASTICTRAIN), "launch", "--config", str(config), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 2, out
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert lines[0].startswith("elastictrain launch: ")
    assert not (tmp_path / "run").exists(), "nothing is started (no run_dir, no etcd)"
    assert time.monotonic() - t0 < 30


def test_launch_is_a_subcommand_and_its_help_names_the_exit_codes() -> None:
    out = subprocess.run(
        [str(ELASTICTRAIN), "launch", "--help"], capture_output=True, text=True, timeout=60, check=False, cwd=REPO
    )
    assert out.returncode == 0 and "--wait-hosts-seconds" in out.stdout and "--max-relaunches" in out.stdout


def zygote_workers(launch: Launch) -> list[psutil.Process]:
    """Workers forked by a warm zygote: children of an ``elastictrain zygote serve`` with its command line, other
    than its checker process."""
    out = []
    for p in list(launch.seen.values()):
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            parent = p.parent()
            forked = "zygote" in cmd and "serve" in cmd and parent is not None and parent.cmdline() == cmd
            forked = forked and p.name() != CHECKER_NAME
            if forked and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


@needs_horovod
def test_hot_join_forks_workers_from_warm_zygotes_and_a_killed_one_rejoins_warm(
    procs: ProcessGroup, tmp_path: Path, no_leftovers: list[Launch]
) -> None:
    config = write_config(tmp_path, "launch-hot", max_steps=400)
    launch = Launch(procs, config, tmp_path)  # hot join is launch's default
    no_leftovers.append(launch)
    first = wait_until(lambda: len(zygote_workers(launch)) == 2 and zygote_workers(launch), 120, what="2 warm workers")
    wait_until(lambda: bool(of_kind(events(launch.run_dir), Metrics)), 120, what="training")
    first[0].kill()
    pids = {p.pid for p in first}
    wait_until(
        lambda: any(p.pid not in pids for p in zygote_workers(launch)), 120, what="a worker forked again after the kill"
    )
    assert launch.wait(timeout=200) == 0, launch.log()
    evs = events(launch.run_dir)
    assert [e.step for e in of_kind(evs, Done)] == [400]
    assert of_kind(evs, Reset), "the kill caused a reset"


VERSIONED_TASK = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset
import elastictrain

VERSION = {version}


def mse(model, batch):
    x, y = batch
    return (model(x).squeeze(1) - y) ** 2


def build(log):
    with open(log, "a") as f:  # which code this process built with
        f.write(f"{{VERSION}} {{os.getpid()}}\\n")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 3, generator=g)
    return elastictrain.Task(model=nn.Linear(3, 1), train_data=TensorDataset(x, x.sum(1)), loss=mse)
"""


@needs_horovod
def test_a_zygote_started_before_a_code_change_does_not_serve_the_old_code(
    procs: ProcessGroup, tmp_path: Path, no_leftovers: list[Launch]
) -> None:
    builds = tmp_path / "builds.txt"
    (tmp_path / "versioned.py").write_text(VERSIONED_TASK.format(version=1))
    cfg = yaml.safe_load(write_config(tmp_path, "launch-upgrade", max_steps=20000).read_text())
    cfg.update(task="versioned:build", task_args={"log": str(builds)})
    cfg.pop("model")
    cfg["data"] = {"batch_size": 16}
    cfg["training"].update(epochs=1000, max_steps=20000)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(cfg))
    launch = Launch(procs, config, tmp_path)
    no_leftovers.append(launch)
    first = wait_until(lambda: len(zygote_workers(launch)) == 2 and zygote_workers(launch), 120, what="2 warm workers")
    wait_until(lambda: bool(of_kind(events(launch.run_dir), Commit)), 120, what="training")
    old_pids = {p.pid for p in first}
    assert {line.split()[0] for line in builds.read_text().splitlines()} == {"1"}

    (tmp_path / "versioned.py").write_text(VERSIONED_TASK.format(version=2))  # the upgrade, mid-run
    first[0].kill()  # its host rejoins after the blacklist cooldown with a new worker

    def built_after_the_change() -> list[str]:
        return [ln for ln in builds.read_text().splitlines() if int(ln.split()[1]) not in old_pids and ln[0] == "2"]

    def rejoined() -> bool:  # below --min-np 2 the survivor waits: the reset after the kill is 2 -> 2
        return any(e.reason == "worker_failed" and e.new_size == 2 for e in of_kind(events(launch.run_dir), Reset))

    wait_until(rejoined, 120, what="the killed host rejoining")
    lines = builds.read_text().splitlines()
    late = [ln for ln in lines if int(ln.split()[1]) not in old_pids][-1:]  # the rejoined worker's build
    assert late and late[0].startswith("2 "), f"the rejoined worker ran the old code: {lines}"
    assert built_after_the_change()
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.wait(timeout=120) == EXIT_STOPPED, launch.log()
