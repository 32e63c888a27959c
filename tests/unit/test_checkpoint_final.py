"""The final and the SIGTERM checkpoint of rank 0: written, or said not to be, never skipped silently."""

from __future__ import annotations

import torch

from elastictrain.checkpoint import load_latest
from elastictrain.config import JobConfig
from elastictrain.engine.trainer import Trainer
from elastictrain.rundir.events import Done
from tests.fixtures.trainer import GatedStorage, trainer


def _rank0_trainer(tmp_path, storage, step: int):
    return trainer(JobConfig(job="final", run_dir=str(tmp_path / "run")), step=step, storage=storage)


def _skip_a_periodic_save_of(trainer: Trainer, storage: GatedStorage) -> None:
    """A save of an older step is still writing when the periodic save of the committed step comes."""
    storage.gate.clear()
    trainer.services.checkpointer.save({"w": torch.zeros(1)}, step=1, epoch=0, world_size=2, config_hash="h")
    assert storage.entered.wait(30)
    trainer.checkpoint(wait=False)  # the periodic trigger: skipped, the writer is busy
    assert trainer.services.checkpointer.stats.skipped == 1
    storage.gate.set()


def test_sigterm_after_a_skipped_periodic_save_still_checkpoints_the_last_commit(tmp_path):
    storage = GatedStorage(tmp_path / "run" / "checkpoints")
    trainer = _rank0_trainer(tmp_path, storage, step=5)
    _skip_a_periodic_save_of(trainer, storage)
    assert trainer.checkpoint_last_commit() is True
    assert storage.get_latest() == "step-00000005"
    assert load_latest(storage).step == 5
    trainer.services.checkpointer.close()


def test_the_end_of_a_job_after_a_skipped_periodic_save_writes_the_final_checkpoint(tmp_path):
    storage = GatedStorage(tmp_path / "run" / "checkpoints")
    trainer = _rank0_trainer(tmp_path, storage, step=7)
    _skip_a_periodic_save_of(trainer, storage)
    trainer._finish(trainer.state)
    assert storage.get_latest() == "step-00000007"
    done = trainer.services.events.of(Done)
    assert len(done) == 1 and done[0].checkpointed is True
    trainer.services.checkpointer.close()


def test_a_final_checkpoint_that_cannot_be_written_is_reported_not_claimed(tmp_path):
    storage = GatedStorage(tmp_path / "run" / "checkpoints")
    trainer = _rank0_trainer(tmp_path, storage, step=9)
    storage.fail = True
    assert trainer.checkpoint_last_commit() is False
    trainer._finish(trainer.state)
    done = trainer.services.events.of(Done)
    assert done[0].checkpointed is False
    assert storage.get_latest() is None
    storage.fail = False  # a later attempt (the disk has room again) writes it
    assert trainer.checkpoint_last_commit() is True and storage.get_latest() == "step-00000009"
    trainer.services.checkpointer.close()
