"""``elastictrain audit`` on crafted run dirs: pass, duplicate, missing, partial and extra epochs, damaged files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastictrain.cli import main as cli_main
from elastictrain.rundir import layout
from elastictrain.rundir.ledger import SampleLedger
from elastictrain.tools.audit import audit_samples, main

N = 8  # dataset length
EPOCHS = 2


def ev(t: float, event: str, step: int, epoch: int = 0) -> dict[str, Any]:
    return {"ts": 1_000_000.0 + t, "event": event, "step": step, "epoch": epoch, "world_size": 2}


def make_run(
    tmp_path: Path,
    steps: list[tuple[int, int, list[int]]],
    *,
    ended: str | None = "done",
    epochs: int = EPOCHS,
    max_steps: int | None = None,
    meta: bool = True,
    drop_last: bool = False,
) -> Path:
    """A run dir as a real run leaves it: config.yaml, events.jsonl and a ledger of ``(step, epoch, ids)``."""
    run = tmp_path / "run"
    run.mkdir()
    limit = "null" if max_steps is None else max_steps
    (run / "config.yaml").write_text(f"job: j\nrun_dir: {run}\ntraining:\n  epochs: {epochs}\n  max_steps: {limit}\n")
    events = [ev(0, "start", 0)] + ([ev(9, ended, steps[-1][0])] if ended else [])
    (run / layout.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))
    kw = {"num_samples": N, "drop_last": drop_last} if meta else {}
    led = SampleLedger(run / "ledger", "100", **kw)
    led.restore(0)
    for step, epoch, ids in steps:
        led.record(step, epoch, ids)
    led.close()
    return run


def two_epochs() -> list[tuple[int, int, list[int]]]:
    return [(1, 0, [3, 1, 0, 2]), (2, 0, [7, 5, 4, 6]), (3, 1, [0, 2, 4, 6]), (4, 1, [1, 3, 5, 7])]


def run_audit(run: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    rc = main(["--run-dir", str(run), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_completed_run_with_every_sample_once_per_epoch_passes_with_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_audit(make_run(tmp_path, two_epochs()), capsys)
    assert rc == 0, out + err
    assert "verdict  PASS: 2 epochs audited (2 complete, 0 partial); samples expected 16, seen 16" in out
    assert "duplicates 0, missing 0" in out
    assert "epoch 1  complete  expected 8  seen 8  duplicates 0  missing 0" in out
    assert err == ""


def test_a_sample_used_twice_in_an_epoch_fails_with_exit_1_and_names_the_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = two_epochs()
    steps[1] = (2, 0, [7, 5, 4, 6, 3])
    rc, out, _ = run_audit(make_run(tmp_path, steps), capsys)
    assert rc == 1
    assert "epoch 0  complete  expected 8  seen 9  duplicates 1 (e.g. 3)  missing 0" in out
    assert "verdict  FAIL" in out and "duplicates 1, missing 0" in out


def test_a_sample_missing_from_a_completed_epoch_fails_with_exit_1_and_names_the_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = two_epochs()
    steps[3] = (4, 1, [1, 3, 7])
    rc, out, _ = run_audit(make_run(tmp_path, steps), capsys)
    assert rc == 1
    assert "epoch 1  complete  expected 8  seen 7  duplicates 0  missing 1 (e.g. 5)" in out
    assert "verdict  FAIL" in out and "missing 1" in out


def test_a_stopped_run_audits_its_last_epoch_as_partial_no_sample_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = two_epochs()[:3]  # stopped halfway through epoch 1
    rc, out, _ = run_audit(make_run(tmp_path, steps, ended="stopped"), capsys)
    assert rc == 0, out
    assert "epoch 1  partial  seen 4  duplicates 0" in out
    assert "2 epochs audited (1 complete, 1 partial); samples expected 8, seen 12" in out

    twice = tmp_path / "twice"
    twice.mkdir()
    steps.append((4, 1, [0, 1]))  # id 0 again in the partial epoch
    rc, out, _ = run_audit(make_run(twice, steps, ended="stopped"), capsys)
    assert rc == 1 and "epoch 1  partial  seen 6  duplicates 1 (e.g. 0)" in out


def test_a_done_run_that_never_finished_an_epoch_is_missing_its_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``done`` with training.epochs 2 but epoch 1 only half in the ledger: not a partial epoch, a loss."""
    rc, out, _ = run_audit(make_run(tmp_path, two_epochs()[:3]), capsys)
    assert rc == 1 and "epoch 1  complete  expected 8  seen 4  duplicates 0  missing 4 (e.g. 1, 3, 5, 7)" in out


def test_max_steps_cuts_the_last_epoch_short_without_a_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run_audit(make_run(tmp_path, two_epochs()[:3], max_steps=3), capsys)
    assert rc == 0 and "epoch 1  partial" in out


def test_samples_of_an_epoch_past_training_epochs_are_a_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = [*two_epochs(), (5, 2, [4, 2])]
    rc, out, _ = run_audit(make_run(tmp_path, steps, ended="stopped"), capsys)
    assert rc == 1 and "epoch 2  extra (past training.epochs 2)  seen 2  duplicates 2 (e.g. 2, 4)" in out


