"""TorchFT's contender in the peer benchmark, written as its ``train_ddp.py`` is, with the checkpointing it asks for.

A Lighthouse (its README's ``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``;
the bench adds ``--heartbeat_timeout_ms`` for its tuned variant) and one replica group per logical host, each a
torchrun of one process that restarts it when it dies::

    REPLICA_GROUP_ID=G NUM_REPLICA_GROUPS=4 TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT \\
        torchrun --standalone --nnodes 1 --nproc-per-node 1 --max-restarts 100 torchft_train.py --checkpoint ckpt-G.pt

As in ``train_ddp.py``: ``Manager`` (its ``ProcessGroupGloo`` with a 5 s timeout, ``PGTransport`` to heal a
replica from a live one, ``min_replica_size=1``, a 30 s timeout), ``torchft.DistributedDataParallel``,
``torchft.Optimizer`` and ``torchft.DistributedSampler`` sharding the data over the replica groups. Its "TODO (by
the user)" is done: every ``CHECKPOINT_EVERY_STEPS`` committed steps (torchrun's interval) a group saves model,
optimizer, the manager's state and its data position (epoch, batches of its shard done), and a restarted group
starts from it (a live peer's state, healed at the first quorum, replaces all but the data position).

Step log: ``step`` is ``Manager.current_step()`` after the step; ``committed`` is TorchFT's own commit outcome,
the ``commit_result`` of the manager's commit log (``torchft_commits``) for this step's ``should_commit``; a
healing group's counter moves to its peers' step even when its commit fails, so the counter cannot say it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

import torch.nn.functional as F
from steplog import StepLogWriter
from task import (
    BATCH_PER_WORKER,
    CHECKPOINT_EVERY_STEPS,
    SEED,
    IndexedImages,
    build_model,
    build_optimizer,
    load_checkpoint,
    save_checkpoint,
    set_threads,
    steplog_dir,
)
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Subset
from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

logging.basicConfig(level=logging.INFO)


class CommitOutcome(logging.Handler):
    """The last ``commit_result`` of TorchFT's commit log (one record per ``should_commit``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.last: bool | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.last = getattr(record, "commit_result", None) is True


@record
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True, help="this replica group's checkpoint file")
    args = p.parse_args()
    replica_group_id = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    set_threads()
    log = StepLogWriter(steplog_dir(), f"{os.environ.get('PEERS_HOST', 'host')}-{os.getpid()}")
    outcome = CommitOutcome()
    commits = logging.getLogger("torchft_commits")
    commits.setLevel(logging.INFO)
    commits.addHandler(outcome)
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

    m = build_model()
    optimizer: Optimizer
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

    epoch, done = 0, 0
    ckpt = load_checkpoint(args.checkpoint)
    if ckpt is not None:
        load_state_dict(ckpt["user"])
        manager.load_state_dict(ckpt["torchft"])
        epoch, done = int(ckpt["data"]["epoch"]), int(ckpt["data"]["batches"])
    while True:
        sampler.set_epoch(epoch)
        shard = list(sampler)[done * BATCH_PER_WORKER :]
        for x, y, idx in DataLoader(Subset(dataset, shard), batch_size=BATCH_PER_WORKER):
            log.started(idx.tolist(), epoch)
            outcome.last = None
            # must be called at the beginning of each train loop; the quorum is computed meanwhile
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            # must be called at the end of the train loop; it steps only if should_commit says so
            optimizer.step()
            done += 1
            committed = outcome.last is True
            step = manager.current_step()
            log.ended(step=step, epoch=epoch, world=manager.num_participants(), ids=idx.tolist(), committed=committed)
            if committed and step % CHECKPOINT_EVERY_STEPS == 0:
                save_checkpoint(
                    args.checkpoint,
                    {"user": state_dict(), "torchft": manager.state_dict(), "data": {"epoch": epoch, "batches": done}},
                )
        epoch, done = epoch + 1, 0


if __name__ == "__main__":
    sys.exit(main())
