"""Make every rank's modules and optimizers equal to one root rank's (used by the engine and by the drop-in)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elastictrain.engine.collective import Collective


def receive_state(
    collective: Collective,
    root: int,
    modules: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    *,
    staged: bool,
    extra: Any = None,
) -> tuple[Callable[[], None], Any]:
    """Receive ``root``'s modules, optimizers and ``extra`` object (a collective: every rank calls it); returns
    ``(apply, root's extra)``.

    Two broadcasts whatever the number of optimizers: first one object from the root (every optimizer's state
    layout: which params have which buffers, so that a rank that has not stepped yet allocates them; every
    param group's hyper-parameters; ``extra``), then every tensor. Each collective costs a round over the whole
    world, so their number, not their size, is what a reset of a large world pays. Keys name the tensors in
    the broadcast, identically on every rank.

    Call ``apply()`` (local, cannot fail) once every collective of the sync has completed. ``staged``: a
    receiving rank takes the tensors into copies of its own and changes nothing of its own until ``apply()``,
    so a collective that fails midway leaves it as it was, a whole step (rollback ``none``: there is no commit
    to repair a mix). Costs one more copy of the state on receivers, during the sync only. Not staged: the
    tensors are overwritten in place as they arrive, and ``apply()`` sets the param groups.
    """
    receiving = staged and collective.rank() != root
    meta: dict[str, Any] = collective.broadcast_object(
        {
            "layouts": {prefix: _layout(opt) for prefix, opt in optimizers.items()},
            "groups": {
                prefix: [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                for prefix, opt in optimizers.items()
            },
            "extra": extra,
        },
        root,
        name="sync.meta",
    )
    tensors: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # staged: (live tensor, received buffer)
    for prefix, module in modules.items():
        for name, t in module.state_dict(keep_vars=True).items():
            live = t.detach()
            tensors[f"{prefix}.{name}"] = buf = live.clone() if receiving else live
            if receiving:
                copies.append((live, buf))
    new_states: list[tuple[torch.optim.Optimizer, dict[torch.Tensor, dict[str, Any]]]] = []
    for prefix, opt in optimizers.items():
        params = [p for g in opt.param_groups for p in g["params"]]
        layout: dict[int, dict[str, Any]] = meta["layouts"][prefix]
        states: dict[torch.Tensor, dict[str, Any]] = {}
        for i, entries in layout.items():
            p = params[i]
            if not entries:
                continue
            live = opt.state.get(p, {})
            st = states[p] = {} if receiving else opt.state.setdefault(p, {})
            for key, spec in entries.items():
                if spec[0] == "value":
                    st[key] = spec[1]
                    continue
                shape, dtype, on_cpu = spec  # where the root keeps it: AdamW's step on the CPU, the rest by the param
                cur, device = live.get(key), torch.device("cpu") if on_cpu else p.device
                fits = isinstance(cur, torch.Tensor) and (tuple(cur.shape), cur.dtype, cur.device) == (
                    shape,
                    dtype,
                    device,
                )
                if receiving:
                    st[key] = cur = cur.clone() if fits else torch.zeros(shape, dtype=dtype, device=device)
                elif not fits:
                    st[key] = cur = torch.zeros(shape, dtype=dtype, device=device)
                tensors[f"{prefix}.{i}.{key}"] = cur
        if receiving:
            new_states.append((opt, states))
        else:
            for i, p in enumerate(params):
                if not layout.get(i):
                    opt.state.pop(p, None)
    collective.broadcast_(tensors, root)
    groups = meta["groups"]

    def apply() -> None:
        if copies:
            with torch.no_grad():
                torch._foreach_copy_([live for live, _ in copies], [buf for _, buf in copies])
        for opt, states in new_states:
            for p in [p for g in opt.param_groups for p in g["params"]]:
                if p in states:
                    opt.state[p] = states[p]
                else:
                    opt.state.pop(p, None)
        for prefix, opt in optimizers.items():
            for g, saved in zip(opt.param_groups, groups[prefix], strict=True):
                g.update(saved)

    return apply, meta["extra"]


def _layout(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Which state each param of ``opt`` has: a tensor's (shape, dtype, on the CPU) or a plain value."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        i: {
            k: (tuple(v.shape), v.dtype, v.device.type == "cpu") if isinstance(v, torch.Tensor) else ("value", v)
            for k, v in opt.state.get(p, {}).items()
        }
        for i, p in enumerate(params)
    }
