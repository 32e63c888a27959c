"""Arm the collective watchdog (:mod:`elastictrain.engine.health.watchdog`) on a Horovod elastic ``State``: the engine's
and the drop-in's, so both recover from a SIGKILLed peer in about a second, in a step or in the state sync
that follows a rendezvous."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from urllib.parse import urlparse

from horovod.common.elastic import State

from elastictrain.engine.health.hang import HangDetector
from elastictrain.engine.health.signals import PROLOGUE, RENDEZVOUS, SYNC, WorkerSignals
from elastictrain.engine.health.watchdog import CollectiveWatchdog, removal_pending
from elastictrain.horovod.private import host_messages, notification_ports


def arm_watchdog(
    state: State,
    signals: WorkerSignals,
    host: Callable[[], str],
    tracking_uri: str | None = None,
    hang: HangDetector | None = None,
) -> CollectiveWatchdog:
    """Start the collective watchdog of this worker and hook it to ``state``.

    ``state`` must call ``on_failure()`` first in its ``restore()`` (a failed collective: the watchdog stands
    down and the failure is recorded in ``signals`` for the other workers) and may call ``on_failure_notice()``
    on a host-change interrupt. The caller marks steps (``step_started``/``step_finished``) and calls
    ``snapshot_ring()`` after each rendezvous, and ``stop()`` at the end. With ``hang`` (the engine's workers) the
    caller also marks ``grads_ready`` and gives the ring's members after each rendezvous (``set_members``), and a
    failure that follows a hung-peer verdict is reported as ``worker_hung`` (``state.failure_cause``).

    ``state.sync`` is wrapped (:func:`guard_sync`): the sync is collective work that the watchdog guards.
    """
    watchdog: CollectiveWatchdog

    def on_failure() -> None:
        watchdog.ring_failed()
        signals.record_failure(host())

    state.on_failure = on_failure
    state.on_failure_notice = lambda: watchdog.idle()
    if hang is not None:
        state.failure_cause = signals.verdict_since
        phases = mark_phases()
        state.on_mark = lambda name: hang.mark(phases[name]) if name in phases else None
    watchdog = CollectiveWatchdog(
        signals,
        host_removed=lambda: removal_pending(host_messages(state)),
        excluded_ports=lambda: control_ports(tracking_uri),
        hang=hang,
    ).start()
    guard_sync(state, watchdog)
    return watchdog


def guard_sync(state: State, watchdog: CollectiveWatchdog) -> None:
    """Make ``state.sync`` (Horovod's elastic loop calls it after every rendezvous but one that only removed hosts,
    and at the start) a phase the watchdog guards: :meth:`~CollectiveWatchdog.sync_started` before it,
    :meth:`~CollectiveWatchdog.sync_finished` after it, whether it returns or raises."""
    sync = state.sync

    @functools.wraps(sync)
    def guarded() -> None:
        watchdog.sync_started()
        try:
            sync()
        finally:
            watchdog.sync_finished()

    state.sync = guarded


def mark_phases() -> dict[str, str]:
    """The heartbeat phase (:mod:`elastictrain.engine.health.hang`) that begins at each mark of a reset
    (:data:`elastictrain.engine.reset.PAUSE_MARKS`). After Horovod's reset the sync follows, or, when Horovod skips
    it (hosts only removed), the prologue: ``reset`` says prologue until ``sync_start`` says otherwise."""
    return {"caught": RENDEZVOUS, "reset": PROLOGUE, "sync_start": SYNC, "sync_end": PROLOGUE}


def control_ports(tracking_uri: str | None = None) -> tuple[set[int], set[int]]:
    """(local, remote) ports of connections that are not Gloo's and are never aborted: Horovod's notification
    service and rendezvous server, and an HTTP MLflow tracking server's keep-alive connections."""
    remote = {int(p) for p in (os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT"), tracking_port(tracking_uri)) if p}
    return notification_ports(), remote


def tracking_port(tracking_uri: str | None) -> int | None:
    """Port of an HTTP MLflow tracking server (``tracking_uri`` or ``$MLFLOW_TRACKING_URI``), or None."""
    parsed = urlparse(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""))
    if parsed.scheme not in ("http", "https"):
        return None
    return parsed.port or (443 if parsed.scheme == "https" else 80)
