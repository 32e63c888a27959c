"""The world the engine trains in: a :class:`Collective` protocol, Horovod's implementation, and one process.

The engine never calls ``horovod.torch`` directly; it receives a :class:`Collective`. That is what lets the
loop, a resize and a rank-0 handover run in one process in the unit tests (:class:`LocalCollective`), the way
torchft's ``Manager`` receives its process group.

Contract of every implementation:

* ``rank``/``size``/``local_rank``/``local_size`` describe the current world; they change only at a reset.
* Collectives are called by every rank in the same order with the same ``name``; a failure raises
  ``HorovodInternalError`` (the elastic loop then restores, resets and syncs).
* ``elastic_run(func)`` returns ``hvd.elastic.run``'s wrapper: ``wrapper(state)`` syncs ``state``, calls
  ``func(state)``, and on ``HorovodInternalError`` (restore first) or ``HostsUpdatedInterrupt`` resets the world
  and goes round again. Horovod's reset is :func:`reset_horovod`: an ``hvd.init`` whose ring could not form is
  tried again for the next ring.
"""

from __future__ import annotations

import atexit
import copy
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from horovod.common.elastic import State

from elastictrain.horovod.private import allreduces_done, exit_hook

T = TypeVar("T")


class Collective(Protocol):
    def rank(self) -> int: ...
    def size(self) -> int: ...
    def local_rank(self) -> int: ...
    def local_size(self) -> int: ...

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        """Overwrite every tensor in place with ``root``'s (started together, then all waited for)."""

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor: ...
    def broadcast_object(self, obj: T, root: int, name: str) -> T: ...
    def allgather_object(self, obj: Any, name: str) -> list[Any]: ...
    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor: ...
    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on every rank) concatenated along dim 0, in rank order."""

    def distributed_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        compression: str,
    ) -> torch.optim.Optimizer:
        """``optimizer`` with its gradients summed over the world before each step (``compression``: none | fp16)."""

    def elastic_run(self, func: Callable[[Any], T]) -> Callable[[State], T]: ...

    def nccl_built(self) -> bool:
        """True when NCCL carries collectives of GPU tensors (it runs one rank per GPU: :mod:`.gpus`)."""


GRADIENT_POLL_SECONDS = 0.0002
"""How long a worker sleeps between two looks at its gradient allreduces while it waits for them
(:func:`wait_without_spinning`): a step waits at most this much longer than the allreduces take."""


def wait_without_spinning(
    optimizer: Any,
    poll: Callable[[int], bool],
    *,
    interval: float = GRADIENT_POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """``optimizer`` (a Horovod ``DistributedOptimizer``) whose ``synchronize()`` first waits, sleeping ``interval``
    between polls, until every gradient allreduce it started is done, then runs Horovod's own ``synchronize``
    (which then finds every handle done and only copies the results in).

    Horovod's own wait (``horovod_torch_wait_and_clear``) spins: it polls the handle in a loop that only yields
    the CPU. The worker that finished its backward pass first thus keeps a core busy for the whole wait, the core
    that the slower workers' backward passes and Horovod's background threads need where workers share cores
    (logical hosts on one machine, or more workers than cores). Errors are Horovod's as before: a failed
    allreduce is done, and Horovod's ``synchronize`` raises it."""
    spinning = optimizer.synchronize

    def synchronize() -> None:
        while not allreduces_done(optimizer, poll):
            sleep(interval)
        spinning()

    optimizer.synchronize = synchronize
    return optimizer


INIT_ATTEMPTS = 3
"""``hvd.init`` calls of one reset (or start) before its failure ends the worker."""


def reset_horovod(
    shutdown: Callable[[], None],
    init: Callable[[], None],
    *,
    attempts: int = INIT_ATTEMPTS,
    on_retry: Callable[[int, Exception], None] = lambda attempt, error: None,
) -> None:
    """Horovod's elastic reset (``shutdown``, then ``init``), with a failed ``init`` tried again up to ``attempts``.

    ``hvd.init`` fails (``ValueError: Horovod initialization failed``; Horovod as patched by
    ``elastictrain/horovod/patch.py``) when the ring the driver assigned could not form: a peer of it died before the
    Gloo contexts were built (Gloo's I/O error: within about 100 ms of the driver seeing the peer's exit, which
    aborts the rendezvous (:mod:`elastictrain.horovod.hvdrun`), else after at most the Gloo timeout). Asking again
    joins the driver's next ring, which no longer has the dead peer. (A worker the driver removed from the job still
    ends in ``hvd.init``, as in stock Horovod.) Any other error, and the last failure, are raised."""
    for attempt in range(1, attempts + 1):
        shutdown()
        try:
            init()
            return
        except ValueError as e:
            if attempt == attempts or "initialization failed" not in str(e):
                raise
            on_retry(attempt, e)


