"""Horovod's elastic synthetic benchmark (``examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py``),
ported to elastictrain with three renames, at a size a CPU runs in seconds.

The renames are all the port needs; everything else is plain Horovod::

    hvd.elastic.TorchState      ->  elastictrain.ElasticState
    hvd.elastic.ElasticSampler  ->  elastictrain.ElasticSampler
    @hvd.elastic.run            ->  @elastictrain.elastic_run

Horovod's script times a torchvision model on one fixed random batch. This one keeps its shape (the argument
parser, a benchmark step, a commit every ``--batches-per-commit`` batches, an elastic run function, a reset
callback that scales the LR with the number of workers, a throughput summary on rank 0) and gives it what the
renames protect in a real job: a small CNN trained on a ``TensorDataset`` of synthetic images read through the
sampler for ``--epochs`` epochs, and an LR scheduler. The LR of step ``s`` (0-based, over all epochs) is
``--lr x workers x --lr-gamma ** (s // --lr-decay-steps)``.

Run it under ``horovodrun`` (see README.md next to this file). With ``--run-dir D`` rank 0 also writes, for
auditing a run:

* ``D/events.jsonl`` (``elastictrain.rundir.events``): a ``metrics`` event after every step (``step`` = steps done,
  ``world_size``, ``loss``, ``lr`` used by the step, ``samples_per_sec``, ``step_seconds``, ``steps`` = 1), and
  ``done`` at the end;
* ``D/ledger/`` (``elastictrain.rundir.ledger.SampleLedger``): the sample ids of every step over all workers (gathered
  with one ``hvd.allgather`` per step), with a ``restore`` line whenever training continues from a commit, so
  ``elastictrain.rundir.ledger.committed_samples(D / "ledger")`` replays the committed steps.

The script exits 0 when training is complete, and 2 with one line for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastictrain
from elastictrain.cliutil import OneLineParser
from elastictrain.rundir.events import Done, EventLog, Metrics
from elastictrain.rundir.ledger import SampleLedger


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


parser = OneLineParser(  # argparse, with misuse reported as one line and exit code 2
    description="Horovod's elastic synthetic benchmark on elastictrain's drop-in (CPU-sized)",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
)
parser.add_argument("--batch-size", type=positive(int), default=8, help="input batch size per worker")
parser.add_argument("--num-samples", type=positive(int), default=384, help="samples in the synthetic dataset")
parser.add_argument("--image-size", type=positive(int), default=16, help="height and width of the images")
parser.add_argument("--epochs", type=positive(int), default=3, help="passes over the dataset")
parser.add_argument("--batches-per-commit", type=positive(int), default=1,
                    help="batches between commits of the elastic state")  # fmt: skip
parser.add_argument("--lr", type=positive(float), default=0.01, help="learning rate of one worker")
parser.add_argument("--lr-decay-steps", type=positive(int), default=20, help="steps between LR decays")
parser.add_argument("--lr-gamma", type=positive(float), default=0.7, help="LR decay factor")
parser.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the sampler")
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="fp16 compression of gradients")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--run-dir", type=Path, default=None, help="write events.jsonl and ledger/ here (rank 0)")
args = parser.parse_args()
if args.num_samples % args.batch_size:
    parser.error(f"--num-samples ({args.num_samples}) must be a multiple of --batch-size ({args.batch_size})")
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
torch.manual_seed(args.seed)
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())
device = torch.device("cuda" if args.cuda else "cpu")

# The same synthetic data on every worker; the first tensor holds the sample ids, for the ledger.
generator = torch.Generator().manual_seed(args.seed)
images = torch.randn(args.num_samples, 3, args.image_size, args.image_size, generator=generator)
labels = torch.randint(0, 10, (args.num_samples,), generator=generator)
dataset = TensorDataset(torch.arange(args.num_samples), images, labels)

model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
    nn.Flatten(), nn.Linear(32, 10),
).to(device)  # fmt: skip


def lr_scaler() -> int:
    return hvd.size()


def lr_factor(step: int) -> float:
    """The LR of step ``step`` relative to ``--lr``: linear in the workers, decayed every ``--lr-decay-steps``."""
    return lr_scaler() * args.lr_gamma ** (step // args.lr_decay_steps)


optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # stepped once per batch

sampler = elastictrain.ElasticSampler(dataset, shuffle=True, seed=args.seed)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


def log(s: str) -> None:
    if hvd.rank() == 0:
        print(s, flush=True)


class RunLog:
    """With ``--run-dir``: rank 0's ``events.jsonl`` and sample ledger (module docstring); without: nothing."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir
        self.events: EventLog | None = None
        self.ledger: SampleLedger | None = None

    def resume(self, step: int) -> None:
        """At every entry into the elastic function (after a sync): training continues from the commit at ``step``.

        The process that holds rank 0 now starts a new ledger file with a ``restore`` line: ledger entries of
        later steps were rolled back.
        """
        if self.run_dir is None:
            return
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        if hvd.rank() == 0:
            if self.events is None:
                self.events = EventLog(self.run_dir / "events.jsonl")
            name = f"{socket.gethostname()}-{os.getpid()}"
            self.ledger = SampleLedger(self.run_dir / "ledger", name, num_samples=len(dataset), drop_last=False)
            self.ledger.restore(step)

    def step(self, step: int, epoch: int, ids: torch.Tensor, loss: float, lr: float, seconds: float) -> None:
        """After each step, on every worker (the ids are gathered from all of them)."""
        if self.run_dir is None:
            return
        all_ids = hvd.allgather(ids, name="horovod_port.sample_ids")
        if self.ledger is not None and self.events is not None:
            self.ledger.record(step, epoch, all_ids.tolist())
            rate = len(all_ids) / seconds
            self.events.emit(
                Metrics(step=step, epoch=epoch, world_size=hvd.size(), loss=loss, lr=lr, samples_per_sec=rate,
                        step_seconds=seconds, steps=1)
            )  # fmt: skip

    def done(self, step: int, epoch: int, loss: float) -> None:
        if self.events is not None:
            self.events.emit(Done(step=step, epoch=epoch, world_size=hvd.size(), final_loss=loss,
                                  val_accuracy=None, checkpointed=None))  # fmt: skip

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        if self.events is not None:
            self.events.close()


