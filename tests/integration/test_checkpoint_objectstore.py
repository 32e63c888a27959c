"""Checkpoints in an object store, against moto's real S3 API server on loopback: a store that answers 500/503 or
drops connections in the middle of a save (through a fault-injecting proxy), and a real training job whose
checkpoints live only in the store, resumed from it with an empty run_dir, exported and reported from it."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from chaos.jobs import ElasticJob
from elastictrain.checkpoint.checkpointer import Checkpointer
from elastictrain.checkpoint.format import load_latest, verify_checkpoint
from elastictrain.checkpoint.location import storage_for
from elastictrain.checkpoint.manifest import CheckpointDamaged
from elastictrain.checkpoint.objectstore import FsspecStorage
from elastictrain.checkpoint.storage import CheckpointStorage
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Checkpoint, CheckpointFailed, Done, Start, of_kind, read_events
from tests.fixtures.elastic_job import job_config
from tests.fixtures.procs import VENV_BIN, kill_tree, wait_until
from tests.fixtures.s3_server import SECRET_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOSTS = local_logical_hosts()


def _part_upload(method: str, path: str) -> bool:
    return method == "PUT" and "partNumber=" in path


def _state(step: int) -> dict[str, torch.Tensor | int]:
    return {"w": torch.full((3 << 20,), float(step)), "step": step}  # 12 MiB: three 5 MiB parts


class LatestWatcher:
    """Reads ``latest`` over and over while a test runs and verifies every checkpoint it names (manifest, sizes,
    SHA-256): a partial checkpoint named even once is recorded."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self.seen: set[str] = set()
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                name = self.storage.get_latest()
                if name is not None and name not in self.seen:
                    verify_checkpoint(self.storage, name)
                    self.seen.add(name)
            except CheckpointDamaged as e:
                self.bad.append(str(e))
            except OSError:
                pass  # the store itself is failing on purpose
            self._stop.wait(0.05)

    def __enter__(self) -> LatestWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.fixture
def store(s3_proxy, tmp_path):
    s3, proxy = s3_proxy
    storage = storage_for(s3.url("faults"), tmp_path)
    assert isinstance(storage, FsspecStorage) and storage.endpoint_url == proxy.endpoint
    storage.block_size = 5 << 20
    return s3, proxy, storage


@pytest.mark.parametrize("fault", ["503", "500", pytest.param("connection dropped", marks=pytest.mark.long)])
def test_the_store_failing_in_the_middle_of_a_save_reports_it_and_latest_keeps_the_last_good_one(store, fault):
    s3, proxy, storage = store
    events: list[tuple[str, dict]] = []
    with (
        LatestWatcher(storage) as watcher,
        Checkpointer(storage, writer="thread", on_event=lambda n, f: events.append((n, f))) as ckpt,
    ):
        ckpt.save(_state(10), step=10, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(120) and ckpt.stats.last_step == 10

        # From the second part on, every part upload fails: the save is in the middle of its multipart upload.
        def second_part_on(method: str, path: str) -> bool:
            return _part_upload(method, path) and "partNumber=1&" not in path + "&"

        if fault == "connection dropped":
            proxy.fail(second_part_on, status=None, drop=True)
        else:
            proxy.fail(second_part_on, status=int(fault))
        ckpt.save(_state(20), step=20, epoch=0, world_size=1, config_hash="h")
        assert ckpt.in_flight or ckpt.stats.failures == 1  # save() returned; the write goes on behind it
        assert ckpt.wait(300)
        assert ckpt.stats.failures == 1 and ckpt.stats.last_step == 10, ckpt.stats
        assert proxy.faulted >= 2  # the client retried the part before giving up
        assert storage.get_latest() == "step-00000010"
        assert storage.list_dir("step-00000020") == []  # nothing of the failed save is visible
        # The store recovers: the next save goes through and moves latest.
        proxy.clear()
        ckpt.save(_state(30), step=30, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(120) and ckpt.stats.last_step == 30
    names = [n for n, _ in events]
    assert names == ["checkpoint", "checkpoint_failed", "checkpoint"], names
    failed = events[1][1]
    assert failed["step"] == 20 and failed["ok"] is False and SECRET_KEY not in json.dumps(failed, default=str)
    assert watcher.bad == [] and "step-00000020" not in watcher.seen
    loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 30 and float(loaded.state["w"][0]) == 30.0
    uploads = s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert uploads == [] or fault == "connection dropped", uploads  # aborted (a dropped abort may linger)


def test_a_brief_outage_is_retried_within_the_save(store):
    _, proxy, storage = store
    proxy.fail(_part_upload, status=503, times=2)
    with Checkpointer(storage, writer="thread") as ckpt:
        ckpt.save(_state(5), step=5, epoch=0, world_size=1, config_hash="h")
        assert ckpt.wait(120)
        assert ckpt.stats.succeeded == 1 and ckpt.stats.failures == 0, ckpt.stats
    assert proxy.faulted == 2
    loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 5


@pytest.mark.long  # the store refusing saves is proven at the storage level above; this is the whole job's view
def test_a_job_trains_on_while_the_store_refuses_its_saves_and_checkpoints_again_after(s3_proxy, jobs, tmp_path):
    s3, proxy = s3_proxy
    location = s3.url("jobs/outage")
    storage = storage_for(location, tmp_path)
    proxy.fail(lambda method, path: method == "PUT" and "/state" in path, status=503)  # every state file upload
    cfg = job_config(
        tmp_path / "run",
        training__epochs=12,
        data__num_samples=768,
        checkpoint__every_steps=6,
        checkpoint__location=location,
    )
    job = ElasticJob(tmp_path / "job", cfg, HOSTS[:2])
    jobs.append(job.start())
    with LatestWatcher(storage) as watcher:
        first_failure = wait_until(
            lambda: of_kind(job.events(), CheckpointFailed), 240, what="a save the store refused"
        )[0]
        step_when_reported = job.step()
        assert storage.get_latest() is None  # nothing was ever complete, so nothing is named
        proxy.clear()
        assert job.wait_exit() == 0, job.tail()
    # The save failed in the background (after the client's retries) while the steps went on.
    assert first_failure.step is not None and step_when_reported > first_failure.step
    events = read_events(job.events_path)
    saved = of_kind(events, Checkpoint)
    assert saved and saved[-1].step is not None and saved[-1].step > first_failure.step
    assert [e.checkpointed for e in of_kind(events, Done)] == [True]
    assert watcher.bad == [] and f"step-{first_failure.step:08d}" not in watcher.seen
    final = load_latest(storage)
    assert final is not None and final.step == saved[-1].step == job.step() and final.skipped == ()
    assert SECRET_KEY not in job.events_path.read_text() and SECRET_KEY not in job.tail(400)


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_BIN / "elastictrain"), *args], capture_output=True, text=True, timeout=180, cwd=cwd)


