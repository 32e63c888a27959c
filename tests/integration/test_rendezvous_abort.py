"""A worker killed while a reset forms (its rendezvous, its state sync): the survivors go on in seconds, not at the
Gloo timeout.

Real horovodrun (:mod:`elastictrain.horovod.hvdrun`), real workers, Horovod as built by ``scripts/setup.sh``
(``elastictrain/horovod/patch.py``). In a rendezvous: the driver writes an abort marker into its rendezvous store when a
worker of the current round exits; the survivors' Gloo set-up (``hvd.init``) sees it and asks for the next ring at
once. In the sync: the collective watchdog guards it like a step (:func:`elastictrain.engine.watch.guard_sync`), so a
survivor whose sync failed shuts the new ring's connections down and one blocked on a live peer aborts on the
recorded failure, instead of waiting in a Gloo receive for ``HOROVOD_GLOO_TIMEOUT_SECONDS``. A worker that is
stopped (SIGSTOP) while the ring forms is judged by its silent heartbeat
(:func:`elastictrain.engine.health.hang.silent_in_rendezvous`): a survivor SIGKILLs it, and from there it is a dead
peer.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from bench import kill_distribution as kd
from chaos.campaign import read_beats
from chaos.jobs import ElasticJob
from chaos.procs import HarnessError, wait_until
from elastictrain.engine.health.signals import RENDEZVOUS, SYNC, Beat, HungVerdict
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Reset
from elastictrain.rundir.layout import RunDir
from tests.fixtures.elastic_job import job_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOSTS = local_logical_hosts()
GLOO_TIMEOUT_SECONDS = 60
"""``elastictrain launch``'s default: what a survivor waited for a peer that never joined the rendezvous."""
RECOVERY_BOUND_SECONDS = 30
"""Half the Gloo timeout: wide for a loaded 2-core machine (the fix recovers in a few seconds), and still far
below the ~60 s that waiting out the Gloo timeout takes."""


def _new_worker_on(job: ElasticJob, host: str, timeout: float = 120) -> psutil.Process:
    def found() -> psutil.Process | None:
        try:
            return job.worker(host=host)
        except HarnessError:
            return None

    process = wait_until(found, timeout, interval=0.02, what=f"a worker process on {host}")
    assert process is not None  # wait_until returns only a truthy value
    return process


@pytest.mark.skipif(len(HOSTS) < 3, reason=f"needs 3 logical local hosts, found {HOSTS}")
def test_a_new_worker_killed_before_it_joins_the_rendezvous_does_not_hold_the_survivors_for_the_gloo_timeout(
    jobs, tmp_path
):
    """2 workers train; a third host comes; the driver assigns it a rank and starts its worker after the two have
    entered the new ring's rendezvous (they wait there for its address). The new worker is SIGKILLed at once,
    before ``hvd.init``: the survivors must reach a completed step at the next ring well inside the Gloo timeout."""
    cfg = job_config(tmp_path / "run", data__num_samples=200_000, training__epochs=1, checkpoint__enabled=False)
    job = ElasticJob(
        tmp_path / "job", cfg, HOSTS[:2], min_np=2, max_np=3, gloo_timeout=GLOO_TIMEOUT_SECONDS, cooldown=(1, 2)
    )
    jobs.append(job.start())
    job.wait_step(6)
    job.set_hosts(HOSTS[:3])
    newcomer = _new_worker_on(job, HOSTS[2])
    t_kill = time.time()
    newcomer.send_signal(signal.SIGKILL)
    _assert_recovers(job, t_kill, "before it joined", timeout=4 * GLOO_TIMEOUT_SECONDS)


def _first_in(phase: str, beats_dir: Path, since: float, spare: set[int]) -> Beat | None:
    beats = read_beats(beats_dir).values()
    return next((b for b in beats if b.phase == phase and b.since >= since and b.pid not in spare), None)


def _survivor_in(phase: str, job: ElasticJob, since: float, spare: set[int], interval: float) -> Beat:
    """The first survivor (not in ``spare``) whose heartbeat says it entered ``phase`` after ``since``."""
    beat = wait_until(
        lambda: _first_in(phase, RunDir(job.run_dir).heartbeats, since, spare),
        60,
        interval=interval,
        what=f"a survivor in the reset's {phase}",
    )
    assert beat is not None  # wait_until returns only a truthy value
    return beat


def _primed_reset(jobs: list[ElasticJob], tmp_path: Path) -> tuple[ElasticJob, float, set[int]]:
    """A 4-worker job, whole; then one worker (not rank 0) SIGKILLed, so that a reset begins. Returns the job, the
    kill's time and the pids a second kill must spare (the dead one and rank 0)."""
    job = ElasticJob(
        tmp_path / "job",
        kd.job_config(tmp_path / "run"),
        HOSTS[:4],
        min_np=2,
        max_np=4,
        gloo_timeout=GLOO_TIMEOUT_SECONDS,
        cooldown=(1, 2),
    )
    jobs.append(job.start())
    kd.wait_full(job)
    rank0 = kd.current_rank0(job)
    primer = next(p for p in job.workers() if p.pid != rank0.pid)
    t_primer = time.time()
    primer.send_signal(signal.SIGKILL)
    return job, t_primer, {primer.pid, rank0.pid}


