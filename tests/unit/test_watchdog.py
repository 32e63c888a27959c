"""The collective watchdog's decision, with chosen times, and the socket abort on a real connection."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time

import pytest
import torch
import torch.utils.data
from horovod.runner.elastic.worker import HostUpdateResult
from structlog.testing import capture_logs

from elastictrain.engine.health.signals import FailureMarker, FileSignals
from elastictrain.engine.health.watchdog import (
    CollectiveWatchdog,
    WatchdogPolicy,
    abort_connections,
    removal_pending,
    ring_connections,
    should_abort,
)

P = WatchdogPolicy()


def decide(now, started, typical=0.1, failure=None, removed=False, peer_closed=lambda: False, progress=None, gone=None):
    return should_abort(
        now=now,
        step_started=started,
        typical_step=typical,
        failure_ts=failure,
        policy=P,
        host_removed=removed,
        peer_closed=peer_closed,
        peer_gone=lambda: gone,
        progress_since=progress,
    )


def test_a_member_known_gone_aborts_an_overdue_step_with_no_failure_recorded():
    why = "host b rank 1 (pid 11) on this machine is gone"
    assert decide(100.3, 100.0, gone=why) is None, "a young step"
    reason = decide(103.0, 100.0, gone=why)
    assert reason is not None and reason.startswith(why)
    assert decide(103.0, 100.0) is None
    syncing = should_abort(
        now=103.0, step_started=100.0, typical_step=0.1, failure_ts=None, policy=P, peer_gone=lambda: why, syncing=True
    )
    assert syncing is None, "the sync's ring is not known yet: the last ring's dead member caused this very reset"


def test_no_abort_between_steps_or_for_a_healthy_step():
    assert decide(100.0, None, failure=99.0) is None
    assert decide(100.0, 99.9, failure=99.95) is None  # a failure, but the step is young
    assert decide(100.0, 90.0) is None  # a slow step with no failure and no notice is left alone


def test_abort_when_a_peer_failed_during_this_step_and_it_is_stuck():
    reason = decide(100.0, 99.0, failure=99.2)
    assert reason is not None and "peer failed" in reason


def test_a_failure_before_this_step_started_is_history():
    assert decide(100.0, 95.0, failure=94.0) is None


def test_slow_steps_raise_the_threshold():
    assert decide(100.0, 98.0, typical=1.0, failure=98.5) is None  # 2 s < 3 x 1 s
    assert decide(100.0, 96.0, typical=1.0, failure=98.5) is not None


def _notices(*updates: int) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for i, u in enumerate(updates):
        q.put((1000.0 + i, HostUpdateResult(u)))
    return q


def test_only_a_notice_of_a_removed_host_is_failure_evidence():
    assert not removal_pending(_notices())
    assert not removal_pending(_notices(HostUpdateResult.added, HostUpdateResult.added))  # scale-ups
    assert removal_pending(_notices(HostUpdateResult.added, HostUpdateResult.removed))
    assert removal_pending(_notices(HostUpdateResult.mixed))
    q = _notices(HostUpdateResult.removed)
    assert removal_pending(q) and q.qsize() == 1  # read, not consumed: the training loop acts on it


def test_a_removal_notice_aborts_only_a_much_longer_stall():
    assert decide(100.0, 99.0, removed=True) is None
    assert decide(100.0, 97.5, removed=True) is not None


def test_a_scale_up_notice_pending_through_a_long_step_does_not_abort_the_ring(tmp_path):
    """Rank 0's scale-up notice stays pending until the next commit; a long step meanwhile must not abort."""
    server, client, peer = _pair()
    notices = _notices(HostUpdateResult.added)
    try:
        dog = CollectiveWatchdog(
            FileSignals.in_folder(tmp_path),
            host_removed=lambda: removal_pending(notices),
            excluded_ports=lambda: (set(), set()),
        )
        dog.snapshot_ring()
        dog._step_started = time.time() - 120.0  # a 2-minute step after a scale-up notice
        dog._check()
        assert dog.aborts == 0 and _works(client, peer)
    finally:
        for s in (client, peer, server):
            s.close()


