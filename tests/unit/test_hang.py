"""The hung-peer verdict (pure, with chosen times), heartbeats read back from disk, and the cure on a real process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from chaos.procs import kill_tree, wait_until
from elastictrain.config import FIRST_STEP_HANG_SECONDS
from elastictrain.engine.health import hang
from elastictrain.engine.health.hang import (
    BeatKeeper,
    HangDetector,
    announce,
    boot_id,
    cpu_ns,
    first_step_bound,
    gathered_members,
    gloo_timeout_seconds,
    gone_peers,
    hang_bound,
    hung_peers,
    job_worker_runs,
    kill_if_same,
    process_alive,
    silent_in_rendezvous,
)
from elastictrain.engine.health.signals import (
    IDLE,
    LOCAL,
    PROLOGUE,
    RENDEZVOUS,
    RESET_PHASES,
    STARTUP,
    SYNC,
    WAITING,
    Beat,
    FailureMarker,
    FileSignals,
    Heartbeats,
    HungVerdict,
    Member,
)
from elastictrain.engine.reset import PAUSE_MARKS
from elastictrain.engine.watch import mark_phases

NOW = 1000.0
MEMBERS = [Member(0, "a", 0, 10), Member(1, "b", 0, 11), Member(2, "c", 0, 12)]


def _signals(hb: Heartbeats, verdict: HungVerdict) -> FileSignals:
    """The run_dir's signals with the heartbeats and the verdict a test reads (its failure marker beside them)."""
    return FileSignals(hb, FailureMarker(hb.folder / "collective-failure"), verdict)


def beat(host: str, pid: int, *, ts: float = NOW, phase: str = WAITING, since: float = NOW, steps: int = 5) -> Beat:
    return Beat(pid=pid, host=host, slot=0, boot_id="boot", created=1.0, ts=ts, phase=phase, since=since, steps=steps)


def verdict(beats: dict, *, me: int = 0, ring_steps: int = 3, hang: float = 10.0):
    return hung_peers(now=NOW, me=me, members=MEMBERS, beats=beats, hang_seconds=hang, ring_steps=ring_steps)


def test_the_bound_is_configured_or_ten_typical_steps_and_at_least_ten_seconds() -> None:
    assert hang_bound(None, 0.05) == 10.0
    assert hang_bound(None, 3.0) == 30.0
    assert hang_bound(4.0, 3.0) == 4.0


def test_a_peer_without_a_heartbeat_for_the_bound_is_hung() -> None:
    beats = {("b", 0): beat("b", 11, ts=NOW - 12), ("c", 0): beat("c", 12)}
    (h,) = verdict(beats)
    assert h.member.rank == 1 and "no heartbeat for 12.0s" in h.why


def test_a_live_peer_stuck_in_its_own_part_of_a_step_is_hung_and_one_waiting_is_not() -> None:
    beats = {("b", 0): beat("b", 11, phase=LOCAL, since=NOW - 11), ("c", 0): beat("c", 12, since=NOW - 50)}
    (h,) = verdict(beats)
    assert h.member.rank == 1 and "stuck in its own part" in h.why
    assert not verdict({("b", 0): beat("b", 11, phase=IDLE, since=NOW - 50)}), "idle (validation, a reset) is no hang"


def test_nothing_is_judged_below_the_bound_for_another_pid_or_without_a_heartbeat() -> None:
    assert not verdict({("b", 0): beat("b", 11, ts=NOW - 9)})
    assert not verdict({("b", 0): beat("b", 99, ts=NOW - 100)}), "an older process of that slot"
    assert not verdict({}), "a member whose heartbeats this machine cannot see"
    assert not verdict({("a", 0): beat("a", 10, ts=NOW - 100)}), "the judge itself"


def test_before_the_judge_completed_a_step_in_its_ring_the_first_steps_bound_applies() -> None:
    beats = {("b", 0): beat("b", 11, ts=NOW - 30, steps=0)}
    assert not verdict(beats, ring_steps=0)
    assert verdict({("b", 0): beat("b", 11, ts=NOW - 61, steps=0)}, ring_steps=0)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"pid": -1}',
        b"x" * 5000,
        b'{"pid":1,"host":"b","slot":0,"boot_id":"x","created":1,"ts":NaN,"phase":"waiting","since":1,"steps":0}',
        b'{"pid":1,"host":"b","slot":0,"boot_id":"x","created":1,"ts":1,"phase":"sleeping","since":1,"steps":0}',
        b'{"pid":true,"host":"b","slot":0,"boot_id":"x","created":1,"ts":1,"phase":"idle","since":1,"steps":0}',
    ],
)
def test_a_malformed_heartbeat_is_ignored(raw: bytes) -> None:
    assert Beat.parse(raw) is None


