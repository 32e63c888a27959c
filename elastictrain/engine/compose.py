"""The worker under horovodrun: the engine's parts (:mod:`elastictrain.engine`) composed over Horovod.

``hvd.init``, the training parts from the config and its task, rank 0's services, the workers' signals (the
run_dir's files or the job's etcd: ``elastic.signals``), the collective watchdog armed on the elastic state, rank 0's
reader of the preemption notices (:mod:`~elastictrain.engine.health.preemption`, when the worker has etcd), a SIGTERM
handler, then :func:`~elastictrain.engine.trainer.run_trainer`. Exit 0 only when training is complete; 143 after
SIGTERM (rank 0 checkpoints the last commit first).
"""

from __future__ import annotations

import os
import signal

from elastictrain.config import JobConfig
from elastictrain.engine.collective import Collective, HorovodCollective
from elastictrain.engine.health.eviction import EtcdEvictor
from elastictrain.engine.health.hang import HangDetector, announce, first_step_bound, gloo_timeout_seconds
from elastictrain.engine.health.preemption import PreemptionWatch
from elastictrain.engine.health.signals import RENDEZVOUS
from elastictrain.engine.health.transport import open_signals
from elastictrain.engine.trainer import Trainer, run_trainer
from elastictrain.engine.watch import arm_watchdog


def run(cfg: JobConfig) -> int:
    """Run one worker to completion: 0 when training completed, 143 when stopped by SIGTERM."""
    announce(open_signals(cfg), RENDEZVOUS)  # hvd.init: the driver's assignment and the rendezvous
    return run_trainer(compose(cfg, HorovodCollective.init()))


def compose(cfg: JobConfig, collective: Collective) -> Trainer:
    """The worker's trainer over ``collective`` (initialised): parts, services, the armed watchdog, SIGTERM."""
    trainer = Trainer.build(cfg, collective)
    signals = open_signals(cfg)
    policy = trainer.straggler_policy
    evictor = EtcdEvictor.from_env(os.environ, min_np=policy.min_np)
    if policy.mode in ("evict", "balance"):
        trainer.stragglers.evictor = evictor

    def evict(host: str) -> str:
        assert evictor is not None
        try:
            evictions, seconds = evictor.evict(host, "hung", policy.cooldown)
        except Exception as e:  # etcd down: the Gloo timeout still bounds the wait
            return f"could not evict host {host}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
        return f"evicted host {host} for {seconds:g}s (evictions: {evictions})"

    trainer.watchdog = arm_watchdog(
        trainer.state,
        signals,
        host=lambda: trainer.ctx.host,
        tracking_uri=cfg.tracking.tracking_uri,
        hang=HangDetector(
            signals,
            host=lambda: trainer.ctx.host,
            slot=lambda: trainer.ctx.local_rank,
            configured_seconds=cfg.elastic.hang_seconds,
            evict=evict if evictor is not None else None,
            first_step_seconds=first_step_bound(gloo_timeout_seconds()),
            first_step_hang_seconds=cfg.elastic.first_step_hang_seconds,
        ),
    )
    # Rank 0 reads the hosts' preemption notices (a just-in-time checkpoint when the job cannot survive them).
    watch = PreemptionWatch.from_env(os.environ, min_np=policy.min_np, active=lambda: trainer.ctx.is_rank0)
    trainer.preemption = watch.start() if watch is not None else None
    signal.signal(signal.SIGTERM, trainer.on_sigterm)
    return trainer
