"""Every path of a run_dir, spelled once: what lives where under ``run_dir`` (names) and :class:`RunDir` (paths).

Stdlib only: ``discover.sh``'s side, the CLI and the status tools import it without torch or Horovod.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

EVENTS = "events.jsonl"
"""The run's event log, written by rank 0 (:mod:`elastictrain.rundir.events`)."""
CONFIG = "config.yaml"
"""The resolved job config, written by rank 0 at its start."""
CHECKPOINTS = "checkpoints"
"""The local checkpoint store (:class:`~elastictrain.checkpoint.storage.LocalStorage`)."""
LATEST = "latest"
"""In a checkpoint store: the key naming the newest complete, verified checkpoint."""
LEDGER = "ledger"
"""The sample audit's ledger (:mod:`elastictrain.rundir.ledger`)."""
WORKER_ERRORS = "errors"
"""Why each worker failed, one file per process (:mod:`elastictrain.rundir.worker_error`)."""
LAUNCH_LOCK = "launch.lock"
"""flock'ed by the launcher for its whole life: one launcher per run_dir (:mod:`elastictrain.rundir.launch`)."""
LAUNCH_STATE = "launch.json"
"""The running launcher's pids, etcd endpoint and hosts (:mod:`elastictrain.rundir.launch`)."""
MLFLOW_DB = "mlflow.db"
"""The run's own MLflow store when no tracking server is configured."""
MLFLOW_RUN_ID = "mlflow_run_id"
"""The job's one MLflow run id (:mod:`elastictrain.engine.tracking`)."""
REPORT_JSON = "report.json"
"""The run's summary (goodput, recovery, checkpoints), written by ``elastictrain report`` and rank 0 at the end."""
REPORT_PNG = "report.png"
"""The run's timeline, beside :data:`REPORT_JSON`."""
OUTBOX_STATE = ".outbox.json"
"""What the launcher's collector applied of the workers' outbox in etcd (:mod:`elastictrain.rundir.outbox`)."""
SIGNALS = ".elastic"
"""What the workers tell each other (:mod:`elastictrain.engine.health.signals`): the three names below."""
HEARTBEATS = "heartbeats"
"""In :data:`SIGNALS`: one heartbeat file per worker, ``<host>-<slot>.json``."""
FAILURE_MARKER = "collective-failure"
"""In :data:`SIGNALS`: the newest collective failure a worker saw (time, host)."""
HUNG_VERDICT = "hung-verdict"
"""In :data:`SIGNALS`: the newest hung peer found (time, reason)."""


@dataclass(frozen=True, slots=True)
class RunDir:
    """The paths of one run_dir."""

    root: Path

    @classmethod
    def of(cls, run_dir: str | os.PathLike[str]) -> RunDir:
        return cls(Path(run_dir))

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def latest(self) -> Path:
        return self.root / CHECKPOINTS / LATEST

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER

    @property
    def worker_errors(self) -> Path:
        return self.root / WORKER_ERRORS

    @property
    def launch_lock(self) -> Path:
        return self.root / LAUNCH_LOCK

    @property
    def launch_state(self) -> Path:
        return self.root / LAUNCH_STATE

    @property
    def mlflow_db(self) -> Path:
        return self.root / MLFLOW_DB

    @property
    def mlflow_run_id(self) -> Path:
        return self.root / MLFLOW_RUN_ID

    @property
    def signals(self) -> Path:
        return self.root / SIGNALS

    @property
    def heartbeats(self) -> Path:
        return self.root / SIGNALS / HEARTBEATS

    @property
    def failure_marker(self) -> Path:
        return self.root / SIGNALS / FAILURE_MARKER

    @property
    def hung_verdict(self) -> Path:
        return self.root / SIGNALS / HUNG_VERDICT