def init_horovod(init: Callable[[], None], exit_hook: Callable[[], Any]) -> None:
    """``init()`` (``hvd.init``), leaving exactly one ``exit_hook`` registered with :mod:`atexit`, failed or not.

    Horovod's ``init`` registers its shutdown (:func:`~elastictrain.horovod.private.exit_hook`) with
    ``atexit`` at every call, and an elastic worker calls it at every reset: each reset would keep one more
    registration for the life of the process (and one more shutdown at its exit). ``atexit.unregister`` drops
    every registration equal to it, then it is registered once, last, where the newest of Horovod's would stand."""
    try:
        init()
    finally:
        atexit.unregister(exit_hook)
        atexit.register(exit_hook)


def horovod_elastic_run(func: Callable[..., T]) -> Callable[..., T]:
    """``hvd.elastic.run`` (Horovod's own loop, ``horovod.common.elastic.run_fn``) with :func:`reset_horovod`."""
    import horovod.torch as hvd
    from horovod.common.elastic import run_fn

    from elastictrain.logconf import get_logger

    log = get_logger("elastictrain.collective")

    def retry(attempt: int, error: Exception) -> None:
        log.warning("hvd.init failed; asking the driver for the next ring", attempt=attempt, error=str(error)[:200])

    hook = exit_hook()
    return run_fn(func, lambda: reset_horovod(hvd.shutdown, lambda: init_horovod(hvd.init, hook), on_retry=retry))


class HorovodCollective:
    """:class:`Collective` over ``horovod.torch`` (call :meth:`init` once per process)."""

    def __init__(self) -> None:
        import horovod.torch as hvd

        self.hvd = hvd

    @classmethod
    def init(cls) -> HorovodCollective:
        """``hvd.init`` (tried again like a reset's, :func:`reset_horovod`, when the first ring cannot form)."""
        c = cls()
        hook = exit_hook()
        reset_horovod(c.hvd.shutdown, lambda: init_horovod(c.hvd.init, hook))
        return c

    def rank(self) -> int:
        return int(self.hvd.rank())

    def size(self) -> int:
        return int(self.hvd.size())

    def local_rank(self) -> int:
        return int(self.hvd.local_rank())

    def local_size(self) -> int:
        return int(self.hvd.local_size())

    def nccl_built(self) -> bool:
        return bool(self.hvd.nccl_built())

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        handles = [self.hvd.broadcast_async_(t, root, name=f"sync.{name}") for name, t in tensors.items()]
        for h in handles:
            self.hvd.synchronize(h)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        return self.hvd.broadcast(tensor, root_rank=root, name=name)

    def broadcast_object(self, obj: T, root: int, name: str) -> T:
        return self.hvd.broadcast_object(obj, root_rank=root, name=name)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return list(self.hvd.allgather_object(obj, name=name))

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name)

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allgather(tensor, name=name)

    def distributed_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        compression: str,
    ) -> torch.optim.Optimizer:
        codec = {"none": self.hvd.Compression.none, "fp16": self.hvd.Compression.fp16}[compression]
        distributed = self.hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters, compression=codec, op=self.hvd.Sum
        )
        return wait_without_spinning(distributed, self.hvd.poll)

    def elastic_run(self, func: Callable[[Any], T]) -> Callable[[State], T]:
        return horovod_elastic_run(func)


class LocalCollective:
    """One process, pretending to be ``rank`` of ``size``: the other ranks hold what this one holds and add
    nothing to sums. Broadcasts and gathers therefore see this rank's values, and a sum is this rank's value.

    :meth:`resize` sets the world that the next reset brings (ranks can move: a rank-0 handover is a resize to
    a rank other than 0). The elastic loop is Horovod's own (``horovod.common.elastic.run_fn``), so restores,
    resets, syncs and host-change interrupts follow Horovod's order exactly; raise ``HorovodInternalError`` or
    call ``state.on_hosts_updated`` to drive it.
    """

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size = rank, size
        self._next: tuple[int, int] | None = None
        self.resets = 0
        self.nccl = False

    def resize(self, rank: int, size: int) -> None:
        """The world after the next reset."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a world of {size}")
        self._next = (rank, size)

    def reset(self) -> None:
        self.resets += 1
        if self._next is not None:
            (self._rank, self._size), self._next = self._next, None

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        return 0

    def local_size(self) -> int:
        return 1

    def nccl_built(self) -> bool:
        return self.nccl

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        pass

    def broadcast(self, tensor: torch.Tensor, root: int, name: str) -> torch.Tensor:
        return tensor.clone()

    def broadcast_object(self, obj: T, root: int, name: str) -> T:
        return copy.deepcopy(obj)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return [copy.deepcopy(obj) for _ in range(self._size)]

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.clone()

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return torch.cat([tensor] * self._size)

    def distributed_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        compression: str,
    ) -> torch.optim.Optimizer:
        return optimizer

    def elastic_run(self, func: Callable[[Any], T]) -> Callable[[State], T]:
        from horovod.common.elastic import run_fn

        return run_fn(func, self.reset)
