"""The cached ImageFolder index: torchvision's classes and order, reused while the folder is unchanged."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from elastictrain.config import ConfigError
from elastictrain.engine import folder_index as fi
from elastictrain.engine.data import SeededImageFolder, image_transforms


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(fi.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(fi, "_MEMO", {})  # each test starts in a fresh process, as far as the index knows
    return tmp_path / "cache" / "folder-index"


def png(path: Path, value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (value, value, value)).save(path)


def age(root: Path, seconds: float = 3600) -> None:
    """Make every folder look written an hour ago, as a dataset that is not being written to."""
    then = time.time() - seconds
    for folder, _, _ in os.walk(root):
        os.utime(folder, (then, then))


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "data"
    for i, name in enumerate(["b", "a", "c"]):
        png(root / name / f"{i}.png", i)
        png(root / name / f"x{i}.JPG", i)
    png(root / "a" / "nested" / "deep" / "n.png")
    (root / "a" / "notes.txt").write_text("not an image")
    age(root)
    return root


def scans(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = fi.scan

    def counting(root: str) -> fi.FolderIndex:
        calls.append(root)
        return real(root)

    monkeypatch.setattr(fi, "scan", counting)
    return calls


def test_index_is_what_torchvision_imagefolder_finds(folder):
    tv = ImageFolder(str(folder))
    index = fi.folder_index(folder)
    assert index.classes == tv.classes
    assert [(os.path.realpath(p), y) for p, y in index.absolute_samples()] == [
        (os.path.realpath(p), y) for p, y in tv.samples
    ]


def test_second_use_reads_the_cache_without_scanning(folder, cache, monkeypatch):
    first = fi.folder_index(folder)
    monkeypatch.setattr(fi, "_MEMO", {})  # another process
    assert len(list(cache.iterdir())) == 1
    calls = scans(monkeypatch)
    assert fi.folder_index(folder) == first
    assert calls == []


@pytest.mark.parametrize("change", ["add", "remove", "add_nested", "add_class"])
def test_a_changed_folder_is_scanned_again(folder, monkeypatch, change):
    fi.folder_index(folder)
    if change == "add":
        png(folder / "b" / "new.png")
    elif change == "remove":
        (folder / "c" / "2.png").unlink()
    elif change == "add_nested":
        png(folder / "a" / "nested" / "deep" / "m.png")
    else:
        png(folder / "d" / "0.png")
    calls = scans(monkeypatch)
    index = fi.folder_index(folder)
    assert len(calls) == 1
    tv = ImageFolder(str(folder))
    assert index.classes == tv.classes and len(index.samples) == len(tv.samples)


def test_a_folder_written_just_now_is_not_cached(tmp_path, cache):
    root = tmp_path / "fresh"
    png(root / "a" / "0.png")
    fi.folder_index(root)
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize(
    "damage",
    [
        lambda doc: b"{not json",
        lambda doc: json.dumps({**doc, "root": "/elsewhere"}).encode(),
        lambda doc: json.dumps({**doc, "files": [["../../etc/passwd"], *doc["files"][1:]]}).encode(),
        lambda doc: json.dumps({**doc, "files": [["/etc/passwd"], *doc["files"][1:]]}).encode(),
        lambda doc: json.dumps({**doc, "dirs": {"../..": 1}}).encode(),
        lambda doc: json.dumps({**doc, "classes": doc["classes"][:1]}).encode(),
        lambda doc: json.dumps({**doc, "version": 99}).encode(),
    ],
    ids=["garbage", "other_root", "climbs_out", "absolute", "dir_out", "short_classes", "version"],
)
def test_a_damaged_or_hostile_cache_file_is_ignored_and_replaced(folder, cache, monkeypatch, damage):
    good = fi.folder_index(folder)
    (path,) = cache.iterdir()
    path.write_bytes(damage(json.loads(path.read_bytes())))
    monkeypatch.setattr(fi, "_MEMO", {})  # another process reads the damaged file
    calls = scans(monkeypatch)
    assert fi.folder_index(folder) == good
    assert len(calls) == 1
    assert json.loads(path.read_bytes())["root"] == good.root


def test_an_unwritable_cache_costs_only_the_cache(folder, tmp_path, monkeypatch):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv(fi.CACHE_ENV, str(blocker))
    assert fi.folder_index(folder).classes == ["a", "b", "c"]


def test_seeded_image_folder_loads_through_the_index(folder):
    ds = SeededImageFolder(str(folder), image_transforms(8, train=False, augment=False), seed=1)
    assert ds.classes == ["a", "b", "c"] and len(ds) == len(ImageFolder(str(folder)))
    image, label = ds[len(ds) - 1]
    assert tuple(image.shape) == (3, 8, 8) and label == 2


def test_a_class_without_images_is_a_config_error(tmp_path):
    root = tmp_path / "data"
    png(root / "a" / "0.png")
    (root / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"not a usable ImageFolder .*empty"):
        len(SeededImageFolder(str(root), image_transforms(8, train=False, augment=False), seed=1, key="task_args.path"))


def test_a_process_reuses_its_own_index_while_the_folder_is_unchanged(folder, cache, monkeypatch):
    first = fi.folder_index(folder)  # as the warm zygote does before it forks workers
    for path in cache.iterdir():
        path.unlink()
    calls = scans(monkeypatch)
    assert fi.folder_index(folder) is first and calls == []
    png(folder / "b" / "late.png")
    assert len(fi.folder_index(folder).samples) == len(first.samples) + 1 and len(calls) == 1
