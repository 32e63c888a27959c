"""Chaos scenarios end to end: a real ``elastictrain launch`` job under faults, then every invariant.

Each scenario runs the small job of :func:`chaos.scenarios.base_config` (about 40 s on 2 cores) while
the fault is injected, and must pass the whole invariant table: completed, every sample exactly once
per epoch, final loss within tolerance of the fault-free run (run once per session, cached), latest
checkpoint verified, one MLflow run, no process left, a recovery after each fault.

The short ones (``ci``) run in ``make test``; the rest only with ``ELASTICTRAIN_CHAOS_LONG=1``
(``make chaos``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos import netns
from chaos.scenarios import SCENARIOS, run_scenario
from tests.fixtures.procs import VENV_BIN

LONG = os.environ.get("ELASTICTRAIN_CHAOS_LONG") == "1"
needs_horovod = pytest.mark.skipif(not (VENV_BIN / "horovodrun").exists(), reason="horovodrun is not installed")
pytestmark = [pytest.mark.chaos, pytest.mark.integration, needs_horovod]


@pytest.fixture(scope="session")
def chaos_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One parent for every scenario of the session, so the fault-free reference runs once."""
    yield tmp_path_factory.mktemp("chaos")


def run_and_check(name: str, root: Path) -> None:
    result = run_scenario(name, root / name, out=print)
    print(result.table)
    assert result.ok, result.table
    assert result.audit is not None and (result.audit.lost, result.audit.duplicated) == (0, 0)
    assert result.unloadable == 0


def scenario_params(ci: bool) -> list[str]:
    return [s.name for s in SCENARIOS.values() if s.ci == ci and s.name != "soak"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", scenario_params(ci=True))
def test_short_scenario_keeps_every_invariant(name: str, chaos_root: Path) -> None:
    run_and_check(name, chaos_root)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not LONG, reason="long chaos scenario: run with `make chaos` (ELASTICTRAIN_CHAOS_LONG=1)")
@pytest.mark.parametrize("name", scenario_params(ci=False))
def test_long_scenario_keeps_every_invariant(name: str, chaos_root: Path) -> None:
    run_and_check(name, chaos_root)


def test_multi_node_tier_with_namespaces_sshd_and_partitions() -> None:
    reason = netns.preflight()
    if reason is not None:
        pytest.skip(reason)
