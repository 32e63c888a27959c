"""``ElasticTrainingState.sync`` over a fake two-rank world: which rank's committed state everyone takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from elastictrain.engine.collective import LocalCollective
from elastictrain.engine.elastic_state import ElasticTrainingState
from elastictrain.engine.policy import ScaleRamp
from elastictrain.engine.sampler import SamplerState
from elastictrain.engine.state import CommittedState, Counters


class TwoRanks(LocalCollective):
    """This process is rank 0; rank 1 committed the same step but *after* the epoch end (epoch + 1, cursor 0)."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=2)
        self.roots: list[int] = []

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        if isinstance(obj, int):  # a bare step: the peer has the same one
            return [obj, obj]
        step, epoch, *rest = obj  # (step, epoch, ...): the peer is one epoch on at the same step
        return [obj, (step, epoch + 1, *rest)]

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        self.roots.append(root)
        return obj

    def broadcast_(self, tensors: Mapping[str, torch.Tensor], root: int) -> None:
        self.roots.append(root)


def test_a_step_tie_syncs_from_the_rank_past_the_epoch_end_so_validation_is_not_run_twice():
    """The epoch-end commit adds no step: a rank whose validation allreduce completed committed (S, E+1)
    while a rank whose allreduce failed rolled back to (S, E). Everyone must take the later commit."""
    fake = TwoRanks()
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    sampler = SamplerState(epoch=1, cursor=96)
    committed = CommittedState(model, opt, sched, None, sampler, Counters(step=30), ScaleRamp(1, 1, 0, 0))
    state = ElasticTrainingState(committed, seed=0, stop_requested=lambda: False, collective=fake)
    state.sync()
    assert fake.roots and set(fake.roots) == {1}, f"synced from ranks {sorted(set(fake.roots))}, not rank 1"
