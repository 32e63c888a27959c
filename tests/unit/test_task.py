"""The Task API: the dataclass's checks, importing and building a task (one-line errors), the meta-device dry
run, device moves of nested batches, per-micro-batch loading, and exact validation sums."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain import Task
from elastictrain.config import ConfigError, config_from_dict
from elastictrain.engine.data import load_batches
from elastictrain.engine.step import Precision, eval_batches, move_to, train_step
from elastictrain.task import TaskError, build_task, check_dataset_size, resolve_builder, validate_task

REPO = Path(__file__).resolve().parents[2]
BASE = {"job": "j", "run_dir": "/tmp/r"}
IMAGE = "elastictrain.tasks.image:build"


def mse(model, batch):
    x, y = batch
    return (model(x).squeeze(1) - y) ** 2


def good_task(**_: object) -> Task:
    x = torch.randn(8, 3)
    return Task(model=nn.Linear(3, 1), train_data=TensorDataset(x, x.sum(1)), loss=mse)


def not_a_task() -> dict:
    return {"model": nn.Linear(1, 1)}


def needs_real_tensors(n: int = 4) -> Task:
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    assert int(x.sum().item()) == n * (n - 1) // 2  # .item() cannot run on the meta device
    return Task(model=nn.Linear(1, 1), train_data=TensorDataset(x, x.squeeze(1)), loss=mse)


def raises() -> Task:
    raise ValueError("no data here\nsecond line")


NotCallable = 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "linear"}, "Task.model must be a torch.nn.Module, got str"),
        ({"train_data": [1, 2].__iter__()}, "Task.train_data must be a map-style dataset"),
        ({"val_data": 5}, "Task.val_data must be a map-style dataset"),
        ({"loss": None}, "Task.loss must be callable"),
        ({"metrics": "acc"}, "Task.metrics must be callable"),
    ],
)
def test_task_rejects_what_the_engine_cannot_use_with_one_line(kwargs, message):
    fields = {"model": nn.Linear(1, 1), "train_data": TensorDataset(torch.zeros(2, 1)), "loss": mse, **kwargs}
    with pytest.raises(TaskError) as err:
        Task(**fields)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_pkg.lm:build", "task: cannot import module 'no_such_pkg.lm' (no module named 'no_such_pkg'"),
        ("tests.unit.test_task:good_tsak", "has no function 'good_tsak' (did you mean 'good_task'?)"),
        ("tests.unit.test_task:NotCallable", "is a int, not a function"),
    ],
)
def test_a_task_that_cannot_be_found_is_one_line(spec, message):
    with pytest.raises(TaskError) as err:
        resolve_builder(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("task", "args", "message"),
    [
        ("tests.unit.test_task:not_a_task", {}, "returned dict, not an elastictrain.Task"),
        ("tests.unit.test_task:raises", {}, "task: tests.unit.test_task:raises raised ValueError: no data here"),
        ("tests.unit.test_task:needs_real_tensors", {"nn": 3}, "task_args.nn: tests.unit.test_task:needs_real_tensors "
         "takes no such argument (did you mean 'task_args.n'?)"),
        (IMAGE, {"modle": "x"}, "task_args.modle: unknown key (did you mean 'task_args.model'"),
        (IMAGE, {"model": "resnt18"}, "unknown architecture 'resnt18' (did you mean 'resnet18'"),
        (IMAGE, {"data": "image_folder"}, "task_args.path: is required"),
    ],
)  # fmt: skip
def test_a_task_that_cannot_be_built_is_one_line(task, args, message):
    cfg = config_from_dict({**BASE, "task": task, "task_args": args})
    with pytest.raises(ConfigError) as err:
        validate_task(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_validation_builds_on_the_meta_device_so_a_large_model_costs_nothing():
    cfg = config_from_dict({**BASE, "task_args": {"model": "resnet50", "num_classes": 1000}})
    t0 = time.monotonic()
    task = validate_task(cfg)
    assert time.monotonic() - t0 < 10
    assert all(p.device.type == "meta" for p in task.model.parameters())


def test_validation_falls_back_to_the_cpu_when_the_task_needs_real_tensors():
    cfg = config_from_dict({**BASE, "task": "tests.unit.test_task:needs_real_tensors"})
    assert validate_task(cfg).model.weight.device.type == "cpu"


def test_build_seeds_torch_with_the_jobs_seed_so_every_worker_starts_from_the_same_weights():
    cfg = config_from_dict({**BASE, "task": "tests.unit.test_task:good_task", "training": {"seed": 5}})
    a, b = build_task(cfg), build_task(cfg)
    assert torch.equal(a.model.weight, b.model.weight) and check_dataset_size(a) == 8


def test_an_empty_dataset_is_refused():
    task = Task(model=nn.Linear(1, 1), train_data=TensorDataset(torch.zeros(0, 1)), loss=mse)
    with pytest.raises(TaskError, match="at least one sample"):
        check_dataset_size(task)


def test_batches_move_to_the_device_whatever_their_nesting():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2), "rest": [Pair(torch.zeros(1), "label"), (torch.ones(1), 3)]}
    moved = move_to(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and isinstance(moved["rest"][0], Pair)
    assert moved["rest"][0].a.device.type == "meta" and moved["rest"][0].b == "label"
    assert moved["rest"][1][0].device.type == "meta" and moved["rest"][1][1] == 3


def test_the_loader_yields_one_collated_batch_per_index_list_in_order():
    ds = TensorDataset(torch.arange(10.0))
    batches = list(load_batches(ds, iter([[3, 1], [7]]), 0))
    assert [b[0].tolist() for b in batches] == [[3.0, 1.0], [7.0]]
    custom = list(load_batches(ds, iter([[2, 4]]), 0, collate_fn=lambda samples: [s[0].item() for s in samples]))
    assert custom == [[2.0, 4.0]]


def test_a_loss_that_is_not_per_sample_is_refused():
    model = nn.Linear(3, 1)
    batch = (torch.randn(4, 3), torch.randn(4))
    with pytest.raises(ValueError, match=r"one value per sample \(a 1-D tensor of shape \[n\]\), got \(\)"):
        train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            None,
            [batch],
            4,
            precision=Precision(None, False),
            grad_clip_norm=None,
            loss_fn=lambda m, b: mse(m, b).sum(),
        )


def test_validation_sums_are_exact_over_uneven_batches():
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    x = torch.arange(5.0).unsqueeze(1)
    ds = TensorDataset(x, torch.zeros(5))
    batches = load_batches(ds, iter([[0, 1, 2], [3, 4]]), 0)
    totals = eval_batches(
        model, batches, Precision(None, False), mse, lambda m, b: {"pos": (m(b[0]) > 1.5).float()[:, 0]}
    )
    assert totals == {"loss": (0 + 1 + 4 + 9 + 16, 5), "pos": (3.0, 5)}


def test_config_validate_reports_a_bad_task_in_one_line_with_exit_2(tmp_path):
    (tmp_path / "job.yaml").write_text("job: j\nrun_dir: r\ntask: mymodel:build\n")
    (tmp_path / "mymodel.py").write_text("def biuld():\n    return None\n")
    proc = subprocess.run(
        [sys.executable, "-m", "elastictrain.cli", "config", "validate", "--config", str(tmp_path / "job.yaml")],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc
    assert proc.stderr.strip() == (
        "elastictrain: config error: task: module 'mymodel' has no function 'build' (did you mean 'biuld'?)"
    )


def test_export_of_a_run_without_checkpoints_is_one_line_with_exit_2(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "elastictrain.cli",
        "export",
        "--run-dir",
        str(tmp_path),
        "--out",
        str(tmp_path / "m.pt"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc
    assert "no checkpoints/ folder" in proc.stderr and not (tmp_path / "m.pt").exists()
