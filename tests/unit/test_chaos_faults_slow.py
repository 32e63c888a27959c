"""``slow-worker`` and ``hang-worker`` against real processes that this test starts.

A stand-in worker is a Python script named ``elastictrain`` run as ``elastictrain train`` with the job's
environment (``ELASTICTRAIN_JOB``, ``HOROVOD_RANK``, ``HOROVOD_HOSTNAME``), so :class:`chaos.procs.JobRef` finds it
exactly as it finds a real worker; it spins (or sleeps) and may start a helper child as a checkpoint writer would.
Every process is killed by pid at teardown (the ``procs`` fixture), stopped ones included: SIGKILL ends them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from chaos import faults
from chaos.procs import JobNotFound, JobRef
from tests.fixtures.procs import REPO, ProcessGroup, wait_until

STAND_IN = """
import subprocess, sys, time
if "--helper" in sys.argv:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("ready", flush=True)
if "--saver" in sys.argv:  # a checkpoint writer: a temp file for 0.2 s, then renamed into place, again and again
    import os
    step = os.path.join(sys.argv[sys.argv.index("--saver") + 1], "checkpoints", "step-00000010")
    os.makedirs(step, exist_ok=True)
    while True:
        temp = os.path.join(step, f".state.pt.tmp-{os.getpid()}-{os.urandom(4).hex()}")
        with open(temp, "wb") as f:
            f.write(b"x" * 1024)
        time.sleep(0.2)
        os.replace(temp, os.path.join(step, "state.pt"))
        time.sleep(0.05)
if "--busy" in sys.argv:
    while True:
        pass
if "--pulse" in sys.argv:
    while True:
        end = time.process_time() + 0.001
        while time.process_time() < end:
            pass
        time.sleep(0.004)
