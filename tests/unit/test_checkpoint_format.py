"""The checkpoint format: manifest, verification, pruning, and load falling back past damage."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import structlog
import torch

from elastictrain.checkpoint.format import (
    list_checkpoints,
    load_latest,
    rollback_latest,
    verify_checkpoint,
    write_checkpoint,
)
from elastictrain.checkpoint.manifest import MANIFEST, CheckpointDamaged
from elastictrain.checkpoint.storage import LatestIsNewer, LocalStorage


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
    # a resume fell back past a damaged newer one: the explicit rollback drops the newer one, saves go on from 30
    assert rollback_latest(storage, "step-00000030") == ["step-00000040"]
    _write(storage, 35, keep_last=1)
    assert storage.get_latest() == "step-00000035"
    assert [n for _, n in list_checkpoints(storage)] == ["step-00000035"]


def test_latest_never_moves_back_to_an_older_step_without_an_explicit_rollback(storage):
    _write(storage, 100)
    _write(storage, 200)
    with pytest.raises(LatestIsNewer, match="names step-00000200"):
        storage.set_latest("step-00000100")
    with pytest.raises(LatestIsNewer):  # a late writer of an older step: its folder stays, latest does not move
        _write(storage, 150, keep_last=1)
    assert storage.get_latest() == "step-00000200"
    assert [n for _, n in list_checkpoints(storage)] == ["step-00000100", "step-00000150", "step-00000200"]
    storage.set_latest("step-00000200")  # the same step again (a re-save) is not a move back
    storage.set_latest("step-00000100", rollback=True)
    assert storage.get_latest() == "step-00000100"


@pytest.mark.parametrize("pointer", [b"../outside/step-00000900", b"step-00000900/..", b"\xff\xfe", b""])
def test_a_latest_that_is_not_a_checkpoint_name_counts_as_none_when_moving_it(storage, pointer):
    _write(storage, 5)
    storage.write_bytes("latest", pointer)
    storage.set_latest("step-00000003")
    assert storage.get_latest() == "step-00000003"
    with pytest.raises(ValueError, match="not a checkpoint folder name"):
        storage.set_latest("../step-00000009")


def test_a_stale_writer_finishing_late_prunes_nothing_a_newer_writer_wrote(storage, tmp_path):
    """The orphaned writer of a dead rank 0 finishes step 100 while the new rank 0 is writing step 300 (its
    temp file is there, no manifest yet) and has written step 200's manifest but not moved latest yet."""
    _write(storage, 50)
    _write(LocalStorage(tmp_path / "other"), 200)
    os.rename(tmp_path / "other" / "step-00000200", storage.root / "step-00000200")
    (storage.root / "step-00000300").mkdir()
    (storage.root / "step-00000300" / ".state.pt.tmp-7-ab").write_bytes(b"half")
    result = _write(storage, 100, keep_last=1)  # latest 50 -> 100 is forward: allowed
    assert storage.get_latest() == "step-00000100" and result.pruned == ("step-00000050",)
    assert sorted(os.listdir(storage.root / "step-00000300")) == [".state.pt.tmp-7-ab"]
    assert verify_checkpoint(storage, "step-00000200")["step"] == 200
    storage.set_latest("step-00000200")  # the new rank 0 moves latest on
    assert load_latest(storage).step == 200


def test_a_fence_that_raises_stops_the_writer_before_latest_moves_and_before_pruning(storage):
    _write(storage, 10)
    _write(storage, 20)
    calls = []

    def fence():
        calls.append(storage.get_latest())
        if len(calls) == 2:
            raise RuntimeError("the trainer is gone")

    with pytest.raises(RuntimeError, match="trainer is gone"):
        _write(storage, 30, keep_last=1, fence=fence)
    assert calls == ["step-00000020", "step-00000030"]  # before latest moved, then before pruning
    assert [n for _, n in list_checkpoints(storage)] == ["step-00000010", "step-00000020", "step-00000030"]
    calls.clear()
    with pytest.raises(RuntimeError):
        _write(storage, 40, fence=lambda: (_ for _ in ()).throw(RuntimeError("the trainer is gone")))
    assert storage.get_latest() == "step-00000030"


def test_an_explicit_rollback_deletes_the_abandoned_newer_checkpoints_and_says_so(storage):
    for step in (10, 20, 30):
        _write(storage, step)
    with structlog.testing.capture_logs() as logs:
        assert rollback_latest(storage, "step-00000010") == ["step-00000020", "step-00000030"]
    assert storage.get_latest() == "step-00000010"
    assert [n for _, n in list_checkpoints(storage)] == ["step-00000010"]
    (warning,) = [e for e in logs if e["event"] == "checkpoint_rolled_back"]
    assert warning["previous"] == "step-00000030" and warning["log_level"] == "warning"
    _write(storage, 15)
    assert storage.get_latest() == "step-00000015"


def test_pruning_removes_folders_without_manifest_and_leftover_temp_files(storage, tmp_path):
    _write(storage, 1)
    (tmp_path / "checkpoints" / "step-00000002").mkdir()
    (tmp_path / "checkpoints" / "step-00000002" / ".state.pt.tmp-1-ab").write_bytes(b"half")
    (tmp_path / "checkpoints" / ".latest.tmp-1-cd").write_bytes(b"step-")
    (tmp_path / "checkpoints" / "step-00000001" / ".state.pt.tmp-1-ef").write_bytes(b"half")
    _write(storage, 3, keep_last=5)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "latest.lock", "step-00000001", "step-00000003"]
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


