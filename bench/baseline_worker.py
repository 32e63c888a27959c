"""The baselines that elastictrain is measured against, as horovodrun workers on the same config.

``python -m bench.baseline_worker plain --config X``: a plain, non-elastic Horovod loop
(``hvd.DistributedOptimizer``, ``broadcast_parameters``, a rank-strided shard of one seeded
permutation), run with ``horovodrun -np N``.

``python -m bench.baseline_worker stock-elastic --config X``: the stock Horovod elastic
loop of Horovod's examples (``hvd.elastic.TorchState`` + ``hvd.elastic.ElasticSampler``, commit every
``elastic.commit_every_steps``), run with a host discovery script.

Both build the model, dataset, optimizer and batch from the same config as ``elastictrain train`` and
write ``run_dir/events.jsonl`` from rank 0 with the same ``metrics`` definition (``samples_per_sec`` =
samples of the interval / wall time since the previous log), plus ``reset`` (``new_size``, ``lost_steps``)
at the first completed step after a reset, and ``done``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from elastictrain.cliutil import OneLineParser
from elastictrain.config import JobConfig, load_config
from elastictrain.rundir.events import Done, Event, EventLog, Metrics, NullEventLog, Reset, Start, open_event_log
from elastictrain.task import build_task


class _Events:
    """Rank 0's event log; opened by whichever process holds rank 0 (after a reset that may change)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.log: EventLog | NullEventLog = NullEventLog()

    def emit(self, event: Event) -> None:
        if hvd.rank() == 0 and isinstance(self.log, NullEventLog):
            self.log = open_event_log(self.cfg.run_path, 0)
        if hvd.rank() == 0:
            self.log.emit(event)
            self.log.flush(timeout=5)

    def close(self) -> None:
        self.log.close()


def _setup(cfg: JobConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    t = cfg.training
    task = build_task(cfg)  # seeded with training.seed, as in `elastictrain train`
    model, train_set = task.model.to(_device(cfg)), task.train_data
    base = torch.optim.SGD(
        model.parameters(), lr=t.base_lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=t.nesterov
    )
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    return model, optimizer, train_set


def _device(cfg: JobConfig) -> torch.device:
    """``cuda``: this worker's GPU (local rank modulo the GPUs); otherwise the CPU."""
    if cfg.device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_SCALERS: dict[int, Any] = {}


def _step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, precision: str = "fp32"
) -> torch.Tensor:
    """One step; on CUDA with ``precision.mode: fp16`` the textbook autocast + GradScaler loop with Horovod."""
    device = next(model.parameters()).device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    optimizer.zero_grad()
    if precision == "fp16" and device.type == "cuda":
        scaler = _SCALERS.setdefault(id(optimizer), torch.amp.GradScaler("cuda"))
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        optimizer.synchronize()  # type: ignore[attr-defined]
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            scaler.step(optimizer)
        scaler.update()
        return loss.detach()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


class _Meter:
    """Samples/s and step time between logs, as ``elastictrain train`` computes them (one allreduce per log)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t_last = time.perf_counter()
        self.count = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.loss = 0.0

    def log(self, events: _Events, step: int, epoch: int) -> None:
        local = torch.tensor([float(self.count), self.loss], dtype=torch.float64)
        total = hvd.allreduce(local, op=hvd.Sum, name="metrics").tolist()
        now = time.perf_counter()
        events.emit(
            Metrics(
                step=step,
                epoch=epoch,
                world_size=hvd.size(),
                steps=self.steps,
                loss=total[1] / max(1, hvd.size() * self.steps),
                samples_per_sec=total[0] / max(1e-9, now - self.t_last),
                step_seconds=self.step_seconds / max(1, self.steps),
            )
        )
        self.reset()
        self.t_last = now


def run_plain(cfg: JobConfig) -> int:
    hvd.init()
    model, optimizer, train_set = _setup(cfg)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    events = _Events(cfg)
    t, bs = cfg.training, cfg.data.batch_size
    rank, size = hvd.rank(), hvd.size()
    steps_per_epoch = len(train_set) // (bs * size)
    max_steps = t.max_steps or steps_per_epoch * t.epochs
    events.emit(Start(step=0, epoch=0, world_size=size, hosts=[], resumed_from_step=None))
    meter, step, epoch = _Meter(), 0, 0
    while step < max_steps:
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(t.seed + epoch)).tolist()
        shard = order[rank::size]
        for i in range(steps_per_epoch):
            if step >= max_steps:
                break
            t0 = time.perf_counter()
            x, y = default_collate([train_set[j] for j in shard[i * bs : (i + 1) * bs]])
            loss = _step(model, optimizer, x, y, cfg.precision.mode)
            step += 1
            meter.count += len(y)
            meter.steps += 1
            meter.loss += float(loss) if step % t.log_every_steps == 0 else 0.0
            meter.step_seconds += time.perf_counter() - t0
            if step % t.log_every_steps == 0:
                meter.log(events, step, epoch)
        epoch += 1
    events.emit(Done(step=step, epoch=epoch, world_size=size))
    events.close()
    return 0


def run_stock_elastic(cfg: JobConfig) -> int:
    hvd.init()
    model, optimizer, train_set = _setup(cfg)
    t, bs = cfg.training, cfg.data.batch_size
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=t.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=bs, sampler=sampler, collate_fn=default_collate)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler, epoch=0, step=0)
    events = _Events(cfg)
    meter = _Meter()
    seen = {"max_step": 0, "pending": None, "old_size": hvd.size()}

    def on_reset() -> None:
        # After a failure TorchState has restored the last commit; the steps past it were rolled back.
        seen["pending"] = {"lost_steps": max(0, int(seen["max_step"]) - state.step), "old_size": seen["old_size"]}
        meter.reset()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: Any) -> None:
        events.emit(Start(step=state.step, epoch=state.epoch, world_size=hvd.size(), hosts=[]))
        seen["old_size"] = hvd.size()
        while state.epoch < t.epochs:
            for batch_idx, (x, y) in enumerate(loader):
                if t.max_steps is not None and state.step >= t.max_steps:
                    return
                t0 = time.perf_counter()
                _step(model, optimizer, x, y, cfg.precision.mode)
                state.step += 1
                seen["max_step"] = state.step
                state.train_sampler.record_batch(batch_idx, bs)
                meter.count += len(y)
                meter.steps += 1
                meter.step_seconds += time.perf_counter() - t0
                if seen["pending"] is not None:
                    pending, seen["pending"] = seen["pending"], None
                    events.emit(
                        Reset(
                            step=state.step,
                            epoch=state.epoch,
                            world_size=hvd.size(),
                            new_size=hvd.size(),
                            lost_steps=pending["lost_steps"],
                            old_size=pending["old_size"],
                        )
                    )
                if state.step % t.log_every_steps == 0:
                    meter.log(events, state.step, state.epoch)
                if state.step % cfg.elastic.commit_every_steps == 0:
                    state.commit()
            state.epoch += 1
            state.train_sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    events.emit(Done(step=state.step, epoch=state.epoch, world_size=hvd.size()))
    events.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m bench.baseline_worker", description=__doc__)
    p.add_argument("mode", choices=["plain", "stock-elastic"])
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    return run_plain(cfg) if args.mode == "plain" else run_stock_elastic(cfg)


if __name__ == "__main__":
    sys.exit(main())
