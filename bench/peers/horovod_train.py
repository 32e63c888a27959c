"""Stock Horovod elastic's contender in the peer benchmark, written as Horovod's elastic examples are.

``horovodrun -np N --min-np A --max-np B --host-discovery-script D python -m horovod_train`` (this folder on
``PYTHONPATH``): ``hvd.elastic.TorchState`` (model, optimizer, sampler, epoch, step) + ``hvd.elastic.ElasticSampler``
+ ``@hvd.elastic.run``, ``state.commit()`` every 10 steps and at each epoch end. After a failure TorchState
restores the last commit: the steps after it are trained again, and the step log shows them redone.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from steplog import StepLogWriter
from task import BATCH_PER_WORKER, SEED, IndexedImages, build_model, build_optimizer, set_threads, steplog_dir

COMMIT_EVERY_STEPS = 10


def main() -> int:
    hvd.init()
    set_threads()
    log = StepLogWriter(steplog_dir(), f"{os.environ.get('HOROVOD_HOSTNAME', socket.gethostname())}-{os.getpid()}")
    dataset = IndexedImages()
    model = build_model()
    optimizer = hvd.DistributedOptimizer(build_optimizer(model.parameters()), named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=SEED)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_PER_WORKER, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler, epoch=0, step=0)

    @hvd.elastic.run
    def train(state: Any) -> None:
        while True:
            for batch_idx, (x, y, idx) in enumerate(loader):
                log.started(idx.tolist(), state.epoch)
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.step += 1
                log.ended(step=state.step, epoch=state.epoch, world=hvd.size(), ids=idx.tolist())
                state.train_sampler.record_batch(batch_idx, BATCH_PER_WORKER)
                if state.step % COMMIT_EVERY_STEPS == 0:
                    state.commit()
            state.epoch += 1
            state.train_sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
