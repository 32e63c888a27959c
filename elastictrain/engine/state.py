"""The complete training state, committed in memory and rolled back in place. No Horovod here.

Two kinds of state, one per ``elastic.rollback`` mode:

- :class:`CommittedState` (``commit``): a commit copies every tensor into buffers allocated once
  (``torch._foreach_copy_``, one call per group), instead of deep-copying state dicts the way stock
  ``TorchState`` does. A rollback copies them back. The scheduler, the GradScaler, the sampler
  position, the counters and the RNG states are small; their state dicts are copied as plain values.
  Stock ``ObjectState`` keeps references to those objects, so its ``restore()`` would not roll them back.
- :class:`LiveState` (``none``): no copy. The live state is the commit: it only ever holds whole
  steps, because everything a step changes (parameters, optimizer state, scheduler, scaler, sampler
  cursor, counters, step log) changes after the step's last collective, in local code that cannot
  fail half-way. A failure discards the partial step (:meth:`CommittedState.discard_partial_step`)
  and keeps the rest. Checkpoints snapshot the live state at a commit point.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import nn

from elastictrain.engine.policy import ScaleRamp
from elastictrain.engine.sampler import SamplerState, StepLog


@dataclass(slots=True)
class Counters:
    step: int = 0
    """Optimizer steps completed."""
    samples: int = 0
    """Training samples consumed by completed steps, over all epochs."""
    world_size: int = 0
    """World size the last step ran at (detects resizes after a sync); 0 until the first step of a start or resume."""
    resets: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, d: dict[str, int]) -> None:
        for k, v in d.items():
            setattr(self, k, int(v))


class Stateful(Protocol):
    """A small part of the committed state with plain values (e.g. the shares of ``elastic.stragglers: balance``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, d: Any) -> None:
        """Load what :meth:`state_dict` returned, or None (a checkpoint written before the part existed)."""


