"""The CheckpointStorage contract, one suite run against every backend: LocalStorage and the object-store backend
(FsspecStorage on moto's S3 server, a thread on loopback, as s3fs's own suite runs).

What the checkpoint format relies on: atomic objects (nothing partial ever visible), listing and deleting by
folder, a ``latest`` that only moves forward, and the format's promises on top (verified load, fallback past a
damaged checkpoint, ``weights_only``, pruning) hold in both.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle

import pytest
import torch

from elastictrain.checkpoint.checkpointer import Checkpointer
from elastictrain.checkpoint.format import list_checkpoints, load_latest, write_checkpoint
from elastictrain.checkpoint.location import storage_for
from elastictrain.checkpoint.manifest import read_latest
from elastictrain.checkpoint.objectstore import FsspecStorage
from elastictrain.checkpoint.storage import CheckpointStorage, LatestIsNewer, LocalStorage
from elastictrain.logconf import get_logger
from tests.fixtures.s3_server import SECRET_KEY

BIG = 12 << 20
"""More than FsspecStorage's 5 MiB smallest part: such a write is a multipart upload."""


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> CheckpointStorage:
    if request.param == "local":
        return storage_for(str(tmp_path / "ckpt"), tmp_path)
    s3 = request.getfixturevalue("s3_server")
    st = storage_for(s3.url("jobs/contract"), tmp_path)
    assert isinstance(st, FsspecStorage)
    st.block_size = 5 << 20
    return st


def _write(storage: CheckpointStorage, step: int, keep_last: int | None = None):
    state = {"w": torch.full((64,), float(step)), "step": step}
    return write_checkpoint(storage, state, step=step, epoch=0, world_size=2, config_hash="h", keep_last=keep_last)


def _flip_a_byte(storage: CheckpointStorage, key: str) -> None:
    data = bytearray(storage.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(key, bytes(data))


def test_a_written_file_reads_back_with_its_size_and_is_listed_under_its_folder(storage):
    storage.write_bytes("step-00000001/state.pt", b"hello")
    storage.write_bytes("step-00000001/manifest.json", b"{}")
    storage.write_bytes("step-00000002/state.pt", b"x")
    assert storage.read_bytes("step-00000001/state.pt") == b"hello"
    assert storage.size("step-00000001/state.pt") == 5
    assert storage.list_dir("") == ["step-00000001", "step-00000002"]
    assert storage.list_dir("step-00000001") == ["manifest.json", "state.pt"]
    assert storage.list_dir("nothing-here") == []
    assert storage.exists("step-00000001") and storage.exists("step-00000001/state.pt")
    assert not storage.exists("step-00000003") and not storage.exists("step-0000000")
    with storage.open_read("step-00000001/state.pt") as f:
        assert f.read() == b"hello"


def test_a_missing_file_is_file_not_found(storage):
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("step-00000009/state.pt")
    with pytest.raises(FileNotFoundError):
        storage.size("step-00000009/state.pt")
    with pytest.raises(FileNotFoundError):
        storage.open_read("step-00000009/state.pt")


def test_a_streamed_write_is_invisible_until_it_completes_even_past_one_part(storage):
    chunk = bytes(range(256)) * 4096  # 1 MiB
    with storage.open_write("step-00000001/state.pt") as f:
        for _ in range(BIG // len(chunk)):
            f.write(chunk)
        assert not storage.exists("step-00000001/state.pt")
        assert "state.pt" not in storage.list_dir("step-00000001")  # (a local temp file may be there)
    assert storage.size("step-00000001/state.pt") == BIG


def test_a_write_that_fails_midway_leaves_the_old_object_and_nothing_partial(storage, request):
    storage.write_bytes("a/f", b"old content")
    with pytest.raises(RuntimeError, match="boom"), storage.open_write("a/f") as f:
        f.write(b"n" * BIG)  # a part or more already uploaded
        raise RuntimeError("boom")
    assert storage.read_bytes("a/f") == b"old content"
    assert storage.list_dir("a") == ["f"]
    if isinstance(storage, FsspecStorage):  # the multipart upload was aborted, not left to linger
        s3 = request.getfixturevalue("s3_server")
        assert s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def test_delete_removes_a_file_or_a_folder_and_never_a_sibling_sharing_its_prefix(storage):
    for key in ("step-00000001/state.pt", "step-00000001/manifest.json", "step-000000010/state.pt", "latest"):
        storage.write_bytes(key, b"x")
    storage.delete("step-00000001")
    assert storage.list_dir("") == ["latest", "step-000000010"]
    storage.delete("latest")
    storage.delete("latest")  # absent is fine
    storage.delete("step-00000099")
    assert storage.list_dir("") == ["step-000000010"]
    with pytest.raises(ValueError):
        storage.delete("")


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "./x"])
def test_keys_with_dot_components_are_refused(storage, key):
    with pytest.raises(ValueError):
        storage.write_bytes(key, b"x")


