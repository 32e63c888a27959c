"""The real worker (``elastictrain.engine.compose.compose``) under real single-rank Horovod, with scripted
interruptions.

Usage: python -m tests.integration.workers.scripted_trainer CONFIG_JSON SCRIPT_JSON

No horovodrun: one process, ``hvd.init()`` of size 1. The script makes the worker believe in other world
sizes and ranks (its collective reports them; every collective still runs for real on one process) and raises
what Horovod raises when a peer dies or hosts change:

* ``{"kind": "failure", "step": S, "size": N, "rank": R}``: ``HorovodInternalError`` inside step S.
* ``{"kind": "allreduce_failure", "step": S}``: ``HorovodInternalError`` from the gradient allreduce of step S
  (``optimizer.synchronize()``, after every backward pass has enqueued its allreduce). With it in the script,
  the optimizer registers its gradient hooks as under horovodrun (Horovod skips them at size 1).
* ``{"kind": "notice", "step": S, "size": N, "rank": R}``: ``HostsUpdatedInterrupt`` at the commit of step S.
* ``{"kind": "notice_at_epoch_end", "epoch": E, "size": N}``: the same, at the commit that ends epoch E - 1
  (the sampler already stands at epoch E).

``{"size": N, "rank": R}`` as the script's first entry (``kind: "initial"``) sets the world before the start.
Exit code: the worker's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from elastictrain.config import config_from_dict
from elastictrain.engine import compose
from elastictrain.engine import trainer as engine
from elastictrain.engine.collective import HorovodCollective


class ScriptedWorld(HorovodCollective):
    """Real Horovod in one process that reports the script's world size and rank."""

    def __init__(self, world: dict[str, int]) -> None:
        super().__init__()
        self.world = world

    def rank(self) -> int:
        return self.world["rank"]

    def size(self) -> int:
        return self.world["size"]


def main(config_json: str, script_json: str) -> int:
    cfg = config_from_dict(json.loads(config_json))
    script: list[dict[str, Any]] = json.loads(script_json)
    world = {"size": 1, "rank": 0}
    if script and script[0].get("kind") == "initial":
        first = script.pop(0)
        world.update({k: first[k] for k in ("size", "rank") if k in first})
    pending = list(script)

    def fire(kind: str, **where: int) -> dict[str, Any] | None:
        for item in pending:
            if item["kind"] == kind and all(item.get(k) == v for k, v in where.items()):
                pending.remove(item)
                world["size"], world["rank"] = item.get("size", world["size"]), item.get("rank", 0)
                return item
        return None

    collective = ScriptedWorld(world)
    collective.hvd.init()
    hooks = any(item["kind"] == "allreduce_failure" for item in pending)
    if hooks:  # DistributedOptimizer registers its hooks at size 1 only for an elastic job
        os.environ["HOROVOD_ELASTIC"] = "1"
    try:
        trainer = compose.compose(cfg, collective)
    finally:
        if hooks:
            del os.environ["HOROVOD_ELASTIC"]  # hvd.init() at a reset must not look for a rendezvous
    assert not hooks or trainer.optimizer._requires_update, "no gradient hooks registered"  # type: ignore[attr-defined]
    state = trainer.state
    real_check, real_train_step = state._check_host_updates, engine.train_step

    def train_step(*args: Any, **kwargs: Any) -> Any:
        if fire("failure", step=trainer.counters.step + 1):
            raise HorovodInternalError("scripted: a peer died")
        if fire("allreduce_failure", step=trainer.counters.step + 1):
            optimizer = args[1]

            def failed_synchronize() -> None:
                del optimizer.synchronize  # the class's again, for the steps after this one
                raise HorovodInternalError("scripted: a peer died in the gradient allreduce")

            optimizer.synchronize = failed_synchronize
        return real_train_step(*args, **kwargs)

    def check_host_updates(*args: Any) -> None:
        hit = fire("notice", step=trainer.counters.step)
        if hit is None and trainer.sampler.cursor == 0:  # the commit that ends an epoch
            hit = fire("notice_at_epoch_end", epoch=trainer.sampler.epoch)
        if hit:
            raise HostsUpdatedInterrupt(False)
        real_check(*args)

    engine.train_step = train_step  # type: ignore[assignment]
    state._check_host_updates = check_host_updates  # type: ignore[method-assign]
    return engine.run_trainer(trainer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
