"""A user's task under ``elastictrain launch``: a module written from the README alone (linear regression on a
TensorDataset, per-sample squared error) trains to completion on two logical hosts, and ``elastictrain export``
gets its weights out; a bad task (one that does not import or build, or whose loss or metrics break the contract
on real samples) is one line and exit 2 within seconds, with nothing started; a loss that raises mid-run is the
launcher's last line."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from elastictrain.rundir import layout
from elastictrain.rundir.events import Done, EpochEnd, of_kind, read_events
from tests.fixtures.procs import VENV_BIN, ProcessGroup, kill_tree

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ELASTICTRAIN = VENV_BIN / "elastictrain"
needs_horovod = pytest.mark.skipif(not (VENV_BIN / "horovodrun").exists(), reason="horovodrun is not installed")

LINREG = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastictrain

TRUE_W, TRUE_B = [1.5, -2.0, 0.5], 0.3


def make(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor(TRUE_W) + TRUE_B + 0.01 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def mse(model, batch):
    x, y = batch
    return (model(x).squeeze(1) - y) ** 2  # one loss per sample


def abs_error(model, batch):
    x, y = batch
    return {"abs_error": (model(x).squeeze(1) - y).abs()}


def build(n=512, val_n=128):
    return elastictrain.Task(
        model=nn.Linear(3, 1),
        train_data=make(n, seed=1),
        val_data=make(val_n, seed=2),
        loss=mse,
        metrics=abs_error,
    )
"""


SQUARED = "return (model(x).squeeze(1) - y) ** 2"
NOT_PER_SAMPLE = (
    "task: the task's loss must return one value per sample (a 1-D tensor of shape [2] for a batch of 2), got "
)


def write_job(tmp_path: Path, **top: object) -> Path:
    cfg = {
        "job": "linreg",
        "run_dir": "runs/linreg",
        "device": "cpu",
        "task": "linreg:build",
        "task_args": {"n": 512},
        "data": {"batch_size": 16},
        "training": {"epochs": 4, "base_lr": 0.05, "momentum": 0.0, "weight_decay": 0.0, "log_every_steps": 4},
        "elastic": {"min_np": 2, "max_np": 2, "base_world_size": 2},
        "checkpoint": {"every_steps": 10},
        "tracking": {"mlflow": False, "progress_bar": False},
        "audit": {"sample_ledger": True},
        **top,
    }
    (tmp_path / "linreg.py").write_text(LINREG)
    path = tmp_path / "linreg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def env() -> dict[str, str]:
    e = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "ELASTICTRAIN_LOG_LEVEL": "warning"}
    e.pop("ELASTICTRAIN_ETCD", None)
    return e


