"""Horovod's elastic reset with a failed ``hvd.init`` tried again (:func:`reset_horovod`), and the source patch that
makes a failed Gloo rendezvous fail ``hvd.init`` instead of killing the worker (``scripts/patch_horovod.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from elastictrain.engine.collective import reset_horovod
from tests.fixtures.procs import REPO

FAILED = "Horovod initialization failed. Please check log messages above for a more descriptive error."


class FakeHorovod:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls: list[str] = []

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def init(self) -> None:
        self.calls.append("init")
        if self.failures:
            raise self.failures.pop(0)


def test_an_init_whose_ring_could_not_form_is_tried_again_after_a_shutdown() -> None:
    hvd = FakeHorovod([ValueError(FAILED)])
    retries: list[int] = []
    reset_horovod(hvd.shutdown, hvd.init, on_retry=lambda attempt, e: retries.append(attempt))
    assert hvd.calls == ["shutdown", "init", "shutdown", "init"] and retries == [1]


def test_the_last_failure_and_any_other_error_are_raised() -> None:
    hvd = FakeHorovod([ValueError(FAILED)] * 3)
    with pytest.raises(ValueError, match="initialization failed"):
        reset_horovod(hvd.shutdown, hvd.init, attempts=3)
    assert hvd.calls.count("init") == 3
    other = FakeHorovod([ValueError("Horovod has not been built with MPI support")])
    with pytest.raises(ValueError, match="MPI"):
        reset_horovod(other.shutdown, other.init)
    assert other.calls == ["shutdown", "init"], "not retried"


def _patcher():
    spec = importlib.util.spec_from_file_location("patch_horovod", REPO / "scripts" / "patch_horovod.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["patch_horovod"] = module
    spec.loader.exec_module(module)
    return module


def test_the_source_patch_applies_once_and_refuses_a_source_it_does_not_know(tmp_path: Path) -> None:
    ph = _patcher()
    ops = tmp_path / "horovod" / "common" / "operations.cc"
    ops.parent.mkdir(parents=True)
    loop = f"void BackgroundThreadLoop() {{\n{ph.GLOO_INIT}\n  x;\n{ph.GLOO_END}\n}}\n"
    original = f"{ph.GLOO_INCLUDE}{loop}{ph.RESET_FLAG}"
    ops.write_text(original)
    assert ph.patch(tmp_path) == ["horovod/common/operations.cc: patched"] * 4
    text = ops.read_text()
    assert "state.initialization_failed = true;" in text and "global_gloo_context.Finalize();" in text
    assert "horovod_global.initialization_failed = false;" in text
    assert text.count("try {") == 1 and text.count("catch (const ::gloo::IoException& ex)") == 1
    assert '#include "gloo/common/error.h"' in text, "the only errors caught: Gloo's I/O (a removed worker ends)"
    assert ph.patch(tmp_path) == ["horovod/common/operations.cc: already patched"] * 4
    assert ops.read_text() == text
    ops.write_text(original.replace("#if HAVE_MPI", "#if HAVE_MPI_X"))
    with pytest.raises(ValueError, match="found 0 times"):
        ph.patch(tmp_path)