def test_heartbeats_round_trip_and_only_the_members_files_are_read(tmp_path: Path) -> None:
    hb = Heartbeats(tmp_path / "hb")
    b = beat("b", 11)
    hb.write(b)
    (tmp_path / "hb" / "c-0.json").write_text("garbage")
    assert hb.read(MEMBERS) == {("b", 0): b}
    with pytest.raises(ValueError):
        hb.path("../etc", 0)


def test_gathered_members_refuse_a_malformed_row() -> None:
    assert gathered_members([("a", 0, 10), ["b", 0, 11]]) == MEMBERS[:2]
    assert gathered_members([("a", 0)]) is None
    assert gathered_members([("a", "0", 10)]) is None


def test_the_verdict_file_answers_only_for_a_hang_found_since_the_given_time(tmp_path: Path) -> None:
    v = HungVerdict(tmp_path / "hung-verdict")
    assert v.since(0) is None
    before = time.time()
    v.record("host b rank 1: no heartbeat\nsecond line")
    assert v.since(before) == "host b rank 1: no heartbeat"
    assert v.since(time.time() + 1) is None


def test_a_stopped_process_on_this_machine_is_sigkilled_by_the_detector(tmp_path: Path) -> None:
    child = _sleeper(job=None, slot=("b", "0"))  # horovodrun's worker of host b slot 0
    try:
        p = psutil.Process(child.pid)
        wait_until(lambda: p.environ(), 10, what="the child's environment")
        p.send_signal(signal.SIGSTOP)
        hb = Heartbeats(tmp_path / "hb")
        det = HangDetector(
            _signals(hb, HungVerdict(tmp_path / "v")), host=lambda: "a", slot=lambda: 0, configured_seconds=2
        )
        boot, _ = det.identity()
        stale = Beat(child.pid, "b", 0, boot, p.create_time(), time.time() - 5, LOCAL, time.time() - 5, 3)
        hb.write(stale)
        det.set_ring(0, [Member(0, "a", 0, 1), Member(1, "b", 0, child.pid)])
        det.steps = 3
        det.set_phase(WAITING)
        found = det.tick(time.time() + 1.5, waited=3.0, typical_step=0.1)
        assert [h.member.pid for h in found] == [child.pid]
        assert child.wait(10) == -signal.SIGKILL
        assert "killed pid" in (HungVerdict(tmp_path / "v").since(0) or "")
        assert det.tick(time.time() + 3, waited=5.0, typical_step=0.1) == [], "cured once"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_slow_eviction_holds_neither_the_watchdog_threads_beats_nor_its_verdicts(tmp_path: Path) -> None:
    """The cure's etcd eviction ran on the watchdog's thread: with a slow etcd (up to ~11 s) the worker neither beat
    nor aborted meanwhile, so its peers could judge this healthy worker hung."""
    started, release = threading.Event(), threading.Event()

    def evict(host: str) -> str:
        started.set()
        release.wait(30)
        return f"evicted host {host} for 300s (evictions: 1)"

    det, hb = _detector(tmp_path)
    det.configured_seconds, det.evict = 2.0, evict
    det.set_ring(0, [Member(0, "a", 0, os.getpid()), Member(1, "b", 0, 4242)])
    det.steps = 3
    det.set_phase(WAITING)
    now = time.time()
    hb.write(Beat(4242, "b", 0, "another-machine", 1.0, now - 5, LOCAL, now - 5, 3))
    found: list = []
    tick = threading.Thread(target=lambda: found.extend(det.tick(now, waited=3.0, typical_step=0.1)), daemon=True)
    verdict = HungVerdict(tmp_path / "v")
    try:
        tick.start()
        assert started.wait(10), "no eviction"
        tick.join(5)
        assert not tick.is_alive(), "the watchdog's thread waits for etcd"
        assert [h.member.host for h in found] == ["b"]
        assert "evicting host b" in (verdict.since(0) or ""), "the verdict is recorded before etcd answers"
        first_recorded = [float((tmp_path / "v").read_text().split()[0])]
        det.tick(now + 1.5, waited=4.5, typical_step=0.1)
        assert (b := _read(hb)) is not None and b.ts == now + 1.5, "it beats while etcd is slow"
    finally:
        release.set()
        tick.join(30)
    wait_until(lambda: "evicted host b for 300s" in (verdict.since(0) or ""), 10, what="the eviction's outcome")
    recorded = float((tmp_path / "v").read_text().split()[0])
    assert recorded == first_recorded[0], "etcd's late answer keeps the verdict's time: a failure meanwhile is no hang"


def test_a_reused_pid_is_not_killed() -> None:
    me = psutil.Process()
    assert "another process" in kill_if_same(me.pid, me.create_time() - 100)


def _detector(tmp_path: Path) -> tuple[HangDetector, Heartbeats]:
    hb = Heartbeats(tmp_path / "hb")
    return HangDetector(_signals(hb, HungVerdict(tmp_path / "v")), host=lambda: "a", slot=lambda: 0), hb


