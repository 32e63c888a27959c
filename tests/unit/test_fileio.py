"""Atomic writes into a shared run_dir: unpredictable temp names, O_EXCL, nothing written through a planted link."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from discovery import discover
from elastictrain import fileio
from elastictrain.engine.health.signals import FailureMarker


def plant_links(folder: Path, names: list[str], victim: Path) -> None:
    """What another user of a shared folder can do: symlinks at every temp name the old code used."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).symlink_to(victim)


def test_temp_names_are_unpredictable_and_beside_the_target(tmp_path: Path) -> None:
    names = {fileio.temp_path(tmp_path / "x.json") for _ in range(100)}
    assert len(names) == 100
    assert all(os.path.dirname(n) == str(tmp_path) and os.path.basename(n).startswith(".x.json.tmp-") for n in names)


def test_an_existing_temp_name_is_never_written_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    monkeypatch.setattr(fileio, "temp_path", lambda path, tag="": str(tmp_path / ".guessed"))
    (tmp_path / ".guessed").symlink_to(victim)
    with pytest.raises(FileExistsError):
        fileio.write_atomic(tmp_path / "x.json", b"new")
    assert victim.read_text() == "precious" and not (tmp_path / "x.json").exists()


def test_a_failed_write_leaves_the_old_content_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), fileio.atomic_file(target) as f:
        f.write(b"half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_writes_are_durable_unless_told_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    fileio.write_atomic(tmp_path / "a.json", "{}")
    with fileio.atomic_path(tmp_path / "b.db") as name:
        Path(name).write_bytes(b"db")
    # each: the temp file before the rename, then the folder after it
    assert [Path(p).name.split(fileio.TEMP_MARKER)[0] for p in synced[0::2]] == [".a.json", ".b.db"]
    assert synced[1::2] == [str(tmp_path), str(tmp_path)]
    synced.clear()
    fileio.write_atomic(tmp_path / "c.json", "{}", durable=False)
    assert synced == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.db", "c.json"]


def test_a_writer_by_name_that_fails_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "store.db"
    target.write_text("old")
    with pytest.raises(RuntimeError), fileio.atomic_path(target) as name:
        Path(name).write_text("half a schema")
        raise RuntimeError("killed mid-create")
    with pytest.raises(FileNotFoundError), fileio.atomic_path(target):
        pass  # the writer wrote nothing
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["store.db"]


def test_a_tag_names_the_writer_in_the_temp_name(tmp_path: Path) -> None:
    from chaos.faults import writer_pid

    name = Path(fileio.temp_path(tmp_path / "state.pt", tag="4242"))
    assert name.name.startswith(".state.pt.tmp-4242-") and writer_pid(name) == 4242


def test_the_discovery_cache_is_not_written_through_a_planted_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    cache = tmp_path / "run" / "discover-cache.json"
    plant_links(cache.parent, [f".{cache.name}.{os.getpid()}.tmp"], victim)
    monkeypatch.setattr(discover, "range_prefix", lambda *a: [("/elastictrain/j/hosts/a", b'{"slots": 1}')])
    env = {"ELASTICTRAIN_ETCD": "http://127.0.0.1:1", "ELASTICTRAIN_JOB": "j"}
    env["ELASTICTRAIN_DISCOVER_CACHE"] = str(cache)
    assert discover.run(env) == (0, ["a:1"], [])
    assert victim.read_text() == "precious" and json.loads(cache.read_text())["hosts"] == ["a:1"]


def test_the_failure_marker_is_not_written_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    marker = tmp_path / "run" / ".elastic" / "collective-failure"
    plant_links(marker.parent, [f".{marker.name}.{os.getpid()}"], victim)
    FailureMarker(marker).record("host-a")
    assert victim.read_text() == "precious" and FailureMarker(marker).last() is not None


def test_the_launch_state_file_is_not_written_through_a_planted_link(tmp_path: Path) -> None:
    from elastictrain.config import config_from_dict
    from elastictrain.launcher.options import LaunchOptions
    from elastictrain.launcher.supervisor import Launcher

    victim = tmp_path / "victim"
    victim.write_text("precious")
    run_dir = tmp_path / "run"
    plant_links(run_dir, [".launch.json.tmp"], victim)
    cfg = config_from_dict({"job": "j", "run_dir": str(run_dir)})
    launcher = Launcher(LaunchOptions(config=tmp_path / "c.yaml", etcd="http://127.0.0.1:1"), cfg, horovodrun=["x"])
    launcher._write_state()
    assert victim.read_text() == "precious" and json.loads((run_dir / "launch.json").read_text())["job"] == "j"
