"""``scripts/setup.sh``'s ``ELASTICTRAIN_TORCH`` knob refuses what it cannot use with one line, before it installs
or builds anything."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_an_unknown_value_is_one_line_and_exit_1():
    proc = _setup({"ELASTICTRAIN_TORCH": "latest", "VENV": str(Path(sys.executable).parents[1])})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "elastictrain setup: ELASTICTRAIN_TORCH=latest is not one of pinned, keep"
    ]


def test_keep_without_a_torch_in_the_venv_is_one_line_and_installs_nothing(tmp_path):
    target = tmp_path / "bare"
    venv.create(target, with_pip=False)
    before = sorted(p.name for p in (target / "lib").rglob("*"))
    proc = _setup({"ELASTICTRAIN_TORCH": "keep", "VENV": str(target), "PYTHON": sys.executable})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"elastictrain setup: ELASTICTRAIN_TORCH=keep but {target} has no importable torch"
    ]
    assert sorted(p.name for p in (target / "lib").rglob("*")) == before
