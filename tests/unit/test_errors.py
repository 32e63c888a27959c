"""One exception tree: every exception the project defines derives from ElastictrainError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from elastictrain import errors

REPO = Path(__file__).resolve().parents[2]

NOT_ERRORS = {"elastictrain.engine.elastic_state.StopRequested"}
"""Control flow, not a failure: a worker told to stop leaves through it."""

PENDING: set[str] = set()
"""Classes on their way into the tree (none now)."""


def project_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in ("elastictrain", "discovery", "chaos", "bench"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, f"{package}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                    found[f"{info.name}.{name}"] = obj
    return found


def test_every_exception_the_project_defines_is_in_the_tree() -> None:
    found = project_exceptions()
    assert len(found) > 20, sorted(found)
    outside = sorted(n for n, c in found.items() if not issubclass(c, errors.ElastictrainError))
    assert outside == sorted((NOT_ERRORS | PENDING) & set(found))


def test_there_is_one_config_error_and_it_is_still_a_value_error() -> None:
    from discovery import discover
    from elastictrain import config, task

    assert discover.ConfigError is config.ConfigError is errors.ConfigError
    assert issubclass(task.TaskError, errors.ConfigError) and issubclass(errors.ConfigError, ValueError)
    with pytest.raises(errors.ConfigError, match="ELASTICTRAIN_JOB must name the job"):
        discover.DiscoverConfig.from_env({"ELASTICTRAIN_ETCD": "http://127.0.0.1:1", "ELASTICTRAIN_JOB": ".."})


def test_registry_errors_from_the_fast_path_and_the_client_share_a_branch() -> None:
    from discovery import discover, registry

    assert issubclass(discover.EtcdUnreachable, registry.RegistryUnavailable)
    assert registry.RegistryError is errors.RegistryError
    assert issubclass(registry.LeaseLost, errors.RegistryError)


def test_discover_sh_loads_the_tree_without_typing_or_structlog() -> None:
    code = "import sys, discovery.discover; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60, check=True
    ).stdout.split()
    assert "elastictrain.errors" in out
    heavy = [m for m in out if m.split(".")[0] in ("typing", "structlog", "torch") or m == "elastictrain.logconf"]
    assert not heavy