def test_epoch_end_validation_is_not_a_step_but_its_collectives_are(tmp_path):
    """Minutes of local validation must not look like a stuck step; the allgather and commit after it must."""
    import dataclasses

    from elastictrain.engine.collective import LocalCollective
    from elastictrain.engine.trainer import Trainer
    from tests.fixtures.engine import small_job

    dog = CollectiveWatchdog(
        FileSignals.in_folder(tmp_path), host_removed=lambda: False, excluded_ports=lambda: (set(), set())
    )
    seen: dict[str, list] = {"eval": [], "allgather": [], "commit": []}

    class Val(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int):
            seen["eval"].append(dog._step_started)
            return torch.zeros(4), 0

    class Recording(LocalCollective):
        def allgather_object(self, obj, name):
            seen["allgather"].append(dog._step_started)
            return super().allgather_object(obj, name)

        def allgather(self, tensor, name):  # the commit's host-update check
            seen["commit"].append(dog._step_started)
            return super().allgather(tensor, name)

    trainer = Trainer.build(small_job(tmp_path / "run", checkpoint={"enabled": False}), Recording())
    trainer.watchdog = dog
    trainer.parts.task = dataclasses.replace(trainer.parts.task, val_data=Val())
    trainer._end_epoch(trainer.state)
    assert seen["eval"] == [None, None, None], "local validation counted as a step"
    assert seen["allgather"][0] is not None and seen["commit"][0] is not None
    assert dog._step_started is None  # idle again afterwards


def test_failure_marker_round_trip(tmp_path):
    m = FailureMarker(tmp_path / ".elastic" / "collective-failure")
    assert m.last() is None
    m.record("hostA")
    assert m.last() is not None


def test_abort_connections_ends_a_blocked_receive_and_spares_excluded_ports():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    peer, _ = server.accept()
    spared_srv = socket.create_server(("127.0.0.1", 0))
    spared_port = spared_srv.getsockname()[1]
    spared = socket.create_connection(("127.0.0.1", spared_port))
    spared_peer, _ = spared_srv.accept()
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(client.recv(10)))
    t.start()
    n = abort_connections(ring_connections(exclude_local_ports={spared_port}, exclude_remote_ports={spared_port}))
    t.join(timeout=5)
    assert not t.is_alive() and got == [b""]  # the blocked receive returned: connection ended
    assert n >= 1
    spared.sendall(b"x")
    assert spared_peer.recv(1) == b"x"  # the excluded connection still works
    for s in (client, peer, server, spared, spared_peer, spared_srv):
        s.close()


def test_a_ring_connection_closed_by_its_peer_is_failure_evidence_once_the_step_is_overdue():
    asked = []

    def peer_closed():
        asked.append(1)
        return True

    assert decide(100.0, 99.9, peer_closed=peer_closed) is None
    assert asked == []  # not even asked while the step is young (it lists sockets)
    reason = decide(100.0, 99.0, peer_closed=peer_closed)
    assert reason is not None and "closed its connection" in reason


def test_a_failure_after_this_workers_last_progress_counts_even_if_its_step_started_later():
    # The peer failed at 99.2 while this worker was still computing; it finished its last step at 99.0 and
    # entered the broken collective at 99.5: that failure is news to this step.
    assert decide(100.5, 99.5, failure=99.2, progress=99.0) is not None
    assert decide(100.5, 99.5, failure=98.0, progress=99.0) is None  # before the last completed step
    assert decide(99.7, 99.5, failure=99.2, progress=99.0) is None  # still a young step


@pytest.mark.parametrize("reset", [False, True], ids=["closed: CLOSE_WAIT", "reset: gone"])
def test_closed_by_peer_sees_a_snapshotted_ring_connection_that_its_peer_closed_or_reset(reset: bool):
    import struct
    import time

    from elastictrain.engine.health.watchdog import closed_by_peer

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    peer, _ = server.accept()
    ring = {pair: r for pair, r in ring_connections(set(), set()).items() if pair[1][1] == server.getsockname()[1]}
    assert ring and not closed_by_peer(ring)
    if reset:  # a dead process's socket answers a send with a reset: ours is then no longer listed at all
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()  # otherwise ours moves to CLOSE_WAIT
    deadline = time.monotonic() + 5
    while not closed_by_peer(ring) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed_by_peer(ring)
    for s in (client, server):
        s.close()


