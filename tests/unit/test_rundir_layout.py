"""The run_dir's layout: every path spelled once, importable by discovery and the CLI at no cost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from elastictrain.rundir.layout import RunDir

REPO = Path(__file__).resolve().parents[2]


def test_the_layout_imports_only_the_standard_library() -> None:
    code = "import sys; b = set(sys.modules); import elastictrain.rundir.layout; print(' '.join(set(sys.modules) - b))"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60, check=True
    ).stdout.split()
    ours = {"elastictrain", "elastictrain.rundir", "elastictrain.rundir.layout"}
    assert "elastictrain.rundir.layout" in out
    assert not [m for m in out if m not in ours and m.split(".")[0] not in sys.stdlib_module_names]


def test_the_workers_signals_live_under_one_folder_of_the_run_dir(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert {run.heartbeats.parent, run.failure_marker.parent, run.hung_verdict.parent} == {run.signals}
    assert run.latest.parent == run.checkpoints and run.signals.parent == tmp_path
