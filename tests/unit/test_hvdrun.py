"""The discovery executor of ``elastictrain.hvdrun``: Horovod's contract (stdout, a failure on a non-zero exit),
without a Python interpreter per call, and nothing left behind by a script that hangs."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from elastictrain.bench.procs import wait_until
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

    def gone() -> bool:
        try:
            return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, 10, what=f"the script's child {child} to die")  # SIGKILL is delivered asynchronously


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


def test_a_slot_whose_worker_died_is_started_again_when_its_host_is_assigned_again() -> None:
    """Horovod's own driver, fixed hosts, fake rendezvous: the repair is what makes the dead slot pending."""
    pytest.importorskip("horovod.runner.elastic.driver")
    import threading
    import time
    from unittest import mock

    from horovod.runner.elastic.discovery import FixedHosts
    from horovod.runner.elastic.driver import ElasticDriver

    from elastictrain import hvdrun

    hvdrun.install()
    release = threading.Event()
    started: list[tuple[str, int]] = []

    def create_worker(slot_info, events):  # a worker that runs until the test ends
        started.append((slot_info.hostname, slot_info.local_rank))
        release.wait(30)
        return 0, time.time()

    driver = ElasticDriver(mock.MagicMock(), FixedHosts({"a": 1, "b": 1}), min_num_proc=2, max_num_proc=2, timeout=10)
    try:
        driver.start(2, create_worker)
        wait_until(lambda: len(started) == 2, 10, what="both workers started")  # each starts in its own thread
        assert sorted(started) == [("a", 0), ("b", 0)]
        # Horovod's registry would block this thread in a barrier until every worker reports; not under test.
        driver._worker_registry = mock.MagicMock()
        b = driver.get_slot_info("b", 0)
        driver._handle_worker_exit(b, 137, time.time())  # b's worker was SIGKILLed; b is discovered again
        pending = driver._update_host_assignments(driver._host_manager.current_hosts)
        assert [(s.hostname, s.local_rank) for s in pending] == [("b", 0)], "b must be started again"
    finally:
        release.set()
        driver.stop()
