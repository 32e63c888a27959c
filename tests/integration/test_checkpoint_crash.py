"""The checkpoint writer process: round trip, restart after death, and SIGKILL at random instants."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from elastictrain.checkpoint import (
    Checkpointer,
    LocalStorage,
    list_checkpoints,
    load_latest,
    verify_checkpoint,
    write_checkpoint,
)
from tests.fixtures.procs import REPO, wait_until

pytestmark = pytest.mark.integration


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def __call__(self, name: str, fields: dict) -> None:
        self.events.append((name, fields))


def _kill(pid: int | None) -> None:
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_process_writer_saves_without_pickling_tensors_and_close_stops_it(tmp_path):
    storage = LocalStorage(tmp_path / "checkpoints")
    rec = Recorder()
    state = {"w": torch.randn(512, 512), "b": torch.arange(10), "n": 3, "nested": [(torch.ones(2), "x")]}
    ckpt = Checkpointer(storage, keep_last=2, writer="process", on_event=rec)
    try:
        ckpt.save(state, step=1, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(30)
        pid = ckpt.writer_pid
        assert pid is not None
        ckpt.save(state, step=2, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(30) and ckpt.writer_pid == pid  # one writer, reused
    finally:
        ckpt.close()
    assert [n for n, _ in rec.events] == ["checkpoint", "checkpoint"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    loaded = load_latest(storage)
    assert loaded.step == 2 and torch.equal(loaded.state["w"], state["w"])
    assert loaded.state["nested"][0][1] == "x" and loaded.state["n"] == 3


def test_writer_killed_while_idle_is_noticed_counted_and_restarted_by_the_next_save(tmp_path):
    storage = LocalStorage(tmp_path / "checkpoints")
    rec = Recorder()
    with Checkpointer(storage, writer="process", on_event=rec) as ckpt:
        ckpt.save({"w": torch.ones(8)}, step=1, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(30)
        old = ckpt.writer_pid
        _kill(old)
        wait_until(lambda: _gone(old), timeout=10, interval=0.005, what="the writer to be reaped")
        ckpt.save({"w": torch.ones(8) * 2}, step=2, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(30)
        assert ckpt.writer_pid != old
        stats = ckpt.stats
    assert stats.failures == 1 and stats.writer_restarts == 1 and stats.succeeded == 2
    assert [n for n, _ in rec.events] == ["checkpoint", "checkpoint_failed", "checkpoint"]
    assert "had died (exit code -9)" in rec.events[1][1]["error"]
    assert load_latest(storage).step == 2


def test_writer_sigkilled_at_random_instants_of_a_save_never_breaks_latest(tmp_path):
    rng = random.Random(20251129)
    storage = LocalStorage(tmp_path / "checkpoints")
    rec = Recorder()
    base = torch.randn(512, 512)  # 1 MiB: a save takes a few ms, mostly fsyncs
    state = {"w": base.clone(), "step": 0, "rng": torch.get_rng_state()}
    ckpt = Checkpointer(storage, keep_last=2, writer="process", on_event=rec)
    try:
        durations = []
        for step in range(4):  # un-killed saves: a baseline checkpoint, and how long a save takes here
            state["w"].copy_(base + step)
            state["step"] = step
            if step > 0:  # like every save in the loop below, this one starts a fresh writer
                pid = ckpt.writer_pid
                _kill(pid)
                wait_until(lambda pid=pid: _gone(pid), timeout=10, interval=0.005, what="the writer to be reaped")
            t0 = time.perf_counter()
            ckpt.save(state, step=step, epoch=0, world_size=1, config_hash="h")
            assert ckpt.wait(30)
            durations.append(time.perf_counter() - t0)
        typical = sorted(durations[1:])[1]
        kills, step = 0, 4
        killed = pid  # the last writer killed; each save below starts a fresh one, in the checkpointer's thread
        deadline = time.monotonic() + 90
        while kills < 60 and time.monotonic() < deadline:
            state["w"].copy_(base + step)
            state["step"] = step
            ckpt.save(state, step=step, epoch=0, world_size=1, config_hash="h")

            def new_writer(killed: int | None = killed) -> bool:
                return ckpt.writer_pid not in (None, killed)

            wait_until(new_writer, timeout=30, interval=0.0005, what="a new writer")
            pid = killed = ckpt.writer_pid  # the writer of this save (a fresh one after a kill)
            instant = time.perf_counter() + rng.uniform(0.0, 1.3 * typical)
            while time.perf_counter() < instant:  # spin to the drawn instant (a sleep is far too coarse)
                pass
            _kill(pid)
            kills += 1
            assert ckpt.wait(30), "the checkpointer must notice the dead writer"
            wait_until(lambda pid=pid: _gone(pid), timeout=10, interval=0.005, what="the writer to be reaped")

            latest = storage.get_latest()
            assert latest is not None
            manifest = verify_checkpoint(storage, latest)  # latest itself is complete and verified
            loaded = load_latest(storage)
            assert loaded is not None and loaded.skipped == () and loaded.step == manifest["step"]
            assert loaded.state["step"] == loaded.step
            assert torch.equal(loaded.state["w"], base + loaded.step)
            name, fields = rec.events[-1]
            if name == "checkpoint" and fields["step"] == step:  # the kill came after the save committed
                assert len(list_checkpoints(storage)) <= 2, "a committed save prunes to keep_last"
            step += 1
        saves = step
        stats = ckpt.stats
    finally:
        ckpt.close()
    assert kills >= 50
    per_save = [f for n, f in rec.events if n in ("checkpoint", "checkpoint_failed") and f["step"] is not None]
    assert len(per_save) == saves, "every save is reported exactly once, as written or as failed"
    killed_mid_save = sum(1 for n, f in rec.events if n == "checkpoint_failed" and f["step"] is not None)
    assert killed_mid_save >= 5 and stats.succeeded >= 4
    assert stats.failures == sum(1 for n, _ in rec.events if n == "checkpoint_failed")


def test_bench_runs_small_and_reports_medians_and_ratios(tmp_path):
    from bench.checkpoint_stall import bench_checkpoint_stall

    result = bench_checkpoint_stall(state_mb=8, repeats=1, tmp_root=str(tmp_path), steady_steps=5)
    assert result["failures"] == 0 and result["skipped"] == 0
    assert result["async_stall_s"] > 0 and result["sync_save_s"] > 0 and result["step_steady_s"] > 0
    assert result["stall_ratio"] == pytest.approx(result["async_stall_s"] / result["sync_save_s"])
    assert os.listdir(tmp_path) == []


TRAINER = """
import sys, time, torch
from elastictrain.checkpoint import Checkpointer
from tests.fixtures.gated_storage import FileGatedStorage
storage = FileGatedStorage(sys.argv[1], sys.argv[2])
ckpt = Checkpointer(storage, keep_last=1, writer="process")
ckpt.save({"w": torch.ones(256)}, step=100, epoch=0, world_size=1, config_hash="h")
deadline = time.monotonic() + 60
while ckpt.writer_pid is None and time.monotonic() < deadline:  # the checkpointer's thread starts it
    time.sleep(0.01)