def test_with_drop_last_missing_ids_are_dropped_not_lost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = [(1, 0, [3, 1, 0]), (2, 0, [7, 5, 4]), (3, 1, [0, 2, 4]), (4, 1, [1, 3, 5])]
    rc, out, _ = run_audit(make_run(tmp_path, steps, drop_last=True), capsys)
    assert rc == 0, out
    assert "missing 0  dropped 2 (drop_last)" in out


def test_rolled_back_steps_and_a_torn_final_line_are_replayed_as_the_worker_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, two_epochs())
    ledger = run / "ledger"
    (path,) = ledger.glob("*.jsonl")
    lines = path.read_text().splitlines()
    # Step 4 was recorded with a wrong share, rolled back to step 3, then recorded again; a kill tore a line.
    bad_then_restore = [
        json.dumps({"kind": "step", "step": 4, "epoch": 1, "ids": [1, 1, 1]}),
        json.dumps({"kind": "restore", "step": 3}),
    ]
    path.write_text("\n".join(lines[:-1] + bad_then_restore + lines[-1:]) + '\n{"kind":"step","st')
    rc, out, _ = run_audit(run, capsys)
    assert rc == 0, out
    assert "1 torn final line(s)" in out


def test_the_audit_of_every_epoch_and_an_extra_one_in_numbers() -> None:
    audit = audit_samples({0: [0, 1, 1, 9], 1: [0, 1], 3: [0]}, num_samples=3, epochs=2)
    assert audit.per_epoch == {0: (1, 2), 1: (1, 0), 3: (0, 1)}  # 9 is out of range; epoch 3 is extra
    assert (audit.lost, audit.duplicated, audit.epochs_checked, audit.ok) == (2, 3, 2, False)
    assert [e.missing_examples for e in audit.epochs[:2]] == [[2], [2]]
    assert audit.epochs[0].out_of_range_examples == [9]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("garbage", "line 2: not JSON"),
        ("not_an_object", "line 2: not a JSON object"),
        ("ids_not_ints", "line 2: ids must be a list of integers"),
        ("negative_step", "line 2: step and epoch must be non-negative integers"),
        ("unknown_kind", "line 2: unknown kind 'rm -rf'"),
        ("meta_differs", "differs from num_samples=8"),
        ("bad_meta", "meta needs num_samples >= 1"),
    ],
)
def test_a_damaged_ledger_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, message: str
) -> None:
    run = make_run(tmp_path, two_epochs())
    (path,) = (run / "ledger").glob("*.jsonl")
    lines = path.read_text().splitlines()
    bad = {
        "garbage": "\x00\x01 not json",
        "not_an_object": "[1, 2]",
        "ids_not_ints": json.dumps({"kind": "step", "step": 9, "epoch": 0, "ids": ["1"]}),
        "negative_step": json.dumps({"kind": "step", "step": -1, "epoch": 0, "ids": [1]}),
        "unknown_kind": json.dumps({"kind": "rm -rf"}),
        "meta_differs": json.dumps({"kind": "meta", "num_samples": 9, "drop_last": False}),
        "bad_meta": json.dumps({"kind": "meta", "num_samples": 0, "drop_last": "no"}),
    }[damage]
    if damage == "meta_differs":  # a second tenure that disagrees
        later = SampleLedger(run / "ledger", "200")
        later.close()
        later.path.write_text(bad + "\n")
    else:
        path.write_text("\n".join([lines[0], bad, *lines[1:]]) + "\n")
    rc, out, err = run_audit(run, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("elastictrain audit: ") and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("setup", ["no_dir", "no_ledger", "no_config", "bad_config", "no_steps", "no_meta"])
def test_a_run_dir_that_cannot_be_audited_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str
) -> None:
    run = make_run(tmp_path, two_epochs(), meta=setup != "no_meta")
    if setup == "no_dir":
        run = tmp_path / "nothing"
    elif setup == "no_ledger":
        for p in (run / "ledger").iterdir():
            p.unlink()
    elif setup == "no_config":
        (run / "config.yaml").unlink()
    elif setup == "bad_config":
        (run / "config.yaml").write_text("training: {epochs: many}\n")
    elif setup == "no_steps":
        (path,) = (run / "ledger").glob("*.jsonl")
        path.write_text(path.read_text().splitlines()[0] + "\n")
    rc, out, err = run_audit(run, capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("elastictrain audit: "), err


def test_an_old_ledger_without_meta_is_audited_with_num_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, two_epochs(), meta=False)
    rc, out, err = run_audit(run, capsys)
    assert rc == 2 and "--num-samples" in err
    rc, out, err = run_audit(run, capsys, "--num-samples", str(N))
    assert rc == 0 and "dataset 8 samples" in out
    rc, out, err = run_audit(run, capsys, "--num-samples", "0")
    assert rc == 2 and err.count("\n") == 1


def test_the_elastictrain_command_dispatches_audit_and_misuse_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, two_epochs())
    assert cli_main(["audit", "--run-dir", str(run)]) == 0
    assert "verdict  PASS" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli_main(["audit"])  # --run-dir is required
    assert exc.value.code == 2
