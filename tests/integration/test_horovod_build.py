"""The Horovod that make setup built: imports beside torch, initialises, and allreduces across real processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.fixtures.procs import VENV_BIN

pytestmark = pytest.mark.integration


def test_horovod_imports_next_to_torch_and_lists_pytorch_and_gloo():
    proc = subprocess.run([str(VENV_BIN / "horovodrun"), "--check-build"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("[X] PyTorch" in line for line in lines)
    assert any("[X] Gloo" in line for line in lines)


def test_hvd_init_in_one_process():
    code = "import torch, horovod.torch as hvd; hvd.init(); print(hvd.rank(), hvd.size(), torch.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["0", "1"]


def test_two_process_allreduce_sums_across_real_workers(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent("""
        import torch, horovod.torch as hvd
        hvd.init()
        x = torch.tensor([float(hvd.rank() + 1), 10.0 * (hvd.rank() + 1)])
        total = hvd.allreduce(x, op=hvd.Sum)
        print(f"RESULT rank={hvd.rank()} size={hvd.size()} sum={total.tolist()}", flush=True)
    """)
    )
    proc = subprocess.run(
        [
            str(VENV_BIN / "horovodrun"),
            "-np",
            "2",
            "-H",
            "localhost:2",
            "--gloo",
            "--network-interfaces",
            "lo",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = sorted(line.split("RESULT ", 1)[1] for line in proc.stdout.splitlines() if "RESULT " in line)
    assert results == ["rank=0 size=2 sum=[3.0, 30.0]", "rank=1 size=2 sum=[3.0, 30.0]"]


def test_the_installed_horovod_carries_the_marker_of_this_checkouts_patch():
    code = (
        "from elastictrain.horovod.build_check import check_patched_horovod; check_patched_horovod(); print('patched')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "patched"), proc.stderr
