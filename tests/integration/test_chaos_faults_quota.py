"""``quota-worker``: a real CPU cgroup quota on processes that this test starts, and the step profile under it.

A stand-in worker is a Python script named ``elastictrain`` run as ``elastictrain train`` with the job's environment
(as in ``test_chaos_faults_slow``), so :class:`chaos.procs.JobRef` finds it as it finds a real worker. Skipped where
the machine offers no CPU controller to this user. Every process is killed by pid at teardown (the ``procs``
fixture); every group is deleted by the code under test, and the tests assert that it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from chaos import faults
from chaos.procs import JobRef, cpu_seconds
from tests.fixtures.procs import REPO, ProcessGroup, wait_until

try:
    BACKEND: faults.CpuBackend | None = faults.cpu_backend()
    faults.CpuQuota(None, backend=BACKEND).close()
except (faults.QuotaUnavailable, OSError):
    BACKEND = None
pytestmark = [
    pytest.mark.integration,
    pytest.mark.long,  # real cgroups and CPU rates: a measurement on an idle machine
    pytest.mark.skipif(BACKEND is None, reason="no CPU cgroup this user can make a quota in"),
]

STAND_IN = """
import os, sys, time
print("ready", flush=True)
if "--helper-after" in sys.argv:  # a helper forked later, as a checkpoint writer is
    time.sleep(float(sys.argv[sys.argv.index("--helper-after") + 1]))
    if os.fork() == 0:
        while True:
            pass
while True:
    pass