run_log = RunLog(args.run_dir)


def benchmark_step(
    state: elastictrain.ElasticState, ids: torch.Tensor, data: torch.Tensor, target: torch.Tensor
) -> None:
    start = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]
    data, target = data.to(device), target.to(device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    scheduler.step()
    sampler.record_batch(state.batch, args.batch_size)

    state.step += 1
    state.batch += 1
    state.loss = loss.item()
    run_log.step(state.step, state.epoch, ids, state.loss, lr, time.perf_counter() - start)
    if state.step % args.batches_per_commit == 0:
        state.commit()


@elastictrain.elastic_run
def run_benchmark(state):
    run_log.resume(state.step)
    while state.epoch < args.epochs:
        start, samples = time.perf_counter(), 0
        for ids, data, target in loader:  # this worker's share of the rest of the epoch, from the last commit
            benchmark_step(state, ids, data, target)
            samples += len(ids)
        rate = samples / (time.perf_counter() - start)
        log(f"Epoch #{state.epoch}: {rate:.1f} samples/sec per worker ({hvd.size()} workers)")
        # A new list, not append(): plain values are committed by reference, as in Horovod.
        state.samples_per_sec = [*state.samples_per_sec, rate]
        state.epoch += 1
        state.batch = 0
        sampler.set_epoch(state.epoch)
        state.commit()


def on_state_reset() -> None:
    """As in Horovod's script: the LR follows the number of workers. LambdaLR would apply the new size at its
    next step; this applies it to the step about to run."""
    for group in optimizer.param_groups:
        group["lr"] = args.lr * lr_factor(scheduler.last_epoch)


log(f"Model: small CNN, {args.image_size}x{args.image_size} synthetic images, {args.num_samples} samples")
log(f"Batch size: {args.batch_size}")
log(f"Number of {'GPU' if args.cuda else 'CPU'}s: {hvd.size()}")

state = elastictrain.ElasticState(
    model, optimizer, scheduler=scheduler, sampler=sampler, epoch=0, batch=0, step=0, loss=0.0, samples_per_sec=[]
)
state.register_reset_callbacks([on_state_reset])
try:
    run_benchmark(state)
    run_log.done(state.step, state.epoch, state.loss)
finally:
    run_log.close()

rates = state.samples_per_sec
conf = 1.96 * statistics.pstdev(rates)
log(f"Samples/sec per worker: {statistics.mean(rates):.1f} +-{conf:.1f}")
log(f"Total samples/sec on {hvd.size()} workers: {hvd.size() * statistics.mean(rates):.1f} +-{hvd.size() * conf:.1f}")
