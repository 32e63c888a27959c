"""A stock Horovod wheel is refused at start: ``elastictrain train`` and ``elastictrain launch`` exit 2 with one line
naming ``make setup`` unless the installed Horovod carries the marker that ``elastictrain/horovod/patch.py`` writes for
this checkout's patch. Horovod is faked by a package in a temp folder put first on ``sys.path``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from elastictrain.engine import worker
from elastictrain.horovod import build_check
from elastictrain.launcher import main as launch_main

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


def patcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "patch_horovod_for_marker", REPO / "elastictrain" / "horovod" / "patch.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_horovod(monkeypatch: pytest.MonkeyPatch, root: Path, marker: str | None) -> Path:
    """A Horovod 0.28.1 package under ``root``, found first by ``import horovod``; ``marker``, when given, is the text
    of its ``elastictrain_patch.py``."""
    package = root / "horovod"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0.28.1"\n')
    if marker is not None:
        (package / "elastictrain_patch.py").write_text(marker)
    for name in [m for m in sys.modules if m == "horovod" or m.startswith("horovod.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    return package


def test_a_worker_on_a_stock_horovod_exits_2_with_one_line_naming_make_setup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = fake_horovod(monkeypatch, tmp_path / "site", marker=None)
    # structlog, configured once per process, would keep capsys's stream, closed after this test, for every later one
    monkeypatch.setattr(worker, "configure_logging", lambda **context: None)
    code = worker.main(["--config", str(DEMO), "--set", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "make setup" in err[0] and str(package) in err[0], err


def test_launch_on_a_stock_horovod_exits_2_before_it_starts_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_horovod(monkeypatch, tmp_path / "site", marker=None)
    monkeypatch.setattr(launch_main, "find_horovodrun", lambda: "/usr/bin/horovodrun")

    def went_on(*args: object, **kwargs: object) -> None:
        raise AssertionError("launch went on past a stock Horovod (it checked the task)")

    monkeypatch.setattr(launch_main, "check_task", went_on)
    code = launch_main.main(["--config", str(DEMO), "--set", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("elastictrain launch: error: ") and "make setup" in err[0], err
    assert not (tmp_path / "run").exists(), "nothing is created for a refused launch"


def test_the_marker_of_this_patch_passes_and_another_patch_or_none_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ph = patcher()
    fake_horovod(monkeypatch, tmp_path / "patched", marker=ph.marker_text())
    build_check.check_patched_horovod()  # the marker the patch writes for this checkout

    fake_horovod(monkeypatch, tmp_path / "older", marker='PATCH_DIGEST = "0123456789abcdef"\n')
    with pytest.raises(build_check.UnpatchedHorovod) as e:
        build_check.check_patched_horovod()
    assert "'0123456789abcdef'" in str(e.value) and "make setup" in str(e.value) and "\n" not in str(e.value)

    fake_horovod(monkeypatch, tmp_path / "stock", marker=None)
    with pytest.raises(build_check.UnpatchedHorovod, match=r"has no elastictrain_patch\.py.*make setup"):
        build_check.check_patched_horovod()


def test_no_horovod_at_all_is_refused_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_check.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        build_check.UnpatchedHorovod, match=r"^Horovod is not installed for this Python: run `make setup`"
    ):
        build_check.check_patched_horovod()


def test_the_expected_digest_is_the_one_the_patch_script_prints() -> None:
    ph = patcher()
    assert ph.digest() == build_check.PATCH_DIGEST, (
        "elastictrain/horovod/patch.py changed: set PATCH_DIGEST in elastictrain/horovod/build_check.py to "
        f"{ph.digest()!r} and run `make setup`"
    )
    assert f"horovod/{build_check.MARKER_MODULE}.py" == ph.MARKER_FILE


def test_the_patch_writes_the_marker_into_the_source_it_patched(tmp_path: Path) -> None:
    ph = patcher()
    for rel, old, _ in ph.EDITS:  # a source holding each text the patch replaces
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((path.read_text() if path.exists() else "") + f"{old}\n")
    assert ph.main([str(tmp_path)]) == 0
    assert (tmp_path / ph.MARKER_FILE).read_text() == ph.marker_text()
    assert f'PATCH_DIGEST = "{ph.digest()}"' in ph.marker_text().splitlines()


def test_the_digest_changes_with_any_edit_of_the_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    ph = patcher()
    before = ph.digest()
    rel, old, new = ph.EDITS[-1]
    monkeypatch.setattr(ph, "EDITS", (*ph.EDITS[:-1], (rel, old, new + " ")))
    assert ph.digest() != before


def test_a_horovod_script_on_the_drop_in_over_a_stock_horovod_is_refused_before_horovod_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A user's own script (``from elastictrain import ElasticState``) started by horovodrun by hand: no launch and no
    ``elastictrain train`` checked its Horovod."""
    import elastictrain

    fake_horovod(monkeypatch, tmp_path / "site", marker=None)
    for name in ("ElasticState", "ElasticSampler", "elastic_run"):
        with pytest.raises(build_check.UnpatchedHorovod, match="make setup"):
            getattr(elastictrain, name)
    assert "horovod.torch" not in sys.modules
