"""One rank per GPU where NCCL carries the collectives: found at each sync, before NCCL refuses it.

NCCL runs one rank per GPU. A communicator with two ranks on one device fails at its first collective, Horovod
reports a failed collective, and an elastic job resets, forms the same ring, and fails again: on the first GPU run,
two logical hosts of one machine (both local rank 0, so both on ``cuda:0``) reset about once a second until they
were killed. So every rank gathers the UUID of the GPU that NCCL would use for it with the sync's positions
(:meth:`elastictrain.engine.elastic_state.ElasticTrainingState.sync`), and :func:`check_one_rank_per_gpu` raises
the same :class:`~elastictrain.errors.ConfigError` on every rank before the sync's first GPU broadcast: the job
stops with one line that names the ranks and the GPU.

A Horovod built without NCCL stages GPU tensors through host memory, where ranks may share a GPU; CPU tensors
name no GPU. Both gather an empty id, which is never a conflict.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elastictrain.errors import ConfigError


def collective_gpu(device: torch.device, nccl: bool) -> str:
    """The UUID of the GPU that NCCL runs this rank's collectives on; empty when NCCL carries none."""
    if device.type != "cuda" or not nccl:
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def shared_gpus(gpus: Sequence[object]) -> dict[str, list[int]]:
    """Each GPU id that more than one rank gave, with those ranks (empty and non-string ids are no GPU)."""
    ranks: dict[str, list[int]] = {}
    for rank, gpu in enumerate(gpus):
        if isinstance(gpu, str) and gpu:
            ranks.setdefault(gpu, []).append(rank)
    return {gpu: rs for gpu, rs in ranks.items() if len(rs) > 1}


def _who(rank: int, members: Sequence[object]) -> str:
    member = members[rank] if rank < len(members) else None
    if isinstance(member, tuple | list) and len(member) >= 2:
        return f"rank {rank} ({member[0]}[{member[1]}])"
    return f"rank {rank}"


def check_one_rank_per_gpu(gpus: Sequence[object], members: Sequence[object] = ()) -> None:
    """Raise :class:`ConfigError` when two ranks run their NCCL collectives on one GPU.

    ``gpus`` holds every rank's :func:`collective_gpu`, ``members`` every rank's ``(host, slot, ...)`` (for the
    message only), both in rank order as gathered. Every rank gathers the same lists, so every rank raises.
    """
    shared = shared_gpus(gpus)
    if not shared:
        return
    gpu, ranks = next(iter(shared.items()))
    raise ConfigError(
        f"{' and '.join(_who(r, members) for r in ranks)} share GPU {gpu}: NCCL runs one rank per GPU; give each "
        "machine at most as many slots as it has GPUs (logical hosts of one machine share its GPUs)"
    )
