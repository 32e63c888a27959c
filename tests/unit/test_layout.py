"""House rules that a reader relies on: tests share code through tests/fixtures only, the product never imports
its benchmarks or its fault injection, and a module over 500 lines (product, discovery, chaos, bench) says at its top,
in one ``Size:`` line, why it is that large."""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LONG = 500


def imported_modules(path: Path) -> set[str]:
    """Modules that ``path`` imports: import statements, and ``import_module("...")`` with a literal name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def test_imported_modules_sees_statements_and_import_module(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import a.b\nfrom c import d\nimport importlib\nimportlib.import_module('e.f')\n")
    assert imported_modules(path) == {"a.b", "c", "importlib", "e.f"}


def test_the_product_never_imports_bench_or_chaos():
    offenders = []
    for package in ("elastictrain", "discovery"):
        for path in sorted((REPO / package).rglob("*.py")):
            for name in imported_modules(path):
                if name.split(".", 1)[0] in ("bench", "chaos"):
                    offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert not offenders, "bench/ and chaos/ run from the checkout, outside the wheel: " + "; ".join(offenders)


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
    for path in sorted(
        p for folder in ("elastictrain", "discovery", "chaos", "bench") for p in (REPO / folder).rglob("*.py")
    ):
        text = path.read_text()
        if text.count("\n") > LONG:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not any(line.startswith("Size: ") for line in doc.splitlines()):
                unexplained.append(f"{path.relative_to(REPO)} ({text.count(chr(10))} lines)")
    assert not unexplained, "no 'Size:' reason in the module docstring: " + ", ".join(unexplained)


def test_a_child_in_another_folder_finds_bench_and_chaos_through_checkout_env():
    from chaos.procs import REPO as CHECKOUT
    from chaos.procs import checkout_env

    assert CHECKOUT == REPO and (CHECKOUT / "bench" / "__init__.py").is_file()
    assert checkout_env({"PYTHONPATH": "/x"})["PYTHONPATH"] == f"{REPO}{os.pathsep}/x"
    assert checkout_env({})["PYTHONPATH"] == str(REPO)