print(ckpt.writer_pid, flush=True)
sys.stdin.read()  # until the test kills it
"""


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_writer_of_a_sigkilled_trainer_dies_and_a_newer_checkpoint_keeps_latest(tmp_path, procs):
    """Rank 0 SIGKILLed while its writer is mid-save (the state file written, held before the manifest): the
    writer dies with it, and the new rank 0's newer checkpoint stays latest and is not pruned."""
    root, gate = tmp_path / "checkpoints", tmp_path / "gate"
    trainer = procs.start(
        [sys.executable, "-c", TRAINER, str(root), str(gate)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert trainer.stdout is not None
    writer = int(trainer.stdout.readline())
    try:
        wait_until(lambda: gate.with_name("gate.writing").exists(), timeout=60, what="the writer mid-save")
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=10)
        # The new rank 0 saves a newer step while the old writer would still be finishing step 100.
        write_checkpoint(LocalStorage(root), {"w": torch.zeros(4)}, step=200, epoch=0, world_size=1,
                         config_hash="h", keep_last=1)  # fmt: skip
        wait_until(lambda: _dead(writer), timeout=30, interval=0.05, what=f"writer {writer} to die with its trainer")
    finally:
        gate.touch()  # let a surviving writer finish (on the old code: it moves latest back and prunes step 200)
        with contextlib.suppress(psutil.Error):
            psutil.Process(writer).kill()
    storage = LocalStorage(root)
    assert storage.get_latest() == "step-00000200"
    assert load_latest(storage).step == 200