def test_a_long_step_with_a_known_failure_but_no_abort_is_logged_once_with_the_decisions_inputs(tmp_path):
    signals = FileSignals.in_folder(tmp_path)
    dog = CollectiveWatchdog(signals, host_removed=lambda: False, excluded_ports=lambda: (set(), set()))
    dog._typical = 4.0  # slow steps: a failure aborts only after 3 x 4 s
    with capture_logs() as logs:
        dog._step_started = time.time() - 6.0
        dog._check()  # a long step (a validation, say) with no failure known: nothing to explain
        signals.record_failure("peer")
        dog._step_started = started = time.time() - 6.0
        dog._check()
        dog._check()  # the same step: not again
    assert [e["event"] for e in logs] == ["step overdue without an abort"]
    entry = logs[0]
    assert entry["waited_seconds"] >= 6.0 and entry["typical_step_seconds"] == 4.0
    assert 0 <= entry["failure_seconds_ago"] < 6.0 and entry["host_removed"] is False and entry["ring_connections"] == 0
    assert dog.aborts == 0 and dog._step_started == started


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    """(server, client, accepted peer) on loopback."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    peer, _ = server.accept()
    return server, client, peer


def _failed_overdue_step(dog: CollectiveWatchdog, signals: FileSignals) -> None:
    dog._step_started = time.time() - 10.0
    signals.record_failure("peer")


def _works(a: socket.socket, b: socket.socket) -> bool:
    a.sendall(b"x")
    b.sendall(b"y")
    return b.recv(1) == b"x" and a.recv(1) == b"y"


def test_an_empty_ring_snapshot_aborts_nothing(tmp_path):
    signals = FileSignals.in_folder(tmp_path)
    dog = CollectiveWatchdog(signals, host_removed=lambda: False, excluded_ports=lambda: (set(), set()))
    dog.snapshot_ring()  # no connection yet: this ring is empty
    server, client, peer = _pair()  # a connection that is no part of the ring (tracking, etcd, ...)
    try:
        _failed_overdue_step(dog, signals)
        dog._check()
        assert _works(client, peer), "a connection outside the (empty) ring was shut down"
    finally:
        for s in (client, peer, server):
            s.close()


def test_a_descriptor_number_reused_after_the_listing_is_not_shut_down(tmp_path, monkeypatch):
    """Gloo closed a ring socket and its number went to another connection between the listing of this
    process's sockets and the shutdown: the other connection must survive."""
    import psutil

    signals = FileSignals.in_folder(tmp_path)
    dog = CollectiveWatchdog(signals, host_removed=lambda: False, excluded_ports=lambda: (set(), set()))
    server_a, client_a, peer_a = _pair()
    dog.snapshot_ring()
    stale = [c for c in psutil.Process().net_connections(kind="tcp") if c.fd == client_a.fileno()]
    number = client_a.fileno()
    server_b, client_b, peer_b = _pair()
    client_a.close()
    peer_a.close()
    raw = client_b.detach()
    os.dup2(raw, number)  # the new connection now holds the old number
    os.close(raw)
    client_b = socket.socket(fileno=number)
    monkeypatch.setattr(psutil.Process, "net_connections", lambda self, kind="inet": stale)
    try:
        _failed_overdue_step(dog, signals)
        dog._check()
        assert _works(client_b, peer_b), "a connection that merely took a ring socket's number was shut down"
    finally:
        for s in (client_b, peer_b, server_a, server_b):
            s.close()


def test_connections_this_process_closed_itself_are_not_evidence_of_a_dead_peer(tmp_path):
    from elastictrain.engine.health.watchdog import closed_by_peer

    signals = FileSignals.in_folder(tmp_path)
    dog = CollectiveWatchdog(signals, host_removed=lambda: False, excluded_ports=lambda: (set(), set()))
    server, client, peer = _pair()
    dog.snapshot_ring()
    client.close()  # both ends are this process's: no peer process closed anything
    peer.close()
    server.close()
    assert not closed_by_peer(dog._ring)
    dog._step_started = time.time() - 10.0  # overdue, with no failure and no notice
    dog._check()
    assert dog.aborts == 0


