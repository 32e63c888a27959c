"""Shares that follow speed under real horovodrun (``elastic.stragglers: balance``,
:mod:`elastictrain.engine.health.shares`).

One of 3 workers is slowed mid-run by a SIGSTOP/SIGCONT duty cycle (:func:`chaos.faults.duty_cycle`): rank 0 writes a
``shares`` event in which the slowed host's share of a step falls below an equal share, the shares of every such
event sum to the global batch, and once the duty cycle ends its share grows back. Nothing is drained (no etcd to
drain through: a slow host that pays for itself is kept anyway), every sample is used exactly once (the ledger), the
job exits 0, and ``status`` shows each host's share.

With uneven shares in force, a fast worker is SIGKILLed (``rollback: commit``): the job rolls back, goes on at 2 and
re-splits the shares over the hosts left (a ``shares`` event for the new world, the slowed host still below its
peer), with every sample exactly once.
"""

from __future__ import annotations

import signal

import pytest

from chaos.faults import duty_cycled
from chaos.jobs import ElasticJob
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Reset, Shares
from elastictrain.tools.status import read_status
from tests.fixtures.elastic_job import assert_exactly_once, job_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

HOSTS = local_logical_hosts()
needs3 = pytest.mark.skipif(len(HOSTS) < 3, reason=f"needs 3 logical local hosts, found {HOSTS}")
NUM_SAMPLES = 14400
"""300 steps of 48 (3 workers x 16): time to fall, settle and grow back."""


@needs3
def test_balance_gives_a_slowed_host_a_smaller_share_and_gives_it_back_with_every_sample_exactly_once(jobs, tmp_path):
    cfg = job_config(
        tmp_path / "run",
        training__epochs=1,
        data__num_samples=NUM_SAMPLES,
        data__image_size=32,
        elastic__window_steps=30,
        elastic__commit_every_steps=2,
        elastic__stragglers="balance",
    )
    job = ElasticJob(tmp_path, cfg, HOSTS[:3], min_np=3, max_np=3, gloo_timeout=60)
    jobs.append(job)
    job.start()
    job.wait_step(20, timeout=240)
    victim = job.worker(rank=2)
    host = str(victim.environ()["HOROVOD_HOSTNAME"])
    equal = 48 // 3
    with duty_cycled(victim, 1.0):  # stopped half the time
        fell = job.wait_event(
            Shares,
            lambda e: (e.shares or {}).get(host, equal) <= 0.8 * equal,
            timeout=240,
            what="the slowed host's share below an equal one",
        )
        job.wait_step(fell.step + 20, timeout=240)  # it holds while the host stays slow
    rose = job.wait_event(
        Shares,
        lambda e: e.step > fell.step and (e.shares or {}).get(host, 0) >= 0.9 * equal,
        timeout=240,
        what="the recovered host's share back near an equal one",
    )
    assert job.wait_exit(timeout=300) == 0, job.tail()
    events = job.events(Shares)
    assert all(sum((e.shares or {}).values()) == e.global_batch == 48 for e in events), events
    assert all(set(e.shares or {}) == set(HOSTS[:3]) for e in events), events
    assert fell.shares is not None and all(n > fell.shares[host] for h, n in fell.shares.items() if h != host), fell
    assert rose.step > fell.step
    assert all(r.new_size == 3 for r in job.events(Reset)), "nothing drained or lost"
    assert_exactly_once(job, NUM_SAMPLES, 1)
    status = read_status(job.run_dir)
    assert status["shares"] is not None and sum(status["shares"]["shares"].values()) == 48, status["shares"]


@needs3
@pytest.mark.long  # the re-split itself is a unit test (test_sampler_shares); this is the whole job's view
def test_after_a_worker_dies_the_shares_are_re_split_over_the_hosts_left_and_every_sample_is_used_once(jobs, tmp_path):
    cfg = job_config(
        tmp_path / "run",
        training__epochs=1,
        data__num_samples=9600,
        data__image_size=32,
        elastic__window_steps=30,
        elastic__commit_every_steps=2,
        elastic__stragglers="balance",
        elastic__rollback="commit",
    )
    job = ElasticJob(tmp_path, cfg, HOSTS[:3], min_np=2, max_np=3, gloo_timeout=60)
    jobs.append(job)
    job.start()
    job.wait_step(20, timeout=240)
    victim = job.worker(rank=2)
    slow = str(victim.environ()["HOROVOD_HOSTNAME"])
    with duty_cycled(victim, 1.0):
        fell = job.wait_event(
            Shares,
            lambda e: e.world_size == 3 and (e.shares or {}).get(slow, 16) <= 12,
            timeout=240,
            what="the slowed host's share below an equal one",
        )
        gone, _ = job.kill_worker(rank=1, sig=signal.SIGKILL)
        assert gone != slow
        job.set_hosts([h for h in HOSTS[:3] if h != gone])
        resplit = job.wait_event(
            Shares,
            lambda e: e.step >= fell.step and e.world_size == 2 and bool(e.shares),
            timeout=240,
            what="the shares re-split over 2 hosts",
        )
    assert resplit.shares is not None and set(resplit.shares) == set(HOSTS[:3]) - {gone}, resplit
    assert sum(resplit.shares.values()) == resplit.global_batch == 32, resplit
    assert resplit.shares[slow] < 16, f"the slowed host keeps a smaller share after the reset: {resplit}"
    assert job.wait_exit(timeout=300) == 0, job.tail()
    assert any(r.new_size == 2 for r in job.events(Reset)), job.events(Reset)
    assert_exactly_once(job, 9600, 1)
