"""The discovery executor of ``elastictrain.horovod.hvdrun``: Horovod's contract (stdout, a failure on a
non-zero exit), without a Python interpreter per call, and nothing left behind by a script that hangs."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from chaos.procs import wait_until
from elastictrain.horovod.hvdrun import run_discovery_script


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

    from elastictrain.horovod import hvdrun

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
    from elastictrain.horovod import hvdrun

    hvdrun.install()
    workers = _Workers()
    driver = _driver({"a": 1, "b": 1}, workers)
    try:
        assert sorted(workers.started) == [("a", 0), ("b", 0)]
        index = {slot: i for i, (slot, _) in enumerate(workers.exits)}
        workers.end(index[("b", 0)], 137)  # b's worker was SIGKILLed; b is discovered again
        wait_until(lambda: driver._worker_registry.record_failure.called, 10, what="b's exit handled")
        pending = driver._update_host_assignments(driver._host_manager.current_hosts)
        assert [(s.hostname, s.local_rank) for s in pending] == [("b", 0)], "b must be started again"
    finally:
        workers.end_all()
        driver.stop()


class _Workers:
    """A fake ``create_worker_fn``: each started process runs until the test ends it with an exit code."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.started: list[tuple[str, int]] = []
        self.exits: list[tuple[tuple[str, int], Any]] = []

    def __call__(self, slot_info: Any, events: Any) -> tuple[int, float]:
        import threading

        code: list[int] = []
        done = threading.Event()
        with self.lock:
            self.started.append((slot_info.hostname, slot_info.local_rank))
            self.exits.append(((slot_info.hostname, slot_info.local_rank), (code, done)))
        done.wait(30)
        return (code[0] if code else 0), time.time()

    def end(self, index: int, code: int) -> None:
        exit_code, done = self.exits[index][1]
        exit_code.append(code)
        done.set()

    def end_all(self) -> None:
        for i in range(len(self.exits)):
            self.exits[i][1][1].set()


