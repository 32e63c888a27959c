"""A job of 8 workers on 8 logical hosts of this machine (four names, then loopback addresses ``127.0.0.x`` that
launch's horovodrun runs locally), through a SIGKILL and a hot scale-up back to 8: exactly once, exit 0, and
every reset reports the parts of its pause."""

from __future__ import annotations

import contextlib
import signal

import pytest

from bench.hotjoin import hot_command, warm_zygotes
from chaos.jobs import ElasticJob
from elastictrain.engine.reset import PAUSE_PARTS
from elastictrain.launcher.hosts import is_loopback, local_logical_hosts, loopback_aliases_work
from elastictrain.rundir.events import Done, Reset, Start
from tests.fixtures.elastic_job import assert_exactly_once, job_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WORLD = 8
SAMPLES = 24_000


@pytest.mark.skipif(not loopback_aliases_work(), reason="this kernel does not answer on 127.0.0.2")
def test_eight_workers_on_eight_logical_hosts_survive_a_sigkill_and_scale_back_up(tmp_path):
    hosts = local_logical_hosts(WORLD)
    assert len(hosts) == WORLD and any(is_loopback(h) and h != "127.0.0.1" for h in hosts)
    victim = hosts[-1]
    cfg = job_config(tmp_path / "run", data__num_samples=SAMPLES, training__epochs=1, elastic__base_world_size=4)
    with contextlib.ExitStack() as stack:
        zygotes = stack.enter_context(warm_zygotes(tmp_path / "job.yaml", cfg, [victim]))  # hot join, as launch
        job = ElasticJob(
            tmp_path,
            cfg,
            hosts,
            min_np=WORLD // 2,
            max_np=WORLD,
            command=hot_command,
            extra_env=zygotes.env,
        )
        stack.callback(job.close)
        job.start()
        start = job.wait_event(Start, lambda e: True, timeout=300, what="the start of 8 workers")
        assert start.world_size == WORLD and start.hosts == sorted(hosts)
        job.wait_step(start.step + 5, timeout=120)
        [forked] = zygotes.forked(victim)
        forked.send_signal(signal.SIGKILL)
        # Fewer than 7 when a survivor aborted in Gloo as the ring broke (horovod/horovod#3264, exit 134): the job
        # goes on, and those hosts come back like the victim's.
        down = job.wait_event(Reset, lambda e: (e.new_size or WORLD) < WORLD, timeout=180, what="the first reset")
        assert down.reason == "worker_failed" and victim not in (down.hosts or [])
        # The victim's host stays listed: Horovod takes it back after its cooldown; its zygote forks a new worker.
        back = job.wait_event(
            Reset, lambda e: e.ts > down.ts and e.new_size == WORLD, timeout=180, what="the scale-up back to 8"
        )
        assert victim in (back.hosts or [])
        assert job.wait_exit(timeout=400) == 0
        assert [p.pid for p in zygotes.forked(victim)] == [], "the forked worker exited with the job"
    [done] = job.events(Done)
    assert done.world_size == WORLD
    assert_exactly_once(job, SAMPLES, 1)
    for reset in (down, back):
        parts = [getattr(reset, f"{p}_seconds") for p in PAUSE_PARTS]
        assert all(p is not None and p >= 0 for p in parts), (reset.reason, parts)
        assert sum(parts) == pytest.approx(reset.recovery_seconds, abs=0.05)
