"""The diff of the three renames shown in README.md and examples/horovod_port/README.md is the example's code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "horovod_port" / "synthetic_benchmark_elastic.py"
RENAMES = {
    "hvd.elastic.TorchState": "elastictrain.ElasticState",
    "hvd.elastic.ElasticSampler": "elastictrain.ElasticSampler",
    "@hvd.elastic.run": "@elastictrain.elastic_run",
}


def diff_block(doc: Path) -> list[str]:
    blocks = re.findall(r"```diff\n(.*?)```", doc.read_text(), re.S)
    assert len(blocks) == 1, f"{doc}: {len(blocks)} diff blocks"
    return blocks[0].splitlines()


@pytest.mark.parametrize("doc", ["README.md", "examples/horovod_port/README.md"])
def test_the_documented_diff_is_the_example_with_exactly_the_three_renames(doc: str) -> None:
    lines = diff_block(REPO / doc)
    code = SCRIPT.read_text().splitlines()
    removed = [line[1:] for line in lines if line.startswith("-")]
    added = [line[1:] for line in lines if line.startswith("+")]
    kept = [line[1:] for line in lines if line.startswith(" ") and line.strip() != "..."]
    assert len(removed) == len(added) == 3
    for old, new in zip(removed, added, strict=True):
        renamed = old
        for horovod, ours in RENAMES.items():
            renamed = renamed.replace(horovod, ours)
        assert renamed == new and renamed != old, f"{old!r} -> {new!r} is not one of the three renames"
    for line in added + kept:
        assert line in code, f"{doc}: {line!r} is not a line of {SCRIPT.name}"
    stock = {ast.unparse(n) for n in ast.walk(ast.parse(SCRIPT.read_text())) if isinstance(n, ast.Attribute)}
    assert not {name for name in stock if name.startswith("hvd.elastic")}, "the example still uses hvd.elastic"