def _read(hb: Heartbeats) -> Beat | None:
    return hb.read([Member(0, "a", 0, 0)]).get(("a", 0))


def test_a_resets_phases_are_written_at_once_not_on_the_next_beat(tmp_path: Path) -> None:
    det, hb = _detector(tmp_path)
    det.set_ring(0, [Member(0, "a", 0, 1)])
    det.steps = 4
    det.set_phase(LOCAL)
    assert _read(hb).phase == IDLE, "a step in a ring that has trained waits for the once-a-second beat"
    for phase in (RENDEZVOUS, SYNC, PROLOGUE):
        det.mark(phase)
        got = _read(hb)
        assert got is not None and got.phase == phase and got.steps == 0
    det.set_ring(0, [Member(0, "a", 0, 1)])
    det.set_phase(LOCAL)
    assert (_read(hb).phase, _read(hb).steps) == (LOCAL, 0), "the first step of a ring is shown at once"
    det.step_done()
    det.set_phase(LOCAL)
    assert _read(hb).phase == LOCAL and _read(hb).steps == 0, "no beat for the second step"


def test_every_pause_mark_but_the_last_begins_a_phase_and_the_reset_phases_parse() -> None:
    phases = mark_phases()
    assert set(phases) == set(PAUSE_MARKS) - {"prologue_end"}
    assert set(phases.values()) <= set(RESET_PHASES)
    for phase in RESET_PHASES:
        assert Beat.parse(beat("b", 11, phase=phase).to_json().encode()) is not None


def test_a_peer_in_a_resets_phase_is_judged_by_its_beats_age_only() -> None:
    for phase in RESET_PHASES:
        assert not verdict({("b", 0): beat("b", 11, phase=phase, since=NOW - 50)})
        assert verdict({("b", 0): beat("b", 11, phase=phase, ts=NOW - 12)})


@pytest.fixture
def keeper(monkeypatch: pytest.MonkeyPatch):
    """A keeper of this test's own for :func:`announce` (the module's serves the process), stopped at the end."""
    k = BeatKeeper()
    monkeypatch.setattr(hang, "_KEEPER", k)
    yield k
    k.stop()
    if k.thread is not None:
        k.thread.join(5)


def test_announce_writes_a_workers_heartbeat_under_horovodrun_only(tmp_path: Path, keeper: BeatKeeper) -> None:
    announce(_signals(Heartbeats(tmp_path), HungVerdict(tmp_path / "v")), STARTUP, {})
    assert not list(tmp_path.iterdir()), "outside horovodrun: no host or slot, no file"
    announce(
        _signals(Heartbeats(tmp_path), HungVerdict(tmp_path / "v")),
        STARTUP,
        {"HOROVOD_HOSTNAME": "a", "HOROVOD_LOCAL_RANK": "x"},
    )
    assert not list(tmp_path.iterdir())
    announce(
        _signals(Heartbeats(tmp_path), HungVerdict(tmp_path / "v")),
        STARTUP,
        {"HOROVOD_HOSTNAME": "a", "HOROVOD_LOCAL_RANK": "0"},
    )
    got = _read(Heartbeats(tmp_path))
    assert got is not None and (got.phase, got.pid, got.steps) == (STARTUP, psutil.Process().pid, 0)


def test_a_resets_phase_holds_until_the_rings_first_step_not_overwritten_by_idle(tmp_path: Path) -> None:
    det, hb = _detector(tmp_path)
    det.mark(PROLOGUE)
    det.set_phase(IDLE)  # the training function's start: the watchdog's idle()
    det.set_ring(0, [Member(0, "a", 0, 1)])
    assert det.phase == PROLOGUE and _read(hb).phase == PROLOGUE
    det.set_phase(LOCAL)
    assert det.phase == LOCAL and _read(hb).phase == LOCAL
    det.step_done()
    assert det.phase == IDLE, "after a step, idle as before"


def test_the_first_steps_bound_is_sixty_seconds_and_at_most_half_the_gloo_timeout() -> None:
    assert first_step_bound(None) == 60.0
    assert first_step_bound(15.0) == 7.5  # the chaos runs' timeout: the verdict comes before the collectives fail
    assert first_step_bound(60.0) == 30.0  # launch's default
    assert first_step_bound(600.0) == 60.0


def test_the_gloo_timeout_is_horovodruns_variable_when_it_is_a_positive_number() -> None:
    assert gloo_timeout_seconds({"HOROVOD_GLOO_TIMEOUT_SECONDS": "15"}) == 15.0
    for raw in ("", "0", "-3", "1.5", "soon"):
        assert gloo_timeout_seconds({"HOROVOD_GLOO_TIMEOUT_SECONDS": raw}) is None
    assert gloo_timeout_seconds({}) is None


