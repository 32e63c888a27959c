"""Run a real ``elastictrain train`` job under real ``horovodrun`` on logical local hosts, and act on it.

The harness itself (:class:`ElasticJob`, :func:`logical_hosts`) lives in ``elastictrain/bench/jobs.py``,
shared with ``elastictrain bench``; this module adds the small test job config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastictrain.bench.jobs import ElasticJob, logical_hosts, read_jsonl

__all__ = ["ElasticJob", "job_config", "logical_hosts", "read_jsonl"]


def job_config(run_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A small CPU job: synthetic 16x16 images, GroupNorm CNN, frequent commits, ledger on, MLflow off."""
    cfg: dict[str, Any] = {
        "job": "itest",
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {
            "kind": "synthetic",
            "image_size": 16,
            "batch_size": 16,
            "num_samples": 3072,
            "num_val_samples": 96,
            "augment": False,
        },
        "training": {"epochs": 2, "base_lr": 0.02, "log_every_steps": 4, "seed": 3},
        "elastic": {"commit_every_steps": 3, "base_world_size": 2},
        "checkpoint": {"every_steps": 12, "writer": "thread"},
        "tracking": {"mlflow": False, "progress_bar": False},
        "audit": {"sample_ledger": True},
    }
    for dotted, value in overrides.items():
        node = cfg
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg
