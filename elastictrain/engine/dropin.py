"""A drop-in for existing Horovod elastic scripts: three renames give them the engine's guarantees.

=====================================  ==========================================
Horovod                                elastictrain
=====================================  ==========================================
``hvd.elastic.TorchState(model, opt,   :class:`ElasticState` (same constructor)
**kwargs)``
``hvd.elastic.ElasticSampler(dataset,  :class:`ElasticSampler` (same constructor)
shuffle, seed)``
``@hvd.elastic.run``                   :func:`elastic_run`
=====================================  ==========================================

What changes for the script, with the engine's parts doing the work:

* **Complete rollback.** Modules and optimizers are committed into buffers allocated once
  (:class:`~elastictrain.engine.state.TensorSnapshot`, :class:`~elastictrain.engine.state.OptimizerSnapshot`). Every
  other keyword argument with ``state_dict``/``load_state_dict`` (LR schedulers, GradScalers, samplers) is committed *by
  value*, as are the RNG states; stock ``TorchState`` keeps schedulers and scalers by reference, so its ``restore()``
  leaves them where the failed steps took them. Plain values (ints, lists) behave as in ``TorchState``: attributes,
  saved by reference at ``commit()``.
* **Sync from the most advanced rank**, not blindly rank 0 (a new process may hold rank 0).
* **Exactly-once data.** :class:`ElasticSampler` pads nothing and re-splits the rest of the epoch over the
  current world at every iteration, so a graceful removal (no sync, Horovod #3399) cannot lose or repeat
  samples.
* **A SIGKILLed peer costs about a second**, not the Gloo timeout: :func:`elastic_run` arms the engine's
  collective watchdog (:func:`elastictrain.engine.watch.arm_watchdog`). A "step" for the watchdog is the time
  between two optimizer steps, taken from an optimizer step hook.

* **No spinning wait for gradients.** A Horovod ``DistributedOptimizer`` given to :class:`ElasticState` waits
  for its allreduces sleeping 0.2 ms between polls; Horovod's own wait spins, taking the core that slower workers
  on the same machine need.
* **Two ranks on one GPU stop the job with one line** at the sync, where NCCL carries the gradients
  (:mod:`elastictrain.engine.gpus`), instead of resetting forever.

The failure marker the watchdog shares between workers (:mod:`~elastictrain.engine.health.signals`) lives in
``$ELASTICTRAIN_RUN_DIR/.elastic/`` when that is set (shared storage on a cluster), else in this machine's
temporary folder under the job's rendezvous address, removed when the training function returns.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from horovod.common.elastic import State
from horovod.torch.elastic.sampler import ElasticSampler as HorovodElasticSampler
from torch import nn

from elastictrain import envnames
from elastictrain.engine.collective import Collective, HorovodCollective, horovod_elastic_run, wait_without_spinning
from elastictrain.engine.gpus import check_one_rank_per_gpu, collective_gpu
from elastictrain.engine.health.signals import FileSignals
from elastictrain.engine.health.watchdog import CollectiveWatchdog
from elastictrain.engine.sampler import ExactlyOncePlanner, SamplerState
from elastictrain.engine.state import (
    OptimizerSnapshot,
    TensorSnapshot,
    load_stateful,
    module_tensors,
    rng_state,
    set_rng_state,
)
from elastictrain.engine.sync import receive_state
from elastictrain.engine.watch import arm_watchdog
from elastictrain.horovod.private import discard_pending_allreduces
from elastictrain.rundir.layout import RunDir

__all__ = ["ElasticSampler", "ElasticState", "elastic_run"]


def _horovod_world() -> tuple[int, int]:
    return hvd.rank(), hvd.size()


class ElasticSampler(torch.utils.data.Sampler[int]):
    """This rank's share of the rest of the epoch: every sample exactly once, nothing padded.

    The epoch's order is one permutation shared by every rank (``seed`` and the epoch, as in
    :class:`~elastictrain.engine.sampler.ExactlyOncePlanner`); the state is ``(epoch, cursor)``, the positions
    consumed by recorded batches. An iteration deals the positions from the cursor on round-robin over the
    ranks of the current world, so the ``i``-th batch of every rank together covers the next
    ``batch_size x world_size`` positions: :meth:`record_batch` advances the cursor by exactly that (less at
    the end of the epoch). The world is read again at every iteration and :meth:`reset`, so any resize,
    graceful or not, re-splits what is left.

    Use as Horovod's: keep it in the state, call ``record_batch(batch_idx, batch_size)`` after each optimizer
    step and ``set_epoch(epoch + 1)`` at the end of an epoch. Nothing is padded, so the last batch of an epoch
    may be shorter on some ranks, and when fewer samples than ranks are left, a rank gets no last batch (its
    loop ends one step early). A dataset length that is a multiple of the per-rank batch size, with the batch
    size at least the world size, never leaves fewer.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        *,
        world: Callable[[], tuple[int, int]] = _horovod_world,
    ) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._world = world
        self._planner = ExactlyOncePlanner(len(dataset), seed)
        self.position = SamplerState()
        self.rank, self.num_replicas = 0, 1
        self.reset()

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def processed_num(self) -> int:
        """Positions of this epoch consumed by recorded batches (Horovod's name for the cursor)."""
        return self.position.cursor

    def reset(self) -> None:
        """Read this rank and the world size again (after a reset)."""
        self.rank, self.num_replicas = self._world()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample; call at the end of an epoch, as with Horovod's sampler."""
        self.position = SamplerState(epoch, 0)

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One step of ``batch_size`` samples per rank was taken by every rank of the current world."""
        self.position.cursor = min(self._planner.num_samples, self.position.cursor + batch_size * self.num_replicas)

    def state_dict(self) -> dict[str, int]:
        return self.position.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        d = dict(state_dict)
        if "cursor" not in d and "processed_num" in d:  # a state dict of Horovod's sampler
            d["cursor"] = d["processed_num"]
        self.position.load_state_dict(d)

    def _positions(self) -> range:
        return range(self.position.cursor + self.rank, self._planner.num_samples, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        self.reset()
        positions = self._positions()
        if not self.shuffle:
            return iter(positions)
        order = self._planner.permutation(self.position.epoch)
        return iter([order[p] for p in positions])

    def __len__(self) -> int:
        return len(self._positions())


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


_RESERVED = {"commits", "watchdog", "on_failure", "on_failure_notice", "save", "restore", "sync", "reset", "commit"}


def _wait_asleep(optimizer: torch.optim.Optimizer) -> None:
    """A Horovod ``DistributedOptimizer`` (it keeps its allreduces in ``_handles``) waits for them as the engine's
    does, sleeping between polls instead of spinning (:func:`~elastictrain.engine.collective.wait_without_spinning`);
    once per optimizer, however many states hold it."""
    if hasattr(optimizer, "_handles") and not getattr(optimizer, "_elastictrain_waits_asleep", False):
        wait_without_spinning(optimizer, hvd.poll)
        optimizer._elastictrain_waits_asleep = True  # type: ignore[attr-defined]


class ElasticState(State):
    """``hvd.elastic.TorchState``'s constructor and protocol (``commit``, ``restore``, ``sync``,
    ``register_reset_callbacks``), committing *all* of the state by value (see the module docstring).

    Keyword arguments become attributes. Modules and optimizers, and objects with ``state_dict`` /
    ``load_state_dict`` (LR schedulers, GradScalers, samplers), are restored in place: keep using the same
    objects. Anything else is a plain value as in ``TorchState``: assign it (``state.epoch = 3``); the
    assignment is kept at ``commit()`` and undone by a rollback.
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any):
        objects = {"model": model, "optimizer": optimizer, **kwargs}
        taken = sorted(set(kwargs) & _RESERVED)
        if taken:
            raise ValueError(f"ElasticState: {', '.join(taken)} is a name of the state itself; pick another name")
        self._modules: dict[str, nn.Module] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._stateful: dict[str, Any] = {}
        self._values: list[str] = []
        for name, value in objects.items():
            if isinstance(value, nn.Module):
                self._modules[name] = value
            elif isinstance(value, torch.optim.Optimizer):
                self._optimizers[name] = value
            elif value is not None and _has_state_dict(value):
                self._stateful[name] = value
            elif value is not None or name not in ("model", "optimizer"):
                self._values.append(name)
            setattr(self, name, value)
        self._module_snapshots = {name: TensorSnapshot() for name in self._modules}
        self._optimizer_snapshots = {name: OptimizerSnapshot(opt) for name, opt in self._optimizers.items()}
        self._saved_stateful: dict[str, Any] = {}
        self._saved_values: dict[str, Any] = {}
        self._saved_rng: dict[str, Any] = {}
        self.commits = 0
        """How many commits this state holds (synced): the rank with the most is the most advanced."""
        self.on_failure: Callable[[], None] = lambda: None
        self.on_failure_notice: Callable[[], None] = lambda: None
        self.watchdog: CollectiveWatchdog | None = None
        """Set by :func:`elastic_run` while it runs; told of each optimizer step."""
        self._step_depth = 0
        for opt in self._optimizers.values():
            opt.register_step_pre_hook(self._optimizer_stepping)
            opt.register_step_post_hook(self._optimizer_stepped)
            _wait_asleep(opt)
        self._collective: Collective = HorovodCollective()
        """The world the state syncs over (a one-process fake in unit tests)."""
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.save()

    def _optimizer_stepping(self, *_: Any) -> None:
        self._step_depth += 1

    def _optimizer_stepped(self, *_: Any) -> None:
        """After an optimizer step; Horovod's ``DistributedOptimizer.step`` runs the hooks twice (its own step,
        then the wrapped optimizer's), so only the outermost counts."""
        self._step_depth = max(0, self._step_depth - 1)
        watchdog = self.watchdog
        if watchdog is not None and self._step_depth == 0:
            watchdog.step_finished()
            watchdog.step_started()

    def save(self) -> None:
        """Commit to host memory (``commit()`` = this, then the host-update check)."""
        for name, module in self._modules.items():
            self._module_snapshots[name].save(module_tensors(module))
        for snapshot in self._optimizer_snapshots.values():
            snapshot.save()
        self._saved_stateful = copy.deepcopy({name: obj.state_dict() for name, obj in self._stateful.items()})
        self._saved_values = {name: getattr(self, name) for name in self._values}
        self._saved_rng = rng_state()
        self.commits += 1

    def restore(self) -> None:
        """Called by the elastic loop when a collective failed: back to the last commit, all of it."""
        self.on_failure()
        self._step_depth = 0  # the failed step raised between its hooks
        for name, module in self._modules.items():
            self._module_snapshots[name].restore(module_tensors(module))
        for snapshot in self._optimizer_snapshots.values():
            snapshot.restore()
        for name, obj in self._stateful.items():
            load_stateful(obj, copy.deepcopy(self._saved_stateful[name]), self._devices())
        for name, value in self._saved_values.items():
            setattr(self, name, value)
        set_rng_state(self._saved_rng)
        for opt in self._optimizers.values():
            discard_pending_allreduces(opt)

    def _devices(self) -> Iterator[torch.device]:
        """Where the training runs: the devices of the modules' parameters (a GradScaler's tensors go there)."""
        return (p.device for m in self._modules.values() for p in m.parameters())

    def reset(self) -> None:
        """After Horovod re-formed the world (before the sync, also when a graceful removal skips it)."""
        self._step_depth = 0
        for obj in self._stateful.values():
            if isinstance(obj, (ElasticSampler, HorovodElasticSampler)):
                obj.reset()

    def sync(self) -> None:
        """Everyone takes the state of the rank with the most commits (ties: the lowest rank), then commits it."""
        collective = self._collective
        cuda = next((d for d in self._devices() if d.type == "cuda"), None)
        gpu = collective_gpu(cuda, collective.nccl_built()) if cuda is not None else ""
        gathered = collective.allgather_object((self.commits, gpu), name="elastictrain.engine.dropin.commits")
        check_one_rank_per_gpu([g[1] for g in gathered])  # before the first GPU broadcast, which NCCL would refuse
        counts = [g[0] for g in gathered]
        root = max(range(len(counts)), key=lambda r: (counts[r], -r))
        apply, small = receive_state(
            collective,
            root,
            self._modules,
            self._optimizers,
            staged=False,
            extra={
                "stateful": {name: obj.state_dict() for name, obj in self._stateful.items()},
                "values": {name: getattr(self, name) for name in self._values},
                "commits": self.commits,
            },
        )
        apply()
        for name, obj in self._stateful.items():
            load_stateful(obj, small["stateful"][name], self._devices())
        for name, value in small["values"].items():
            setattr(self, name, value)
        self.reset()
        self.commits = small["commits"]
        self.save()