"""


@pytest.fixture
def job() -> JobRef:
    return JobRef(f"chaos-quota-{uuid.uuid4().hex[:10]}")


def start(procs: ProcessGroup, tmp_path: Path, job: str, *flags: str, rank: int = 1) -> psutil.Process:
    script = tmp_path / "bin" / "elastictrain"
    script.parent.mkdir(exist_ok=True)
    script.write_text(STAND_IN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICTRAIN_", "HOROVOD_"))}
    env |= {"ELASTICTRAIN_JOB": job, "HOROVOD_RANK": str(rank), "HOROVOD_HOSTNAME": "h1"}
    proc = procs.start([sys.executable, str(script), "train", *flags], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return psutil.Process(proc.pid)


def cpu_rates(procs: list[psutil.Process], seconds: float) -> list[float]:
    """CPU seconds per second of each of ``procs`` with its descendants, over one measured ``seconds``."""
    c0, t0 = [cpu_seconds(p) for p in procs], time.monotonic()
    time.sleep(seconds)  # the measurement window itself, not a wait for an event
    wall = time.monotonic() - t0
    return [(cpu_seconds(p) - c) / wall for p, c in zip(procs, c0, strict=True)]


def cpu_group(pid: int) -> str | None:
    assert BACKEND is not None
    v1, v2 = faults.cgroup.cgroup_paths(Path(f"/proc/{pid}/cgroup").read_text())
    return v2 if BACKEND.version == 2 else v1


def our_groups() -> list[Path]:
    assert BACKEND is not None
    return sorted(Path(BACKEND.root).glob(f"{faults.QUOTA_GROUP_PREFIX}{os.getpid()}-*"))


@pytest.mark.timeout(90)
def test_a_quotad_worker_and_a_helper_it_forks_later_get_a_fifth_of_a_core_then_all_again_and_go_back(
    procs: ProcessGroup, tmp_path: Path, job: JobRef
) -> None:
    worker = start(procs, tmp_path, job.job, "--helper-after", "0.5")
    control = start(procs, tmp_path, f"{job.job}-other", "--helper-after", "0.5")  # another job: never hit
    home = cpu_group(worker.pid)
    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    stop = threading.Event()
    done: list[dict] = []
    t = threading.Thread(target=lambda: done.append(faults.quota_worker(job, log, rank=1, cpu_fraction=0.2, stop=stop)))
    t.start()
    try:
        helper = wait_until(lambda: worker.children(), 10, what="the helper forked")[0]
        group = wait_until(lambda: our_groups(), 5, what="the quota group")[0]
        wait_until(lambda: cpu_group(helper.pid) == "/" + group.name, 5, what="the helper in the group")
        wait_until(lambda: control.children(), 10, what="the control's helper forked")
        limited, free = cpu_rates([worker, control], 2.0)  # two busy processes each
        assert 0.1 <= limited <= 0.3 and limited < free, f"{limited:.3f} CPU s/s under a 0.2 quota, {free:.3f} free"
    finally:
        stop.set()
        t.join(15)
    assert not t.is_alive() and done and done[0]["reason"] == "stopped", done
    assert our_groups() == [], "the group is deleted"
    assert cpu_group(worker.pid) == home and cpu_group(helper.pid) == home, "moved back where they were"
    recovered, free = cpu_rates([worker, control], 2.0)  # on this shared machine: a share like the control's
    assert recovered >= 0.6 * free, f"{recovered:.3f} CPU s/s once the quota is lifted, {free:.3f} for the control"
    first, last = faults.read_chaos(tmp_path / "chaos.jsonl")
    assert first["action"] == last["action"] == "quota-worker" and "phase" not in first
    assert (first["pid"], first["cpu_fraction"], first["start_rank"]) == (worker.pid, 0.2, 1)
    assert last["phase"] == "end" and sorted(last["pids"]) == sorted([worker.pid, helper.pid])
    assert last["throttled_seconds"] > 1.0 and last["nr_throttled"] >= 10, last
    assert last["backend"] == f"cgroup v{BACKEND.version}" and done[0] == last


@pytest.mark.timeout(60)
def test_a_quota_ends_by_itself_after_its_seconds_and_when_its_worker_exits(
    procs: ProcessGroup, tmp_path: Path, job: JobRef
) -> None:
    worker = start(procs, tmp_path, job.job)
    log = faults.ChaosLog(tmp_path / "chaos.jsonl")
    t0 = time.monotonic()
    end = faults.quota_worker(job, log, rank=1, cpu_fraction=0.5, seconds=1.5)
    assert end["reason"] == "seconds elapsed" and 1.5 <= time.monotonic() - t0 < 5, end
    assert our_groups() == []
    done: list[dict] = []
    t = threading.Thread(target=lambda: done.append(faults.quota_worker(job, log, rank=1, cpu_fraction=0.5)))
    t.start()
    wait_until(lambda: our_groups(), 5, what="the quota group")
    worker.kill()
    t.join(10)
    assert not t.is_alive() and done[0]["reason"] == "worker exited"
    assert our_groups() == []


@pytest.mark.timeout(60)
def test_a_failing_test_body_still_deletes_the_group_and_frees_its_processes(
    procs: ProcessGroup, tmp_path: Path, job: JobRef
) -> None:
    worker = start(procs, tmp_path, job.job)
    home = cpu_group(worker.pid)
    with pytest.raises(RuntimeError, match="the test failed"), faults.CpuQuota(0.1) as quota:
        assert quota.add([worker]) == [worker.pid] and quota.pids() == [worker.pid]
        quota.set(0.05)  # slower still, mid-run
        raise RuntimeError("the test failed")
    assert not quota.path.exists() and cpu_group(worker.pid) == home


@pytest.mark.timeout(60)
def test_the_group_of_a_creator_killed_before_its_cleanup_is_removed_by_the_next_quota(
    procs: ProcessGroup, tmp_path: Path, job: JobRef
) -> None:
    worker = start(procs, tmp_path, job.job)
    creator = procs.start(
        [
            sys.executable,
            "-c",
            f"from chaos import faults\nimport psutil, time\nq = faults.CpuQuota(0.3)\n"
            f"q.add([psutil.Process({worker.pid})])\nprint(q.path.name, flush=True)\ntime.sleep(600)",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert creator.stdout is not None
    name = creator.stdout.readline().strip()
    assert BACKEND is not None and name and (Path(BACKEND.root) / name).is_dir()
    creator.kill()
    creator.wait(10)
    assert name in faults.remove_stale_quota_groups()
    assert not (Path(BACKEND.root) / name).exists() and cpu_group(worker.pid) == "/"


PROFILED = """
import json, time, torch
from elastictrain.engine.profile import StepProfile
profile = StepProfile(torch.device("cpu"))
print("ready", flush=True)
input()  # the quota is on
out = []
for _ in range(3):
    profile.step_started(); profile.data_ready()
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.thread_time() - cpu0 < 0.1:
        pass
    profile.grads_ready(); profile.step_finished(1)
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    steps, compute, *_ = profile.take()
    out.append({"compute": compute, "wall": wall, "cpu": cpu})
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(90)
def test_the_profile_of_a_worker_under_a_quota_counts_the_time_it_was_throttled(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    """0.1 s of CPU under a tenth of a core takes about 1 s: compute is most of the wall time, not the 0.1 s of CPU (the
    run-queue delay of a throttled thread is the host's own slowness). The quota is set after the profile was
    made, as a fault sets it mid-run; the first take() after the move reads the new group. The bound allows for
    this shared machine's other load."""
    p = procs.start(
        [sys.executable, "-c", PROFILED],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin is not None and p.stdout is not None and p.stdout.readline().strip() == "ready"
    with faults.CpuQuota(0.1) as quota:
        quota.add([psutil.Process(p.pid)])
        p.stdin.write("\n")
        p.stdin.flush()
        steps = json.loads(p.stdout.readline())
    for s in steps:
        assert s["wall"] > 4 * s["cpu"], s  # the quota did hold it back
        # Leaving out all run-queue delay gave about the CPU time; what is left out now is only the delay that
        # the machine's other processes explain while the quota was not biting.
        assert s["compute"] >= 3 * s["cpu"] and s["compute"] <= s["wall"] + 0.01, s  # its window starts earlier
