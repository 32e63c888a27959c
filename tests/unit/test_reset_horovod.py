"""Horovod's elastic reset with a failed ``hvd.init`` tried again (:func:`reset_horovod`), and the source patch that
makes a failed Gloo rendezvous fail ``hvd.init`` instead of killing the worker, and lets the driver abort one
(``elastictrain/horovod/patch.py``)."""

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
    spec = importlib.util.spec_from_file_location("patch_horovod", REPO / "elastictrain" / "horovod" / "patch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["patch_horovod"] = module
    spec.loader.exec_module(module)
    return module


def _fake_source(ph, root: Path) -> dict[Path, str]:
    """Every file the patch edits, holding each text it replaces once (between lines of other code)."""
    texts: dict[Path, str] = {}
    for rel, old, _ in ph.EDITS:
        texts[root / rel] = texts.get(root / rel, "// other code\n") + f"{old}\n  other();\n"
    for path, text in texts.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return texts


def test_the_source_patch_applies_once_and_refuses_a_source_it_does_not_know(tmp_path: Path) -> None:
    ph = _patcher()
    original = _fake_source(ph, tmp_path)
    done = ph.patch(tmp_path)
    assert done == [f"{rel}: patched" for rel, _, _ in ph.EDITS]
    ops = tmp_path / "horovod" / "common" / "operations.cc"
    text = ops.read_text()
    assert "state.initialization_failed = true;" in text and "global_gloo_context.Finalize();" in text
    assert "horovod_global.initialization_failed = false;" in text
    assert text.count("try {") == 1 and text.count("catch (const ::gloo::IoException& ex)") == 1
    assert '#include "gloo/common/error.h"' in text, "the only errors caught: Gloo's I/O (a removed worker ends)"
    patched = {path: path.read_text() for path in original}
    assert ph.patch(tmp_path) == [f"{rel}: already patched" for rel, _, _ in ph.EDITS]
    assert {path: path.read_text() for path in original} == patched
    ops.write_text(original[ops].replace("#if HAVE_MPI", "#if HAVE_MPI_X"))
    with pytest.raises(ValueError, match="found 0 times"):
        ph.patch(tmp_path)


def test_the_gloo_waits_of_a_rendezvous_end_with_a_gloo_io_error_when_it_is_aborted(tmp_path: Path) -> None:
    """Both waits that outlived a dead peer: the store's wait for its address, a pair's wait for its connection;
    and a worker that gives up aborts the rendezvous for the others."""
    ph = _patcher()
    _fake_source(ph, tmp_path)
    ph.patch(tmp_path)
    header = (tmp_path / "horovod/common/gloo/http_store.h").read_text()
    store = (tmp_path / "horovod/common/gloo/http_store.cc").read_text()
    context = (tmp_path / "horovod/common/gloo/gloo_context.cc").read_text()
    pair = (tmp_path / "third_party/gloo/gloo/transport/tcp/pair.h").read_text()
    assert f'#define ELASTICTRAIN_ABORT_PATH "{ph.ABORT_PATH}"' in header and "abort_url_ =" in header
    wait = store[store.index("for (int polls = 0; !CheckKeys(keys); ++polls)") :]
    assert wait.index("Aborted(&reason)") < wait.index("GLOO_THROW_IO_EXCEPTION"), "the error patch-2 routes"
    assert "connectAbortCheck() = [store]()" in context and "~AbortCheck()" in context, "set for one rendezvous only"
    destructor = context[context.index("~AbortCheck()") :]
    assert "std::uncaught_exceptions() > unwinding" in destructor and "http->Abort(" in destructor, (
        "a worker whose set-up fails aborts the round for the others (they would wait for it in vain)"
    )
    assert "PerformHTTP(request, HTTP_PUT_METHOD, reason)" in store
    assert "cv_.wait_for(lock, slice, pred)" in pair and 'GLOO_ERROR_MSG("Connect aborted' in pair
    assert "signalAndThrowException" in pair[pair.index("Connect aborted") - 120 :], "an IoException, as a timeout"
