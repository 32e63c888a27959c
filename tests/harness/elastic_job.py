"""Run a real ``elastictrain train`` job under real ``horovodrun`` on logical local hosts, and act on it.

The harness itself (:class:`ElasticJob`) lives in ``elastictrain/bench/jobs.py`` (hosts come from
:func:`elastictrain.launcher.hosts.local_logical_hosts`),
shared with ``elastictrain bench``; this module adds the small test job config and the
exactly-once check on its ledger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastictrain.bench.jobs import ElasticJob, read_jsonl
from elastictrain.ledger import committed_samples

__all__ = ["ElasticJob", "assert_exactly_once", "job_config", "read_jsonl"]


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


def assert_exactly_once(job: ElasticJob, num_samples: int, epochs: int) -> None:
    per_epoch = committed_samples(job.run_dir / "ledger")
    assert sorted(per_epoch) == list(range(epochs)), f"epochs in ledger: {sorted(per_epoch)}"
    for epoch, ids in per_epoch.items():
        assert len(ids) == num_samples, f"epoch {epoch}: {len(ids)} samples used, expected {num_samples}"
        assert sorted(ids) == list(range(num_samples)), f"epoch {epoch}: duplicates or gaps"
