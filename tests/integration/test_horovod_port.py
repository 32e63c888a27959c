"""The ported Horovod script (``examples/horovod_port``) under real ``horovodrun`` with ``discovery/discover.sh``.

A real etcd and an ``elastictrain agent`` per logical host of this machine; horovodrun discovers them through
``discover.sh`` and starts one worker per host. A worker other than rank 0 is SIGKILLed mid-run; its host stays
blacklisted (no cooldown), so the job finishes one worker smaller. From what the script itself writes
(``--run-dir``: ``events.jsonl`` and the sample ledger) the test asserts: the job completes; the survivors' first
step at the new size comes seconds after the last step before the kill, far under the Gloo timeout; every sample
exactly once per epoch; the LR of every step, replayed ones included, is the schedule's for that step and world
size (the scheduler rolls back with the rest of the state); no process of the job is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from chaos import invariants as inv
from chaos.procs import JobRef
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Metrics, of_kind, read_events
from elastictrain.rundir.ledger import committed_samples, ledger_files
from elastictrain.tools.audit import audit_samples
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.procs import REPO, VENV_BIN, ProcessGroup, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOROVODRUN = VENV_BIN / "horovodrun"
SCRIPT = REPO / "examples" / "horovod_port" / "synthetic_benchmark_elastic.py"
GLOO_TIMEOUT_SECONDS = 60
RECOVERY_BOUND_SECONDS = 15.0
"""Last step before the kill -> first step at the new size; stock Horovod waits out the Gloo timeout (60 s)."""
SAMPLES, BATCH, EPOCHS, COMMIT_EVERY = 384, 8, 4, 4
LR, GAMMA = 0.01, 0.98
"""The LR decays at every step (``--lr-decay-steps 1``), so a replayed step with a scheduler that was not rolled
back would show a different LR."""

needs = pytest.mark.skipif(
    not HOROVODRUN.exists() or len(local_logical_hosts()) < 2, reason="needs horovodrun and 2 logical local hosts"
)


def expected_lr(step: int, world_size: int) -> float:
    """The LR the script's schedule gives step ``step`` (1-based: the steps done after it) at ``world_size``."""
    return LR * world_size * GAMMA ** (step - 1)


def workers(job: str) -> list[psutil.Process]:
    """The job's worker processes: Python running the script (not the shell horovodrun wraps around it)."""
    out = []
    for p in JobRef(job).processes():
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if len(cmd) >= 2 and cmd[1] == str(SCRIPT):
            out.append(p)
    return out


def rank0_pid(ledger: Path) -> int:
    """The pid of the process that holds rank 0: its name ends the newest ledger file (``...-<host>-<pid>``)."""
    return int(ledger_files(ledger)[-1].stem.rsplit("-", 1)[1])


