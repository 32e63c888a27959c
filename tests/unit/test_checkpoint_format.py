"""The checkpoint format: manifest, verification, pruning, and load falling back past damage."""

from __future__ import annotations

import json
import os

import pytest
import structlog
import torch

from elastictrain.checkpoint.format import (
    MANIFEST,
    CheckpointDamaged,
    list_checkpoints,
    load_latest,
    verify_checkpoint,
    write_checkpoint,
)
from elastictrain.checkpoint.storage import LocalStorage


def _state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "step": step}


def _write(storage, step, keep_last=None, **kw):
    return write_checkpoint(
        storage,
        _state(step),
        step=step,
        epoch=step // 10,
        world_size=4,
        config_hash="cfg1",
        keep_last=keep_last,
        **kw,
    )


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(tmp_path / "checkpoints")


def test_manifest_records_fields_and_a_sha256_per_file(storage):
    res = _write(storage, 12, meta={"mlflow_run_id": "abc"})
    assert res.name == "step-00000012" and storage.get_latest() == "step-00000012"
    manifest = json.loads(storage.read_bytes(f"{res.name}/{MANIFEST}"))
    assert manifest["step"] == 12 and manifest["epoch"] == 1 and manifest["world_size"] == 4
    assert manifest["config_hash"] == "cfg1" and manifest["meta"] == {"mlflow_run_id": "abc"}
    assert manifest["created_at"].endswith("+00:00")
    ((fname, entry),) = manifest["files"].items()
    assert entry["bytes"] == storage.size(f"{res.name}/{fname}") == res.bytes
    assert verify_checkpoint(storage, res.name)["step"] == 12


def test_keep_last_prunes_older_checkpoints_but_never_the_one_latest_names(storage):
    for step in (10, 20, 30, 40):
        _write(storage, step, keep_last=2)
    assert [n for _, n in list_checkpoints(storage)] == ["step-00000030", "step-00000040"]
    # latest moved back (a resume fell back past a damaged newer one): latest is kept, the newer is dropped
    storage.set_latest("step-00000030")
    _write(storage, 35, keep_last=1)
    assert storage.get_latest() == "step-00000035"
    assert [n for _, n in list_checkpoints(storage)] == ["step-00000035"]


def test_pruning_removes_folders_without_manifest_and_leftover_temp_files(storage, tmp_path):
    _write(storage, 1)
    (tmp_path / "checkpoints" / "step-00000002").mkdir()
    (tmp_path / "checkpoints" / "step-00000002" / ".state.pt.tmp-1-ab").write_bytes(b"half")
    (tmp_path / "checkpoints" / ".latest.tmp-1-cd").write_bytes(b"step-")
    (tmp_path / "checkpoints" / "step-00000001" / ".state.pt.tmp-1-ef").write_bytes(b"half")
    _write(storage, 3, keep_last=5)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-00000001", "step-00000003"]
    assert sorted(os.listdir(tmp_path / "checkpoints" / "step-00000001")) == [MANIFEST, "state.pt"]


def test_saving_the_same_step_again_never_touches_the_files_its_manifest_names(storage):
    first = _write(storage, 5)
    old_manifest = json.loads(storage.read_bytes(f"{first.name}/{MANIFEST}"))
    write_checkpoint(storage, {"w": torch.ones(3), "step": 5}, step=5, epoch=0, world_size=1, config_hash="c")
    new_manifest = json.loads(storage.read_bytes(f"{first.name}/{MANIFEST}"))
    assert new_manifest["state_file"] != old_manifest["state_file"]
    assert storage.list_dir(first.name) == sorted([MANIFEST, new_manifest["state_file"]])
    assert torch.equal(load_latest(storage).state["w"], torch.ones(3))


def _newest_state_file(storage):
    name = storage.get_latest()
    manifest = json.loads(storage.read_bytes(f"{name}/{MANIFEST}"))
    return storage.local_path(f"{name}/{manifest['state_file']}")


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def _drop_manifest(path):
    os.unlink(path.parent / MANIFEST)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(_truncate, "bytes, manifest says"), (_flip_byte, "SHA-256 does not match"), (_drop_manifest, "no manifest")],
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(storage, damage, reason):
    _write(storage, 100)
    _write(storage, 200)
    damage(_newest_state_file(storage))
    with pytest.raises(CheckpointDamaged):
        verify_checkpoint(storage, "step-00000200")
    with structlog.testing.capture_logs() as logs:
        loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 100 and loaded.epoch == 10
    assert torch.equal(loaded.state["w"], _state(100)["w"])
    assert loaded.path.endswith("step-00000100")
    assert len(loaded.skipped) == 1 and reason in loaded.skipped[0].replace(MANIFEST, "manifest")
    warnings = [e for e in logs if e["event"] == "checkpoint_damaged_falling_back"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert warnings[0]["damaged"] == "step-00000200" and warnings[0]["fallback"] == "step-00000100"
    assert "falling back to the previous checkpoint step-00000100" in warnings[0]["message"]


def test_load_latest_is_none_without_checkpoints_and_when_all_are_damaged(storage):
    assert load_latest(storage) is None
    _write(storage, 1)
    _truncate(_newest_state_file(storage))
    assert load_latest(storage) is None


def test_missing_latest_pointer_still_finds_the_newest_complete_checkpoint(storage):
    _write(storage, 1)
    _write(storage, 2)
    storage.delete("latest")
    assert load_latest(storage).step == 2