@pytest.mark.parametrize(("first_step_seconds", "hung"), [(first_step_bound(15.0), True), (60.0, False)])
def test_a_peer_stopped_in_a_rings_first_step_is_hung_before_a_15s_gloo_timeout(
    tmp_path: Path, first_step_seconds: float, hung: bool
) -> None:
    """The campaign's hang: rank 0 SIGSTOPped a second after a reset. With the first step's 60 s, the survivors'
    15-s Gloo timeout came first and the next rendezvous waited for the stopped worker for good."""
    detector, hb = _detector(tmp_path)
    detector.first_step_seconds = first_step_seconds
    gone_pid = 2**22 + 12345  # above pid_max's default: no process to kill
    detector.set_ring(0, [Member(0, "a", 0, 0), Member(1, "b", 0, gone_pid)])
    detector.set_phase(WAITING)
    now = time.time()
    hb.write(beat("b", gone_pid, ts=now - 11, steps=0))
    found = detector.tick(now, waited=11.0, typical_step=0.05)
    assert [h.member.rank for h in found] == ([1] if hung else [])


@pytest.mark.parametrize("took", [35.0, 600.0])
def test_a_joiner_that_still_beats_is_not_hung_in_its_rings_first_step_however_long_a_healthy_start_takes(
    took: float,
) -> None:
    """A joiner's first step (loader start-up, cudnn autotune, a cold cache) may take minutes: its watchdog thread
    beats meanwhile, and nothing in the ring times out (Horovod keeps negotiating). With launch's Gloo timeout (60 s)
    the first step's bound was 30 s, and a joiner 30 s in its own work was killed or its host evicted."""
    bound = first_step_bound(60.0)

    def judged(b: Beat) -> list[str]:
        beats = {("b", 0): b}
        found = hung_peers(
            now=NOW, me=0, members=MEMBERS, beats=beats, hang_seconds=10.0, ring_steps=0, first_step_seconds=bound
        )
        return [h.why for h in found]

    assert judged(beat("b", 11, phase=LOCAL, since=NOW - took, ts=NOW - 0.5, steps=0)) == []
    (why,) = judged(beat("b", 11, phase=LOCAL, since=NOW - min(took, 60), ts=NOW - bound, steps=0))
    assert "no heartbeat" in why, "a stopped joiner is silent: found at the bound"
    assert judged(beat("b", 11, phase=LOCAL, since=NOW - 11, ts=NOW - 0.5, steps=1)) == [], "the judge's count"
    assert verdict({("b", 0): beat("b", 11, phase=LOCAL, since=NOW - 11)}, ring_steps=1), "from the second step on"


def test_a_joiner_stuck_in_its_own_work_of_the_first_step_is_hung_at_the_first_step_bound_not_never() -> None:
    """A deadlocked loader in a ring's first step beats from its watchdog thread while every other worker waits in
    the step; nothing times out. ``elastic.first_step_hang_seconds`` (30 min by default) ends that wait."""

    def judged(since: float, bound: float = FIRST_STEP_HANG_SECONDS) -> list[str]:
        beats = {("b", 0): beat("b", 11, phase=LOCAL, since=NOW - since, ts=NOW - 0.5, steps=0)}
        found = hung_peers(
            now=NOW, me=0, members=MEMBERS, beats=beats, hang_seconds=10.0, ring_steps=0, first_step_hang_seconds=bound
        )
        return [h.why for h in found]

    assert FIRST_STEP_HANG_SECONDS == 1800.0
    assert judged(FIRST_STEP_HANG_SECONDS - 1) == [], "a slow start, half an hour long, lives"
    (why,) = judged(FIRST_STEP_HANG_SECONDS)
    assert "stuck in its own part of the ring's first step" in why
    assert judged(120.0, bound=300.0) == [] and judged(300.0, bound=300.0), "the configured bound"


def test_in_a_rings_first_step_a_slow_joiner_lives_and_a_stopped_one_is_sigkilled(tmp_path: Path) -> None:
    """Real processes of this machine, the judge's clock 35 s into the ring's first step: the joiner that beats (its
    first step is slow) lives; the one SIGSTOPped (silent since the step began) is killed."""
    slow, stopped = _sleeper(job=None, slot=("b", "0")), _sleeper(job=None, slot=("c", "0"))
    try:
        for proc in (slow, stopped):
            wait_until(lambda p=proc: psutil.Process(p.pid).environ(), 10, what="the child's environment")
        psutil.Process(stopped.pid).send_signal(signal.SIGSTOP)
        det, hb = _detector(tmp_path)
        det.first_step_seconds = first_step_bound(60.0)
        det.set_ring(0, [Member(0, "a", 0, 1), Member(1, "b", 0, slow.pid), Member(2, "c", 0, stopped.pid)])
        det.set_phase(WAITING)  # the judge's own part of the ring's first step is done
        boot, _ = det.identity()
        now = time.time() + 35
        for proc, host, ts in ((slow, "b", now - 0.5), (stopped, "c", now - 35)):
            made = psutil.Process(proc.pid).create_time()
            hb.write(Beat(proc.pid, host, 0, boot, made, ts, LOCAL, now - 35, 0))
        found = det.tick(now, waited=35.0, typical_step=0.05)
        assert [h.member.pid for h in found] == [stopped.pid]
        assert stopped.wait(10) == -signal.SIGKILL
        assert slow.poll() is None and psutil.Process(slow.pid).status() != psutil.STATUS_ZOMBIE
    finally:
        for proc in (slow, stopped):
            _end(proc)