def test_latest_moves_forward_only_unless_rolled_back(storage):
    assert storage.get_latest() is None
    storage.set_latest("step-00000010")
    storage.set_latest("step-00000020")
    with pytest.raises(LatestIsNewer, match="step-00000020"):
        storage.set_latest("step-00000010")
    assert storage.get_latest() == "step-00000020"
    storage.set_latest("step-00000010", rollback=True)
    assert storage.get_latest() == "step-00000010"
    with pytest.raises(ValueError):
        storage.set_latest("../elsewhere")


def test_a_latest_that_names_no_checkpoint_folder_is_ignored(storage):
    storage.write_bytes("latest", b"../../etc/passwd\n")
    assert read_latest(storage, on_invalid=lambda m: None) is None
    storage.set_latest("step-00000005")  # garbage counts as no pointer: moving on is allowed
    assert storage.get_latest() == "step-00000005"


def test_saves_prune_to_keep_last_and_load_the_newest(storage):
    for step in (10, 20, 30, 40):
        _write(storage, step, keep_last=2)
    assert [s for s, _ in list_checkpoints(storage)] == [30, 40]
    loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 40 and loaded.state["step"] == 40
    assert torch.equal(loaded.state["w"], torch.full((64,), 40.0))
    assert loaded.path == storage.describe("step-00000040")


def test_a_damaged_object_falls_back_to_the_previous_checkpoint(storage):
    _write(storage, 10)
    _write(storage, 20)
    _flip_a_byte(storage, "step-00000020/state.pt")
    loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 10
    assert len(loaded.skipped) == 1 and "SHA-256 does not match" in loaded.skipped[0]


class Planted:
    """An object only full unpickling could rebuild: a planted state file that would run code on load."""


def test_a_state_file_needing_arbitrary_unpickling_is_refused_by_weights_only(storage):
    _write(storage, 10)
    res = _write(storage, 20)
    buf = io.BytesIO()
    torch.save({"evil": Planted()}, buf)
    manifest_key = f"{res.name}/manifest.json"
    manifest = json.loads(storage.read_bytes(manifest_key))
    data = buf.getvalue()
    storage.write_bytes(f"{res.name}/state.pt", data)
    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    storage.write_bytes(manifest_key, json.dumps(manifest).encode())
    loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 10
    assert "weights_only=True" in loaded.skipped[0]


def test_the_writer_process_saves_through_a_pickled_copy_of_the_storage(storage):
    with Checkpointer(storage, writer="process", keep_last=2) as ckpt:
        ckpt.save({"w": torch.arange(1000.0)}, step=7, epoch=0, world_size=1, config_hash="h", if_busy="wait")
        assert ckpt.wait(120)
        assert ckpt.stats.succeeded == 1, ckpt.stats
    loaded = load_latest(storage)
    assert loaded is not None and loaded.step == 7 and torch.equal(loaded.state["w"], torch.arange(1000.0))


