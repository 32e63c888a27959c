"""A resume refuses a config that changes which samples each step sees; safe changes stay allowed."""

from __future__ import annotations

import pytest

from elastictrain.checkpoint import LocalStorage, load_latest
from elastictrain.config import ConfigError, config_from_dict
from tests.fixtures.trainer import trainer

BASE = {"job": "resume", "data": {"num_samples": 256}, "training": {"seed": 3, "epochs": 2}}


def _cfg(tmp_path, *overrides: str):
    return config_from_dict({**BASE, "run_dir": str(tmp_path / "run")}, overrides)


def _checkpoint_at_step_5(tmp_path) -> None:
    first = trainer(_cfg(tmp_path), step=5)
    assert first.checkpoint_last_commit() is True
    first.services.checkpointer.close()
    manifest = load_latest(LocalStorage.for_run_dir(tmp_path / "run")).manifest
    assert manifest["meta"]["resume_inputs"]["training.seed"] == 3


@pytest.mark.parametrize(
    ("overrides", "num_samples", "named"),
    [
        (("training.seed=4",), None, ["training.seed=3", "training.seed=4"]),
        (("data.drop_last=true",), None, ["data.drop_last=False", "data.drop_last=True"]),
        (("data.num_samples=300",), None, ["dataset_length=256", "dataset_length=300"]),
        ((), 255, ["dataset_length=256", "dataset_length=255"]),  # an image folder that lost a file
        (("training.seed=4", "data.drop_last=true"), None, ["training.seed=3", "data.drop_last=True"]),
    ],
    ids=["seed", "drop_last", "num_samples", "dataset-length", "two-keys"],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_resume_that_changes_the_permutation_inputs_is_refused_with_one_line_naming_them(
    tmp_path, overrides, num_samples, named, rank
):
    _checkpoint_at_step_5(tmp_path)
    second = trainer(_cfg(tmp_path, *overrides), rank=rank, num_samples=num_samples)
    with pytest.raises(ConfigError) as e:
        second.resume_from_checkpoint()
    msg = str(e.value)
    assert "\n" not in msg and "step-00000005" in msg, msg
    for part in named:
        assert part in msg, msg
    assert second.counters.step == 0  # nothing was loaded
    if second.services.checkpointer is not None:
        second.services.checkpointer.close()


def test_safe_changes_such_as_the_learning_rate_and_the_epochs_resume(tmp_path):
    _checkpoint_at_step_5(tmp_path)
    second = trainer(_cfg(tmp_path, "training.base_lr=0.01", "training.epochs=5", "data.batch_size=8"))
    second.resume_from_checkpoint()
    assert second.counters.step == 5 and second.resumed_from == 5
    second.services.checkpointer.close()


def test_the_config_fingerprint_ignores_runtime_endpoints_but_not_the_training(tmp_path):
    a = _cfg(tmp_path, "discovery.prefix=/a")
    b = config_from_dict(
        {**BASE, "run_dir": str(tmp_path / "elsewhere")},
        ["discovery.prefix=/b", "tracking.tracking_uri=http://127.0.0.1:5000"],
    )
    assert a.digest() == b.digest()
    assert a.digest() != _cfg(tmp_path, "training.seed=4").digest()
    assert a.digest() != _cfg(tmp_path, "training.base_lr=0.5").digest()
