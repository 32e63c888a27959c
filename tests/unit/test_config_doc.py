"""docs/configuration.md lists exactly the keys of elastictrain/config.py (its table is generated from them)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from elastictrain.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def leaf_keys(cls: Any, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        keys += leaf_keys(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [prefix + f.name]
    return keys


def test_the_checked_in_config_table_is_the_one_the_dataclasses_generate() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_config_doc.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_the_doc_names_every_key_in_field_order_each_with_a_meaning() -> None:
    rows = re.findall(r"^\| `([a-z_.]+)` \| .* \| (.*) \|$", DOC.read_text(), flags=re.M)
    assert [key for key, _ in rows] == leaf_keys(JobConfig)
    assert not [key for key, meaning in rows if not meaning.strip()], "a config field without a docstring"
