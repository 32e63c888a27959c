"""The elastic worker under real horovodrun: scale up, graceful removal, hard failure; exactly-once data.

Each scenario asserts that the job completes (exit 0), that the ledger shows every sample exactly once
per epoch, and that the loss falls. Under the ``global`` policy the parameters must match a run without
faults within 1e-4 relative L2 a few steps after the membership change (:func:`params_after_the_reset`).
"""

from __future__ import annotations

import signal

import pytest
import torch

from chaos.jobs import ElasticJob
from elastictrain.checkpoint import LocalStorage, checkpoint_name, list_checkpoints, load_checkpoint
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Done, Metrics, Reset
from tests.fixtures.elastic_job import assert_exactly_once, job_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOSTS = local_logical_hosts()
needs3 = pytest.mark.skipif(len(HOSTS) < 3, reason=f"needs 3 logical local hosts, found {HOSTS}")


GLOBAL_POLICY = {
    "elastic__policy": "global",
    "elastic__global_batch_size": 48,
    "elastic__micro_batch_size": 16,
    "training__epochs": 1,
    "data__num_samples": 2400,
    "data__image_size": 32,
    "checkpoint__every_steps": 4,
    "checkpoint__keep_last": 20,
}
"""The ``global`` policy job whose parameters are compared with a fault-free run's (every checkpoint kept)."""


def run_job(jobs, tmp_path, name, hosts, **cfg) -> ElasticJob:
    job = ElasticJob(tmp_path / name, job_config(tmp_path / name / "run", **cfg), hosts)
    jobs.append(job)
    return job.start()


def assert_loss_falls(job: ElasticJob) -> None:
    losses = [e.loss for e in job.events(Metrics) if e.loss is not None]
    assert len(losses) >= 4
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first, f"loss did not fall: {losses}"


def params_at(job: ElasticJob, step: int) -> torch.Tensor:
    loaded = load_checkpoint(LocalStorage.for_run_dir(job.run_dir), checkpoint_name(step))
    return torch.cat([t.flatten().double() for k, t in loaded.state["model"].items()])


def params_after_the_reset(clean: ElasticJob, faulty: ElasticJob) -> float:
    """Relative L2 distance of the two runs' parameters at the first checkpoint at least 4 steps after the
    faulty run's last reset: steps at the new size are in it, a lost, repeated or wrongly scaled step shows.

    Not at the end: 3-worker runs are not bit-reproducible (two differed by 1e-8 in the loss at step 4, before
    any fault; likely Horovod's timing-dependent tensor fusion changing the ring's summation order) while 2-worker
    runs are bit-identical, and this job's training amplifies last-bit differences about 10x every 10 steps (those
    two runs, reset at the same step, ended 5e-4 apart at step 50, failing the old end-of-run check).
    """
    after = max(r.step for r in faulty.events(Reset)) + 4
    steps = [s for s, _ in list_checkpoints(LocalStorage.for_run_dir(faulty.run_dir)) if s >= after]
    assert steps, f"no checkpoint at or after step {after} (the reset came too late to compare)"
    step = steps[0]
    a, b = params_at(clean, step), params_at(faulty, step)
    return float((a - b).norm() / a.norm())


@needs3
def test_scale_up_2_to_3_keeps_every_sample_exactly_once(jobs, tmp_path):
    # Long enough (2 x 96 steps) that a third worker can start (import torch, rendezvous) on a busy machine.
    job = run_job(jobs, tmp_path, "up", HOSTS[:2])
    job.wait_step(8)
    job.set_hosts(HOSTS[:3])
    assert job.wait_exit() == 0, job.tail()
    resets = job.events(Reset)
    assert any((r.old_size, r.new_size) == (2, 3) for r in resets), resets
    assert job.events(Done)
    assert_exactly_once(job, 3072, 2)
    assert_loss_falls(job)


@needs3
def test_graceful_removal_3_to_2_loses_no_step(jobs, tmp_path):
    job = run_job(jobs, tmp_path, "down", HOSTS[:3])
    job.wait_step(8)
    job.set_hosts(HOSTS[:2])
    assert job.wait_exit() == 0, job.tail()
    resets = job.events(Reset)
    shrink = [r for r in resets if (r.old_size, r.new_size) == (3, 2)]
    assert shrink, resets
    assert_exactly_once(job, 3072, 2)
    assert_loss_falls(job)


