"""House rules that a reader relies on: tests share code through tests/fixtures only, and a module of the
product over about 500 lines says at its top why it is that large."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LONG = 500


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_no_test_module_imports_another_test_module():
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for name in imported_modules(path):
            last = name.rsplit(".", 1)[-1]
            if name.startswith("tests.") and last.startswith("test_"):
                offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert not offenders, "shared test code belongs in tests/fixtures: " + "; ".join(offenders)


def test_a_long_module_says_why_at_its_top():
    unexplained = []
    for path in sorted((REPO / "elastictrain").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > LONG + 50:  # "about 500"
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Size:" not in doc:
                unexplained.append(f"{path.relative_to(REPO)} ({text.count(chr(10))} lines)")
    assert not unexplained, "no 'Size:' reason in the module docstring: " + ", ".join(unexplained)
