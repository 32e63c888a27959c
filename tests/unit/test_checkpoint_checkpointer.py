"""Checkpointer in-process (thread and sync writers): round trip, failures, skips, buffer reuse."""

from __future__ import annotations

import contextlib
import copy
import random
import threading

import pytest
import torch
from torch import nn

from elastictrain.checkpoint import Checkpointer, LocalStorage, load_latest
from elastictrain.checkpoint.storage import CheckpointStorage


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def __call__(self, name: str, fields: dict) -> None:
        with self.lock:
            self.events.append((name, fields))

    def names(self) -> list[str]:
        with self.lock:
            return [n for n, _ in self.events]


class FlakyStorage(LocalStorage):
    """LocalStorage whose writes fail while ``fail`` is set, and block while ``gate`` is clear."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    @contextlib.contextmanager
    def open_write(self, path):
        self.entered.set()
        self.gate.wait(30)
        if self.fail:
            raise OSError(28, "No space left on device")
        with super().open_write(path) as f:
            yield f


def _assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _make_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, sched, scaler


def _train_step(model, opt, sched, scaler):
    x = torch.randn(4, 3, 8, 8)
    loss = model(x).square().mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()


def _full_state(model, opt, sched, scaler, step):
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "counters": {"global_step": step, "samples_done": step * 4, "mlflow_run_id": "run-1"},
    }


@pytest.mark.parametrize("writer", ["thread", "sync"])
def test_realistic_state_round_trips_and_resumes_bit_exactly(tmp_path, writer):
    model, opt, sched, scaler = _make_training()
    for _ in range(3):
        _train_step(model, opt, sched, scaler)
    storage = LocalStorage(tmp_path / "checkpoints")
    rec = Recorder()
    with Checkpointer(storage, keep_last=2, writer=writer, on_event=rec) as ckpt:
        state = _full_state(model, opt, sched, scaler, step=3)
        expected = copy.deepcopy(state)  # state_dicts alias live tensors; keep the values of step 3
        stall = ckpt.save(state, step=3, epoch=0, world_size=2, config_hash="h", meta={"note": "x"})
        assert stall >= 0
        _train_step(model, opt, sched, scaler)  # training goes on while the write is in flight
        assert ckpt.wait(30)
    after_one_more = [p.detach().clone() for p in model.parameters()]

    loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 3 and loaded.world_size == 2
    assert loaded.manifest["meta"] == {"note": "x"}
    _assert_same(expected, loaded.state)
    assert rec.names() == ["checkpoint"] and rec.events[0][1]["ok"] is True

    model2, opt2, sched2, scaler2 = _make_training()
    model2.load_state_dict(loaded.state["model"])
    opt2.load_state_dict(loaded.state["optimizer"])
    sched2.load_state_dict(loaded.state["scheduler"])
    scaler2.load_state_dict(loaded.state["scaler"])
    torch.set_rng_state(loaded.state["rng"]["torch"])
    _train_step(model2, opt2, sched2, scaler2)
    for a, b in zip(after_one_more, model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_failed_save_is_counted_reported_and_leaves_latest_alone(tmp_path):
    storage = FlakyStorage(tmp_path / "checkpoints")
    rec = Recorder()
    with Checkpointer(storage, keep_last=2, writer="thread", on_event=rec) as ckpt:
        ckpt.save({"w": torch.ones(10)}, step=1, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(30)
        storage.fail = True
        ckpt.save({"w": torch.zeros(10)}, step=2, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(30)
        stats = ckpt.stats
    assert stats.failures == 1 and stats.succeeded == 1 and stats.last_step == 1
    name, fields = rec.events[-1]
    assert name == "checkpoint_failed" and fields["step"] == 2 and fields["ok"] is False
    assert "No space left on device" in fields["error"] and fields["failures"] == 1
    assert storage.get_latest() == "step-00000001"
    assert torch.equal(load_latest(storage).state["w"], torch.ones(10))


def test_a_snapshot_error_is_a_reported_failure_not_an_exception(tmp_path):
    rec = Recorder()
    with Checkpointer(LocalStorage(tmp_path), writer="sync", on_event=rec) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1, epoch=0, world_size=1, config_hash="h", meta={"bad": object()})
        assert ckpt.stats.failures == 1
    assert rec.names() == ["checkpoint_failed"] and "snapshot failed" in rec.events[0][1]["error"]


def test_save_while_busy_is_skipped_and_counted_and_the_in_flight_snapshot_is_intact(tmp_path):
    storage = FlakyStorage(tmp_path / "checkpoints")
    rec = Recorder()
    state = {"w": torch.zeros(1000)}
    with Checkpointer(storage, writer="thread", on_event=rec) as ckpt:
        storage.gate.clear()
        ckpt.save(state, step=1, epoch=0, world_size=1, config_hash="h")
        assert storage.entered.wait(10) and ckpt.in_flight
        state["w"].fill_(7.0)  # the trainer mutates its state while the write is stuck
        ckpt.save(state, step=2, epoch=0, world_size=1, config_hash="h")
        assert ckpt.stats.skipped == 1
        storage.gate.set()
        assert ckpt.wait(30)
    assert rec.names() == ["checkpoint_skipped", "checkpoint"]
    assert rec.events[0][1] == {"step": 2, "in_flight_step": 1, "skipped": 1}
    loaded = load_latest(storage)
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(1000))


def test_if_busy_wait_waits_for_the_in_flight_save_then_saves(tmp_path):
    storage = FlakyStorage(tmp_path / "checkpoints")
    with Checkpointer(storage, writer="thread") as ckpt:
        storage.gate.clear()
        ckpt.save({"w": torch.zeros(4)}, step=1, epoch=0, world_size=1, config_hash="h")
        assert storage.entered.wait(10)
        threading.Timer(0.05, storage.gate.set).start()
        ckpt.save({"w": torch.ones(4)}, step=2, epoch=0, world_size=1, config_hash="h", if_busy="wait")
        assert ckpt.wait(30)
        assert ckpt.stats.skipped == 0 and ckpt.stats.succeeded == 2
    assert load_latest(storage).step == 2


def test_buffers_are_reused_and_reallocated_only_when_the_structure_changes(tmp_path):
    storage = LocalStorage(tmp_path)
    with Checkpointer(storage, writer="sync") as ckpt:
        ckpt.save({"a": torch.ones(100)}, step=1, epoch=0, world_size=1, config_hash="h")
        pool = ckpt._buffers.pool
        ckpt.save({"a": torch.full((100,), 2.0)}, step=2, epoch=0, world_size=1, config_hash="h")
        assert ckpt._buffers.pool is pool and ckpt._buffers.generation == 1
        bigger = {"a": torch.ones(100), "b": torch.arange(5000, dtype=torch.int64), "c": torch.tensor(True)}
        ckpt.save(bigger, step=3, epoch=0, world_size=1, config_hash="h")
        assert ckpt._buffers.generation == 2
        assert ckpt.stats.succeeded == 3
    _assert_same(bigger, load_latest(storage).state)


def test_a_broken_event_callback_does_not_break_saving(tmp_path):
    def explode(name, fields):
        raise RuntimeError("callback bug")

    with Checkpointer(LocalStorage(tmp_path), writer="thread", on_event=explode) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=1, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(30) and ckpt.stats.succeeded == 1


def test_bad_arguments_are_rejected_with_a_message_naming_them(tmp_path):
    storage: CheckpointStorage = LocalStorage(tmp_path)
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(storage, keep_last=0)
    with pytest.raises(ValueError, match="writer"):
        Checkpointer(storage, writer="fork")  # type: ignore[arg-type]
    ckpt = Checkpointer(storage, writer="sync")
    ckpt.close()
    with pytest.raises(RuntimeError, match="after close"):
        ckpt.save({}, step=1, epoch=0, world_size=1, config_hash="h")


def test_odd_tensors_round_trip_through_the_snapshot_buffers(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    big = torch.randn(5_000_000)  # 20 MB: split into chunks over the copy threads
    state = {
        "transposed": base.t(),  # not contiguous
        "sliced": base[:, ::2],
        "conj": torch.complex(base, -base).conj(),
        "bf16": base.to(torch.bfloat16),
        "bool": base > 10,
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "big": big,
        "tied": [big, big],  # one tensor twice: one slot
        "sparse": torch.eye(3).to_sparse(),  # not poolable: pickled with the skeleton
        "tuple": (1, "two", None, 3.5),
    }
    with Checkpointer(LocalStorage(tmp_path), writer="sync", copy_threads=2) as ckpt:
        ckpt.save(state, step=1, epoch=0, world_size=1, config_hash="h")
        assert ckpt.stats.succeeded == 1
    loaded = load_latest(LocalStorage(tmp_path)).state
    for key in ("transposed", "sliced", "bf16", "bool", "scalar", "empty", "big"):
        _assert_same(state[key].contiguous(), loaded[key], key)
    assert torch.equal(loaded["conj"], state["conj"].resolve_conj())
    assert torch.equal(loaded["tied"][1], big) and torch.equal(loaded["sparse"].to_dense(), torch.eye(3))
    assert loaded["tuple"] == (1, "two", None, 3.5)


def test_neither_building_a_process_writer_nor_its_first_save_waits_for_the_fork_servers_imports(tmp_path):
    """A worker that takes rank 0 after a reset builds its checkpointer on the recovery's path
    (``wait_for_writer=False``) and may save soon after, while every other worker waits in the next collective:
    neither may wait while the fork server imports torch. In a fresh process (the fork server is one per
    process), a preload module holds the server's imports until a gate file exists: building the checkpointer
    and its first save return while they are held; released, that save completes."""
    import os
    import subprocess
    import sys
    import textwrap

    (tmp_path / "held_import.py").write_text(
        textwrap.dedent(
            f"""
            import pathlib, time
            gate, done = pathlib.Path({str(tmp_path / "gate")!r}), pathlib.Path({str(tmp_path / "imported")!r})
            deadline = time.monotonic() + 20
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            done.write_text("x")
            """
        )
    )
    code = textwrap.dedent(
        f"""
        import pathlib
        import torch
        from elastictrain.checkpoint import Checkpointer, LocalStorage, load_latest
        from elastictrain.checkpoint import async_writer
        async_writer._FORKSERVER_PRELOAD.append("held_import")
        tmp = pathlib.Path({str(tmp_path)!r})
        storage = LocalStorage(tmp / "ckpt")
        ckpt = Checkpointer(storage, writer="process", wait_for_writer=False)
        ckpt.save({{"w": torch.ones(3)}}, step=1, epoch=0, world_size=1, config_hash="h")
        held = not (tmp / "imported").exists()
        (tmp / "gate").write_text("open")
        ok = ckpt.wait(60)
        ckpt.close()
        print("held", held, "saved", ok and load_latest(storage).step == 1, "imported", (tmp / "imported").exists())
        """
    )
    # The fork server finds the preload module through PYTHONPATH (it does not take the parent's sys.path).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", ""), "."])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-6:] == ["held", "True", "saved", "True", "imported", "True"], (
        out.stdout + out.stderr[-2000:]
    )
