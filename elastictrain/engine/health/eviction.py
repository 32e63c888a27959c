"""Evicting a host for a cool-down, through etcd: the :class:`~elastictrain.engine.health.stragglers.Evictor` of a real
job.

An eviction is a spot notice's path: the host's record goes ``draining`` (discover.sh stops listing it, Horovod
removes it gracefully) with a ``drain_until`` that its agent honours by making it ``ready`` again
(:func:`discovery.registry.evict`). The etcd endpoints, job, prefix and TLS settings are the ones the launcher gives
horovodrun and so every worker (the variables discover.sh reads); a worker without them evicts nothing. An eviction
that would leave the hosts discovery lists as ready with fewer than ``min_np`` slots is refused
(:class:`~discovery.registry.BelowMinNp`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from discovery.discover import DiscoverConfig
from elastictrain import envnames
from elastictrain.errors import ConfigError


class EtcdEvictor:
    """Drains hosts of this job in etcd (each call opens and closes its own connection: evictions are rare)."""

    def __init__(self, spec: str, cfg: DiscoverConfig, *, min_np: int, timeout_seconds: float = 5.0) -> None:
        self.spec = spec
        self.cfg = cfg
        self.min_np = min_np
        self.timeout_seconds = timeout_seconds

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, min_np: int) -> EtcdEvictor | None:
        """The evictor of the job the environment names, or None when it names no usable etcd; it never takes the
        job below ``min_np`` slots (the larger of ``elastic.min_np`` and the launcher's ``--min-np``)."""
        try:
            return cls(env[envnames.ETCD], DiscoverConfig.from_env(env), min_np=min_np)
        except (KeyError, ConfigError):
            return None

    def evict(self, host: str, reason: str, cooldown: Callable[[int], float]) -> tuple[int, float]:
        from discovery.registry import EtcdRegistry, HostNotFound, evict

        cfg = self.cfg
        with EtcdRegistry(
            self.spec, cfg.job, cfg.prefix, timeout_seconds=self.timeout_seconds, access=cfg.access
        ) as registry:
            entry = registry.get(host)
            if entry is None:
                raise HostNotFound(f"no host {host!r} in job {cfg.job!r}")
            seconds = cooldown(entry.record.evictions)
            record = evict(registry, host, reason=reason, cooldown_seconds=seconds, now=time.time(), min_np=self.min_np)
            return record.evictions, seconds