def test_the_storage_pickles_without_its_connection(storage):
    copy = pickle.loads(pickle.dumps(storage))
    storage.write_bytes("f", b"1")
    assert copy.read_bytes("f") == b"1" and copy.describe("f") == storage.describe("f")


# ------------------------------------------------------------------------------------------ the object store only


@pytest.fixture
def s3_storage(s3_server, tmp_path) -> FsspecStorage:
    st = storage_for(s3_server.url("jobs/one"), tmp_path)
    assert isinstance(st, FsspecStorage)
    return st


def test_a_late_second_writer_loses_the_compare_and_swap_and_cannot_move_latest_back(s3_storage, tmp_path):
    """Writer A reads latest (step 10), then writer B moves it to 30 before A writes 20: A's conditional write
    fails, A reads again, sees 30, and refuses to move it back."""
    s3_storage.set_latest("step-00000010")
    other = pickle.loads(pickle.dumps(s3_storage))
    read = s3_storage._latest_with_etag
    calls = []

    def read_then_lose_the_race(key):
        answer = read(key)
        if not calls:
            other.set_latest("step-00000030")
        calls.append(answer)
        return answer

    s3_storage._latest_with_etag = read_then_lose_the_race  # type: ignore[method-assign]
    with pytest.raises(LatestIsNewer, match="step-00000030"):
        s3_storage.set_latest("step-00000020")
    assert len(calls) == 2 and calls[0][1] == "step-00000010" and calls[1][1] == "step-00000030"
    assert s3_storage.get_latest() == "step-00000030"


def test_two_first_writers_race_on_an_absent_latest_and_only_one_creates_it(s3_storage):
    other = pickle.loads(pickle.dumps(s3_storage))
    read = s3_storage._latest_with_etag
    calls = []

    def read_then_lose_the_race(key):
        answer = read(key)
        if not calls:
            other.set_latest("step-00000050")
        calls.append(answer)
        return answer

    s3_storage._latest_with_etag = read_then_lose_the_race  # type: ignore[method-assign]
    with pytest.raises(LatestIsNewer):
        s3_storage.set_latest("step-00000040")  # If-None-Match: * failed: it re-read and saw 50
    assert calls[0] == (None, None) and s3_storage.get_latest() == "step-00000050"


def test_no_credential_reaches_the_description_the_pickle_the_events_or_the_logs(s3_storage):
    from structlog.testing import capture_logs

    events: list[tuple[str, dict]] = []
    with (
        capture_logs() as logs,
        Checkpointer(s3_storage, writer="thread", on_event=lambda n, f: events.append((n, f))) as ck,
    ):
        ck.save({"w": torch.ones(8)}, step=1, epoch=0, world_size=1, config_hash="h", if_busy="wait")
        ck.wait(60)
        get_logger("test").info("storage", storage=repr(s3_storage))
    assert [n for n, _ in events] == ["checkpoint"]
    written = json.dumps([events, logs], default=str) + s3_storage.describe() + repr(s3_storage)
    assert events[0][1]["path"] == s3_storage.describe("step-00000001")
    assert SECRET_KEY not in written and "testing" not in written
    assert SECRET_KEY.encode() not in pickle.dumps(s3_storage)


@pytest.mark.parametrize(
    ("location", "says"),
    [
        ("ftp://host/x", "scheme 'ftp'"),
        ("s3://AKIA:secret@bucket/x", "carries credentials"),
        ("s3://bucket/x?versionId=1", "no '?' query"),
        ("s3://b/x", "not a bucket"),
        ("s3://bucket/a/../b", "'..'"),
    ],
)
def test_a_bad_location_is_one_line_naming_what_is_wrong(location, says, tmp_path):
    from elastictrain.config import CheckpointConfig, ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint\.location") as e:
        CheckpointConfig(location=location)
    assert says in str(e.value) and "\n" not in str(e.value) and "secret" not in str(e.value)
    with pytest.raises(ValueError):
        storage_for(location, tmp_path)


