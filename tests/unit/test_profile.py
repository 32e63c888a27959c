"""The step profile's compute time: the training thread's own work, not the time other processes held the cores."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import torch

from elastictrain.engine.profile import StepProfile
from tests.fixtures.procs import wait_until


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="run-queue delay is read from Linux's schedstat")
def test_compute_time_leaves_out_the_time_busy_neighbours_held_the_cores() -> None:
    profile = StepProfile(torch.device("cpu"))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        for p in busy:  # the neighbours hold the cores before the step starts
            wait_until(lambda p=p: sum(psutil.Process(p.pid).cpu_times()[:2]) > 0.05, 10, what="a busy neighbour")
        profile.step_started()
        profile.data_ready()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - cpu0 < 0.3:
            pass
        profile.grads_ready()
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        profile.step_finished(8)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    steps, compute, _data, step, samples = profile.take()
    assert (steps, samples) == (1, 8)
    assert compute == pytest.approx(cpu, abs=0.06), (compute, cpu, wall)
    assert step >= wall >= compute


def test_a_disabled_profile_measures_nothing() -> None:
    profile = StepProfile(torch.device("cpu"), enabled=False)
    profile.step_started()
    profile.data_ready()
    profile.grads_ready()
    profile.step_finished(4)
    assert profile.take() == [0.0, 0.0, 0.0, 0.0, 0.0]