# ---------------------------------------------------------------- hostile or damaged checkpoints


class _RunsCodeWhenUnpickled:
    """Unpickling this opens (creates) ``path``: stands in for arbitrary code planted in a checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _assert_falls_back_to_100(storage, damaged: str = "step-00000200") -> None:
    with structlog.testing.capture_logs() as logs:
        loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 100, loaded
    assert torch.equal(loaded.state["w"], _state(100)["w"])
    warnings = [e for e in logs if e["event"] == "checkpoint_damaged_falling_back"]
    assert [w["damaged"] for w in warnings] == [damaged], logs
    assert warnings[0]["log_level"] == "warning" and warnings[0]["fallback"] == "step-00000100"


def _rewrite_state(storage, name: str, data: bytes) -> None:
    """Replace ``name``'s state file by ``data`` and make its manifest match (size and SHA-256)."""
    manifest = json.loads(storage.read_bytes(f"{name}/{MANIFEST}"))
    storage.write_bytes(f"{name}/{manifest['state_file']}", data)
    manifest["files"][manifest["state_file"]] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    storage.write_bytes(f"{name}/{MANIFEST}", json.dumps(manifest).encode())


def test_a_planted_checkpoint_that_runs_code_when_unpickled_is_never_unpickled(storage, tmp_path):
    marker = tmp_path / "PWNED"
    _write(storage, 100)
    write_checkpoint(
        storage,
        {"w": torch.zeros(2), "x": _RunsCodeWhenUnpickled(str(marker))},
        step=200,
        epoch=20,
        world_size=4,
        config_hash="cfg1",
    )
    verify_checkpoint(storage, "step-00000200")  # its manifest matches: only the loader can refuse it
    _assert_falls_back_to_100(storage)
    assert not marker.exists(), "the checkpoint was unpickled with arbitrary code"


def test_a_state_file_that_torch_load_rejects_falls_back_with_a_warning(storage):
    _write(storage, 100)
    _write(storage, 200)
    _rewrite_state(storage, "step-00000200", b"this is not a torch file")
    _assert_falls_back_to_100(storage)


def _set_manifest(storage, name: str, edit) -> None:
    manifest = json.loads(storage.read_bytes(f"{name}/{MANIFEST}"))
    new = edit(manifest)
    storage.write_bytes(f"{name}/{MANIFEST}", new if isinstance(new, bytes) else json.dumps(new).encode())


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: {**m, "files": {m["state_file"]: 5}},
        lambda m: {**m, "files": {m["state_file"]: {"sha256": 5, "bytes": "x"}}},
        lambda m: {**m, "files": {m["state_file"]: {"sha256": "ab", "bytes": -1}}},
        lambda m: {**m, "files": [m["state_file"]]},
        lambda m: {**m, "state_file": ["state.pt"]},
        lambda m: {**m, "state_file": "../../outside.pt", "files": {"../../outside.pt": m["files"][m["state_file"]]}},
        lambda m: {**m, "step": "two hundred"},
        lambda m: {**m, "step": 100},  # a manifest that does not belong to its folder
        lambda m: {**m, "world_size": 0},
        lambda m: [m],
        lambda m: None,
        lambda m: b"\xff\xfe not json",
    ],
    ids=[
        "file-entry-int",
        "file-entry-types",
        "file-entry-values",
        "files-list",
        "state-file-list",
        "state-file-escapes",
        "step-str",
        "step-other-folder",
        "world-size-zero",
        "manifest-list",
        "manifest-null",
        "manifest-bytes",
    ],
)
def test_a_malformed_manifest_falls_back_to_the_previous_checkpoint_with_a_warning(storage, edit):
    _write(storage, 100)
    _write(storage, 200)
    _set_manifest(storage, "step-00000200", edit)
    with pytest.raises(CheckpointDamaged):
        verify_checkpoint(storage, "step-00000200")
    _assert_falls_back_to_100(storage)


@pytest.mark.parametrize("pointer", ["../outside/step-00000300", "/etc", "step-00000200/../../outside", "..", "nope"])
def test_latest_naming_something_outside_the_checkpoints_is_ignored_with_a_warning(storage, tmp_path, pointer):
    outside = LocalStorage(tmp_path / "outside")
    _write(outside, 300)
    _write(storage, 100)
    _write(storage, 200)
    storage.write_bytes("latest", pointer.encode())
    with structlog.testing.capture_logs() as logs:
        loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 200 and loaded.path.startswith(str(storage.root))
    assert any(e["event"] == "checkpoint_latest_invalid" and e["log_level"] == "warning" for e in logs), logs


def test_a_checkpoint_folder_that_is_a_link_out_of_the_checkpoints_is_not_loaded(storage, tmp_path):
    outside = LocalStorage(tmp_path / "outside")
    _write(outside, 300)
    _write(storage, 100)
    _write(storage, 200)
    (storage.root / "step-00000300").symlink_to(outside.root / "step-00000300")
    storage.set_latest("step-00000300")
    with structlog.testing.capture_logs() as logs:
        loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 200
    warnings = [e for e in logs if e["event"] == "checkpoint_damaged_falling_back"]
    assert [w["damaged"] for w in warnings] == ["step-00000300"]