class TensorSnapshot:
    """Copies of a fixed list of tensors in buffers allocated once; pinned when the source is on a GPU."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._signature: list[tuple[torch.Size, torch.dtype, torch.device]] = []

    @staticmethod
    def _sig(tensors: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
        return [(t.shape, t.dtype, t.device) for t in tensors]

    def save(self, tensors: list[torch.Tensor]) -> None:
        sig = self._sig(tensors)
        if sig != self._signature:
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda) for t in tensors]
            self._signature = sig
        if tensors:
            torch._foreach_copy_(self._buffers, tensors, non_blocking=True)
            if any(t.is_cuda for t in tensors):
                torch.cuda.synchronize()

    def load(self, values: list[torch.Tensor], like: list[tuple[torch.Size, torch.dtype, torch.device]]) -> None:
        """Adopt ``values`` (e.g. a checkpoint's CPU tensors) as the committed copy of tensors shaped ``like``.

        ``like`` gives each live tensor's (shape, dtype, device); a later :meth:`restore` copies the values
        there. Nothing is read back from a device.
        """
        assert len(values) == len(like), "a checkpoint's tensor count does not match the live state"
        buffers = []
        for v, (shape, dtype, device) in zip(values, like, strict=True):
            if tuple(v.shape) != tuple(shape):
                raise ValueError(f"a checkpoint tensor has shape {tuple(v.shape)}, the live one {tuple(shape)}")
            b = v.detach().to(device="cpu", dtype=dtype, copy=True)
            buffers.append(b.pin_memory() if device.type == "cuda" else b)
        self._buffers, self._signature = buffers, list(like)

    @property
    def devices(self) -> list[torch.device]:
        """Where each committed tensor lives (its buffer is on the CPU)."""
        return [d for _, _, d in self._signature]

    def restore(self, tensors: list[torch.Tensor]) -> None:
        assert self._sig(tensors) == self._signature, "tensor layout changed since the last commit"
        if tensors:
            torch._foreach_copy_(tensors, self._buffers)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self._buffers


def module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers of ``model`` as plain tensors, in ``state_dict`` order."""
    return [t.detach() for t in model.state_dict(keep_vars=True).values()]


def optimizer_state_device(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> torch.device:
    """The device on which torch keeps optimizer state ``key`` of ``param`` (its ``load_state_dict`` policy).

    On the parameter's device, whatever its shape (a 0-dim parameter's buffers too), except the
    ``step`` counter of Adam-like optimizers, which stays on the CPU unless the parameter's group is
    ``capturable`` or ``fused``. Every place that creates optimizer state (a rollback, a checkpoint
    load, a sync) asks this, so a broadcast finds the same device on every rank.
    """
    if key == "step":
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return param.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
    return param.device


class OptimizerSnapshot:
    """The optimizer's per-parameter state and param-group hyper-parameters, saved and restored in place."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.tensors = TensorSnapshot()
        self._layout: list[tuple[int, str]] = []
        self._values: dict[tuple[int, str], Any] = {}
        self._groups: list[dict[str, Any]] = []

    def _entries(self) -> tuple[list[tuple[int, str]], list[torch.Tensor], dict[tuple[int, str], Any]]:
        layout, tensors, values = [], [], {}
        for i, p in enumerate(self.params):
            for key, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    layout.append((i, key))
                    tensors.append(v)
                else:
                    values[(i, key)] = copy.copy(v)
        return layout, tensors, values

    def save(self) -> None:
        layout, tensors, values = self._entries()
        self._layout, self._values = layout, values
        self.tensors.save(tensors)
        self._groups = [{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def restore(self) -> None:
        state = self.optimizer.state
        saved_params = {i for i, _ in self._layout} | {i for i, _ in self._values}
        for i, p in enumerate(self.params):
            if i not in saved_params:
                state.pop(p, None)  # state created after the commit (e.g. the first step) is undone
        current = {(i, k) for i, p in enumerate(self.params) for k in state.get(p, {})}
        targets: list[torch.Tensor] = []
        devices = self.tensors.devices
        for i, key in self._layout:
            p = self.params[i]
            entry = state.setdefault(p, {})
            buf, device = self.tensors.buffers[len(targets)], devices[len(targets)]
            t = entry.get(key)
            if not isinstance(t, torch.Tensor) or t.shape != buf.shape or t.dtype != buf.dtype or t.device != device:
                entry[key] = t = torch.empty(buf.shape, dtype=buf.dtype, device=device)  # where it was committed
            targets.append(t)
        for (i, key), v in self._values.items():
            state.setdefault(self.params[i], {})[key] = copy.copy(v)
        for i, key in current - set(self._layout) - set(self._values):
            state[self.params[i]].pop(key, None)
        self.tensors.restore(targets)
        for g, saved in zip(self.optimizer.param_groups, self._groups, strict=True):
            g.update(copy.copy(saved))


def rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def reseed(seed: int, step: int, rank: int) -> None:
    """Derive every RNG from ``(seed, step, rank)``: used after a sync, when rank numbering may have changed."""
    s = (seed * 1_000_003 + step) * 4099 + rank
    torch.manual_seed(s)
    random.seed(s)


def load_stateful(obj: Any, state: Any, devices: Iterable[torch.device] = ()) -> None:
    """``obj.load_state_dict(state)``; a GradScaler is then made ready to step (:func:`ready_grad_scaler`).

    Call wherever committed, synced or checkpointed state goes into a live object with ``state_dict`` /
    ``load_state_dict`` (rollback, sync, resume): the engine and the drop-in both load through here.
    ``devices``: where the training runs (the model's parameters), for the scaler's tensors.
    """
    obj.load_state_dict(state)
    if isinstance(obj, torch.amp.GradScaler):
        ready_grad_scaler(obj, devices)


def ready_grad_scaler(scaler: torch.amp.GradScaler, devices: Iterable[torch.device] = ()) -> None:
    """Give an enabled GradScaler its ``_scale`` and ``_growth_tracker`` tensors now, with the values it holds.

    ``GradScaler.load_state_dict`` records the scale but creates those tensors only at the first ``scale()``.
    A worker whose first step after a load or a sync has no sample (an empty share) never calls ``scale()``,
    and its ``unscale_`` of the allreduced gradients would fail. The tensors go on the first of ``devices``
    of the scaler's kind (``cuda:1`` for a CUDA scaler of a model on ``cuda:1``), else on that kind's current
    device; tensors already there keep their values.
    """
    if not scaler.is_enabled():
        return
    kind = scaler._device
    device = next((d for d in devices if d.type == kind), None)
    if device is None:
        device = torch.device(kind)
        if kind == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    scale, tracker = scaler._scale, scaler._growth_tracker
    if scale is None or tracker is None:
        scaler._lazy_init_scale_growth_tracker(device)  # from the loaded (or initial) scale and growth tracker
    elif scale.device != device or tracker.device != device:
        scaler._scale, scaler._growth_tracker = scale.to(device), tracker.to(device)


class CommittedState:
    """All state that a rollback must restore: model, optimizer, scheduler, scaler, sampler, counters, RNG (and the
    step log and the shares, when the job has them)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        sampler: SamplerState,
        counters: Counters,
        ramp: ScaleRamp,
        step_log: StepLog | None = None,
        shares: Stateful | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.counters = counters
        self.ramp = ramp
        self.step_log = step_log or StepLog()
        self.shares = shares
        self._model_snapshot = TensorSnapshot()
        self._opt_snapshot = OptimizerSnapshot(optimizer)
        self._small: dict[str, Any] = {}
        self._rng: dict[str, Any] = {}
        self.on_restore: list[Callable[[], None]] = []

    def small_state(self) -> dict[str, Any]:
        """The non-tensor part: cheap to copy, broadcast as one object, stored in checkpoints."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self.sampler.state_dict(),
            "counters": self.counters.state_dict(),
            "ramp": self.ramp.state_dict(),
            "step_log": self.step_log.state_dict(),
            **({"shares": self.shares.state_dict()} if self.shares is not None else {}),
        }

    def load_small_state(self, d: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(d["scheduler"])
        if self.scaler is not None:
            devices = (p.device for p in self.model.parameters())
            if d.get("scaler"):
                load_stateful(self.scaler, d["scaler"], devices)
            else:
                ready_grad_scaler(self.scaler, devices)
        self.sampler.load_state_dict(d["sampler"])
        self.counters.load_state_dict(d["counters"])
        self.ramp.load_state_dict(d["ramp"])
        self.step_log.load_state_dict(d.get("step_log"))
        if self.shares is not None:
            self.shares.load_state_dict(d.get("shares"))

    keeps_copy = True
    """A commit copies the state and a failure rolls back to it (``elastic.rollback: commit``)."""

    def save(self) -> None:
        self._model_snapshot.save(module_tensors(self.model))
        self._opt_snapshot.save()
        self._small = copy.deepcopy(self.small_state())
        self._rng = rng_state()

    def discard_partial_step(self) -> None:
        """Forget what the step in progress accumulated: gradients and the GradScaler's per-step record.

        Call after a failed collective. The step's collectives come before anything it changes for good
        (the gradient allreduce precedes unscale, clip, the optimizer step and the scaler update), so
        this is all a failure can have left half-done.
        """
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        per_optimizer = getattr(self.scaler, "_per_optimizer_states", None)
        if per_optimizer is not None:
            per_optimizer.clear()  # a defaultdict: the next step starts from a fresh record

    def restore(self) -> None:
        self._model_snapshot.restore(module_tensors(self.model))
        self._opt_snapshot.restore()
        self.load_small_state(copy.deepcopy(self._small))
        set_rng_state(self._rng)
        for callback in self.on_restore:
            callback()

    def committed_small(self) -> dict[str, Any]:
        """The small part of the last commit (counters, sampler, ...), as saved."""
        return self._small

    def full_state(self) -> dict[str, Any]:
        """The committed state as one structure of tensors and small values (for checkpoints)."""
        return {
            "model": dict(zip(self.model.state_dict().keys(), self._model_snapshot.buffers, strict=True)),
            "optimizer_layout": list(self._opt_snapshot._layout),
            "optimizer_tensors": list(self._opt_snapshot.tensors.buffers),
            "optimizer_values": {f"{i}:{k}": v for (i, k), v in self._opt_snapshot._values.items()},
            "optimizer_groups": copy.deepcopy(self._opt_snapshot._groups),
            **copy.deepcopy(self._small),
            "rng_torch": self._rng.get("torch"),
        }

    def load_full_state(self, d: dict[str, Any]) -> None:
        """Load a checkpoint written from :meth:`full_state` into the live objects, then commit it.

        Device-agnostic: the checkpoint's tensors (on the CPU) become the commit as they are, and are
        copied to where the live objects keep them: model tensors onto the model's device, optimizer
        state where :func:`optimizer_state_device` says (a GPU parameter's buffers on its GPU, AdamW's
        ``step`` on the CPU).
        """
        self.model.load_state_dict(d["model"])  # checks names and shapes
        live = module_tensors(self.model)
        self._model_snapshot.load(list(d["model"].values()), TensorSnapshot._sig(live))
        snap = self._opt_snapshot
        snap._layout = [(int(i), str(k)) for i, k in d["optimizer_layout"]]
        snap._values = {(int(k.split(":", 1)[0]), k.split(":", 1)[1]): v for k, v in d["optimizer_values"].items()}
        snap._groups = d["optimizer_groups"]
        values = list(d["optimizer_tensors"])
        like = [
            (v.shape, v.dtype, optimizer_state_device(self.optimizer, snap.params[i], key))
            for v, (i, key) in zip(values, snap._layout, strict=True)
        ]
        snap.tensors.load(values, like)
        snap.restore()
        self.load_small_state(d)
        self._small = copy.deepcopy(self.small_state())
        self._rng = rng_state()


class LiveState(CommittedState):
    """``elastic.rollback: none``: the live state is the commit, and nothing is copied.

    Valid only where the engine owns the step (see the module docstring): :meth:`save` does nothing,
    :meth:`committed_small` and :meth:`full_state` read the live objects (the checkpointer
    copies them before it returns), and there is nothing to :meth:`restore`; a failure calls
    :meth:`discard_partial_step` instead.
    """

    keeps_copy = False

    def save(self) -> None:
        """Nothing to copy: the live state is the commit."""

    def restore(self) -> None:
        raise RuntimeError("LiveState keeps no copy to roll back to; discard_partial_step() after a failure")

    def committed_small(self) -> dict[str, Any]:
        return self.small_state()

    def full_state(self) -> dict[str, Any]:
        layout, tensors, values = self._opt_snapshot._entries()
        return {
            "model": {k: t.detach() for k, t in self.model.state_dict().items()},
            "optimizer_layout": layout,
            "optimizer_tensors": tensors,
            "optimizer_values": {f"{i}:{k}": v for (i, k), v in values.items()},
            "optimizer_groups": [
                {k: copy.copy(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ],
            **copy.deepcopy(self.small_state()),
            "rng_torch": torch.get_rng_state(),
        }

    def load_full_state(self, d: dict[str, Any]) -> None:
        """Load a checkpoint into the live objects (as :class:`CommittedState` does), keeping no copy of it."""
        super().load_full_state(d)
        self._model_snapshot = TensorSnapshot()
        self._opt_snapshot.tensors = TensorSnapshot()
        self._small = {}


def make_state(
    rollback: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    sampler: SamplerState,
    counters: Counters,
    ramp: ScaleRamp,
    step_log: StepLog | None = None,
    shares: Stateful | None = None,
) -> CommittedState:
    """The state for ``elastic.rollback``: ``commit`` -> :class:`CommittedState`, ``none`` -> :class:`LiveState`."""
    kinds: dict[str, type[CommittedState]] = {"commit": CommittedState, "none": LiveState}
    return kinds[rollback](model, optimizer, scheduler, scaler, sampler, counters, ramp, step_log, shares)
