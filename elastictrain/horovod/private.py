"""Every access to a private attribute of Horovod, in one place (written against horovod 0.28.1).

Horovod's public API cannot drop a failed step's pending gradient allreduces, list them to wait for them
without spinning, read the host-change notices that a ``State`` has queued, or name the ports of this worker's
own notification service. The engine needs all four; each function here says which private attribute it
touches. After a Horovod upgrade, this module and ``tests/unit/test_horovod_private.py`` and
``tests/unit/test_gradient_wait.py`` (which check that every attribute is still there) are what to read.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from horovod.common.elastic import State


def discard_pending_allreduces(optimizer: Any) -> None:
    """Forget the gradient allreduces of the step that failed, as Horovod's ``load_state_dict`` does.

    A failed step leaves its handles in the ``DistributedOptimizer`` (``_handles``, ``_synchronized``,
    ``_should_synchronize``, ``_allreduce_delay``); without this the retried step's ``zero_grad()`` raises
    "called after loss.backward() but before optimizer.step()". Gradients are dropped too (the step is redone).
    Any other optimizer only loses its gradients.
    """
    if hasattr(optimizer, "_handles"):
        optimizer._handles = {}
        optimizer._synchronized = False
        optimizer._should_synchronize = True
        for p in optimizer._allreduce_delay:
            optimizer._allreduce_delay[p] = optimizer.backward_passes_per_step
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def allreduces_done(optimizer: Any, poll: Callable[[int], bool]) -> bool:
    """Whether every gradient allreduce that ``optimizer`` (a ``DistributedOptimizer``) has started is done, asked of
    ``poll`` (``horovod.torch.poll``) for each handle in ``_handles`` (parameter or group -> ``(handle, ctx)``; a
    ``None`` handle is not started yet and a callable one is not Horovod's: ``synchronize`` deals with both)."""
    handles = [h for h, _ in list(getattr(optimizer, "_handles", {}).values())]
    return all(h is None or callable(h) or poll(h) for h in handles)


def host_messages(state: State) -> queue.Queue:
    """The host-change notices ``state`` has received and not acted on (``State._host_messages``), as
    ``(timestamp, HostUpdateResult)`` pairs. Replaced by a new queue at every reset: read it through this."""
    return state._host_messages


def last_host_update(state: State) -> float:
    """Timestamp of the newest host-change notice ``state`` has acted on (``State._last_updated_timestamp``)."""
    return float(state._last_updated_timestamp)


def set_last_host_update(state: State, timestamp: float) -> None:
    state._last_updated_timestamp = timestamp


def notification_ports() -> set[int]:
    """Local ports of this worker's notification service (``notification_manager._service``), where Horovod's
    driver tells it about host changes; empty when the service is not running."""
    from horovod.common.elastic import notification_manager

    ports: set[int] = set()
    service = getattr(notification_manager, "_service", None)
    if service is not None:
        for addrs in service.addresses().values():
            ports.update(int(port) for _ip, port in addrs)
    return ports


def exit_hook() -> Callable[[], Any]:
    """What every ``hvd.init`` registers with ``atexit``: ``horovod.torch.mpi_ops._basics.shutdown`` (the
    ``HorovodBasics`` bound method; ``hvd.shutdown`` wraps it, so it is not equal to it and cannot unregister it)."""
    from horovod.torch.mpi_ops import _basics

    return _basics.shutdown