def test_a_member_whose_process_on_this_machine_is_gone_is_named_at_once() -> None:
    """No bound: a dead pid is dead (the 60-s stalls: two survivors each waiting on the other, both rings' other
    members killed, and Gloo telling neither)."""
    beats = {("b", 0): beat("b", 11), ("c", 0): beat("c", 12)}

    def gone(alive_pids: set[int], *, me: int = 0, boot: str = "boot") -> list[str]:
        return gone_peers(me=me, members=MEMBERS, beats=beats, boot=boot, alive=lambda pid: pid in alive_pids)

    assert gone({10, 11, 12}) == []
    assert gone({10, 12}) == ["host b rank 1 (pid 11) on this machine is gone"]
    assert gone(set(), me=1) == ["host c rank 2 (pid 12) on this machine is gone"], "never the judge itself"
    assert gone(set(), boot="another machine or PID namespace") == [], "a pid means nothing elsewhere"
    assert gone(set(), boot="") == [], "an unknown machine identity acts on no pid"
    assert (
        gone_peers(me=0, members=MEMBERS, beats={("b", 0): beat("b", 99)}, boot="boot", alive=lambda pid: False) == []
    ), "an older process of that slot"


def test_a_process_is_alive_until_it_is_gone_or_a_zombie() -> None:
    me = psutil.Process()
    assert process_alive(me.pid)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process_alive(child.pid), "exited, not yet reaped"
    finally:
        child.wait()
    assert not process_alive(child.pid)


def test_the_machine_identity_names_the_pid_namespace() -> None:
    ident = boot_id()
    assert ident.endswith(f"/pidns:{Path('/proc/self/ns/pid').stat().st_ino}")
    assert ident.split("/pidns:")[0] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_the_gone_lookup_is_made_at_most_twice_a_second(tmp_path: Path) -> None:
    from tests.fixtures.procs import dead_pid

    hb = Heartbeats(tmp_path / "hb")
    detector = HangDetector(_signals(hb, HungVerdict(tmp_path / "verdict")), host=lambda: "a", slot=lambda: 0)
    gone = dead_pid()
    me = psutil.Process()
    detector.set_ring(0, [Member(0, "a", 0, me.pid), Member(1, "b", 0, gone)])
    hb.write(Beat(gone, "b", 0, boot_id(), me.create_time(), NOW, WAITING, NOW, 1))
    assert detector.gone(now=NOW) == f"host b rank 1 (pid {gone}) on this machine is gone"
    hb.path("b", 0).unlink()
    assert detector.gone(now=NOW + 0.2) is not None, "within half a second the last answer stands"
    assert detector.gone(now=NOW + 0.6) is None, "then it is looked up again"


def test_an_announced_beat_is_kept_fresh_until_the_detector_beats(tmp_path: Path, keeper: BeatKeeper) -> None:
    """A starting worker (cold imports, its first ``hvd.init``) beats once a second although it has no detector yet:
    in a rendezvous, a silent process must mean one that does not run."""
    env = {"HOROVOD_HOSTNAME": "a", "HOROVOD_LOCAL_RANK": "0"}
    announce(_signals(Heartbeats(tmp_path), HungVerdict(tmp_path / "v")), RENDEZVOUS, env)
    first = _read(Heartbeats(tmp_path))
    assert first is not None and first.phase == RENDEZVOUS
    fresher = wait_until(lambda: (b := _read(Heartbeats(tmp_path))) and b.ts > first.ts and b, 10, what="a new beat")
    assert (fresher.phase, fresher.since, fresher.pid) == (RENDEZVOUS, first.since, first.pid)
    det = HangDetector(_signals(Heartbeats(tmp_path), HungVerdict(tmp_path / "v")), host=lambda: "a", slot=lambda: 0)
    det.mark(PROLOGUE)  # the detector's first beat
    assert keeper.thread is not None
    keeper.thread.join(5)
    assert not keeper.thread.is_alive(), "the keeper stops once the detector beats"
    announce(_signals(Heartbeats(tmp_path), HungVerdict(tmp_path / "v")), STARTUP, env)
    assert _read(Heartbeats(tmp_path)).phase == PROLOGUE, "an announcement never overwrites the detector's beat"


def rv(beats: list[Beat], *, runs=lambda b: True, boot: str = "boot", bound: float = 7.5) -> list[str]:
    return [h.beat.host for h in silent_in_rendezvous(now=NOW, beats=beats, bound=bound, boot=boot, me=10, runs=runs)]


