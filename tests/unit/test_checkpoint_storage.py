"""LocalStorage: atomic writes, the latest pointer, listing and deleting."""

from __future__ import annotations

import os
import pickle

import pytest

from elastictrain.checkpoint.storage import TEMP_MARKER, LocalStorage


def test_atomic_write_creates_folders_and_leaves_no_temp_file(tmp_path):
    storage = LocalStorage(tmp_path / "ckpt")
    storage.write_bytes("step-00000001/state.pt", b"hello")
    assert storage.read_bytes("step-00000001/state.pt") == b"hello"
    assert storage.size("step-00000001/state.pt") == 5
    assert os.listdir(tmp_path / "ckpt" / "step-00000001") == ["state.pt"]


def test_write_interrupted_by_an_error_keeps_the_old_file_and_removes_the_temp(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.write_bytes("a/f", b"old content")
    with pytest.raises(RuntimeError, match="boom"), storage.open_write("a/f") as f:
        f.write(b"new, half written")
        raise RuntimeError("boom")
    assert storage.read_bytes("a/f") == b"old content"
    assert not [n for n in os.listdir(tmp_path / "a") if TEMP_MARKER in n]


def test_the_file_is_invisible_under_its_name_until_the_write_completes(tmp_path):
    storage = LocalStorage(tmp_path)
    with storage.open_write("x/f") as f:
        f.write(b"data")
        assert not storage.exists("x/f")
    assert storage.exists("x/f")


def test_latest_pointer_round_trip_and_absent_pointer(tmp_path):
    storage = LocalStorage(tmp_path)
    assert storage.get_latest() is None
    storage.set_latest("step-00000007")
    assert storage.get_latest() == "step-00000007"
    storage.set_latest("step-00000009")
    assert storage.get_latest() == "step-00000009"


def test_list_and_delete_files_and_folders(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.write_bytes("b/1", b"1")
    storage.write_bytes("a/2", b"2")
    assert storage.list_dir("") == ["a", "b"]
    assert storage.list_dir("missing") == []
    storage.delete("a")
    storage.delete("b/1")
    storage.delete("never/was")
    assert storage.list_dir("") == ["b"]
    assert storage.list_dir("b") == []


def test_keys_cannot_escape_the_root(tmp_path):
    storage = LocalStorage(tmp_path / "root")
    with pytest.raises(ValueError, match=r"\.\."):
        storage.write_bytes("../outside", b"x")
    with pytest.raises(ValueError, match="root"):
        storage.delete("")


def test_storage_is_picklable_for_the_writer_process(tmp_path):
    storage = LocalStorage.for_run_dir(tmp_path)
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.root == tmp_path / "checkpoints"