@needs3
def test_worker_killed_mid_epoch_rolls_back_and_keeps_every_sample_exactly_once(jobs, tmp_path):
    job = run_job(jobs, tmp_path, "kill", HOSTS[:3], elastic__rollback="commit")
    job.wait_step(10)
    host, _ = job.kill_worker(rank=2, sig=signal.SIGKILL)
    job.set_hosts([h for h in HOSTS[:3] if h != host])  # the machine is gone, as a cloud would report
    assert job.wait_exit() == 0, job.tail()
    resets = job.events(Reset)
    assert any(r.new_size == 2 for r in resets), resets
    assert_exactly_once(job, 3072, 2)
    assert_loss_falls(job)


@needs3
def test_global_policy_parameters_match_a_fault_free_run(jobs, tmp_path):
    cfg = GLOBAL_POLICY
    clean = run_job(jobs, tmp_path, "clean", HOSTS[:2], **cfg)
    assert clean.wait_exit() == 0, clean.tail()
    faulty = run_job(jobs, tmp_path, "faulty", HOSTS[:3], **cfg)  # 3 workers, then 2: a different split
    faulty.wait_step(3)
    faulty.set_hosts(HOSTS[:2])
    assert faulty.wait_exit() == 0, faulty.tail()
    assert any((r.old_size, r.new_size) == (3, 2) for r in faulty.events(Reset)), "no resize 3 -> 2"
    rel = params_after_the_reset(clean, faulty)
    print(f"relative L2 difference after the reset: {rel:.3e}")
    assert rel < 1e-4, f"relative L2 difference {rel:.3e}"
    assert_exactly_once(faulty, 2400, 1)


@needs3
def test_worker_killed_with_rollback_none_loses_no_step_and_matches_a_fault_free_run(jobs, tmp_path):
    """``elastic.rollback: none``: a SIGKILLed worker costs the partial step only. Commits every 10 steps, so
    a rollback to the last commit would show as lost steps in the ``reset`` event."""
    cfg = {**GLOBAL_POLICY, "elastic__rollback": "none", "elastic__commit_every_steps": 10}
    clean = run_job(jobs, tmp_path, "clean", HOSTS[:2], **cfg)
    assert clean.wait_exit() == 0, clean.tail()
    faulty = run_job(jobs, tmp_path, "faulty", HOSTS[:3], **cfg)
    faulty.wait_step(14)  # between two commits
    host, _ = faulty.kill_worker(rank=2, sig=signal.SIGKILL)
    faulty.set_hosts([h for h in HOSTS[:3] if h != host])
    assert faulty.wait_exit() == 0, faulty.tail()
    resets = faulty.events(Reset)
    assert any(r.reason == "worker_failed" and r.new_size == 2 for r in resets), resets
    assert [r.lost_steps for r in resets] == [0] * len(resets), resets
    assert_exactly_once(faulty, 2400, 1)
    rel = params_after_the_reset(clean, faulty)
    print(f"relative L2 difference after the reset: {rel:.3e}")
    assert rel < 1e-4, f"relative L2 difference {rel:.3e}"


def test_bf16_autocast_fp16_compression_and_accumulation_train_exactly_once(jobs, tmp_path):
    job = run_job(
        jobs,
        tmp_path,
        "amp",
        HOSTS[:2],
        precision__mode="bf16",
        compression__gradients="fp16",
        training__grad_accumulation=2,
        training__epochs=1,
    )
    assert job.wait_exit() == 0, job.tail()
    assert_exactly_once(job, 3072, 1)
    assert_loss_falls(job)


@pytest.mark.skipif(len(HOSTS) < 4, reason=f"needs 4 logical local hosts, found {HOSTS}")
def test_rank0_killed_together_with_another_worker_recovers_in_seconds_not_at_the_gloo_timeout(tmp_path):
    """Rank 0 and another worker SIGKILLed at the same instant, three times in one 4-worker job: each time the
    survivors go on within 10 s (the Gloo timeout is 60 s; a survivor once waited in a receive until it)."""
    import random

    from bench import kill_distribution as kd

    job = ElasticJob(
        tmp_path / "pair", kd.job_config(tmp_path / "pair" / "run"), HOSTS[:4], min_np=2, max_np=4, cooldown=(1, 2)
    )
    rng = random.Random(4)
    try:
        job.start()
        for _ in range(3):
            kd.wait_full(job)
            r = kd.kill_once(job, "rank 0 + other", rng)
            assert r["seconds"] < 10, f"{r['seconds']:.1f} s from the kill to the next step:\n{job.tail()}"
    finally:
        job.close()
