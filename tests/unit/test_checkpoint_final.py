"""The final and the SIGTERM checkpoint of rank 0: written, or said not to be, never skipped silently."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import torch
from torch import nn

from elastictrain.checkpoint import Checkpointer, LocalStorage, load_latest
from elastictrain.config import JobConfig
from elastictrain.elastic import DistContext, ElasticTrainer
from elastictrain.policy import ScaleRamp
from elastictrain.sampler import SamplerState
from elastictrain.state import CommittedState, Counters


class GatedStorage(LocalStorage):
    """LocalStorage whose writes block while ``gate`` is clear and fail while ``fail`` is set."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False

    @contextlib.contextmanager
    def open_write(self, path):
        self.entered.set()
        assert self.gate.wait(30)
        if self.fail:
            raise OSError(28, "No space left on device")
        with super().open_write(path) as f:
            yield f


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, event, **fields) -> None:
        self.emitted.append((event, fields))


def _committed_at(step: int) -> CommittedState:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    st = CommittedState(model, opt, sched, None, SamplerState(), Counters(), ScaleRamp(1, 1, 0, 0))
    st.counters.step = step
    st.save()
    return st


def _rank0_trainer(tmp_path, storage, step: int) -> ElasticTrainer:
    """Rank 0's checkpoint side of a trainer, without Horovod: the committed state is at ``step``."""
    t = object.__new__(ElasticTrainer)
    t.cfg = JobConfig(job="final", run_dir=str(tmp_path / "run"))
    t.ctx = DistContext(rank=0, size=2)
    t.committed = _committed_at(step)
    t.counters, t.sampler = t.committed.counters, t.committed.sampler
    t.config_hash = "h"
    t.tracker = SimpleNamespace(run_id="r")
    t.events = Events()
    t.checkpointer = Checkpointer(storage, writer="thread")
    t._checkpointed_step = -1
    t._metrics = {"steps": 0}
    t.ledger = None
    t.step_log = t.committed.step_log
    t._ledger_written = -1
    t._last_loss = None
    return t


def _skip_a_periodic_save_of(trainer: ElasticTrainer, storage: GatedStorage) -> None:
    """A save of an older step is still writing when the periodic save of the committed step comes."""
    storage.gate.clear()
    trainer.checkpointer.save({"w": torch.zeros(1)}, step=1, epoch=0, world_size=2, config_hash="h")
    assert storage.entered.wait(30)
    trainer._checkpoint()  # the periodic trigger: skipped, the writer is busy
    assert trainer.checkpointer.stats.skipped == 1
    storage.gate.set()


def test_sigterm_after_a_skipped_periodic_save_still_checkpoints_the_last_commit(tmp_path):
    storage = GatedStorage(tmp_path / "run" / "checkpoints")
    trainer = _rank0_trainer(tmp_path, storage, step=5)
    _skip_a_periodic_save_of(trainer, storage)
    assert trainer.checkpoint_last_commit() is True
    assert storage.get_latest() == "step-00000005"
    assert load_latest(storage).step == 5
    trainer.checkpointer.close()


def test_the_end_of_a_job_after_a_skipped_periodic_save_writes_the_final_checkpoint(tmp_path):
    storage = GatedStorage(tmp_path / "run" / "checkpoints")
    trainer = _rank0_trainer(tmp_path, storage, step=7)
    _skip_a_periodic_save_of(trainer, storage)
    trainer._finish(SimpleNamespace(save=lambda: None))
    assert storage.get_latest() == "step-00000007"
    done = [f for e, f in trainer.events.emitted if e == "done"]
    assert len(done) == 1 and done[0]["checkpointed"] is True
    trainer.checkpointer.close()


def test_a_final_checkpoint_that_cannot_be_written_is_reported_not_claimed(tmp_path):
    storage = GatedStorage(tmp_path / "run" / "checkpoints")
    trainer = _rank0_trainer(tmp_path, storage, step=9)
    storage.fail = True
    assert trainer.checkpoint_last_commit() is False
    trainer._finish(SimpleNamespace(save=lambda: None))
    done = [f for e, f in trainer.events.emitted if e == "done"]
    assert done[0]["checkpointed"] is False
    assert storage.get_latest() is None
    storage.fail = False  # a later attempt (the disk has room again) writes it
    assert trainer.checkpoint_last_commit() is True and storage.get_latest() == "step-00000009"
    trainer.checkpointer.close()