def test_in_a_rendezvous_a_silent_process_of_this_machine_that_still_runs_is_hung() -> None:
    stopped = beat("b", 11, ts=NOW - 8, phase=RENDEZVOUS)
    assert rv([stopped]) == ["b"]
    assert rv([beat("b", 11, ts=NOW - 30, phase=STARTUP)]) == ["b"], "stopped while it started"
    assert rv([beat("b", 11, ts=NOW - 7, phase=RENDEZVOUS)]) == [], "below the bound"
    assert rv([stopped], runs=lambda b: False) == [], "dead, or its pid is another process's now"
    assert rv([beat("a", 10, ts=NOW - 30)]) == [], "the judge itself"
    other_machine = Beat(12, "c", 0, "another-boot", 1.0, NOW - 15, RENDEZVOUS, NOW - 15, 0)
    assert rv([other_machine]) == [], "another machine's: not judged in a rendezvous"
    assert rv([stopped], boot="") == [], "no machine identity: nothing is acted on"


JOB = "job-under-test"


def _sleeper(
    job: str | None = JOB, code: str = "import time; time.sleep(60)", slot: tuple[str, str] | None = None
) -> subprocess.Popen:
    drop = ("ELASTICTRAIN_JOB", "HOROVOD_HOSTNAME", "HOROVOD_LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop} | ({"ELASTICTRAIN_JOB": job} if job else {})
    if slot is not None:
        env |= {"HOROVOD_HOSTNAME": slot[0], "HOROVOD_LOCAL_RANK": slot[1]}
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:  # its command line and environment are the child's own only once it has exec'd
        wait_until(lambda: psutil.Process(child.pid).cmdline()[-1:] == [code], 10, what="the child's exec")
    except BaseException:
        _end(child)
        raise
    return child


def _end(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()


def test_a_beats_writer_runs_only_as_the_same_live_worker_of_the_job() -> None:
    """A heartbeat file is untrusted: only the process that wrote it, started when it says and a worker of this job
    by its environment, is ever acted on."""
    child, other, plain = _sleeper(), _sleeper(job="another-job"), _sleeper(job=None, slot=("b", "0"))
    try:
        for proc in (child, other, plain):
            wait_until(lambda p=proc: psutil.Process(p.pid).environ(), 10, what="the child's environment")
        made = psutil.Process(child.pid).create_time()
        ours = Beat(child.pid, "b", 0, "boot", made, NOW, RENDEZVOUS, NOW, 0)
        assert not job_worker_runs(ours, JOB), "the job's environment alone (horovodrun, an agent, a zygote): no worker"
        assert not job_worker_runs(ours, ""), "no job to match, and not horovodrun's worker of host b slot 0"
        made_plain = psutil.Process(plain.pid).create_time()
        horovodruns = Beat(plain.pid, "b", 0, "boot", made_plain, NOW, RENDEZVOUS, NOW, 0)
        assert job_worker_runs(horovodruns, ""), "horovodrun's worker of the beat's host and slot (no launch)"
        assert not job_worker_runs(Beat(plain.pid, "c", 0, "boot", made_plain, NOW, RENDEZVOUS, NOW, 0), "")
        assert not job_worker_runs(Beat(plain.pid, "b", 0, "boot", made_plain - 100, NOW, RENDEZVOUS, NOW, 0), "")
        theirs = Beat(other.pid, "b", 0, "boot", psutil.Process(other.pid).create_time(), NOW, RENDEZVOUS, NOW, 0)
        assert not job_worker_runs(theirs, JOB), "another job's process (or the launcher, etcd, a shell)"
        assert not job_worker_runs(Beat(2**22 + 12345, "b", 0, "boot", 1.0, NOW, RENDEZVOUS, NOW, 0), JOB)
    finally:
        for proc in (child, other, plain):
            _end(proc)


def test_another_jobs_horovodrun_worker_is_never_a_worker_of_this_job() -> None:
    """Two jobs of one user on one machine: a heartbeat written into this job's run_dir that names the other job's
    worker (its host and slot, its pid and start time) must not get it killed; nor one of another launch of this job."""
    theirs = _sleeper(job="another-job", slot=("b", "0"))
    try:
        p = psutil.Process(theirs.pid)
        wait_until(lambda: p.environ(), 10, what="the child's environment")
        beat = Beat(theirs.pid, "b", 0, "boot", p.create_time(), NOW, RENDEZVOUS, NOW, 0)
        assert job_worker_runs(beat, "another-job"), "its own job's judge knows it"
        assert not job_worker_runs(beat, JOB), "another job's worker of the same host and slot"
        assert not job_worker_runs(beat, "another-job", launch_id="launch-2"), "another launch of its job"
    finally:
        _end(theirs)


ZYGOTE = """
import os, sys, time
ready, named = os.pipe()
checker = os.fork()
if checker == 0:  # the zygote's file-system checker: forked by it, and it names itself
    with open("/proc/self/comm", "w") as f:
        f.write("zygote-check")
    os.write(named, b"x")
    time.sleep(60)
    os._exit(0)
os.read(ready, 1)
if os.fork() == 0:  # a hot-joined worker: the zygote's command line and environment
    loader = os.fork()
    if loader == 0:  # a helper of that worker (a data loader's process)
        time.sleep(60)
        os._exit(0)
    print(os.getpid(), loader, checker, flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@contextlib.contextmanager
def _zygote() -> Iterator[tuple[psutil.Process, psutil.Process, psutil.Process, psutil.Process]]:
    """A process that looks like the job's zygote (``elastictrain zygote serve``, ``ELASTICTRAIN_JOB``), the worker it
    forked, that worker's own forked helper and the zygote's checker process; all ended by pid at the exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")} | {"ELASTICTRAIN_JOB": JOB}
    cmd = [sys.executable, "-c", ZYGOTE, "zygote", "serve", "--config", "c.yaml", "--job", JOB, "--host", "b"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        worker, loader, checker = (int(pid) for pid in proc.stdout.readline().split())
        yield psutil.Process(proc.pid), psutil.Process(worker), psutil.Process(loader), psutil.Process(checker)
    finally:
        kill_tree(proc.pid)
        proc.wait()


def _beat_of(p: psutil.Process, boot: str = "boot", ts: float = NOW) -> Beat:
    return Beat(p.pid, "b", 0, boot, p.create_time(), ts, RENDEZVOUS, ts, 0)


def test_of_a_zygotes_processes_only_the_worker_it_forked_is_a_worker_of_the_job() -> None:
    """A hot-joined worker shows its zygote's command line and environment (a fork, no exec); the zygote, whose end
    ends every worker it forked (parent-death signal), its checker process and the worker's own helpers are no
    workers."""
    with _zygote() as (zygote, worker, loader, checker):
        assert job_worker_runs(_beat_of(worker), JOB)
        assert not job_worker_runs(_beat_of(worker), "another-job")
        assert not job_worker_runs(_beat_of(zygote), JOB), "the zygote"
        assert not job_worker_runs(_beat_of(loader), JOB), "a helper of a worker"
        assert not job_worker_runs(_beat_of(checker), JOB), "the zygote's checker"


@pytest.mark.parametrize("where", ["step", "rendezvous"])
def test_a_forged_heartbeat_never_gets_a_process_that_is_no_worker_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A heartbeat file is untrusted. One that names the zygote (this machine's boot id, its pid and start time, silent
    for long) must not get it killed, by a step's verdict or a rendezvous's: its worker would die with it."""
    monkeypatch.setenv("ELASTICTRAIN_JOB", JOB)
    with _zygote() as (zygote, worker, _, _):
        zygote.send_signal(signal.SIGSTOP)  # quiet: no CPU time, as an idle zygote
        wait_until(lambda: zygote.status() == psutil.STATUS_STOPPED, 10, what="the zygote stopped")
        det, hb = _detector(tmp_path)
        det.configured_seconds = 2.0
        det.set_ring(0, [Member(0, "a", 0, os.getpid()), Member(1, "b", 0, zygote.pid)])
        now = time.time()
        hb.write(_beat_of(zygote, boot=det.identity()[0], ts=now - 60))
        if where == "step":  # the ring's member named by its gathered pid: judged hung, and the cure checks
            det.steps = 3
            det.set_phase(WAITING)
            assert [h.member.pid for h in det.tick(now, waited=3.0, typical_step=0.1)] == [zygote.pid]
            assert "no worker of this job here" in (HungVerdict(tmp_path / "v").since(0) or "")
        else:  # any heartbeat of the folder: not even a suspect
            det.mark(RENDEZVOUS)
            det.since = now - 60
            assert det.tick(now, waited=None, typical_step=0.1) == []
            assert det.tick(now + 3, waited=None, typical_step=0.1) == []
        assert zygote.status() == psutil.STATUS_STOPPED, "the zygote was killed"
        assert worker.status() != psutil.STATUS_ZOMBIE


def test_cpu_time_is_read_over_every_thread_and_stands_still_for_a_stopped_process() -> None:
    child = _sleeper(code="while True: pass")
    try:
        first = wait_until(lambda: cpu_ns(child.pid), 10, what="the busy child's first CPU time")
        wait_until(lambda: (cpu_ns(child.pid) or 0) > first, 10, what="the busy child's CPU time to grow")
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_STOPPED, 10, what="stopped")
        stopped = cpu_ns(child.pid)
        time.sleep(0.2)  # a stopped process: its CPU time must not move over any interval
        assert cpu_ns(child.pid) == stopped
        assert cpu_ns(2**22 + 12345) is None
    finally:
        _end(child)


@contextlib.contextmanager
def _stopped_sleeper() -> Iterator[psutil.Process]:
    """A worker of this job (horovodrun's of host b slot 0), SIGSTOPped (ended at the exit)."""
    child = _sleeper(slot=("b", "0"))
    try:
        p = psutil.Process(child.pid)
        wait_until(lambda: p.environ(), 10, what="the child's environment")
        p.send_signal(signal.SIGSTOP)
        yield p
    finally:
        _end(child)


def _judge(tmp_path: Path, child_pid: int, created: float, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ELASTICTRAIN_JOB", JOB)
    det, hb = _detector(tmp_path)
    det.first_step_seconds = first_step_bound(15.0)  # a rendezvous's bound: 7.5 s
    det.set_ring(0, [Member(0, "a", 0, 1), Member(1, "b", 0, child_pid)])
    det.mark(RENDEZVOUS)
    boot, _ = det.identity()
    now = time.time()
    hb.write(Beat(child_pid, "b", 0, boot, created, now, RENDEZVOUS, now, 0))
    return det, now


def test_a_silent_peer_that_still_uses_cpu_is_not_hung_in_a_rendezvous(tmp_path: Path, monkeypatch) -> None:
    """Start-up that holds the GIL (a native library's import) keeps a worker from beating, but not from running; a
    judge whose clock jumped, or whose beats were not written, sees every peer silent, and every one running."""
    child = _sleeper(slot=("b", "0"))
    try:
        det, now = _judge(tmp_path, child.pid, psutil.Process(child.pid).create_time(), monkeypatch)
        wait_until(lambda: psutil.Process(child.pid).environ(), 10, what="the child's environment")
        used = iter(range(10**6, 10**9, 10**6))
        for later in (4, 6, 8, 10, 12):
            assert det.judge_rendezvous(now + later, 7.5, lambda pid: next(used)) == []
        still = 10**6
        assert det.judge_rendezvous(now + 14, 7.5, lambda pid: still) == [], "quiet for 0 s yet"
        assert [h.member.pid for h in det.judge_rendezvous(now + 16, 7.5, lambda pid: still)] == [child.pid]
    finally:
        _end(child)


def test_a_process_stopped_while_the_ring_forms_is_sigkilled_by_a_survivor_in_the_rendezvous(
    tmp_path: Path, monkeypatch
) -> None:
    """The campaign's hang: a worker SIGSTOPped while its ring waits in a rendezvous. The driver sees it alive, so the
    rendezvous waited for it for good; a survivor's detector now kills it (then the driver's abort ends the round)."""
    with _stopped_sleeper() as p:
        det, now = _judge(tmp_path, p.pid, p.create_time(), monkeypatch)
        assert det.tick(now + 3, waited=None, typical_step=0.05) == [], "nothing before half the bound"
        assert det.tick(now + 5, waited=None, typical_step=0.05) == [], "its CPU time noted, not judged"
        found = det.tick(now + 8, waited=None, typical_step=0.05)
        assert [h.member.pid for h in found] == [p.pid]
        wait_until(lambda: p.status() == psutil.STATUS_ZOMBIE, 10, what="the stopped child killed")
        assert "while its ring forms" in (HungVerdict(tmp_path / "v").since(0) or "")


def test_a_stopped_peer_is_judged_only_while_the_judge_is_in_a_rendezvous(tmp_path: Path, monkeypatch) -> None:
    with _stopped_sleeper() as p:
        det, now = _judge(tmp_path, p.pid, p.create_time(), monkeypatch)
        det.mark(PROLOGUE)
        for later in (5, 8, 12):
            assert det.tick(now + later, waited=None, typical_step=0.05) == []
        assert p.status() == psutil.STATUS_STOPPED, "not killed"


def test_a_closing_worker_retires_its_heartbeat_and_leaves_a_newer_process_of_its_slot_alone(tmp_path: Path) -> None:
    det, hb = _detector(tmp_path)
    det.mark(RENDEZVOUS)
    assert _read(hb) is not None
    det.retire()
    assert _read(hb) is None, "a closing worker beats no more: no heartbeat to be judged by"
    hb.write(beat("a", 4242))
    det.retire()
    assert _read(hb) is not None and _read(hb).pid == 4242


def test_heartbeats_read_all_returns_the_valid_files_named_by_their_own_host_and_slot(tmp_path: Path) -> None:
    hb = Heartbeats(tmp_path)
    hb.write(beat("a", 10))
    hb.write(beat("b", 11))
    (tmp_path / "c-0.json").write_text(beat("z", 12).to_json())  # a file that names another slot
    (tmp_path / "d-0.json").write_bytes(b"{not json")
    (tmp_path / "notes.txt").write_text("x")
    assert sorted(b.host for b in hb.read_all()) == ["a", "b"]
    assert Heartbeats(tmp_path / "missing").read_all() == []
