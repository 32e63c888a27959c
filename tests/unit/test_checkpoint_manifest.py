"""The manifest reader: one, torch-free, shared by the checkpoint format and the operator's tools."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import elastictrain.checkpoint as checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_the_manifest_reader_and_the_storage_import_without_torch() -> None:
    code = (
        "import sys, elastictrain.checkpoint.manifest, elastictrain.checkpoint.storage, elastictrain.tools.status; "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, check=True
    ).stdout.split()
    assert "elastictrain.checkpoint.manifest" in out
    assert not [m for m in out if m.split(".")[0] == "torch" or m == "elastictrain.checkpoint.format"]


def test_every_name_the_package_offers_resolves_in_its_home_module() -> None:
    assert sorted(checkpoint.__all__) == sorted(checkpoint._HOME_OF)
    for name in checkpoint.__all__:
        home = checkpoint._HOME_OF[name]
        assert getattr(checkpoint, name) is getattr(sys.modules[f"elastictrain.checkpoint.{home}"], name)
