"""Real Horovod elastic: a gradient allreduce enqueued while the background thread shuts down leaves nothing behind.

Horovod 0.28.1 checks its shut-down flag without the tensor queue's lock (``EnqueueTensorAllreduces``), and the
background thread, once it leaves its loop, sets that flag and then empties the queue (``FinalizeTensorQueue``).
A gradient hook whose enqueue falls between the two adds an entry that nothing will ever finish to the global
process set's queue, which ``hvd.shutdown`` and ``hvd.init`` keep: in the next ring that parameter's hook raises
``ValueError: ... same name as another tensor that is currently being processed``, and a step whose last enqueue
was the stranded one waits for it forever. The Horovod patch (``elastictrain/horovod/patch.py``) must close the queue
when it is finalized, until the next ``hvd.init``; on an unpatched build this test fails at the first stranded
allreduce.

The worker (``workers/allreduce_race.py``) makes the race frequent: many tiny layers, so that a backward pass is a
dense run of enqueues, and rank 0 failing a random moment into its backward pass, so that the coordinated
shutdown reaches the other ranks mid-backward (as a drained worker's exit does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chaos.jobs import ElasticJob
from chaos.procs import wait_until
from elastictrain.launcher.hosts import local_logical_hosts
from tests.fixtures.procs import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = REPO / "tests" / "integration" / "workers" / "allreduce_race.py"
RESETS = 300
WORKERS = 3


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_gradient_hooks_racing_the_background_threads_shutdown_strand_no_allreduce(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    job = ElasticJob(
        workdir=tmp_path,
        config={"run_dir": str(tmp_path / "run")},
        hosts=local_logical_hosts(WORKERS),
        min_np=WORKERS,
        max_np=WORKERS,
        command=lambda cfg: [sys.executable, str(WORKER), str(record), str(RESETS)],
    )

    def bad() -> list[dict]:
        return [r for r in records(record) if r.get("stranded") or "duplicate" in r]

    try:
        proc = job.start().proc
        assert proc is not None
        wait_until(lambda: proc.poll() is not None or bad(), 540, interval=1.0, what=f"{RESETS} resets")
    finally:
        job.close()
    found = bad()
    assert not found, f"an allreduce was stranded in Horovod's tensor queue by its shutdown: {found[:2]}"
    resets = max((r["reset"] for r in records(record) if "stranded" in r), default=0)
    assert proc.returncode == 0 and resets >= RESETS, f"exit {proc.returncode} after {resets} resets:\n{job.tail()}"
