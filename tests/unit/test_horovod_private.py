"""Every private attribute of Horovod the engine touches (elastictrain/horovod/private.py) is still there
and means what the engine takes it to mean: the check to read after a Horovod upgrade."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap

from horovod.common.elastic import State
from horovod.runner.elastic.worker import HostUpdateResult

from elastictrain.horovod import private as private


class _State(State):
    def __init__(self) -> None:
        super().__init__(bcast_object=lambda obj: obj, get_rank=lambda: 0)

    def save(self) -> None: ...
    def restore(self) -> None: ...
    def sync(self) -> None: ...


def test_host_notices_queue_where_the_engine_reads_them_and_a_reset_replaces_the_queue():
    state = _State()
    assert private.last_host_update(state) == 0.0
    state.on_hosts_updated(12.5, HostUpdateResult.removed)  # what Horovod's notification service calls
    pending = private.host_messages(state)
    assert isinstance(pending, queue.Queue) and list(pending.queue) == [(12.5, HostUpdateResult.removed)]
    private.set_last_host_update(state, 12.5)
    assert private.last_host_update(state) == 12.5
    state.on_reset()
    assert private.host_messages(state) is not pending and private.host_messages(state).empty()


def test_no_notification_service_means_no_ports():
    assert private.notification_ports() == set()


def test_discarding_a_failed_steps_allreduces_resets_the_distributed_optimizer():
    """In a child process: ``hvd.init`` once, a real ``DistributedOptimizer`` with its gradient hooks, a backward
    pass that enqueues allreduces, then the discard: the next ``zero_grad`` must not raise."""
    code = textwrap.dedent(
        """
        import os
        import torch, horovod.torch as hvd
        from elastictrain.horovod.private import discard_pending_allreduces
        hvd.init()
        model = torch.nn.Linear(3, 2)
        os.environ["HOROVOD_ELASTIC"] = "1"  # the gradient hooks, as under horovodrun (skipped at size 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        os.environ.pop("HOROVOD_ELASTIC")
        model(torch.randn(4, 3)).sum().backward()
        assert opt._handles, "no allreduce was enqueued"
        discard_pending_allreduces(opt)
        assert opt._handles == {} and not opt._synchronized and opt._should_synchronize
        assert all(v == opt.backward_passes_per_step for v in opt._allreduce_delay.values())
        assert all(p.grad is None for p in model.parameters())
        opt.zero_grad()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_exit_hook_is_what_every_hvd_init_registers_with_atexit():
    import inspect

    import horovod.torch as hvd
    from horovod.common.basics import HorovodBasics

    hook = private.exit_hook()
    assert hook.__self__.__class__ is HorovodBasics and hook.__func__ is HorovodBasics.shutdown  # type: ignore[attr-defined]
    assert "atexit.register(self.shutdown)" in inspect.getsource(HorovodBasics.init)
    assert hvd.shutdown != hook, "hvd.shutdown wraps the hook: unregistering it would leave the hook registered"
