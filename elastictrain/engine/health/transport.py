"""Which :class:`~elastictrain.engine.health.signals.WorkerSignals` a worker uses: ``elastic.signals`` chooses the
run_dir's files (:class:`~elastictrain.engine.health.signals.FileSignals`) or the job's etcd
(:class:`~elastictrain.engine.health.etcd_signals.EtcdSignals`), one object per process and transport.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elastictrain import envnames
from elastictrain.config import etcd_transport
from elastictrain.engine.health.signals import FileSignals, WorkerSignals

if TYPE_CHECKING:
    from elastictrain.config import JobConfig

_OPENED: dict[tuple[str, ...], WorkerSignals] = {}


def open_signals(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> WorkerSignals:
    """This worker's signals for ``cfg`` (``elastic.signals``, :func:`~elastictrain.config.etcd_transport`): one
    object per process and transport, so that the start-up's announcements and the detector share etcd's lease and
    thread. Raises :class:`ConfigError` (one line) for an etcd the environment names badly."""
    env = os.environ if environ is None else environ
    transport = etcd_transport("elastic.signals", cfg.elastic.signals, env)
    if transport == "files":
        return FileSignals.of_run_dir(cfg.run_path)
    key = (transport, env.get(envnames.ETCD, ""), env.get(envnames.ETCD_PREFIX, ""), env.get(envnames.JOB, ""))
    if key not in _OPENED:
        from elastictrain.engine.health.etcd_signals import EtcdSignals

        _OPENED[key] = EtcdSignals.from_env(env, hang_seconds=cfg.elastic.hang_seconds).start()
    return _OPENED[key]


os.register_at_fork(after_in_child=_OPENED.clear)  # no thread crosses a fork: a child opens its own
