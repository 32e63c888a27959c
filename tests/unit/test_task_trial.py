"""The task is tried on real samples before a job starts (elastictrain/engine/task_trial.py): each way a loss, a metric
or
a collate can break the contract is one line naming it; a good task passes; a large model is tried on meta."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastictrain
from elastictrain.config import ConfigError, JobConfig, load_config
from elastictrain.config_cli import check_task
from elastictrain.engine import task_trial
from elastictrain.task import TaskError, validate_task

MODULE = "trial_task_mod"
NOT_PER_SAMPLE = (
    "task: the task's loss must return one value per sample (a 1-D tensor of shape [2] for a batch of 2), got "
)


def mse(model, batch):
    x, y = batch
    return (model(x).squeeze(1) - y) ** 2


def data(n: int = 8) -> TensorDataset:
    return TensorDataset(torch.randn(n, 3), torch.randn(n))


def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **task_fields) -> JobConfig:
    """A config whose task builds ``elastictrain.Task(model=nn.Linear(3, 1), train_data=..., loss=mse, **fields)``."""
    import types

    mod = types.ModuleType(MODULE)

    def build():
        fields = {"model": nn.Linear(3, 1), "train_data": data(), "loss": mse, **task_fields}
        return elastictrain.Task(**fields)

    mod.build = build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, mod)
    path = tmp_path / "job.yaml"
    path.write_text(f"job: trial\nrun_dir: {tmp_path / 'run'}\ntask: {MODULE}:build\n")
    return load_config(path)


def trial(cfg: JobConfig) -> task_trial.TrialResult:
    return task_trial.try_task(cfg, validate_task(cfg))


def test_a_per_sample_loss_and_metrics_pass_on_two_real_samples(tmp_path, monkeypatch):
    cfg = job(tmp_path, monkeypatch, val_data=data(), metrics=lambda m, b: {"abs": (m(b[0]).squeeze(1) - b[1]).abs()})
    result = trial(cfg)
    assert (result.samples, result.device, result.metrics) == (2, "cpu", ("abs",))
    assert str(result) == "loss and metrics abs tried on 2 samples (shape, finite, gradient)"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss": lambda m, b: mse(m, b).mean()},
         NOT_PER_SAMPLE + "() (a scalar: return the per-sample values, e.g. reduction='none', not their mean)"),
        ({"loss": lambda m, b: (m(b[0]) - b[1][:, None]) ** 2},
         NOT_PER_SAMPLE + "(2, 1)"),
        ({"loss": lambda m, b: mse(m, b)[:1]},
         NOT_PER_SAMPLE + "(1,)"),
        ({"loss": lambda m, b: 0.5},
         NOT_PER_SAMPLE + "float"),
        ({"loss": lambda m, b: mse(m, b) * float("nan")},
         "task: the task's loss returned non-finite values (nan) for train_data[0:2] on the CPU"),
        ({"loss": lambda m, b: mse(m, b) + float("inf")},
         "task: the task's loss returned non-finite values (inf) for train_data[0:2] on the CPU"),
        ({"loss": lambda m, b: mse(m, b).detach()},
         "task: the loss has no gradient: it must be computed from the model's output"),
        ({"loss": lambda m, b: b[2]},
         "task: loss(model, batch) raised IndexError: list index out of range (on train_data[0:2], on the CPU)"),
        ({"metrics": lambda m, b: {"abs": (m(b[0]) - b[1][:, None]).abs()}},
         "task: the task's metric 'abs' must return one value per sample (a 1-D tensor of shape [2] for a batch of 2), "
         "got (2, 1)"),
        ({"metrics": lambda m, b: [1.0, 2.0]}, "task: metrics must return a mapping {name: Tensor[n]}, got list"),
        ({"metrics": lambda m, b: {"abs": mse(m, b) / 0.0}},
         "task: the task's metric 'abs' returned non-finite values"),
        ({"collate": lambda samples: 1 / 0},
         "task: collating raised ZeroDivisionError: division by zero (on train_data[0:2], on the CPU)"),
    ],
    ids=["scalar", "column", "too-short", "not-a-tensor", "nan", "inf", "no-grad", "loss-raises", "metric-shape",
         "metrics-not-a-mapping", "metric-nan", "collate-raises"],
)  # fmt: skip
def test_each_broken_contract_is_one_line_naming_it(tmp_path, monkeypatch, fields, message):
    with pytest.raises(TaskError) as err:
        trial(job(tmp_path, monkeypatch, **fields))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_metrics_are_tried_on_the_validation_data_when_there_is_one(tmp_path, monkeypatch):
    val = TensorDataset(torch.randn(4, 5), torch.randn(4))  # 5 features: the model takes 3
    with pytest.raises(TaskError, match=r"on val_data\[0:2\]"):
        trial(job(tmp_path, monkeypatch, val_data=val))


def test_a_dataset_of_one_sample_is_tried_with_a_batch_of_one(tmp_path, monkeypatch):
    assert trial(job(tmp_path, monkeypatch, train_data=data(1))).samples == 1


def test_a_model_above_the_size_limit_is_tried_on_the_meta_device_for_shapes(tmp_path, monkeypatch):
    monkeypatch.setattr(task_trial, "REAL_MODEL_MAX_PARAMETERS", 1)
    cfg = job(tmp_path, monkeypatch, loss=lambda m, b: mse(m, b) * float("nan"))
    result = trial(cfg)  # values are not checked on meta: a nan passes, the shape is still checked
    assert result.device == "meta"
    with pytest.raises(TaskError, match=r"got \(\)"):
        trial(job(tmp_path, monkeypatch, loss=lambda m, b: mse(m, b).sum()))


def test_config_validate_reports_the_trial_and_skips_it_when_asked(tmp_path, monkeypatch):
    cfg = job(tmp_path, monkeypatch)
    path = str(tmp_path / "job.yaml")
    assert "loss tried on 2 samples" in check_task(cfg, path, trial_seconds=30)
    assert "tried" not in check_task(cfg, path)


def test_a_trial_that_runs_past_its_limit_is_one_line(tmp_path, monkeypatch):
    import time

    def slow(m, b):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # Python code: the alarm interrupts it
            pass
        return mse(m, b)

    cfg = job(tmp_path, monkeypatch, loss=slow)
    with pytest.raises(ConfigError) as err:
        check_task(cfg, str(tmp_path / "job.yaml"), trial_seconds=0.5)
    assert str(err.value).startswith("task: trying the task on real samples took over 0.5s (raise the limit")
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "the timer is disarmed after the trial"


def test_a_dataset_that_reports_its_own_one_line_error_is_shown_as_it_is(tmp_path, monkeypatch):
    class Missing(TensorDataset):
        def __len__(self) -> int:
            raise ConfigError("task_args.path: /data/x is not a directory")

    cfg = job(tmp_path, monkeypatch, train_data=Missing(torch.zeros(1)))
    with pytest.raises(ConfigError) as err:
        trial(cfg)
    assert str(err.value) == "task_args.path: /data/x is not a directory"
