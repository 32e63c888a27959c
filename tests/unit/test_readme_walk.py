"""The README's bring-your-own-model walk works as written: its linreg.py and linreg.yaml, saved side by side, pass
``elastictrain config validate`` (import, build, and the loss tried on 2 real samples)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from elastictrain import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_file(first_line: str) -> str:
    """The README code block whose first line is ``first_line`` (e.g. ``# linreg.py``)."""
    blocks = [b for b in re.findall(r"```\w*\n(.*?)```", README.read_text(), re.S) if b.startswith(first_line + "\n")]
    assert len(blocks) == 1, f"README: {len(blocks)} blocks start with {first_line!r}"
    return blocks[0]


def test_the_readme_linreg_task_passes_config_validate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "linreg.py").write_text(readme_file("# linreg.py"))
    (tmp_path / "linreg.yaml").write_text(readme_file("# linreg.yaml"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "linreg", raising=False)
    assert cli.main(["config", "validate", "--config", "linreg.yaml"]) == 0
    assert "config ok: task linreg:build: model Linear (4 parameters)" in capsys.readouterr().out
    sys.modules.pop("linreg", None)