class _ProbeDataset(torch.utils.data.Dataset):
    """Each sample reports, from inside the loader worker, its inherited TCP sockets and its parent-death signal."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        import ctypes

        inet = 0
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(int(name)))
                inet += s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                s.close()
        sig = ctypes.c_int(0)
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        return torch.tensor([float(inet)]), sig.value, i


def test_loader_workers_hold_no_tcp_socket_of_the_trainer_and_die_with_it():
    """A SIGKILLed trainer's forked loader workers would keep its Gloo sockets open: its peers would see no
    close until the workers noticed (seconds later)."""
    import signal

    from elastictrain.engine.data import load_batches

    server, client, peer = _pair()
    try:
        x, sig, ids = next(load_batches(_ProbeDataset(), iter([[0, 1]]), loader_workers=1))
        assert ids.tolist() == [0, 1]
        assert x.flatten().tolist() == [0.0, 0.0], "a loader worker holds TCP sockets of the trainer"
        assert sig.tolist() == [signal.SIGKILL] * 2
    finally:
        for s in (client, peer, server):
            s.close()


def test_a_worker_whose_collective_failed_shuts_its_ring_so_peers_blocked_on_it_fail_now(tmp_path):
    """Horovod keeps a failed worker's sockets open until the next rendezvous; a peer blocked in a receive from
    it would wait for the Gloo timeout. Connections of a newer ring (taken after it) are not touched."""
    dog = CollectiveWatchdog(
        FileSignals.in_folder(tmp_path), host_removed=lambda: False, excluded_ports=lambda: (set(), set())
    )
    server, ours, blocked_peer = _pair()
    dog.snapshot_ring()
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(blocked_peer.recv(10)))
    t.start()
    later = _pair()  # e.g. the next ring's connection, made after the snapshot
    try:
        assert dog.ring_failed() >= 1
        t.join(timeout=5)
        assert not t.is_alive() and got == [b""], "the peer's receive did not end"
        assert dog._step_started is None and dog._ring == {}
        assert _works(later[1], later[2])
        assert dog.ring_failed() == 0  # once per ring
    finally:
        for s in (ours, blocked_peer, server, *later):
            s.close()


def test_in_the_state_sync_a_known_failure_aborts_but_a_removal_notice_alone_does_not():
    """The sync after a rendezvous is guarded like a step, except that a drain's notice never aborts it (a sync has
    no typical length; the drained worker still completes it)."""
    sync = dict(typical=0.1, progress=100.0)
    assert should_abort(
        now=101.0, step_started=100.0, typical_step=0.1, failure_ts=100.2, policy=P, syncing=True, progress_since=100.0
    )
    assert should_abort(
        now=101.0,
        step_started=100.0,
        typical_step=0.1,
        failure_ts=None,
        policy=P,
        syncing=True,
        peer_closed=lambda: True,
    )
    assert decide(130.0, 100.0, removed=True, **sync) is not None  # in a step
    assert (
        should_abort(
            now=130.0, step_started=100.0, typical_step=0.1, failure_ts=None, policy=P, host_removed=True, syncing=True
        )
        is None
    )


class _SyncingState:
    """A Horovod ``State`` stand-in whose sync runs the given function (the watchdog arms on it as on a real one)."""

    def __init__(self, sync) -> None:
        self._host_messages: queue.Queue = queue.Queue()
        self._sync = sync

    def sync(self) -> None:
        self._sync()


def test_a_worker_whose_state_sync_fails_shuts_the_new_rings_connections_so_peers_blocked_on_it_fail_now(tmp_path):
    """A peer dies in the sync after a rendezvous; the survivor whose broadcast failed must shut the connections of
    the ring formed by that rendezvous, or a peer blocked in a receive from it waits out the Gloo timeout."""
    from elastictrain.engine.watch import arm_watchdog

    server, ours, blocked_peer = _pair()  # a connection of the ring just formed (hvd.init connects every pair)

    def sync() -> None:
        raise RuntimeError("Connection reset by peer")  # the sync's broadcast fails here

    state = _SyncingState(sync)
    dog = arm_watchdog(state, FileSignals.in_folder(tmp_path), host=lambda: "me")
    try:
        with pytest.raises(RuntimeError):
            state.sync()
        blocked_peer.settimeout(5)
        state.on_failure()  # what restore() does first
        assert blocked_peer.recv(10) == b"", "the peer's receive did not end"
        assert dog._step_started is None
    finally:
        dog.stop()
        for s in (ours, blocked_peer, server):
            s.close()


def test_a_worker_blocked_in_the_state_sync_aborts_when_a_peer_records_a_failure(tmp_path):
    """The survivor waits in the sync's broadcast on a live peer that failed (and keeps its sockets open): the
    watchdog aborts the sync as it would a stuck step, well before any Gloo timeout."""
    from elastictrain.engine.watch import arm_watchdog

    server, ours, live_peer = _pair()
    signals = FileSignals.in_folder(tmp_path)
    got: list[bytes] = []

    def sync() -> None:
        ours.settimeout(10)
        signals.record_failure("peer")  # the peer's own broadcast failed
        got.append(ours.recv(10))  # blocked on that peer, which sends nothing more

    state = _SyncingState(sync)
    dog = arm_watchdog(state, signals, host=lambda: "me")
    try:
        t0 = time.monotonic()
        state.sync()
        assert got == [b""] and time.monotonic() - t0 < 5, "the blocked sync was not aborted"
        deadline = time.monotonic() + 2
        while dog.aborts == 0 and time.monotonic() < deadline:  # counted just after the shutdown that woke us
            time.sleep(0.01)
        assert dog.aborts == 1 and dog._step_started is None
    finally:
        dog.stop()
        for s in (ours, live_peer, server):
            s.close()


def test_a_ring_member_gone_from_this_machine_aborts_an_overdue_step_that_no_failure_marks(tmp_path):
    """Two survivors each waiting on the other while Gloo tells neither that the ring's other members died: the
    watchdog of either sees the dead member's pid gone and shuts the ring's connections down."""
    import psutil

    from elastictrain.engine.health.hang import HangDetector, boot_id
    from elastictrain.engine.health.signals import Beat, Member
    from tests.fixtures.procs import dead_pid

    signals = FileSignals.in_folder(tmp_path)
    heartbeats = signals.heartbeats
    hang = HangDetector(signals, host=lambda: "a", slot=lambda: 0)
    gone = dead_pid()
    me = psutil.Process()
    hang.set_ring(0, [Member(0, "a", 0, me.pid), Member(1, "b", 0, gone)])
    heartbeats.write(Beat(gone, "b", 0, boot_id(), me.create_time(), time.time(), "waiting", time.time(), 3))
    server, client, peer = _pair()
    mine = {client.getsockname()[1], peer.getsockname()[1]}
    others = lambda: ({p for p in range(65536) if p not in mine}, set())  # noqa: E731  only this test's pair
    dog = CollectiveWatchdog(signals, host_removed=lambda: False, excluded_ports=others, hang=hang)
    try:
        dog.snapshot_ring()
        assert len(dog._ring) == 2, "both ends of the pair are this process's"
        dog._step_started = time.time() - 10.0  # overdue; nothing recorded a failure
        with capture_logs() as logs:
            dog._check()
        assert dog.aborts == 1
        [abort] = [e for e in logs if e["event"] == "aborting blocked collectives"]
        assert abort["reason"].startswith(f"host b rank 1 (pid {gone}) on this machine is gone")
        assert peer.recv(1) == b"", "the ring's connection was shut down"
    finally:
        for s in (server, client, peer):
            s.close()


def test_an_overdue_step_whose_ring_members_all_run_is_not_aborted(tmp_path):
    import psutil

    from elastictrain.engine.health.hang import HangDetector, boot_id
    from elastictrain.engine.health.signals import Beat, Member

    signals = FileSignals.in_folder(tmp_path)
    heartbeats = signals.heartbeats
    hang = HangDetector(signals, host=lambda: "a", slot=lambda: 0)
    me = psutil.Process()
    parent = me.parent()
    assert parent is not None
    hang.set_ring(0, [Member(0, "a", 0, me.pid), Member(1, "b", 0, parent.pid)])
    heartbeats.write(Beat(parent.pid, "b", 0, boot_id(), parent.create_time(), time.time(), "waiting", time.time(), 3))
    every_port = (set(range(65536)), set())  # an empty ring: no connection of this process can be the signal
    dog = CollectiveWatchdog(signals, host_removed=lambda: False, excluded_ports=lambda: every_port, hang=hang)
    dog.snapshot_ring()
    dog._step_started = time.time() - 10.0
    dog._check()
    assert dog.aborts == 0