def _driver(
    hosts: dict[str, int],
    workers: _Workers,
    cls: Any = None,
    rendezvous: Any = None,
    *,
    discovery: Any = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> Any:
    """Horovod's driver over ``hosts`` (``discovery``, else Horovod's ``FixedHosts``; min and max: every slot) with
    its first round's workers started (``workers``) and its registry mocked."""
    from unittest import mock

    from horovod.runner.elastic.discovery import FixedHosts
    from horovod.runner.elastic.driver import ElasticDriver

    n = sum(hosts.values())
    min_np, max_np = min_np or n, max_np or n
    rendezvous = rendezvous or mock.MagicMock()
    discovery = discovery or FixedHosts(hosts)
    driver = (cls or ElasticDriver)(rendezvous, discovery, min_num_proc=min_np, max_num_proc=max_np, timeout=10)
    driver.start(min_np, workers)
    wait_until(lambda: len(workers.started) == driver.world_size(), 10, what="every worker started")
    # Horovod's registry would block the exit threads in a barrier until every worker reports; not under test.
    driver._worker_registry = mock.MagicMock()
    return driver


def test_a_late_exit_of_an_older_process_does_not_mark_the_live_process_of_its_slot_dead() -> None:
    pytest.importorskip("horovod.runner.elastic.driver")
    from elastictrain.horovod import hvdrun

    hvdrun.install()
    workers = _Workers()
    driver = _driver({"a": 1, "b": 1}, workers)
    try:
        b = driver.get_slot_info("b", 0)
        driver._start_worker_process(b)  # b's slot got a new process while the old one was still shutting down
        wait_until(lambda: len(workers.started) == 3, 10, what="b's second process started")
        old_b = next(i for i, (slot, _) in enumerate(workers.exits) if slot == ("b", 0))
        workers.end(old_b, 137)  # the old process's exit arrives late
        wait_until(lambda: driver._worker_registry.record_failure.called, 10, what="the old exit handled")
        pending = driver._update_host_assignments(driver._host_manager.current_hosts)
        assert pending == [], "b's live process would get a twin"
    finally:
        workers.end_all()
        driver.stop()


def test_two_workers_that_exit_at_once_are_both_started_again() -> None:
    """A kill-host ends two workers at the same instant; their exits are handled in two threads at once."""
    pytest.importorskip("horovod.runner.elastic.driver")
    import threading

    from horovod.runner.elastic.driver import ElasticDriver

    from elastictrain.horovod import hvdrun

    hvdrun.install()
    barrier = threading.Barrier(2, timeout=2)
    built = threading.Event()

    class Driver(ElasticDriver):  # holds both exit threads at any state the patch creates after construction
        def __setattr__(self, name: str, value: Any) -> None:
            if built.is_set() and name.startswith("_elastictrain"):
                with contextlib.suppress(threading.BrokenBarrierError):
                    barrier.wait()
            super().__setattr__(name, value)

    workers = _Workers()
    driver = _driver({"a": 1, "b": 1, "c": 1}, workers, cls=Driver)
    built.set()
    try:
        index = {slot: i for i, (slot, _) in enumerate(workers.exits)}
        workers.end(index[("b", 0)], 137)
        workers.end(index[("c", 0)], 137)
        wait_until(lambda: driver._worker_registry.record_failure.call_count == 2, 10, what="both exits handled")
        pending = driver._update_host_assignments(driver._host_manager.current_hosts)
        assert sorted((s.hostname, s.local_rank) for s in pending) == [("b", 0), ("c", 0)]
    finally:
        workers.end_all()
        driver.stop()


def test_another_horovod_version_fails_with_one_line(monkeypatch, capsys) -> None:
    horovod = pytest.importorskip("horovod")
    from elastictrain.horovod import hvdrun

    monkeypatch.setattr(horovod, "__version__", "0.29.0")
    monkeypatch.setattr(sys, "argv", ["hvdrun", "--version"])
    with pytest.raises(SystemExit) as exited:
        hvdrun.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "0.28.1" in err and "0.29.0" in err


def test_loopback_hosts_run_locally_after_install_and_other_addresses_still_over_ssh() -> None:
    """Horovod's own check (gloo_run's and the driver's ``filter_local_addresses``) after the third repair."""
    pytest.importorskip("horovod.runner.util.network")
    from horovod.runner.util import network

    from elastictrain.horovod import hvdrun
    from elastictrain.launcher.hosts import local_addresses

    assert "127.0.0.7" not in local_addresses(), "what stock Horovod compares with: it would ssh to 127.0.0.7"
    hvdrun.install()
    assert network.filter_local_addresses(["127.0.0.7", "127.0.0.1", "localhost"]) == []
    assert "127.0.0.33" in network.get_local_host_addresses()
    assert "192.0.2.200" not in network.get_local_host_addresses()
    assert network.filter_local_addresses(["203.0.113.9"]) == ["203.0.113.9"]
    hvdrun.install()  # idempotent: not wrapped twice
    assert isinstance(network.get_local_host_addresses(), hvdrun.LocalAddresses)
    assert not isinstance(next(iter(network.get_local_host_addresses())), hvdrun.LocalAddresses)


def test_the_rendezvous_server_listens_with_a_backlog_that_a_large_world_does_not_overflow() -> None:
    """32 workers' Gloo stores poll the driver's HTTP store every 10 ms; a backlog of 5 dropped their SYNs."""
    pytest.importorskip("horovod.runner.http.http_server")
    import shutil
    import subprocess

    from horovod.runner.http.http_server import RendezvousServer

    from elastictrain.horovod import hvdrun

    hvdrun.install()
    server = RendezvousServer()
    port = server.start()
    try:
        if shutil.which("ss") is None:
            pytest.skip("needs ss to read the listen backlog")
        out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
        backlog = int(out.split()[2])  # State Recv-Q Send-Q ...: a listening socket's Send-Q is its backlog
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        assert backlog == min(hvdrun.RENDEZVOUS_BACKLOG, somaxconn) > 5
    finally:
        server.stop()


def _abort_marker(port: int) -> bytes | None:
    """What a worker's patched Gloo store reads at the abort path (``None``: not there, a 404)."""
    import urllib.error
    import urllib.request

    from elastictrain.horovod import hvdrun

    url = f"http://127.0.0.1:{port}/{hvdrun.ABORT_SCOPE}/{hvdrun.ABORT_KEY}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bytes(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


@contextlib.contextmanager
def _round_of_two() -> Any:
    """Horovod's own driver (with the repairs) and rendezvous server over hosts a and b, one slot each: yields
    ``(driver, workers, port)``; every worker ended and the driver stopped afterwards."""
    pytest.importorskip("horovod.runner.elastic.driver")
    from horovod.runner.http.http_server import RendezvousServer

    from elastictrain.horovod import hvdrun

    hvdrun.install()
    server = RendezvousServer()
    port = server.start()
    workers = _Workers()
    driver = _driver({"a": 1, "b": 1}, workers, rendezvous=server)
    try:
        yield driver, workers, port
    finally:
        workers.end_all()
        driver.stop()


def test_a_worker_of_the_round_that_dies_aborts_the_rendezvous_until_the_next_round_starts() -> None:
    """The survivors' Gloo stores would poll the marker's path."""
    with _round_of_two() as (driver, workers, port):
        assert _abort_marker(port) is None
        index = {slot: i for i, (slot, _) in enumerate(workers.exits)}
        workers.end(index[("b", 0)], 137)
        marker = wait_until(lambda: _abort_marker(port), 10, what="the abort marker")
        assert marker == b"b[0] exited with code 137"
        driver._update_host_assignments(driver._host_manager.current_hosts)  # the next round: a fresh store
        assert _abort_marker(port) is None


def test_exits_that_end_no_rendezvous_write_no_abort_marker() -> None:
    """A finished worker (exit 0), and the late exit of a slot's older process whose successor is in the round."""
    with _round_of_two() as (driver, workers, port):
        driver._start_worker_process(driver.get_slot_info("b", 0))
        wait_until(lambda: len(workers.started) == 3, 10, what="b's second process started")
        old_b = next(i for i, (slot, _) in enumerate(workers.exits) if slot == ("b", 0))
        workers.end(old_b, 137)
        a = next(i for i, (slot, _) in enumerate(workers.exits) if slot == ("a", 0))
        workers.end(a, 0)
        wait_until(lambda: driver._worker_registry.record_failure.called, 10, what="the old exit handled")
        wait_until(lambda: driver._worker_registry.record_success.called, 10, what="a's exit handled")
        assert _abort_marker(port) is None


def test_the_driver_writes_the_abort_marker_where_the_patched_gloo_store_looks() -> None:
    import importlib.util

    from elastictrain.horovod import hvdrun
    from tests.fixtures.procs import REPO

    spec = importlib.util.spec_from_file_location("patch_horovod", REPO / "elastictrain" / "horovod" / "patch.py")
    assert spec is not None and spec.loader is not None
    ph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ph)
    assert f"{hvdrun.ABORT_SCOPE}/{hvdrun.ABORT_KEY}" == ph.ABORT_PATH
    assert f'"{ph.ABORT_PATH}"' in ph.STORE_DEFINE_PATCHED


