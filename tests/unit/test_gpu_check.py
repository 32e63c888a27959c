"""``python -m bench.gpu_check``: the no-GPU path, per-check isolation and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import gpu_check


def test_without_a_gpu_it_prints_one_line_and_exits_0(tmp_path):
    assert not torch.cuda.is_available()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(gpu_check.__file__).parents[1])},
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    assert "no CUDA GPU" in proc.stdout
    assert not (tmp_path / "runs").exists()


def _boom(_work: Path) -> str:
    raise RuntimeError("the job exited 1\nTraceback (most recent call last): ...")


def test_a_failing_check_is_a_fail_row_and_the_others_still_run(tmp_path):
    ran: list[str] = []

    def ok(name: str):
        def fn(work: Path) -> str:
            assert work.is_dir()
            ran.append(name)
            return f"{name} fine | 3x"

        return fn

    rows = gpu_check.run_checks([("first", ok("first")), ("boom", _boom), ("last", ok("last"))], tmp_path)
    assert ran == ["first", "last"]
    assert [r["status"] for r in rows] == ["PASS", "FAIL", "PASS"]
    assert rows[1]["detail"] == "RuntimeError: the job exited 1"  # one line: the first of the message
    table = gpu_check.format_table(rows).splitlines()
    assert table[0] == "| check | result | seconds | detail |"
    assert len(table) == 2 + 3
    assert table[2].startswith("| first | PASS | ") and table[2].endswith("| first fine \\| 3x |")
    assert table[3].startswith("| boom | FAIL | ") and "RuntimeError: the job exited 1 |" in table[3]


def test_with_a_gpu_the_table_goes_to_json_and_a_failure_gives_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=0: "Fake GPU")
    rc = gpu_check.main([], checks=[("ok", lambda _w: "fine"), ("boom", _boom)], root=tmp_path)
    assert rc == 1
    out = capsys.readouterr().out
    assert "| ok | PASS |" in out and "| boom | FAIL |" in out
    (result,) = tmp_path.glob("*.json")
    data = json.loads(result.read_text())
    assert data["gpu"] == "Fake GPU"
    assert [(r["check"], r["status"]) for r in data["rows"]] == [("ok", "PASS"), ("boom", "FAIL")]
    monkeypatch.setattr(gpu_check, "CHECKS", [("ok", lambda _w: "fine")])
    assert gpu_check.main([], root=tmp_path / "again") == 0


def test_bench_run_overrides_update_sections_and_replace_values(tmp_path):
    from bench.runs import merge_config, throughput_config

    base = throughput_config(tmp_path, max_steps=10, world_size=1)
    cfg = merge_config(base, {"device": "cuda", "data": {"batch_size": 64}, "precision": {"mode": "fp16"}})
    assert cfg["device"] == "cuda" and cfg["precision"] == {"mode": "fp16"}
    assert cfg["data"] == {**base["data"], "batch_size": 64}  # the rest of the section kept
    assert base["device"] == "cpu" and "batch_size" not in base["data"]  # the base is not changed
    assert merge_config(base, None) == base


def test_only_picks_checks_by_name_and_a_name_that_matches_none_is_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    ran: list[str] = []
    checks = [("nccl build", lambda _w: ran.append("nccl") or "ok"), ("ResNet-50", lambda _w: ran.append("r") or "ok")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=0: "Fake GPU")
    assert gpu_check.main(["--only", "resnet"], checks=checks, root=tmp_path) == 0
    assert ran == ["r"]
    assert gpu_check.main(["--only", "tpu"], checks=checks, root=tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpu-check: --only 'tpu' names no check (checks: 'nccl build', 'ResNet-50')"]