@needs
def test_ported_script_survives_a_sigkill_in_seconds_with_every_sample_once_and_its_lr_rolled_back(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    hosts = local_logical_hosts()[:3]
    job = f"port-{os.urandom(3).hex()}"
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
        "ELASTICTRAIN_ETCD": etcd_server.endpoint,
        "ELASTICTRAIN_JOB": job,
        "ELASTICTRAIN_DISCOVER_CACHE": str(tmp_path / "discover-cache.json"),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_SECONDS),
        "ELASTICTRAIN_RUN_DIR": str(run_dir),  # elastic_run's failure marker: here, not in the machine's temp folder
        "ELASTICTRAIN_LOG_LEVEL": "warning",
    }
    log_path = tmp_path / "processes.log"
    log = log_path.open("ab")

    def agent(host: str) -> subprocess.Popen:
        return procs.start(
            [str(VENV_BIN / "elastictrain"), "agent", "--etcd", etcd_server.endpoint, "--job", job, "--host", host,
             "--slots", "1", "--ttl", "3", "--heartbeat", "0.5", "--request-timeout", "0.5", "--drain-grace", "0"],
            env=env, stdout=log, stderr=log,
        )  # fmt: skip

    agents = [agent(host) for host in hosts]
    want = "".join(f"{h}:1\n" for h in sorted(hosts))

    def discovered() -> bool:
        out = subprocess.run([str(REPO / "discovery" / "discover.sh")], env=env, capture_output=True, text=True,
                             timeout=10, check=False)  # fmt: skip
        return out.stdout == want

    wait_until(discovered, 30, what=f"{len(hosts)} hosts discovered")

    n = len(hosts)
    horovodrun = procs.start(
        [str(HOROVODRUN), "-np", str(n), "--min-np", "1", "--max-np", str(n),
         "--host-discovery-script", str(REPO / "discovery" / "discover.sh"), "--network-interfaces", "lo",
         str(VENV_BIN / "python"), str(SCRIPT), "--no-cuda", "--run-dir", str(run_dir),
         "--num-samples", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
         "--batches-per-commit", str(COMMIT_EVERY), "--lr", str(LR), "--lr-decay-steps", "1",
         "--lr-gamma", str(GAMMA)],
        env=env, stdout=log, stderr=log, cwd=tmp_path,
    )  # fmt: skip

    def metrics() -> list[Metrics]:
        path = run_dir / "events.jsonl"
        return of_kind(read_events(path), Metrics) if path.exists() else []

    def tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    try:
        wait_until(lambda: len(metrics()) >= 10 or horovodrun.poll() is not None, 180, what="10 steps")
        assert horovodrun.poll() is None, f"the job ended before the kill: {tail()}"
        rank0 = rank0_pid(run_dir / "ledger")
        victim = max((w for w in workers(job) if w.pid != rank0), key=lambda w: w.pid)
        kill_ts = time.time()
        victim.send_signal(signal.SIGKILL)
        code = horovodrun.wait(timeout=300)
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
    assert code == 0, tail()
    assert all(agent.wait(timeout=30) == 0 for agent in agents), tail()

    # No process of the job left: the workers (with the killed one), horovodrun, discover.sh and the agents.
    leftovers: list[psutil.Process] = []
    deadline = time.monotonic() + 15
    while (leftovers := JobRef(job).processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in leftovers if p.is_running()]

    events = read_events(run_dir / "events.jsonl")
    steps = of_kind(events, Metrics)
    before = [e for e in steps if e.ts < kill_ts]
    after = [e for e in steps if e.ts > kill_ts and e.world_size == n - 1]
    assert before and after, f"steps before the kill: {len(before)}, at {n - 1} workers after it: {len(after)}"
    recovery = after[0].ts - before[-1].ts
    print(f"recovery {recovery:.2f} s; steps {len(steps)} ({len(steps) - len({e.step for e in steps})} replayed)")
    sizes = [e.world_size for e in steps]
    assert sizes == sorted(sizes, reverse=True) and set(sizes) == {n, n - 1}, f"world sizes: {sizes}"

    checks = [
        inv.check_completed(code, events),
        inv.check_exactly_once(audit_samples(committed_samples(run_dir / "ledger"), SAMPLES, EPOCHS)),
        inv.Check(
            "recovered in seconds, not the Gloo timeout",
            recovery < RECOVERY_BOUND_SECONDS,
            f"{recovery:.2f} s from the last step before the kill to the first at {n - 1} workers "
            f"(bound {RECOVERY_BOUND_SECONDS:g} s, Gloo timeout {GLOO_TIMEOUT_SECONDS} s)",
        ),
        inv.check_no_leftovers(left),
    ]
    assert inv.passed(checks), inv.format_table("ported Horovod script under a SIGKILL", checks) + "\n" + tail()

    wrong_lr = [
        (e.step, e.world_size, e.lr)
        for e in steps
        if e.lr != pytest.approx(expected_lr(e.step, e.world_size), rel=1e-6)
    ]
    assert not wrong_lr, f"steps whose LR is not the schedule's (step, world size, lr): {wrong_lr[:5]}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "argument --batch-size: must be > 0, got 0"),
        (["--num-samples", "100"], "--num-samples (100) must be a multiple of --batch-size (8)"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2_before_horovod_starts(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    out = subprocess.run(
        [str(VENV_BIN / "python"), str(SCRIPT), "--no-cuda", "--run-dir", str(tmp_path / "run"), *argv],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [f"{SCRIPT.name}: error: {message}"], out.stderr
    assert out.stdout == "" and not (tmp_path / "run").exists()
