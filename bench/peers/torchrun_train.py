"""torchrun (TorchElastic)'s contender in the peer benchmark, written as torchrun's elastic docs show.

One agent per logical host::

    torchrun --nnodes 1:4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id peers \\
             --max-restarts 100 --local-addr HOST torchrun_train.py --checkpoint DIR/ckpt.pt

The script follows the docs' elastic train script (``load_checkpoint``, ``init_process_group`` from the
environment torchrun exports, train, ``save_checkpoint``) with DDP and a ``DistributedSampler``. On any
membership change torchrun stops every worker and starts them again; they resume from the last checkpoint.
The docs' example saves at each epoch end; here rank 0 saves every 10 steps (atomically: a temporary file,
then ``os.replace``), so that a restart redoes at most 10 steps, as a Horovod commit interval of 10 would.
The checkpoint holds the model, optimizer, step, epoch and the steps done in that epoch; a resumed worker
skips that many batches of its shard (its shard is re-cut for the new world size).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    args = p.parse_args()
    set_threads()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = StepLogWriter(steplog_dir(), f"{os.environ.get('PEERS_HOST', 'host')}-{os.getpid()}")
    model = build_model()
    optimizer = build_optimizer(model.parameters())
    ckpt = load_checkpoint(args.checkpoint) or {"step": 0, "epoch": 0, "steps_in_epoch": 0}
    if "model" in ckpt:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    ddp = DDP(model)
    dataset = IndexedImages()
    step, epoch, skip = int(ckpt["step"]), int(ckpt["epoch"]), int(ckpt["steps_in_epoch"])
    while True:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True)
        sampler.set_epoch(epoch)
        shard = list(sampler)[skip * BATCH_PER_WORKER :]
        loader = DataLoader(Subset(dataset, shard), batch_size=BATCH_PER_WORKER)
        done_in_epoch = skip
        for x, y, idx in loader:
            log.started(idx.tolist(), epoch)
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            step += 1
            done_in_epoch += 1
            log.ended(step=step, epoch=epoch, world=world, ids=idx.tolist())
            if rank == 0 and step % CHECKPOINT_EVERY_STEPS == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                save_checkpoint(
                    args.checkpoint, {**state, "step": step, "epoch": epoch, "steps_in_epoch": done_in_epoch}
                )
        epoch, skip = epoch + 1, 0


if __name__ == "__main__":
    sys.exit(main())