def test_two_host_changes_within_one_second_both_reach_the_workers(monkeypatch) -> None:
    """Horovod's driver stamped notices with whole seconds and its workers act only on a later stamp: a host removed
    and added again within one second left the second notice unread, and the job at the smaller size for good."""
    pytest.importorskip("horovod.runner.elastic.driver")
    from horovod.common.elastic import State
    from horovod.common.exceptions import HostsUpdatedInterrupt
    from horovod.runner.elastic import driver as driver_module
    from horovod.runner.elastic.worker import HostUpdateResult

    from elastictrain.horovod import hvdrun

    hvdrun.install()
    monkeypatch.setattr(time, "time", lambda: 1_796_000_000.25)  # both notices in one second
    state = State(bcast_object=lambda obj: obj, get_rank=lambda: 0)  # Horovod's own worker-side check
    for update in (HostUpdateResult.removed, HostUpdateResult.added):
        state.on_hosts_updated(driver_module._epoch_time_s(), update)  # the stamp the driver sends
        with pytest.raises(HostsUpdatedInterrupt):
            state.check_host_updates()


def test_notice_stamps_are_wall_clock_and_strictly_increasing_even_when_the_clock_steps_back() -> None:
    from elastictrain.horovod.hvdrun import NoticeClock

    times = iter([100.5, 100.5, 99.0, 200.25])
    clock = NoticeClock(lambda: next(times))
    stamps = [clock() for _ in range(4)]
    assert stamps[0] == 100.5 and stamps[3] == 200.25
    assert all(b > a for a, b in itertools.pairwise(stamps))


