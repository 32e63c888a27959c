"""One rank per GPU where NCCL carries the collectives (:mod:`elastictrain.engine.gpus`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastictrain.engine.collective import LocalCollective
from elastictrain.engine.elastic_state import ElasticTrainingState
from elastictrain.engine.gpus import check_one_rank_per_gpu, collective_gpu, shared_gpus
from elastictrain.engine.policy import ScaleRamp
from elastictrain.engine.sampler import SamplerState
from elastictrain.engine.state import CommittedState, Counters
from elastictrain.errors import ConfigError


def test_shared_gpus_names_each_gpu_given_by_more_than_one_rank():
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", "", "", None, 7]) == {"GPU-a": [0, 2]}
    assert shared_gpus(["GPU-a", "GPU-b"]) == {}
    assert shared_gpus(["", ""]) == {}  # CPU tensors, or GPU tensors staged through host memory: no GPU


def test_two_ranks_on_one_gpu_is_one_line_naming_both_ranks_their_hosts_and_the_gpu():
    members = [("localhost", 0, 11), ("127.0.0.1", 0, 12), ("10.0.0.2", 0, 13)]
    with pytest.raises(ConfigError) as err:
        check_one_rank_per_gpu(["GPU-x", "GPU-x", "GPU-y"], members)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("rank 0 (localhost[0]) and rank 1 (127.0.0.1[0]) share GPU GPU-x: NCCL runs one rank per GPU")


def test_distinct_gpus_or_none_pass_and_odd_members_still_give_a_message():
    check_one_rank_per_gpu(["GPU-x", "GPU-y"], [("a", 0, 1), ("b", 0, 2)])
    check_one_rank_per_gpu(["", ""], [])
    with pytest.raises(ConfigError, match=r"^rank 0 and rank 1 share GPU g"):
        check_one_rank_per_gpu(["g", "g"], [None])


def test_no_gpu_id_without_nccl_or_on_the_cpu():
    assert collective_gpu(torch.device("cpu"), nccl=True) == ""
    assert collective_gpu(torch.device("cuda", 0), nccl=False) == ""


class TwoRanksOnOneGpu(LocalCollective):
    """Rank 1 of two; the peer gives the same GPU id as this rank: the sync must stop before any broadcast."""

    def __init__(self) -> None:
        super().__init__(rank=1, size=2)
        self.broadcasts = 0

    def allgather_object(self, obj, name):
        step, epoch, reached, _member, gpu = obj
        return [(step, epoch, reached, ("localhost", 0, 1), gpu), obj]

    def broadcast_object(self, obj, root, name):
        self.broadcasts += 1
        return obj

    def broadcast_(self, tensors, root):
        self.broadcasts += 1


def _state(collective: LocalCollective, gpu: str) -> ElasticTrainingState:
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    committed = CommittedState(model, opt, sched, None, SamplerState(), Counters(step=3), ScaleRamp(1, 1, 0, 0))
    state = ElasticTrainingState(committed, 0, lambda: False, collective)
    state.member = lambda: ("127.0.0.1", 0, 2)
    state.gpu = gpu
    return state


def test_the_sync_stops_with_the_error_before_its_first_broadcast_when_two_ranks_share_a_gpu():
    collective = TwoRanksOnOneGpu()
    with pytest.raises(ConfigError, match=r"rank 0 \(localhost\[0\]\) and rank 1 \(127\.0\.0\.1\[0\]\) share GPU"):
        _state(collective, "GPU-same").sync()
    assert collective.broadcasts == 0


def test_the_sync_goes_on_when_no_rank_names_a_gpu():
    collective = TwoRanksOnOneGpu()
    _state(collective, "").sync()
    assert collective.broadcasts > 0
