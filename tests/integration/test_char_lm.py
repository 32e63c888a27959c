"""The char-LM example (``examples/char_lm``) under ``elastictrain launch`` on logical hosts of this machine, at a
small size, with a SIGKILLed worker and the scale-up when its host returns. Asserts the chaos invariants: the
job completes, every sample exactly once per epoch (ledger), the final loss within tolerance of a fault-free run
with the same seed, one MLflow run, no process left."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from chaos import faults
from chaos import invariants as inv
from chaos.jobs import LaunchedJob
from chaos.scenarios import mlflow_run_ids, reference_loss
from elastictrain.errors import ScenarioError
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import EpochEnd, Reset, of_kind
from elastictrain.rundir.ledger import committed_samples
from elastictrain.tools.audit import audit_samples
from tests.fixtures.procs import REPO, VENV_BIN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

EXAMPLE = REPO / "examples" / "char_lm"
EPOCHS = 2
TASK_ARGS = {"seq_len": 32, "d_model": 64, "layers": 2, "heads": 2, "dropout": 0.0, "max_bytes": 200_000}
needs = pytest.mark.skipif(
    len(local_logical_hosts()) < 3 or not (VENV_BIN / "horovodrun").exists(),
    reason="needs horovodrun and 3 logical local hosts",
)


def config() -> dict[str, Any]:
    """The example's own config at a small size: global batch 48 (the maths does not depend on membership),
    about 120 steps per epoch, 2 to 3 workers, ledger and MLflow on."""
    import yaml

    cfg = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    for key in ("job", "run_dir"):
        cfg.pop(key)
    cfg.update(
        device="cpu",
        task_args=TASK_ARGS,
        data={"batch_size": 16},
        training={**cfg["training"], "epochs": EPOCHS, "log_every_steps": 5, "seed": 7},
        elastic={**cfg["elastic"], "global_batch_size": 48, "micro_batch_size": 16, "commit_every_steps": 5,
                 "min_np": 2, "max_np": 3},
        checkpoint={"every_steps": 10, "keep_last": 3},
        tracking={"mlflow": True, "experiment": "char-lm-test", "progress_bar": False},
        audit={"sample_ledger": True},
        discovery={"ttl_seconds": 3, "heartbeat_seconds": 0.5},
    )  # fmt: skip
    return cfg


def num_samples() -> int:
    spec = importlib.util.spec_from_file_location("char_lm_example", EXAMPLE / "char_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return len(module.build(**TASK_ARGS).train_data)


class NotRank0:
    """Pick a worker other than the current rank 0 (rank-0 kills have their own chaos scenarios)."""

    def __init__(self, run: LaunchedJob) -> None:
        self.run = run

    def choice(self, seq: Sequence[Any]) -> Any:
        r0 = self.run.job().rank0()
        return sorted((w for w in seq if r0 is None or w.pid != r0.pid), key=lambda w: w.pid)[-1]


@needs
def test_char_lm_survives_a_sigkill_and_a_scale_up_with_every_invariant(tmp_path: Path, monkeypatch) -> None:
    # The task module is found through PYTHONPATH here (the job's config is written into its run dir).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH")) if p))
    cfg = config()
    reference = reference_loss(cfg, tmp_path, timeout=300)
    assert reference is not None, "the fault-free run did not finish"

    run = LaunchedJob(tmp_path / "faulty", {"job": f"char-lm-{os.urandom(3).hex()}", **cfg})
    leftovers: list[str] = []
    try:
        run.start()
        run.wait_step(25)
        kill = faults.kill_worker(run.job(), run.log, rng=NotRank0(run))

        def resets_after_kill() -> list[Reset]:
            return [e for e in of_kind(run.events(), Reset) if e.ts > kill["ts"]]

        run.wait_for(lambda: any(e.reason == "worker_failed" for e in resets_after_kill()), 60, "the recovery")
        run.wait_for(
            lambda: any((e.new_size or 0) > (e.old_size or 0) for e in resets_after_kill()),
            90,
            "the scale-up (host back)",
        )
        code = run.wait_exit(240)
    except ScenarioError as e:
        pytest.fail(f"{e}; launch log: {(run.run_dir / 'launch.log').read_text()[-2000:]}")
    finally:
        leftovers = run.close()

    events = run.events()
    checks = [
        inv.check_completed(code, events),
        inv.check_exactly_once(audit_samples(committed_samples(run.run_dir / "ledger"), num_samples(), EPOCHS)),
        inv.check_final_loss(inv.final_loss(events), reference),
        inv.check_one_mlflow_run(mlflow_run_ids(run.run_dir), (run.run_dir / "mlflow_run_id").read_text().strip()),
        inv.check_no_leftovers(leftovers),
    ]
    assert inv.passed(checks), inv.format_table("char-lm under a SIGKILL and a scale-up", checks)
    epoch_ends = of_kind(events, EpochEnd)
    perplexity = [e.val_metrics["val_perplexity"] for e in epoch_ends]
    assert len(epoch_ends) == EPOCHS and perplexity[-1] < perplexity[0] * 1.05, perplexity