def test_a_location_whose_package_is_missing_names_the_extra(monkeypatch):
    import importlib.util

    from elastictrain.checkpoint import location

    real = importlib.util.find_spec
    monkeypatch.setattr(location.importlib.util, "find_spec", lambda n: None if n == "gcsfs" else real(n))
    assert (
        location.location_problem("gs://bucket/x") == "gs:// needs the gcsfs package: pip install 'elastictrain[gcs]'"
    )


def test_the_default_and_a_path_are_local_storage(tmp_path, monkeypatch):
    assert storage_for("", tmp_path).describe() == str(tmp_path / "checkpoints")
    assert isinstance(storage_for(str(tmp_path / "elsewhere"), tmp_path), LocalStorage)
    monkeypatch.chdir("/")  # a tool run from anywhere finds a relative location under the run_dir
    assert storage_for("ckpt", tmp_path / "run").describe() == str(tmp_path / "run" / "ckpt")


def test_the_cli_exits_2_with_one_line_for_a_bad_location_and_never_echoes_a_secret(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "job.yaml"
    path.write_text("job: demo\nrun_dir: /tmp/x\n")
    proc = subprocess.run(
        [sys.executable, "-m", "elastictrain.cli", "config", "show", "--config", str(path), "--set",
         "checkpoint.location=s3://AKIA:hunter2@bucket/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint.location" in lines[0] and "carries credentials" in lines[0]
    assert "hunter2" not in proc.stderr + proc.stdout


def test_the_tools_find_the_location_a_run_recorded_and_distrust_its_config(tmp_path):
    from elastictrain.checkpoint.location import recorded_location, storage_for_run_dir

    run = tmp_path / "run"
    run.mkdir()
    assert recorded_location(run) is None and storage_for_run_dir(run).describe() == str(run / "checkpoints")
    (run / "config.yaml").write_text("job: x\ncheckpoint:\n  location: s3://bucket/jobs/x\n")
    assert recorded_location(run) == "s3://bucket/jobs/x"
    assert storage_for_run_dir(run).describe("latest") == "s3://bucket/jobs/x/latest"
    assert storage_for_run_dir(run, str(tmp_path / "given")).describe() == str(tmp_path / "given")
    (run / "config.yaml").write_text("checkpoint:\n  location: [1, 2]\n")
    with pytest.raises(ValueError, match="not a string"):
        recorded_location(run)
    (run / "config.yaml").write_text("checkpoint:\n  location: ftp://elsewhere/x\n")
    with pytest.raises(ValueError, match="not supported"):
        storage_for_run_dir(run)
    (run / "config.yaml").write_bytes(b"x: " + b"a" * (2 << 20))
    with pytest.raises(ValueError, match="larger than"):
        recorded_location(run)


def test_a_botocore_without_conditional_writes_is_refused_not_silently_unconditional(s3_storage, monkeypatch):
    """s3fs drops parameters botocore does not know: without IfMatch the swap would be a plain overwrite."""
    import botocore.session

    from elastictrain.checkpoint import objectstore
    from elastictrain.errors import CheckpointError

    real = botocore.session.Session.get_service_model

    def without_if_match(self, name, api_version=None):
        model = real(self, name, api_version)
        members = model.operation_model("PutObject").input_shape.members
        members.pop("IfMatch", None)
        return model

    objectstore._require_conditional_puts.cache_clear()
    monkeypatch.setattr(botocore.session.Session, "get_service_model", without_if_match)
    try:
        with pytest.raises(CheckpointError, match="cannot send conditional writes"):
            s3_storage.set_latest("step-00000001")
        assert s3_storage.get_latest() is None
    finally:
        objectstore._require_conditional_puts.cache_clear()
