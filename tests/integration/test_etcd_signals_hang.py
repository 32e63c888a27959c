"""A hung worker judged through etcd: ``elastictrain launch`` (embedded etcd, real agents) with ``elastic.signals:
etcd``. The workers' heartbeats live in etcd under the job's prefix, not in the run_dir; a worker SIGSTOPped mid-run
(never continued) is found hung by the others from those beats and SIGKILLed (same machine); the job continues at
N-1: a ``reset`` with reason ``worker_hung`` well before the Gloo timeout, every sample exactly once, exit 0."""

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

from chaos.faults import target_worker
from chaos.procs import JobRef
from discovery.kv import EtcdKeyValue
from elastictrain import envnames
from elastictrain.engine.health.etcd_signals import BEATS, signals_prefix
from elastictrain.engine.health.signals import Beat
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir import layout
from elastictrain.rundir.events import Failure, Metrics, Reset, of_kind, read_events
from elastictrain.rundir.ledger import committed_samples
from tests.fixtures.elastic_job import job_config
from tests.fixtures.procs import VENV_BIN, ProcessGroup, wait_until

# long: in one of four runs on 2026-12-06 (a clean .ci/run) the ring of a worker that had joined mid-run failed 5.2 s
# after the SIGSTOP with no hung verdict read through etcd, and the reset said worker_failed: a race between the etcd
# verdict and the failure it causes, not yet fixed (issue 38's closing note). make test-long runs it.
pytestmark = [pytest.mark.long, pytest.mark.integration, pytest.mark.timeout(480)]

HOSTS = local_logical_hosts()
needs3 = pytest.mark.skipif(len(HOSTS) < 3, reason=f"needs 3 logical local hosts, found {HOSTS}")
GLOO_TIMEOUT = 60
JOB = f"hang-etcd-{os.urandom(3).hex()}"  # unique: processes are found by their job name
SAMPLES = 3072


def _config(tmp_path: Path) -> Path:
    cfg = job_config(
        tmp_path / "run",
        job=JOB,
        training__epochs=1,
        elastic__hang_seconds=5,
        elastic__signals="etcd",
        elastic__min_np=2,
        elastic__max_np=3,
    )
    cfg["discovery"] = {"ttl_seconds": 3, "heartbeat_seconds": 0.5}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _beats_in_etcd(spec: str) -> list[Beat]:
    with contextlib.closing(EtcdKeyValue(spec, JOB)) as store:
        start = signals_prefix("/elastictrain", JOB) + BEATS
        rows = store.get_prefix(start, 100)
    return [b for _, value, _ in rows if (b := Beat.parse(value)) is not None]


@needs3
def test_a_sigstopped_worker_is_found_hung_through_etcd_signals_and_the_job_goes_on(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    config = _config(tmp_path)
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "ELASTICTRAIN_LOG_LEVEL": "warning"}
    env.pop(envnames.ETCD, None)
    log_path = tmp_path / "launch.log"
    with log_path.open("ab") as log:
        launch = procs.start(
            [str(VENV_BIN / "elastictrain"), "launch", "--config", str(config), "--hosts", ",".join(HOSTS[:3]),
             "--gloo-timeout-seconds", str(GLOO_TIMEOUT), "--drain-grace", "2"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
    run_dir = tmp_path / "run"
    heartbeat_files = layout.RunDir.of(run_dir).heartbeats

    def evs():
        try:
            return read_events(run_dir / layout.EVENTS)
        except FileNotFoundError:
            return []

    three = wait_until(
        lambda: next((e for e in evs() if isinstance(e, Metrics) and e.world_size == 3), None), 240, what="3 training"
    )
    wait_until(lambda: any(isinstance(e, Metrics) and e.step >= three.step + 8 for e in evs()), 120, what="steps")
    victim = target_worker(JobRef.resolve(JOB, run_dir), rng=None)  # any worker but the current rank 0
    spec = (victim.client or victim.proc).environ()[envnames.ETCD]  # a hot-joined worker shows its zygote's
    beats = wait_until(lambda: (b := _beats_in_etcd(spec)) and len(b) >= 3 and b, 30, what="3 beats in etcd")
    assert {b.pid for b in beats} >= {victim.proc.pid}
    assert not heartbeat_files.exists(), "no heartbeat file: the signals travel through etcd"

    victim.proc.send_signal(signal.SIGSTOP)
    stopped = victim.proc.pid, victim.proc.create_time()
    assert launch.wait(timeout=360) == 0, log_path.read_text()[-4000:]
    events = evs()
    hung = [r for r in of_kind(events, Reset) if r.reason == "worker_hung"]
    assert hung, [(r.reason, r.recovery_seconds) for r in of_kind(events, Reset)]
    assert hung[0].new_size == 2
    assert hung[0].recovery_seconds is not None and hung[0].recovery_seconds < GLOO_TIMEOUT / 2, hung[0]
    failures = [f for f in of_kind(events, Failure) if f.reason == "worker_hung"]
    assert failures and "no heartbeat" in (failures[0].error or ""), failures
    assert not heartbeat_files.exists()
    with contextlib.suppress(psutil.NoSuchProcess):
        p = psutil.Process(stopped[0])
        assert p.create_time() != stopped[1] or p.status() == psutil.STATUS_ZOMBIE, "the hung worker lives on"
    per_epoch = committed_samples(run_dir / layout.LEDGER)
    assert sorted(per_epoch[0]) == list(range(SAMPLES)), "every sample exactly once"
    print(json.dumps({"worker_hung": hung[0].to_record(), "failure": failures[0].to_record()}))