def test_a_job_checkpoints_only_to_the_store_and_a_new_empty_run_dir_resumes_exports_and_reports_from_it(
    s3_server, jobs, tmp_path
):
    location = s3_server.url("jobs/resume")
    storage = storage_for(location, tmp_path)
    cfg = job_config(
        tmp_path / "run-a",
        training__epochs=1,
        data__num_samples=1536,
        checkpoint__every_steps=9,
        checkpoint__location=location,
        checkpoint__writer="process",
    )
    first = ElasticJob(tmp_path / "a", cfg, HOSTS[:2])
    jobs.append(first.start())
    with LatestWatcher(storage) as watcher:
        wait_until(lambda: (load_latest(storage) or None) is not None and first.step() >= 14, 240, what="a checkpoint")
        kill_tree(first.proc.pid, signal.SIGKILL)  # the whole job at once: a preemption
        first.proc.wait(timeout=30)
    ckpt = load_latest(storage)
    assert ckpt is not None and ckpt.path.startswith(location + "/step-")
    assert not (tmp_path / "run-a" / "checkpoints").exists()  # nothing on the node's disk
    assert watcher.bad == []

    # A new node: an empty run_dir; the checkpoints are in the store.
    cfg_b = {**cfg, "run_dir": str(tmp_path / "run-b")}
    second = ElasticJob(tmp_path / "b", cfg_b, HOSTS[:2])
    jobs.append(second.start())
    assert second.wait_exit() == 0, second.tail()
    starts = of_kind(read_events(second.events_path), Start)
    assert starts[-1].resumed_from_step == ckpt.step
    assert of_kind(read_events(second.events_path), CheckpointFailed) == []
    saved = of_kind(read_events(second.events_path), Checkpoint)
    assert saved and all(e.path is not None and e.path.startswith(location + "/step-") for e in saved)
    final = load_latest(storage)
    assert final is not None and final.step > ckpt.step
    assert not (tmp_path / "run-b" / "checkpoints").exists()

    out = tmp_path / "model.pt"
    exported = _run_cli("export", "--run-dir", str(tmp_path / "run-b"), "--out", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    model = torch.load(out, weights_only=True)
    assert all(torch.equal(model[k], final.state["model"][k]) for k in model)

    status = _run_cli("status", "--run-dir", str(tmp_path / "run-b"), "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["checkpoint"]["path"] == f"{location}/step-{final.step:08d}", st["checkpoint"]
    for text in (status.stdout, status.stderr, exported.stdout, exported.stderr, second.tail()):
        assert SECRET_KEY not in text
