"""Slow and hung workers under real horovodrun (:mod:`elastictrain.engine.health.stragglers`,
:mod:`elastictrain.engine.health.hang`).

- A worker SIGSTOPped mid-run (never continued) is found hung by the others and SIGKILLed (same machine); the job
  continues at N-1 as after a SIGKILL: a ``reset`` with reason ``worker_hung``, well before the Gloo timeout, every
  sample exactly once, exit 0, and the stopped process is gone.
- A worker slowed by half with a SIGSTOP/SIGCONT duty cycle is named in a ``straggler`` event by rank 0 under the
  default policy (``report``), and ``status`` shows it as the slowest host; nothing is drained.
- With ``elastic.stragglers: evict`` under ``elastictrain launch`` (real etcd, real agents), the slowed host is
  drained through etcd: an ``eviction`` event with ``action: drain``, a graceful reset to N-1 with 0 steps lost,
  exit 0, every sample exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml

from chaos.faults import duty_cycled, target_worker
from chaos.jobs import ElasticJob
from chaos.procs import JobRef
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir import layout
from elastictrain.rundir.events import Done, Eviction, Metrics, Reset, Straggler, of_kind, read_events
from elastictrain.rundir.ledger import committed_samples
from elastictrain.tools.status import read_status
from tests.fixtures.elastic_job import assert_exactly_once, job_config
from tests.fixtures.procs import VENV_BIN, ProcessGroup, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOSTS = local_logical_hosts()
needs3 = pytest.mark.skipif(len(HOSTS) < 3, reason=f"needs 3 logical local hosts, found {HOSTS}")
GLOO_TIMEOUT = 60
SLOWDOWN = 1.0
"""Stopped half the time. With 3 workers on this 2-core machine the others take up the time a stopped one leaves,
so a 50% slowdown shows as a compute ratio of about 1.46 only (measured by chaos's duty-cycle tests), at the edge
of both the 1.3 threshold and the 1.5 a 3 -> 2 drain needs to pay; stopped half the time it is clearly slow."""


@needs3
def test_a_sigstopped_worker_is_found_hung_killed_and_the_job_goes_on_without_it(jobs, tmp_path):
    cfg = job_config(tmp_path / "run", training__epochs=1, elastic__hang_seconds=5)
    job = ElasticJob(tmp_path, cfg, HOSTS[:3], min_np=2, max_np=3, gloo_timeout=GLOO_TIMEOUT)
    jobs.append(job)
    job.start()
    three = job.wait_event(Metrics, lambda e: e.world_size == 3, timeout=180, what="3 workers training")
    job.wait_step(three.step + 2)  # past the first step after the scale-up, which gets a longer bound
    victim = job.worker(rank=1)
    victim.send_signal(signal.SIGSTOP)
    stopped_at = victim.create_time(), victim.pid
    assert job.wait_exit(timeout=300) == 0, job.tail()
    resets = job.events(Reset)
    hung = [r for r in resets if r.reason == "worker_hung"]
    assert hung, f"no worker_hung reset: {[(r.reason, r.recovery_seconds) for r in resets]}"
    assert hung[0].new_size == 2
    assert hung[0].recovery_seconds is not None and hung[0].recovery_seconds < GLOO_TIMEOUT / 2, hung[0]
    failures = [f for f in job.events() if f.name == "failure" and getattr(f, "reason", None) == "worker_hung"]
    assert failures and "no heartbeat" in (failures[0].error or ""), failures
    with contextlib.suppress(psutil.NoSuchProcess):
        p = psutil.Process(stopped_at[1])
        assert p.create_time() != stopped_at[0] or p.status() == psutil.STATUS_ZOMBIE, "the hung worker lives on"
    assert_exactly_once(job, 3072, 1)


@needs3
def test_report_names_a_worker_slowed_by_half_and_status_shows_it(jobs, tmp_path):
    cfg = job_config(
        tmp_path / "run",
        training__epochs=1,
        data__num_samples=7200,
        data__image_size=32,
        elastic__window_steps=30,
        elastic__commit_every_steps=2,
    )
    job = ElasticJob(tmp_path, cfg, HOSTS[:3], min_np=3, max_np=3, gloo_timeout=GLOO_TIMEOUT)
    jobs.append(job)
    job.start()
    job.wait_step(40)  # windows filled before the slowdown
    victim = job.worker(rank=2)
    host = victim.environ().get("HOROVOD_HOSTNAME")
    start = job.step()
    with duty_cycled(victim, SLOWDOWN):
        named = job.wait_event(
            Straggler, lambda e: bool(e.slow) and e.host == host, timeout=240, what="the slowed host named"
        )
    assert named.ratio is not None and named.ratio >= 1.3
    assert named.step - start <= 100, f"named {named.step - start} steps after the slowdown"
    assert job.wait_exit(timeout=300) == 0, job.tail()
    assert not job.events(Eviction), "report drains nothing"
    assert all(r.new_size == 3 for r in job.events(Reset)), job.events(Reset)
    status = read_status(job.run_dir)
    assert host in status["stragglers"]["named"] or any(
        d["event"] == "straggler" and d["host"] == host for d in status["stragglers"]["decisions"]
    )


def _launch_config(tmp_path: Path, hosts: list[str]) -> Path:
    cfg = job_config(
        tmp_path / "run",
        job="evict",
        training__epochs=1,
        data__num_samples=6000,
        data__image_size=32,
        elastic__window_steps=30,
        elastic__commit_every_steps=2,
        elastic__stragglers="evict",
        elastic__min_np=2,
        elastic__max_np=len(hosts),
        elastic__straggler_cooldown_seconds=600,
    )
    cfg["discovery"] = {"ttl_seconds": 3, "heartbeat_seconds": 0.5}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@needs3
def test_evict_drains_a_slowed_worker_through_etcd_with_no_step_lost(procs: ProcessGroup, tmp_path):
    hosts = HOSTS[:3]
    config = _launch_config(tmp_path, hosts)
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "ELASTICTRAIN_LOG_LEVEL": "warning"}
    env.pop("ELASTICTRAIN_ETCD", None)
    log_path = tmp_path / "launch.log"
    with log_path.open("ab") as log:
        launch = procs.start(
            [str(VENV_BIN / "elastictrain"), "launch", "--config", str(config), "--hosts", ",".join(hosts),
             "--gloo-timeout-seconds", str(GLOO_TIMEOUT), "--drain-grace", "2"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
    run_dir = tmp_path / "run"

    def evs():
        try:
            return read_events(run_dir / layout.EVENTS)
        except FileNotFoundError:
            return []

    wait_until(
        lambda: any(e.name == "metrics" and e.step >= 40 and e.world_size == 3 for e in evs()), 240, what="training"
    )
    worker = target_worker(JobRef.resolve("evict", run_dir), rng=None)  # any worker but the current rank 0
    target = worker.host
    with duty_cycled(worker.proc, SLOWDOWN):
        drained = wait_until(
            lambda: next((e for e in of_kind(evs(), Eviction) if e.action == "drain"), None), 300, what="a drain"
        )
    assert drained.host == target, drained
    assert drained.error is None and drained.evictions == 1 and drained.cooldown_seconds == 600, drained
    assert drained.samples_per_sec_without > drained.samples_per_sec_now, drained
    assert launch.wait(timeout=400) == 0, log_path.read_text()[-4000:]
    events = evs()
    assert [e.step for e in of_kind(events, Done)], "no done event"
    shrink = [r for r in of_kind(events, Reset) if r.new_size == 2]
    assert shrink and all(r.lost_steps == 0 for r in shrink), of_kind(events, Reset)
    per_epoch = committed_samples(run_dir / "ledger")
    assert sorted(per_epoch[0]) == list(range(6000)), "every sample exactly once"
    print(json.dumps({"drain": drained.to_record()}))
