"""The worker under horovodrun: the engine's parts (:mod:`elastictrain.engine`) composed over Horovod.

``hvd.init``, the training parts from the config and its task, rank 0's services, the collective watchdog
armed on the elastic state, a SIGTERM handler, then :func:`~elastictrain.engine.trainer.run_trainer`. Exit 0
only when training is complete; 143 after SIGTERM (rank 0 checkpoints the last commit first).
"""

from __future__ import annotations

import signal

from elastictrain.config import JobConfig
from elastictrain.engine.collective import Collective, HorovodCollective
from elastictrain.engine.trainer import Trainer, run_trainer
from elastictrain.engine.watch import arm_watchdog
from elastictrain.watchdog import FailureMarker


def run(cfg: JobConfig) -> int:
    """Run one worker to completion: 0 when training completed, 143 when stopped by SIGTERM."""
    return run_trainer(compose(cfg, HorovodCollective.init()))


def compose(cfg: JobConfig, collective: Collective) -> Trainer:
    """The worker's trainer over ``collective`` (initialised): parts, services, the armed watchdog, SIGTERM."""
    trainer = Trainer.build(cfg, collective)
    trainer.watchdog = arm_watchdog(
        trainer.state,
        FailureMarker(cfg.run_path / ".elastic" / "collective-failure"),
        host=lambda: trainer.ctx.host,
        tracking_uri=cfg.tracking.tracking_uri,
    )
    signal.signal(signal.SIGTERM, trainer.on_sigterm)
    return trainer
