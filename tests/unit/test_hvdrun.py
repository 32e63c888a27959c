"""The discovery executor of ``elastictrain.hvdrun``: Horovod's contract (stdout, a failure on a non-zero exit),
without a Python interpreter per call, and nothing left behind by a script that hangs."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from elastictrain.hvdrun import run_discovery_script


def test_stdout_is_returned_and_stderr_is_not_mixed_in(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'b:1'\necho 'a:2'\necho 'noise' >&2\n")
    script.chmod(0o755)
    assert run_discovery_script(str(script)) == "b:1\na:2\n"


def test_a_non_zero_exit_fails_like_horovods_executor(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"Failed to execute discovery script: .*Exit code: 3"):
        run_discovery_script("exit 3")


def test_a_hanging_script_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    # The script starts a grandchild that would outlive a kill of the shell alone.
    script = f"sleep 300 & echo $! > {pid_file}; wait"
    with pytest.raises(RuntimeError, match=r"Timed out after 0\.5s"):
        run_discovery_script(script, timeout=0.5)
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_horovods_discovery_class_uses_it_after_install(tmp_path: Path) -> None:
    pytest.importorskip("horovod.runner.elastic.discovery")
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    from elastictrain import hvdrun

    script = tmp_path / "discover.sh"
    # Records its parent (the ``sh -c`` around it, or this process) and that one's parent.
    script.write_text(
        "#!/bin/sh\n"
        f"echo \"$PPID $(awk '/^PPid/{{print $2}}' /proc/$PPID/status)\" > {tmp_path / 'ppid'}\n"
        "echo 'h1:2'\necho 'h2:1'\n"
    )
    script.chmod(0o755)
    original = HostDiscoveryScript._execute_discovery_script
    try:
        hvdrun.install()
        assert HostDiscoveryScript(str(script), 1).find_available_hosts_and_slots() == {"h1": 2, "h2": 1}
        # The shell's parent is this process: no middleman interpreter in between (Horovod spawns one).
        assert os.getpid() in [int(p) for p in (tmp_path / "ppid").read_text().split()]
    finally:
        HostDiscoveryScript._execute_discovery_script = original
