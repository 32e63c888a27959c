"""TorchFT 0.2.0's contender in the peer benchmark, written as its README's ``train_ddp.py`` is.

A Lighthouse (``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``) and one
replica group per logical host, each a torchrun of one process that restarts it when it dies::

    REPLICA_GROUP_ID=G NUM_REPLICA_GROUPS=4 TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT \\
        torchrun --standalone --nnodes 1 --nproc-per-node 1 --max-restarts 100 torchft_train.py

As in ``train_ddp.py``: ``Manager`` (its ``ProcessGroupGloo`` with a 5 s timeout, ``PGTransport`` to heal a
replica from a live one, ``min_replica_size=1``, a 30 s timeout), ``torchft.DistributedDataParallel``,
``torchft.Optimizer`` and ``torchft.DistributedSampler`` sharding the data over the replica groups. A step
whose ``should_commit`` fails is thrown away (logged ``committed: false``); the step counter is
``Manager.current_step()``. Like the example, the data loader is not checkpointed: a restarted replica group
starts its shard again, and a group that is down leaves its shard untrained.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch.nn.functional as F
from steplog import StepLogWriter
from task import BATCH_PER_WORKER, SEED, IndexedImages, build_model, build_optimizer, set_threads, steplog_dir
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

logging.basicConfig(level=logging.INFO)


@record
def main() -> int:
    replica_group_id = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    set_threads()
    log = StepLogWriter(steplog_dir(), f"{os.environ.get('PEERS_HOST', 'host')}-{os.getpid()}")
    dataset = IndexedImages()
    sampler = DistributedSampler(
        dataset,
        replica_rank=replica_group_id,
        num_replica_groups=num_replica_groups,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=SEED,
    )
    loader = DataLoader(dataset, batch_size=BATCH_PER_WORKER, sampler=sampler)

    m = build_model()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    transport = PGTransport(pg, timeout=timedelta(seconds=10), device="cpu")

    def load_state_dict(state_dict: dict) -> None:
        m.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict() -> dict:
        return {"model": m.state_dict(), "optim": optimizer.state_dict()}

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"peers_{replica_group_id}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=transport,
    )
    model = DistributedDataParallel(manager, m)
    optimizer = Optimizer(manager, build_optimizer(m.parameters()))

    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for x, y, idx in loader:
            log.started()
            before = manager.current_step()
            # must be called at the beginning of each train loop; the quorum is computed meanwhile
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            # must be called at the end of the train loop; it steps only if every replica's allreduce succeeded
            optimizer.step()
            after = manager.current_step()
            log.ended(
                step=after, epoch=epoch, world=manager.num_participants(), ids=idx.tolist(), committed=after > before
            )
        epoch += 1


if __name__ == "__main__":
    sys.exit(main())
