"""A worker whose machine becomes slower the way hardware does, under real horovodrun: a CPU quota
(:func:`chaos.faults.cpu_quota`, a real cgroup) on its processes mid-run, lifted later.

With the default window and ``elastic.stragglers: report``, rank 0 names the quota'd host in a ``straggler`` event
within 100 steps of the quota (the profile counts the time its cgroup throttled it,
:mod:`elastictrain.engine.profile`), clears it once the quota is lifted and its window is fast again, drains nothing;
every sample exactly once, exit 0, and the quota's group is gone.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from chaos import faults
from chaos.jobs import ElasticJob
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Eviction, Reset, Straggler
from tests.fixtures.elastic_job import assert_exactly_once, job_config

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(600)]  # the goal's measurement

HOSTS = local_logical_hosts()
try:
    BACKEND: faults.CpuBackend | None = faults.cpu_backend()
except faults.QuotaUnavailable:
    BACKEND = None
needs = pytest.mark.skipif(
    len(HOSTS) < 3 or BACKEND is None, reason=f"needs 3 logical local hosts ({HOSTS}) and a CPU cgroup"
)
CPU_FRACTION = 0.15
"""The issue's measurement: 15% of one core, named only 365 steps later when run-queue delay was all excused."""
NUM_SAMPLES = 12000
"""250 steps of 48 (16 a worker): 40 before the quota, up to 100 under it, the rest to clear the host after it is
lifted (with run-queue delay all excused, the old profile, this job ended at step 200 with the host never named)."""


@contextlib.contextmanager
def quota(proc: psutil.Process, cpu_fraction: float) -> Iterator[list[faults.QuotaRun]]:
    stop = threading.Event()
    done: list[faults.QuotaRun] = []
    t = threading.Thread(target=lambda: done.append(faults.cpu_quota([proc], cpu_fraction, stop)), daemon=True)
    t.start()
    try:
        yield done
    finally:
        stop.set()
        t.join(20)


@needs
def test_a_worker_put_under_a_cpu_quota_is_named_within_100_steps_and_cleared_after_it_recovers(jobs, tmp_path):
    cfg = job_config(
        tmp_path / "run",
        training__epochs=1,
        data__num_samples=NUM_SAMPLES,
        data__image_size=32,
        elastic__commit_every_steps=2,
    )
    job = ElasticJob(tmp_path, cfg, HOSTS[:3], min_np=3, max_np=3, gloo_timeout=60)
    jobs.append(job)
    job.start()
    job.wait_step(40, timeout=240)
    victim = job.worker(rank=2)
    host = victim.environ().get("HOROVOD_HOSTNAME")
    start = job.step()
    with quota(victim, CPU_FRACTION) as done:
        named = job.wait_event(
            Straggler, lambda e: bool(e.slow) and e.host == host, timeout=400, what="the quota'd host named"
        )
    lifted = job.step()
    assert done and done[0].throttled_seconds > 0, done  # the quota did bite
    assert named.ratio is not None and named.ratio >= 1.3, named
    assert named.step - start <= 100, f"named {named.step - start} steps after the quota (ratio {named.ratio})"
    cleared = job.wait_event(
        Straggler, lambda e: e.slow is False and e.host == host, timeout=400, what="the recovered host cleared"
    )
    assert cleared.step > lifted
    assert job.wait_exit(timeout=400) == 0, job.tail()
    assert not job.events(Eviction), "report drains nothing"
    assert all(r.new_size == 3 for r in job.events(Reset)), job.events(Reset)
    assert_exactly_once(job, NUM_SAMPLES, 1)
    assert BACKEND is not None and not any(
        p.name.startswith(faults.QUOTA_GROUP_PREFIX) and p.name.split("-")[2] == str(os.getpid())
        for p in Path(BACKEND.root).iterdir()
    ), "the quota's group is deleted"
