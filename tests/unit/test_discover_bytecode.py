"""discover.sh keeps the bytecode of its modules, so that a call once a second does not compile them again.

Each test runs discover.sh without an etcd endpoint (it exits 2 at once, no network) under
``PYTHONDONTWRITEBYTECODE=1``, as our image sets it, with the user's cache in tmp_path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DISCOVER_SH = Path(__file__).resolve().parents[2] / "discovery" / "discover.sh"


def run_without_etcd(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ELASTICTRAIN_PYTHON": sys.executable}
    return subprocess.run(
        [str(DISCOVER_SH)], env={**base, **env}, capture_output=True, text=True, timeout=60, check=False
    )


def compiled(root: Path, module: str) -> list[Path]:
    return sorted(root.rglob(f"{module}.cpython-*.pyc"))


def test_bytecode_goes_to_the_users_cache_even_when_the_environment_forbids_writing_it(tmp_path: Path) -> None:
    cache = tmp_path / "xdg"
    proc = run_without_etcd({"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(cache), "HOME": str(tmp_path)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("discover: error: ELASTICTRAIN_ETCD is not set")
    pycache = cache / "elastictrain" / "pycache"
    for module in ("discover", "wire", "endpoints", "fileio"):
        assert compiled(pycache, module), f"no bytecode of discovery/{module}.py under {pycache}"


def test_without_xdg_cache_home_the_cache_is_under_home_and_a_prefix_set_by_the_user_wins(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run_without_etcd({"PYTHONDONTWRITEBYTECODE": "1", "HOME": str(home)})
    assert compiled(home / ".cache" / "elastictrain" / "pycache", "discover")

    prefix = tmp_path / "mine"
    run_without_etcd({"PYTHONDONTWRITEBYTECODE": "1", "HOME": str(home), "PYTHONPYCACHEPREFIX": str(prefix)})
    assert compiled(prefix, "discover")


def test_an_unwritable_cache_costs_only_the_compilation(tmp_path: Path) -> None:
    proc = run_without_etcd({"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": "/proc/no-such-place"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1  # the one error line, no traceback about the cache