def _signals_folder() -> Path:
    """Where the workers' signals live: ``$ELASTICTRAIN_RUN_DIR/.elastic``, else a temporary folder of the job."""
    run_dir = os.environ.get(envnames.RUN_DIR)
    if run_dir:
        return RunDir.of(run_dir).signals
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "local")
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0")
    job = f"{addr}-{port}".replace("/", "_")
    return Path(tempfile.gettempdir()) / f"elastictrain-{os.getuid()}" / job


def _host() -> str:
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def elastic_run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``@hvd.elastic.run`` with the collective watchdog armed.

    The elastic loop is Horovod's own (sync, then ``func``; on ``HorovodInternalError`` restore, re-init, reset
    callbacks, sync; on ``HostsUpdatedInterrupt`` re-init, reset callbacks, sync unless hosts were only
    removed). Around it a watchdog thread aborts this worker's Gloo connections when a peer is known to have
    failed and this worker has waited in one step far longer than steps take, so the failure surfaces as a
    ``HorovodInternalError`` at once instead of after ``HOROVOD_GLOO_TIMEOUT_SECONDS``. Steps are timed from
    the optimizer step hook of an :class:`ElasticState`; with another ``State`` the whole call is one step.
    """

    def watched(state: State, *args: Any, **kwargs: Any) -> Any:
        watchdog = getattr(state, "watchdog", None)
        if watchdog is not None:
            watchdog.idle()
            watchdog.snapshot_ring()  # after the sync: the Gloo connections of the ring just formed
            watchdog.step_started()
        try:
            return func(state, *args, **kwargs)
        finally:
            if watchdog is not None:
                watchdog.idle()

    run = horovod_elastic_run(functools.wraps(func)(watched))

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        folder = _signals_folder()
        watchdog = arm_watchdog(state, FileSignals.in_folder(folder), host=_host)
        state.watchdog = watchdog
        try:
            result = run(state, *args, **kwargs)
        finally:
            watchdog.stop()
            state.watchdog = None
        if not os.environ.get(envnames.RUN_DIR):  # the job's folder in the temp dir: nothing reads it now
            shutil.rmtree(folder, ignore_errors=True)
        return result

    return wrapper