@needs_horovod
def test_a_readme_task_module_trains_to_completion_under_launch_and_exports(tmp_path: Path) -> None:
    write_job(tmp_path)
    procs = ProcessGroup()
    log = tmp_path / "launch.log"
    try:
        with log.open("wb") as out:
            proc = procs.start(
                [str(ELASTICTRAIN), "launch", "--config", "linreg.yaml", "--hosts", "localhost,127.0.0.1",
                 "--gloo-timeout-seconds", "15"],
                env=env(), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
            )  # fmt: skip
            code = proc.wait(timeout=180)
    finally:
        procs.cleanup()
    assert code == 0, log.read_text()[-3000:]
    run = tmp_path / "runs" / "linreg"
    events = read_events(run / layout.EVENTS)
    done = of_kind(events, Done)
    assert len(done) == 1 and (done[0].final_loss or 1.0) < 0.01, done
    epoch_ends = of_kind(events, EpochEnd)
    assert len(epoch_ends) == 4 and (epoch_ends[-1].val_metrics["val_abs_error"] or 1.0) < 0.05, epoch_ends[-1]
    assert (epoch_ends[-1].val_loss or 1.0) < 0.01 and epoch_ends[-1].val_accuracy is None

    from elastictrain.rundir.ledger import committed_samples

    per_epoch = committed_samples(run / "ledger")
    assert all(sorted(ids) == list(range(512)) for ids in per_epoch.values()) and len(per_epoch) == 4

    out = subprocess.run(
        [str(ELASTICTRAIN), "export", "--run-dir", str(run), "--out", str(tmp_path / "model.pt")],
        capture_output=True, text=True, timeout=120, env=env(), check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == {"weight", "bias"}
    assert torch.allclose(state["weight"], torch.tensor([[1.5, -2.0, 0.5]]), atol=0.05), state
    resolved = yaml.safe_load((tmp_path / "model.yaml").read_text())
    assert resolved["task"] == "linreg:build" and resolved["task_args"] == {"n": 512}


@pytest.mark.parametrize(
    ("top", "module", "message"),
    [
        ({"task": "linreg_missing:build"}, None, "task: cannot import module 'linreg_missing'"),
        ({"task": "linreg:biuld"}, None, "task: module 'linreg' has no function 'biuld' (did you mean 'build'?)"),
        ({"task": "broken:build", "task_args": {}}, "def build():\n    return 42\n", "returned int, not an"),
        ({"task_args": {"nn": 3}}, None, "task_args.nn: linreg:build takes no such argument (did you mean"),
        ({"task": "elastictrain.tasks.image:build", "task_args": {"model": "resnet"}}, None,
         "task_args.model: unknown architecture 'resnet'"),
        # The task is tried on 2 real samples before anything starts (elastictrain/engine/task_trial.py).
        ({"task": "broken:build"}, LINREG.replace(SQUARED, f"return ({SQUARED[7:]}).mean()"),
         NOT_PER_SAMPLE + "() (a scalar"),
        ({"task": "broken:build"}, LINREG.replace(SQUARED, "return (model(x) - y[:, None]) ** 2"),
         NOT_PER_SAMPLE + "(2, 1)"),
        ({"task": "broken:build"}, LINREG.replace(SQUARED, SQUARED + " * float('nan')"),
         "task: the task's loss returned non-finite values (nan) for train_data[0:2] on the CPU"),
        ({"task": "broken:build"}, LINREG.replace("(model(x).squeeze(1) - y).abs()", "(model(x) - y[:, None]).abs()"),
         NOT_PER_SAMPLE.replace("loss", "metric 'abs_error'") + "(2, 1)"),
    ],
    ids=["no-module", "no-function", "not-a-task", "bad-arg", "bad-arch", "scalar-loss", "loss-shape", "nan-loss",
         "metric-shape"],
)  # fmt: skip
def test_a_bad_task_fails_launch_with_one_line_and_exit_2_and_starts_nothing(
    tmp_path: Path, top: dict, module: str | None, message: str
) -> None:
    config = write_job(tmp_path, **top)
    if module is not None:
        (tmp_path / "broken.py").write_text(module)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(ELASTICTRAIN), "launch", "--config", str(config), "--hosts", "localhost,127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env(),
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr
    assert lines[0].startswith("elastictrain launch: config error: ")
    assert stdout == ""
    assert not (tmp_path / "runs").exists(), "nothing is started (no run_dir, no etcd)"
    assert time.monotonic() - t0 < 20


RAISES_AT_STEP_3 = LINREG.replace(
    "def mse(model, batch):\n    x, y = batch\n",
    "calls = 0\n\n\ndef mse(model, batch):\n    global calls\n    x, y = batch\n"
    "    if model.training:\n        calls += 1\n        if calls == 3:\n"
    "            raise ValueError('bad batch at step 3: labels out of range')\n",
)


@needs_horovod
def test_a_loss_that_raises_mid_run_is_the_launchers_last_line_naming_host_and_exception(tmp_path: Path) -> None:
    config = write_job(tmp_path, task="raiser:build")
    (tmp_path / "raiser.py").write_text(RAISES_AT_STEP_3)
    assert "raise ValueError" in RAISES_AT_STEP_3
    procs = ProcessGroup()
    try:
        proc = procs.start(
            [str(ELASTICTRAIN), "launch", "--config", str(config), "--hosts", "localhost,127.0.0.1",
             "--gloo-timeout-seconds", "15", "--status-every", "0"],
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        )  # fmt: skip
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        procs.cleanup()
    assert proc.returncode == 1, (stdout[-2000:], stderr[-3000:])
    last = stderr.strip().splitlines()[-1]
    assert last in (
        f"elastictrain launch: worker {host}[0] failed: ValueError: bad batch at step 3: labels out of range"
        for host in ("localhost", "127.0.0.1")
    ), stderr[-3000:]
    assert "Horovod detected that one or more processes exited with non-zero status" in stderr  # kept above it
