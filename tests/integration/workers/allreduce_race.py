"""A Horovod elastic worker whose gradient hooks race the background thread's shutdown, over and over.

Usage: python allreduce_race.py RECORD_FILE RESETS

A ``DistributedOptimizer`` over a chain of many tiny layers, so that a backward pass is a dense run of gradient
allreduce enqueues. Every few steps rank 0 fails (``HorovodInternalError``) from a tensor hook of a random layer,
a random moment into its backward pass: its reset's ``hvd.shutdown`` ends every other rank's background thread
(Horovod's coordinated shutdown) while their backward passes are still enqueueing. No process dies: each reset
re-forms the same ring.

Each rank appends JSON lines to RECORD_FILE:

* ``{"reset": n, "started": k, "stranded": [names], "rank": r}`` after each reset: ``k`` gradient allreduces
  were started in the step the failure interrupted; ``stranded`` names those whose handle Horovod had still not
  finished 50 ms after this rank's enqueue was refused with "Horovod has been shut down" (an entry added to the
  tensor queue after the shutdown emptied it: nothing will ever finish it, and the queue outlives ``hvd.init``).
  Not measured after rank 0's own (injected) failure, whose background thread still runs.
* ``{"duplicate": message, "name": parameter, "reset": n, "rank": r}`` when a gradient allreduce was refused with
  "same name as another tensor that is currently being processed"; the rank then exits 3.

Every rank returns (the job exits 0) after RESETS resets.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import horovod.torch as hvd
import horovod.torch.optimizer
import torch
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HorovodInternalError
from torch import nn

LAYERS = 300
EVERY_STEPS = 3
"""Rank 0 fails in one step of this many."""

STARTED: list[tuple[int, str]] = []
"""(handle, name) of every gradient allreduce started in the current step."""


def _recording(allreduce_async_: Any) -> Any:
    """Horovod's ``allreduce_async_`` as the optimizer calls it, noting each started allreduce in ``STARTED``."""

    def start(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> int:
        handle = int(allreduce_async_(tensor, *args, **kwargs))
        STARTED.append((handle, str(kwargs.get("name"))))
        return handle

    return start


def _finished(handle: int) -> bool:
    try:
        return bool(hvd.poll(handle))
    except ValueError:  # released already: by the synchronize that raised
        return True


def _fail(grad: torch.Tensor) -> None:
    raise HorovodInternalError("injected")


class RaceState(ObjectState):
    """Counts resets; on a shutdown, notes the started allreduces that it left unfinished."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.resets = 0
        self.step = 0
        self.started = 0
        self.stranded: list[str] = []
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)

    def restore(self) -> None:
        self.started = len(STARTED)
        if "shut down" in str(sys.exc_info()[1]):  # restore() runs in the loop's `except HorovodInternalError`
            time.sleep(0.05)  # the background thread is finishing every entry of its queue (or has)
            self.stranded = sorted(name for handle, name in STARTED if not _finished(handle))
        # what elastictrain's discard_pending_allreduces does
        opt = self.optimizer
        opt._handles = {}
        opt._synchronized = False
        for p in opt._allreduce_delay:
            opt._allreduce_delay[p] = opt.backward_passes_per_step
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
        super().restore()


def main(record_file: str, resets: int) -> int:
    horovod.torch.optimizer.allreduce_async_ = _recording(horovod.torch.optimizer.allreduce_async_)
    hvd.init()
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(LAYERS)]
    model = nn.Sequential(*layers)
    base = torch.optim.SGD(model.parameters(), lr=1e-4)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=hvd.Sum)
    state = RaceState(optimizer)
    rng = random.Random(hvd.rank())
    x = torch.randn(8, 4)

    def record(**fields: Any) -> None:
        with open(record_file, "a") as f:
            f.write(json.dumps({**fields, "rank": hvd.rank()}) + "\n")

    def on_reset() -> None:
        state.resets += 1
        record(reset=state.resets, started=state.started, stranded=state.stranded)
        state.started, state.stranded = 0, []

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: RaceState) -> None:
        while state.resets < resets:
            state.step += 1
            optimizer.zero_grad()
            STARTED.clear()
            loss = model(x).square().sum()
            failing = hvd.rank() == 0 and state.step % EVERY_STEPS == 0
            hook = layers[rng.randrange(LAYERS)].weight.register_hook(_fail) if failing else None
            try:
                loss.backward()
                optimizer.step()
            except ValueError as e:
                names = optimizer._parameter_names
                delay, handles = optimizer._allreduce_delay, optimizer._handles
                refused = [names[p] for p in optimizer._requires_update if delay[p] == 0 and p not in handles]
                record(duplicate=str(e)[:80], name=refused, reset=state.resets)
                sys.exit(3)
            finally:
                if hook is not None:
                    hook.remove()

    train(state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