def _assert_recovers(job: ElasticJob, t_kill: float, where: str, timeout: float) -> None:
    """The job's next completed step comes well inside the Gloo timeout after the kill."""
    reset = job.wait_event(Reset, lambda e: e.ts >= t_kill, timeout=timeout, what="a completed step after the kill")
    seconds = reset.ts - t_kill
    assert seconds < RECOVERY_BOUND_SECONDS, (
        f"{seconds:.1f} s from the kill {where} to the next step (Gloo timeout {GLOO_TIMEOUT_SECONDS} s):\n{job.tail()}"
    )


def _listening_ports(process: psutil.Process) -> set[int]:
    try:
        return {c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


@pytest.mark.timeout(600)
@pytest.mark.skipif(len(HOSTS) < 4, reason=f"needs 4 logical local hosts, found {HOSTS}")
def test_a_survivor_killed_in_the_gloo_set_up_of_the_next_ring_does_not_hold_the_others_for_the_gloo_timeout(
    jobs, tmp_path
):
    """4 workers; one is SIGKILLed (a reset begins), then a second survivor as soon as it has the driver's next ring
    and is connecting to it: its Gloo pairs' listening sockets appear (before or just after it writes its address,
    so the other two wait for its address or for its connection; Gloo gives the latter five times the Gloo timeout).
    This is the campaign's kill "during a reset's rendezvous"; the last two must go on well inside the Gloo timeout.
    """
    job, t_primer, spare = _primed_reset(jobs, tmp_path)
    beat = _survivor_in(RENDEZVOUS, job, t_primer, spare, interval=0.005)
    victim = psutil.Process(beat.pid)
    before = _listening_ports(victim)  # Horovod's notification service, ...
    wait_until(lambda: _listening_ports(victim) - before, 60, interval=0.002, what="the victim's Gloo pairs")
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    _assert_recovers(job, t_kill, "in the Gloo set-up", timeout=6 * GLOO_TIMEOUT_SECONDS)


@pytest.mark.timeout(600)
@pytest.mark.skipif(len(HOSTS) < 4, reason=f"needs 4 logical local hosts, found {HOSTS}")
def test_a_survivor_killed_in_the_state_sync_after_a_reset_does_not_hold_the_others_for_the_gloo_timeout(
    jobs, tmp_path
):
    """4 workers; one is SIGKILLed (a reset begins), then a second survivor (not rank 0) the moment its heartbeat
    says it is in the sync of the ring that reset formed (the campaign's kill "during a reset's sync"). The last two
    must reach a completed step well inside the Gloo timeout."""
    job, t_primer, spare = _primed_reset(jobs, tmp_path)
    beat = _survivor_in(SYNC, job, t_primer, spare, interval=0.002)
    t_kill = time.time()
    psutil.Process(beat.pid).send_signal(signal.SIGKILL)
    _assert_recovers(job, t_kill, "in the sync", timeout=4 * GLOO_TIMEOUT_SECONDS)


@pytest.mark.timeout(600)
@pytest.mark.skipif(len(HOSTS) < 4, reason=f"needs 4 logical local hosts, found {HOSTS}")
def test_a_survivor_stopped_while_its_ring_forms_is_judged_hung_and_the_others_go_on(jobs, tmp_path):
    """4 workers; one is SIGKILLed (a reset begins), then a second survivor (not rank 0) is SIGSTOPped the moment its
    heartbeat says it is in the reset's rendezvous (the campaign's hang "during a reset's rendezvous"). The driver
    sees it alive: the rendezvous waited for it for good, each ``hvd.init`` ending at the Gloo timeout. Now a
    survivor's detector SIGKILLs it after its silence bound (10 s here), and the last two train on."""
    job, t_primer, spare = _primed_reset(jobs, tmp_path)
    beat = _survivor_in(RENDEZVOUS, job, t_primer, spare, interval=0.005)
    victim = psutil.Process(beat.pid)
    t_stop = time.time()
    for p in [*victim.children(recursive=True), victim]:
        p.send_signal(signal.SIGSTOP)
    _assert_recovers(job, t_stop, "after a SIGSTOP in the rendezvous", timeout=6 * GLOO_TIMEOUT_SECONDS)
    why = HungVerdict(RunDir(job.run_dir).hung_verdict).since(t_stop) or ""
    assert f"(pid {victim.pid})" in why and "while its ring forms" in why, why
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE, "the stopped worker was killed"
