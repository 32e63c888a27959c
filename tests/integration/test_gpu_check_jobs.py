"""The job checks of ``make gpu-check`` (:mod:`bench.gpu_check`) with their jobs on the CPU.

``make gpu-check`` runs in the repository with its scratch folders under the relative ``runs/gpu-check``. On the
first GPU run every job check failed there: horovodrun runs in the job's folder, so the relative paths the job was
given (its discovery script, its config, its run_dir) named other folders once inside it. These run the same checks
from a relative scratch folder, with the jobs' device set to ``cpu``: real horovodrun, real workers, a real SIGKILL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import gpu_check

pytestmark = pytest.mark.integration


@pytest.fixture
def on_cpu_from_a_relative_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.chdir(tmp_path)
    return Path("runs") / "gpu-check"


def test_kill_and_resume_check_passes_from_a_relative_folder(on_cpu_from_a_relative_folder):
    work = on_cpu_from_a_relative_folder / "fp16"
    work.mkdir(parents=True)
    result = gpu_check.check_fp16_resume(work)
    assert "resumed there on cpu and finished" in result


def test_two_worker_kill_check_passes_from_a_relative_folder(on_cpu_from_a_relative_folder):
    work = on_cpu_from_a_relative_folder / "shared"
    work.mkdir(parents=True)
    result = gpu_check.check_shared_gpu_kill(work)
    assert "reset 2->1" in result