def test_untold_change_names_the_slots_the_hosts_allow_that_the_round_lacks_and_back() -> None:
    pytest.importorskip("horovod.runner.elastic.worker")
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.elastic.worker import HostUpdateResult

    from elastictrain.horovod.hvdrun import untold_change

    def round_of(*slots: tuple[str, int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for rank, (host, local_rank) in enumerate(slots):
            out.setdefault(host, []).append(SlotInfo(host, rank, local_rank, 0, len(slots), 1, 1))
        return out

    two, four = round_of(("a", 0), ("b", 0)), round_of(("a", 0), ("b", 0), ("c", 0), ("d", 0))
    assert untold_change(two, four) == HostUpdateResult.added
    assert untold_change(four, two) == HostUpdateResult.removed
    assert untold_change(two, round_of(("a", 0), ("c", 0))) == HostUpdateResult.added | HostUpdateResult.removed
    assert untold_change(two, round_of(("b", 0), ("a", 0))) == HostUpdateResult.no_update  # ranks only
    assert untold_change(four, four) == HostUpdateResult.no_update


class _Discovered:
    """Host discovery whose hosts the test sets; counts its calls (one per iteration of the driver's loop)."""

    def __init__(self, hosts: dict[str, int]) -> None:
        import threading

        self.lock = threading.Lock()
        self.hosts = dict(hosts)
        self.calls = 0

    def set(self, hosts: dict[str, int]) -> None:
        with self.lock:
            self.hosts = dict(hosts)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        with self.lock:
            self.calls += 1
            return dict(self.hosts)


class _Rank0:
    """Rank 0's side of Horovod's notices: its real ``WorkerNotificationService`` (registered with the driver as a
    worker registers it) feeding Horovod's own worker-side ``State``. ``hold`` keeps the service from answering (a
    stopped rank 0: it takes the connection and never replies)."""

    def __init__(self) -> None:
        import threading

        from horovod.common.elastic import State
        from horovod.runner.common.util import secret
        from horovod.runner.elastic.worker import WorkerNotificationService

        self.state = State(bcast_object=lambda obj: obj, get_rank=lambda: 0)
        self.told: list[tuple[float, int]] = []
        self.hold = threading.Event()
        self.held = threading.Event()
        """Set once a notice came while ``hold`` was set (the driver's send is then waiting for a reply)."""
        self.released = threading.Event()
        self.key = secret.make_secret_key()
        self.service = WorkerNotificationService(self.key, {"lo"}, self)

    def handle_hosts_updated(self, timestamp: float, update: int) -> None:
        if self.hold.is_set():
            self.held.set()
            self.released.wait(30)
            return
        self.state.on_hosts_updated(timestamp, update)  # in the State before the test can see it told
        self.told.append((timestamp, update))

    def register(self, driver: Any) -> None:
        rank0 = driver.get_coordinator_info()
        driver.register_worker_server(rank0.hostname, rank0.local_rank, self.service.addresses(), self.key)

    def close(self) -> None:
        self.released.set()
        self.service.shutdown()


@contextlib.contextmanager
def _notices(
    monkeypatch: Any, hosts: dict[str, int], min_np: int
) -> Iterator[tuple[Any, _Discovered, _Workers, _Rank0]]:
    """Horovod's driver with the repairs, a discovery pass every 20 ms over ``hosts`` (max 4 slots), fake workers
    (:func:`_driver`) and rank 0's real notification service."""
    pytest.importorskip("horovod.runner.elastic.driver")
    from horovod.runner.elastic import driver as driver_module

    from elastictrain.horovod import hvdrun

    hvdrun.install()
    monkeypatch.setattr(driver_module, "DISCOVER_HOSTS_FREQUENCY_SECS", 0.02)
    discovered, workers = _Discovered(hosts), _Workers()
    driver = _driver(hosts, workers, discovery=discovered, min_np=min_np, max_np=4)
    rank0 = _Rank0()
    try:
        rank0.register(driver)
        yield driver, discovered, workers, rank0
    finally:
        rank0.close()
        workers.end_all()
        driver.stop()


def test_an_added_host_whose_notice_the_survivors_reset_dropped_is_told_again_until_the_round_has_it(
    monkeypatch,
) -> None:
    """Horovod's driver told rank 0 of an added host once, and the worker's ``State.on_reset`` empties the queue of
    notices: a notice that arrived while the survivors' reset was still running (the CI run: rank 0 and another
    worker killed, their hosts back after the cooldown while the survivors' ring formed) was lost, and the job stayed
    at 2 workers for good. Horovod's own driver, notification service and client, and worker-side ``State``."""
    from horovod.common.exceptions import HostsUpdatedInterrupt

    with _notices(monkeypatch, {"a": 1, "b": 1}, 2) as (driver, hosts, _, rank0):
        hosts.set({"a": 1, "b": 1, "c": 1, "d": 1})  # c and d back while the survivors' reset runs
        wait_until(lambda: rank0.told, 10, what="the first notice")
        rank0.state.on_reset()  # the survivors' reset ends: Horovod drops what it was told
        rank0.state.check_host_updates()  # nothing left to act on (this is how the job stayed at 2)

        first = len(rank0.told)
        wait_until(lambda: len(rank0.told) > first, 10, what="the added hosts told again")
        assert rank0.told[-1][1] == 2 and rank0.told[-1][0] > rank0.told[0][0]  # HostUpdateResult.added, newer
        with pytest.raises(HostsUpdatedInterrupt):
            rank0.state.check_host_updates()

        driver._update_host_assignments(driver._host_manager.current_hosts)  # the round that has c and d
        settled, calls = len(rank0.told), hosts.calls
        wait_until(lambda: hosts.calls >= calls + 5, 10, what="five more discovery rounds")
        assert len(rank0.told) == settled, "told again after the round had the hosts"


def test_a_removal_alone_is_not_told_again_and_a_rank0_whose_process_exited_is_told_nothing(monkeypatch) -> None:
    with _notices(monkeypatch, {"a": 1, "b": 1}, 1) as (driver, hosts, workers, rank0):
        name = driver.get_coordinator_info().hostname

        hosts.set({name: 1})  # the other host is gone: told once (Horovod's notice), never again
        wait_until(lambda: rank0.told, 10, what="the removal's notice")
        calls = hosts.calls
        wait_until(lambda: hosts.calls >= calls + 5, 10, what="five more discovery rounds")
        assert [update for _, update in rank0.told] == [1]  # HostUpdateResult.removed, once

        hosts.set({name: 1, "x": 1})  # x added, and told again while the round lacks it ...
        wait_until(lambda: len(rank0.told) >= 3, 10, what="x told, then told again")
        index = {slot: i for i, (slot, _) in enumerate(workers.exits)}
        workers.end(index[(name, 0)], 137)  # ... until rank 0's process exits
        wait_until(lambda: (name, 0) in driver._elastictrain_slots.dead(), 10, what="rank 0's exit recorded")
        told, calls = len(rank0.told), hosts.calls
        wait_until(lambda: hosts.calls >= calls + 5, 10, what="five more discovery rounds")
        assert len(rank0.told) == told, "a rank 0 whose process exited was told again"


def test_a_stopped_rank0_holds_neither_the_discovery_loop_nor_a_worker_exit(monkeypatch) -> None:
    """Horovod's notice client waits for rank 0's reply without limit, and the driver holds its locks meanwhile: a
    SIGSTOPped rank 0 (it takes the connection, never replies) held discovery for as long as it stayed stopped."""
    from elastictrain.horovod import hvdrun

    monkeypatch.setattr(hvdrun, "NOTICE_TIMEOUT_SECONDS", 0.2, raising=False)
    monkeypatch.setattr(hvdrun, "NOTICE_BACKOFF_SECONDS", 0.5, raising=False)
    with _notices(monkeypatch, {"a": 1, "b": 1}, 1) as (driver, hosts, workers, rank0):
        name = driver.get_coordinator_info().hostname
        other = "b" if name == "a" else "a"
        rank0.hold.set()  # stopped
        hosts.set({"a": 1, "b": 1, "c": 1})
        calls = hosts.calls
        wait_until(lambda: hosts.calls >= calls + 10, 10, what="discovery going on while rank 0 is stopped")
        index = {slot: i for i, (slot, _) in enumerate(workers.exits)}
        workers.end(index[(other, 0)], 137)
        wait_until(lambda: (other, 0) in driver._elastictrain_slots.dead(), 10, what="a worker's exit recorded")
        assert rank0.told == []
        rank0.hold.clear()  # rank 0 answers again: c is told after the back-off
        wait_until(lambda: rank0.told, 10, what="c told once rank 0 answers")
        assert rank0.told[-1][1] & 2


def test_a_notice_waiting_on_a_stopped_rank0_holds_neither_the_round_lock_nor_the_hosts_condition(monkeypatch) -> None:
    """The driver sent every notice under the round lock (a worker's exit takes it before its abort marker, a round
    takes it to start) and under the hosts condition (a round waits on it for slots): each try on a stopped rank 0
    held both for the notice's timeout. The send is now the only thing that waits for rank 0."""
    from elastictrain.horovod import hvdrun

    monkeypatch.setattr(hvdrun, "NOTICE_TIMEOUT_SECONDS", 30.0, raising=False)
    with _notices(monkeypatch, {"a": 1, "b": 1}, 1) as (driver, hosts, workers, rank0):
        name = driver.get_coordinator_info().hostname
        other = "b" if name == "a" else "a"
        rank0.hold.set()  # stopped: it takes the connection and never replies
        hosts.set({"a": 1, "b": 1, "c": 1})
        assert rank0.held.wait(10), "no notice sent"
        free = []
        for lock in (driver._elastictrain_round, driver._wait_hosts_cond):
            free.append(lock.acquire(timeout=2))
            if free[-1]:
                lock.release()
        assert free == [True, True], "the round lock, the hosts condition: held while rank 0 does not reply"
        calls = hosts.calls
        wait_until(lambda: hosts.calls >= calls + 5, 10, what="discovery going on while the notice waits")
        index = {slot: i for i, (slot, _) in enumerate(workers.exits)}
        workers.end(index[(other, 0)], 137)
        wait_until(lambda: (other, 0) in driver._elastictrain_slots.dead(), 10, what="a worker's exit recorded")
        assert rank0.told == []


def test_an_outbox_whose_thread_could_not_start_sends_the_next_notice(monkeypatch: Any) -> None:
    """``Thread.start`` can fail ("can't start new thread"); the outbox must not believe a sender runs from then on."""
    import threading

    from elastictrain.horovod.hvdrun import Notice, Outbox

    sent: list[Notice] = []
    done = threading.Event()
    outbox = Outbox(lambda n: (sent.append(n), done.set()))
    real_start = threading.Thread.start

    def fail_once(self: threading.Thread) -> None:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", fail_once)
    first = Notice(round=1, slot=("a", 0), client=None, update=1)
    second = Notice(round=2, slot=("a", 0), client=None, update=1)
    with contextlib.suppress(RuntimeError):
        outbox.post(first)
    outbox.post(second)
    assert done.wait(10), "the outbox never sent again"
    assert sent[-1] == second
