"""Typed config: parsing, overrides, environment, and every rejection path (one line, exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastictrain.config import ConfigError, JobConfig, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]
BASE = {"job": "j", "run_dir": "/tmp/r"}


def test_shipped_configs_parse_with_the_recipe_values():
    demo = load_config(REPO / "configs/demo.yaml")
    assert demo.device == "cpu" and demo.task_args["model"] == "small_cnn"
    r50 = load_config(REPO / "configs/resnet50_imagenet.yaml")
    assert r50.task_args["model"] == "resnet50" and r50.training.epochs == 90
    assert r50.data.batch_size == 128 and r50.training.momentum == 0.9
    assert r50.training.weight_decay == 1e-4 and r50.training.grad_clip_norm == 5.0
    assert r50.training.schedule.kind == "multistep"
    assert r50.training.schedule.milestones == (30, 60, 80)
    assert r50.training.schedule.warmup_epochs == 5
    assert r50.precision.mode == "fp16" and r50.checkpoint.keep_last == 3
    assert r50.elastic.lr_scaling == "linear"


def test_set_overrides_any_field_with_yaml_typed_values():
    cfg = config_from_dict(
        BASE,
        [
            "training.base_lr=0.05",
            "training.schedule.milestones=[2, 4]",
            "training.schedule.kind=multistep",
            "data.path=null",
            "run_dir=/shared/x",
            "elastic.rollback=none",
        ],
    )
    assert cfg.training.base_lr == 0.05
    assert cfg.elastic.rollback == "none"  # the word, not YAML's null
    assert cfg.training.schedule.milestones == (2, 4)
    assert cfg.run_dir == "/shared/x"


def test_ints_are_accepted_where_floats_are_expected():
    cfg = config_from_dict({**BASE, "training": {"base_lr": 1}})
    assert isinstance(cfg.training.base_lr, float)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("discovery.etcd", "discovery.etcd: unknown key"),
        ("discovery.cache_staleness_seconds", "discovery.cache_staleness_seconds: unknown key"),
        ("discovery.ttl_second", "discovery.ttl_second: unknown key (did you mean 'discovery.ttl_seconds'?)"),
    ],
)
def test_keys_that_nothing_reads_are_not_config(key: str, message: str) -> None:
    """etcd endpoints come from ``launch --etcd`` / ``ELASTICTRAIN_ETCD`` and the cache staleness from
    ``ELASTICTRAIN_DISCOVER_STALENESS``: a config key for either would be read by nothing."""
    with pytest.raises(ConfigError) as err:
        config_from_dict(BASE, [f"{key}=1"])
    assert str(err.value).startswith(message)


def test_resolved_config_round_trips_through_yaml_and_has_a_stable_digest():
    cfg = load_config(REPO / "configs/demo.yaml")
    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg and again.digest() == cfg.digest()
    assert config_from_dict(BASE, ["training.seed=1"]).digest() != config_from_dict(BASE).digest()
    assert cfg.flat()["training.schedule.kind"] == "cosine"


def test_config_is_frozen():
    cfg = config_from_dict(BASE)
    with pytest.raises(AttributeError):
        cfg.job = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "overrides", "message"),
    [
        ({**BASE, "trainig": {}}, [], "trainig: unknown key (did you mean 'training'?)"),
        (
            {**BASE, "training": {"base_rl": 0.1}},
            [],
            "training.base_rl: unknown key (did you mean 'training.base_lr'?)",
        ),
        ({**BASE, "training": {"epochs": "ten"}}, [], "training.epochs: must be an integer, got 'ten'"),
        ({**BASE, "training": {"epochs": True}}, [], "training.epochs: must be an integer"),
        ({**BASE, "training": {"base_lr": -1}}, [], "training.base_lr: must be > 0"),
        ({**BASE, "tracking": {"flush_seconds": -1}}, [], "tracking.flush_seconds: must be in [0, 3600], got -1"),
        (
            {**BASE, "tracking": {"open_wait_seconds": -1}},
            [],
            "tracking.open_wait_seconds: must be in [0, 3600], got -1",
        ),
        ({**BASE, "training": []}, [], "training: must be a mapping"),
        ({**BASE, "elastic": {"policy": "globl"}}, [], "did you mean 'global'?"),
        ({**BASE, "elastic": {"policy": "global"}}, [], "elastic.global_batch_size: is required"),
        ({**BASE, "elastic": {"min_np": 4, "max_np": 2}}, [], "elastic.max_np: must be >= elastic.min_np"),
        (
            {**BASE, "discovery": {"ttl_seconds": 3, "heartbeat_seconds": 2}},
            [],
            "discovery.heartbeat_seconds",
        ),
        ({**BASE, "task": "mypkg.lm.build"}, [], "task: must be 'module:function'"),
        ({**BASE, "task_args": [1]}, [], "task_args: must be a mapping"),
        ({**BASE, "task": "m:build", "model": {"name": "x"}}, [], "model.name: belongs to the built-in image task"),
        ({**BASE, "model": {"name": "x"}, "task_args": {"model": "y"}}, [], "model.name: set twice"),
        ({**BASE, "training": {"schedule": {"kind": "multistep"}}}, [], "training.schedule.milestones"),
        ({"run_dir": "/tmp/r"}, [], "job: required key is missing"),
        ({**BASE, "job": "a b"}, [], "job: invalid job name 'a b'"),
        ({**BASE, "job": ".."}, [], "job: invalid job name '..'"),
        ({**BASE, "job": "-x"}, [], "job: invalid job name '-x'"),
        ({**BASE, "job": "caf\u00e9"}, [], "job: invalid job name 'caf\\xe9'"),
        ({**BASE, "job": "x" * 254}, [], "job: invalid job name"),
        (BASE, ["training"], "--set 'training': expected dotted.key=value"),
        (BASE, ["job.x=1"], "--set job.x: job is not a section"),
        (BASE, ["training.nope=1"], "training.nope: unknown key"),
        (BASE, ["checkpoint.keep_last=0"], "checkpoint.keep_last: must be >= 1"),
        (BASE, ["elastic.rollback=nonee"], "elastic.rollback: must be one of 'commit', 'none', got 'nonee'"),
        ({**BASE, "elastic": {"rollback": None}}, [], "elastic.rollback: must be one of 'commit', 'none', got None"),
        (
            BASE,
            ["elastic.straggler_cooldown_seconds=0"],
            "elastic.straggler_cooldown_seconds: must be > 0 and finite, got 0",
        ),
        (BASE, ["elastic.straggler_cooldown_seconds=.nan"], "elastic.straggler_cooldown_seconds: must be > 0"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(data, overrides, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, overrides)
    text = str(err.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("job: j\nrun_dir: r\ntraining: {epochs: 0}\n", [], "training.epochs: must be >= 1"),
        ("job: j\nrun_dir: r\n  bad: [\n", [], "invalid YAML at line"),
        ("- a\n- b\n", [], "the top level must be a mapping"),
        (
            "job: j\nrun_dir: r\n",
            ["--set", "model.nmae=x"],
            "model.nmae: unknown key (did you mean 'model.name'?)",
        ),
        (None, [], "config file not found"),
    ],
)
def test_cli_rejects_bad_config_with_exit_2_and_one_line(tmp_path, content, args, message):
    path = tmp_path / "job.yaml"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run(
        [sys.executable, "-m", "elastictrain.cli", "config", "show", "--config", str(path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr


def test_cli_prints_the_resolved_config(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastictrain.cli",
            "config",
            "show",
            "--config",
            str(REPO / "configs/demo.yaml"),
            "--set",
            "training.base_lr=0.02",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["training"]["base_lr"] == 0.02 and shown["job"] == "demo"
    assert isinstance(config_from_dict(shown), JobConfig)


def test_cli_misuse_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "elastictrain.cli", "frobnicate"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr


def test_image_task_keys_of_older_configs_move_into_task_args():
    cfg = config_from_dict(
        {**BASE, "model": {"name": "resnet18"}, "data": {"kind": "synthetic", "num_samples": 64, "batch_size": 8}},
        ["data.image_size=24", "training.label_smoothing=0.1"],
    )
    assert cfg.task == "elastictrain.tasks.image:build"
    assert cfg.task_args == {"model": "resnet18", "data": "synthetic", "num_samples": 64, "image_size": 24,
                             "label_smoothing": 0.1}  # fmt: skip
    assert cfg.data.batch_size == 8


def test_an_override_of_an_image_key_wins_over_the_files_task_args():
    data = {**BASE, "task_args": {"num_samples": 64}}
    assert config_from_dict(data, ["data.num_samples=32"]).task_args == {"num_samples": 32}


def test_task_args_are_free_form_and_appear_in_the_flat_params():
    cfg = config_from_dict({**BASE, "task": "mypkg.lm:build", "task_args": {"seq_len": 128, "vocab": [1, 2]}})
    assert cfg.task_args == {"seq_len": 128, "vocab": [1, 2]}
    assert cfg.flat()["task_args.seq_len"] == "128" and cfg.flat()["task"] == "mypkg.lm:build"
