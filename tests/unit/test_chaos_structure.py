"""The chaos package's shape: no import cycle, the namespace tier free of scenario code, scenarios registered
as functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from chaos import scenarios
from chaos.jobs import LaunchedJob

CHAOS = Path(__file__).resolve().parents[2] / "chaos"


def chaos_imports() -> dict[str, set[str]]:
    """module -> the chaos modules it imports (at any depth of its code, lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for path in CHAOS.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "chaos":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("chaos."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("chaos.")}
        graph[path.stem] = deps - {path.stem}
    return graph


def test_chaos_modules_import_each_other_without_a_cycle() -> None:
    graph = chaos_imports()
    done: set[str] = set()

    def visit(mod: str, stack: list[str]) -> None:
        assert mod not in stack, f"import cycle: {' -> '.join([*stack, mod])}"
        if mod in done:
            return
        for dep in sorted(graph.get(mod, ())):
            visit(dep, [*stack, mod])
        done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])
    assert "scenarios" not in graph["netns"]
    assert not graph["jobs"] & {"scenarios", "campaign", "netns", "resets"}, (
        "the harness is under every tier, not over one"
    )


def test_a_registered_scenario_is_its_function_and_a_name_registers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenarios, "SCENARIOS", {})
    calls: list[tuple[object, bool]] = []

    @scenarios.scenario("probe", "a test scenario", ci=False, graceful=True)
    def probe(r: LaunchedJob, quick: bool) -> None:
        calls.append((r, quick))

    s = scenarios.SCENARIOS["probe"]
    assert s.inject is probe and s.graceful and not s.ci and s.nodes == 0
    s.inject("run", True)  # type: ignore[arg-type]
    assert calls == [("run", True)]
    with pytest.raises(ValueError, match="'probe' is registered twice"):
        scenarios.scenario("probe", "again", ci=True)(probe)


def test_every_scenario_injects_through_a_module_level_function() -> None:
    for s in scenarios.SCENARIOS.values():
        assert s.inject.__module__ == "chaos.scenarios", s.name
        assert getattr(scenarios, s.inject.__name__) is s.inject, f"{s.name}: not a function of chaos.scenarios"