time.sleep(600)
"""


@pytest.fixture
def job() -> JobRef:
    return JobRef(f"chaos-unit-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "elastictrain"
    path.parent.mkdir()
    path.write_text(STAND_IN)
    return path


def start(
    procs: ProcessGroup, script: Path, job: str | None, *flags: str, rank: int = 1, host: str = "h1", train: bool = True
) -> psutil.Process:
    """A stand-in worker of ``job`` (None: of no job) started as ``rank`` on ``host``; returns once it runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTRAIN_", "HOROVOD_"))}
    if job is not None:
        env |= {"ELASTICTRAIN_JOB": job, "HOROVOD_RANK": str(rank), "HOROVOD_HOSTNAME": host}
    args = [sys.executable, str(script), *(["train"] if train else []), *flags]
    proc = procs.start(args, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return psutil.Process(proc.pid)


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def stopped(p: psutil.Process) -> bool:
    return p.status() == psutil.STATUS_STOPPED


def lines(path: Path) -> list[dict]:
    return faults.read_chaos(path)


@pytest.mark.timeout(60)
def test_a_worker_slowed_by_half_gets_two_thirds_of_the_cpu_of_a_free_one_and_runs_on_afterwards(
    procs: ProcessGroup, script: Path, job: JobRef, tmp_path: Path
) -> None:
    """Both stand-ins pulse: 1 ms of CPU, then 4 ms asleep, so that each wants well under a core and gets it
    promptly however loaded the 2 cores are; the slowed one then does 1 / 1.5 of the control's work. Two busy
    loops would measure the scheduler instead: on loaded cores they compete with each other and with everything
    else, and the share a stopped one leaves goes partly back to it once it runs again."""
    slowed = start(procs, script, job.job, "--pulse", "--helper")
    control = start(procs, script, f"{job.job}-other", "--pulse", rank=1, host="h1")  # another job: never hit
    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    before = cpu_seconds(slowed), cpu_seconds(control)
    t0 = time.monotonic()
    end = faults.slow_worker(job, log, host="h1", slowdown=0.5, seconds=3.0)
    wall = time.monotonic() - t0
    slowed_rate = (cpu_seconds(slowed) - before[0]) / wall
    control_rate = (cpu_seconds(control) - before[1]) / wall
    ratio = slowed_rate / control_rate
    assert 0.5 <= ratio <= 0.8, f"slowed {slowed_rate:.3f} vs control {control_rate:.3f} CPU s/s: ratio {ratio:.2f}"
    assert 3.0 <= wall <= 4.0, wall
    wait_until(lambda: not stopped(slowed), 1, what="the slowed worker running again")
    time.sleep(0.3)
    assert not stopped(slowed) and all(not stopped(c) for c in slowed.children()), "left continued, helper too"
    assert not stopped(control)

    first, last = lines(tmp_path / "chaos.jsonl")
    assert first["action"] == last["action"] == "slow-worker" and "phase" not in first
    assert (first["pid"], first["host"], first["start_rank"], first["slowdown"]) == (slowed.pid, "h1", 1, 0.5)
    assert first["target_stopped_fraction"] == pytest.approx(1 / 3, abs=1e-3)
    assert last["phase"] == "end" and last["reason"] == "seconds elapsed" and last["pid"] == slowed.pid
    assert last["stopped_fraction"] == pytest.approx(1 / 3, abs=0.05), last
    assert last["cycles"] >= 25 and last["start_ts"] == first["ts"]
    assert end == last, "returns the end record it logged"


@pytest.mark.timeout(60)
def test_a_slowdown_ends_when_stop_is_set_or_its_worker_exits_and_never_leaves_it_stopped(
    procs: ProcessGroup, script: Path, job: JobRef, tmp_path: Path
) -> None:
    worker = start(procs, script, job.job, "--busy", rank=2, host="h2")
    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    stop = threading.Event()
    done: list[dict] = []
    t = threading.Thread(target=lambda: done.append(faults.slow_worker(job, log, rank=2, slowdown=3.0, stop=stop)))
    t.start()
    time.sleep(0.5)
    stop.set()
    t.join(timeout=2)
    assert not t.is_alive() and done[0]["reason"] == "stopped"
    assert done[0]["stopped_fraction"] == pytest.approx(0.75, abs=0.1), done[0]  # 3 / (1 + 3)
    wait_until(lambda: not stopped(worker), 1, what="the worker running again")

    stop.clear()
    t = threading.Thread(target=lambda: done.append(faults.slow_worker(job, log, rank=2, slowdown=1.0, stop=stop)))
    t.start()
    time.sleep(0.3)
    worker.kill()  # a drained worker exits: the slowdown ends with it
    t.join(timeout=2)
    assert not t.is_alive() and done[1]["reason"] == "worker exited"
    assert [r.get("phase") for r in lines(tmp_path / "chaos.jsonl")] == [None, "end", None, "end"]


@pytest.mark.timeout(60)
def test_a_hung_worker_and_its_helper_stay_stopped_and_only_sigkill_ends_them(
    procs: ProcessGroup, script: Path, job: JobRef, tmp_path: Path
) -> None:
    rank0 = start(procs, script, job.job, rank=0, host="h0")
    worker = start(procs, script, job.job, "--helper", rank=1, host="h1")
    helper = worker.children()[0]
    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    record = faults.hang_worker(job, log)  # no rank or host: any worker but rank 0
    assert record["pid"] == worker.pid and sorted(record["pids"]) == sorted([worker.pid, helper.pid])
    wait_until(lambda: stopped(worker) and stopped(helper), 2, what="the worker and its helper stopped")
    time.sleep(0.5)
    assert stopped(worker) and stopped(helper), "never continued"
    assert not stopped(rank0)
    assert lines(tmp_path / "chaos.jsonl") == [record], "one line, no end: a hang is not undone"

    worker.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert stopped(worker), "SIGTERM stays pending on a stopped process"
    worker.kill()
    helper.kill()
    _, alive = psutil.wait_procs([helper], timeout=5)  # not our child: reaped by whoever adopted it
    assert not alive
    procs.procs[-1].wait(timeout=5)  # the worker is ours: reap it


@pytest.mark.timeout(60)
def test_a_process_that_is_not_a_worker_of_the_job_is_never_hit(
    procs: ProcessGroup, script: Path, job: JobRef, tmp_path: Path
) -> None:
    not_train = start(procs, script, job.job, train=False)  # the job's environment, but not `elastictrain train`
    other_job = start(procs, script, f"{job.job}-other", rank=1, host="h1")
    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    with pytest.raises(JobNotFound, match="no live worker started as rank 1"):
        faults.hang_worker(job, log, rank=1)
    with pytest.raises(JobNotFound, match="no live worker on host 'h1'"):
        faults.slow_worker(job, log, host="h1", slowdown=0.5, seconds=1)
    with pytest.raises(JobNotFound, match="has no live worker"):
        faults.hang_worker(job, log)
    with pytest.raises(ValueError, match="not both"):
        faults.hang_worker(job, log, rank=1, host="h1")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--slowdown"):
            faults.slow_worker(job, log, rank=1, slowdown=bad)
    with pytest.raises(ValueError, match="--period-seconds"):
        faults.slow_worker(job, log, rank=1, slowdown=0.5, period_seconds=0.001)
    time.sleep(0.2)
    assert not stopped(not_train) and not stopped(other_job)
    assert lines(tmp_path / "chaos.jsonl") == [], "a refused fault logs nothing"


def chaos_cli(procs: ProcessGroup, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return procs.start([sys.executable, "-m", "chaos", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


@pytest.mark.timeout(120)
def test_the_cli_slows_a_worker_until_sigterm_then_hangs_it(
    procs: ProcessGroup, script: Path, job: JobRef, tmp_path: Path
) -> None:
    worker = start(procs, script, job.job, "--busy", rank=1, host="h1")
    events = tmp_path / "chaos.jsonl"
    common = ("--job", job.job, "--events", str(events))
    cli = chaos_cli(procs, "slow-worker", "--host", "h1", "--slowdown", "0.5", *common)
    wait_until(lambda: lines(events), 60, what="the slow-worker start line")
    time.sleep(0.5)
    cli.send_signal(signal.SIGTERM)  # the handler only sets the stop flag: the fault ends its cycle, continues
    out, _ = cli.communicate(timeout=10)
    assert cli.returncode == 0, out
    end = json.loads(out.splitlines()[-1])
    assert end["phase"] == "end" and end["reason"] == "stopped" and end["pid"] == worker.pid
    wait_until(lambda: not stopped(worker), 1, what="the worker running again")

    cli = chaos_cli(procs, "hang-worker", "--rank", "1", *common)
    out, _ = cli.communicate(timeout=60)
    assert cli.returncode == 0 and json.loads(out)["pid"] == worker.pid
    wait_until(lambda: stopped(worker), 2, what="the hung worker stopped")
    assert [(r["action"], r.get("phase")) for r in lines(events)] == [
        ("slow-worker", None),
        ("slow-worker", "end"),
        ("hang-worker", None),
    ]
    cli = chaos_cli(procs, "slow-worker", "--rank", "7", "--slowdown", "0.5", *common)
    out, _ = cli.communicate(timeout=60)
    assert cli.returncode == 1, "nothing to hit: exit 1"
    cli = chaos_cli(procs, "slow-worker", "--rank", "1", "--slowdown", "0", *common)
    assert cli.wait(timeout=60) == 2, "a bad --slowdown: exit 2"


@pytest.mark.timeout(60)
def test_a_duty_cycle_in_a_thread_slows_only_the_processes_it_is_given(
    procs: ProcessGroup, script: Path, tmp_path: Path
) -> None:
    """:func:`chaos.faults.duty_cycle` is the primitive under ``slow-worker`` (the product's tests call it on a
    process they found themselves): without ``helpers``, a child of the slowed process runs free."""
    proc = start(procs, script, None, "--pulse", "--helper")
    child = proc.children()[0]
    stop = threading.Event()
    result: list[faults.DutyCycle] = []
    t = threading.Thread(target=lambda: result.append(faults.duty_cycle([proc], 1.0, stop, period_seconds=0.05)))
    t.start()
    seen = set()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        seen.add((proc.status(), child.status()))
        time.sleep(0.003)
    stop.set()
    t.join(timeout=2)
    assert not t.is_alive()
    assert {s for s, _ in seen} >= {psutil.STATUS_STOPPED} and psutil.STATUS_STOPPED not in {c for _, c in seen}
    (r,) = result
    assert r.reason == "stopped" and r.target_fraction == 0.5 and r.stopped_fraction == pytest.approx(0.5, abs=0.1)
    assert r.record()["stopped_fraction"] == round(r.stopped_fraction, 4)
    wait_until(lambda: not stopped(proc), 1, what="the process running again")
    with pytest.raises(ValueError, match="--seconds"):
        faults.duty_cycle([proc], 0.5, seconds=0)


@pytest.mark.timeout(60)
def test_a_kill_during_a_checkpoint_freezes_the_writer_before_the_slow_process_lookup(
    procs: ProcessGroup, script: Path, job: JobRef, tmp_path: Path
) -> None:
    """The lookup of the job's processes (an environment scan of every process) outlasted a small model's save, so
    the kill landed after it. Here the lookup returns only once the writer is stopped or its save has ended: the
    kill interrupts the save only if the writer was frozen first."""
    run_dir = tmp_path / "run"
    writer = start(procs, script, job.job, "--saver", str(run_dir), rank=0, host="h0")

    class SlowLookup(JobRef):
        def worker_of(self, pid: int):  # type: ignore[no-untyped-def]
            temps = faults.checkpoint_temp_files(run_dir)
            wait_until(lambda: stopped(writer) or not any(t.exists() for t in temps), 5, what="frozen or saved")
            return JobRef.worker_of(self, pid)

    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    record = faults.kill_during_checkpoint(SlowLookup(job.job, run_dir), log, timeout=20)
    assert record["writer_pid"] == writer.pid == record["pid"]
    assert record["mid_write"] is True, "the save ended before the kill: the writer was not frozen"
    procs.procs[-1].wait(timeout=5)
    assert faults.checkpoint_temp_files(run_dir), "the interrupted save's temp file is left, as a crash leaves it"
