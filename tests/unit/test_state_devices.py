"""Optimizer state lives where its owner expects it, on a job whose parameters are not on the CPU.

No GPU here: the ``meta`` device stands in for a GPU (a non-CPU device whose tensors a CPU tensor can
be copied into). The rules under test are the ones a CUDA job needs: a parameter's buffers on the
parameter's device (a 0-dim parameter's too), AdamW's ``step`` on the CPU unless ``capturable`` or
``fused``, and a checkpoint loaded on the CPU restored onto those devices.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastictrain.engine.collective import LocalCollective
from elastictrain.engine.elastic_state import ElasticTrainingState
from elastictrain.engine.policy import ScaleRamp
from elastictrain.engine.sampler import SamplerState
from elastictrain.engine.state import CommittedState, Counters, optimizer_state_device

SIMULATED_GPU = torch.device("meta")


class WithScalar(nn.Module):
    """A model with a 0-dim parameter (a learnable temperature), as the issue's second bullet has."""

    def __init__(self, device=None) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2, device=device)
        self.temperature = nn.Parameter(torch.ones((), device=device))

    def forward(self, x):
        return self.lin(x) * self.temperature


def _committed(device=None, opt_cls=torch.optim.AdamW) -> CommittedState:
    torch.manual_seed(0)
    model = WithScalar(device)
    kw = {"momentum": 0.9} if opt_cls is torch.optim.SGD else {}
    opt = opt_cls(model.parameters(), lr=0.1, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return CommittedState(model, opt, sched, None, SamplerState(), Counters(), ScaleRamp(1, 1, 0, 0))


def _trained_on_cpu(opt_cls) -> dict:
    st = _committed(opt_cls=opt_cls)
    for _ in range(2):
        st.optimizer.zero_grad()
        st.model(torch.randn(4, 3)).square().sum().backward()
        st.optimizer.step()
        st.counters.step += 1
    st.save()
    return st.full_state()  # what a checkpoint holds: every tensor on the CPU


def _devices(st: CommittedState) -> dict[tuple[str, str], torch.device]:
    names = {id(p): n for n, p in st.model.named_parameters()}
    return {(names[id(p)], k): v.device for p, s in st.optimizer.state.items() for k, v in s.items()}


def _expected(opt_cls) -> dict[tuple[str, str], torch.device]:
    keys = ("exp_avg", "exp_avg_sq") if opt_cls is torch.optim.AdamW else ("momentum_buffer",)
    out = {}
    for name in ("lin.weight", "lin.bias", "temperature"):
        for k in keys:
            out[(name, k)] = SIMULATED_GPU
        if opt_cls is torch.optim.AdamW:
            out[(name, "step")] = torch.device("cpu")
    return out


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_a_cpu_checkpoint_loads_onto_a_gpu_job_and_rolls_back_there(opt_cls):
    full = _trained_on_cpu(opt_cls)
    st = _committed(SIMULATED_GPU, opt_cls)
    st.load_full_state(full)  # raised "tensor layout changed since the last commit"
    assert st.counters.step == 2
    assert _devices(st) == _expected(opt_cls)
    st.restore()  # a rollback to the loaded commit keeps every tensor where it is
    assert _devices(st) == _expected(opt_cls)
    st.optimizer.state.clear()  # state gone (e.g. a rollback past state created after the commit)
    st.restore()
    assert _devices(st) == _expected(opt_cls)
    if opt_cls is torch.optim.AdamW:
        step = next(s["step"] for s in st.optimizer.state.values())
        assert step.dtype == torch.float32 and step.dim() == 0


def test_the_step_follows_the_param_when_the_optimizer_is_capturable_or_fused():
    p = nn.Parameter(torch.ones(2, device=SIMULATED_GPU))
    q = nn.Parameter(torch.ones((), device=SIMULATED_GPU))
    plain = torch.optim.AdamW([p, q])
    capturable = torch.optim.AdamW([p], capturable=True)
    assert optimizer_state_device(plain, p, "step") == torch.device("cpu")
    assert optimizer_state_device(plain, q, "exp_avg") == SIMULATED_GPU  # 0-dim: still the param's device
    assert optimizer_state_device(capturable, p, "step") == SIMULATED_GPU
    assert optimizer_state_device(plain, p, "exp_avg_sq") == SIMULATED_GPU


class _JoinerCollective(LocalCollective):
    """The world as a worker that is not the root of a sync sees it: the root's answers, broadcasts recorded."""

    def __init__(self, root_layout) -> None:
        super().__init__(rank=1, size=2)
        self.broadcasts = {}
        self.root_layout = root_layout

    def allgather_object(self, obj, name):
        # rank 0 is ahead (step, epoch, step reached): it is the root, this process (rank 1) receives
        return [(10, 0, 10, ("root", 0, 1)), obj]

    def broadcast_object(self, obj, root, name):
        if name == "sync.meta":  # the root's layouts; this joiner's own groups and small state stand in for the root's
            return {**obj, "layouts": {"opt": self.root_layout}}
        return obj

    def broadcast_(self, tensors, root):
        self.broadcasts.update({name: t.device for name, t in tensors.items()})


def test_a_joining_worker_creates_optimizer_state_on_the_devices_of_the_root(monkeypatch):
    root = _committed(opt_cls=torch.optim.AdamW)
    root.optimizer.zero_grad()
    root.model(torch.randn(4, 3)).square().sum().backward()
    root.optimizer.step()
    params = [p for g in root.optimizer.param_groups for p in g["params"]]
    # The root's state as a GPU root holds it: buffers on the GPU, step on the CPU (what the root announces).
    root_layout = {
        i: {
            k: (tuple(v.shape), v.dtype, k == "step") if isinstance(v, torch.Tensor) else ("value", v)
            for k, v in root.optimizer.state[p].items()
        }
        for i, p in enumerate(params)
    }
    fake = _JoinerCollective(root_layout)
    joiner = _committed(SIMULATED_GPU, torch.optim.AdamW)
    state = ElasticTrainingState(joiner, 0, lambda: False, fake)
    monkeypatch.setattr(state, "save", lambda: None)
    state.sync()
    names = [n for n, _ in joiner.model.named_parameters()]
    scalar = names.index("temperature")
    assert fake.broadcasts[f"opt.{scalar}.exp_avg"] == SIMULATED_GPU  # a 0-dim param's buffer: on the GPU
    assert fake.broadcasts[f"opt.{scalar}.step"] == torch.device("cpu")
    for i in range(len(names)):
        assert fake.broadcasts[f"opt.{i}.step"] == torch.device("cpu")
        assert fake.broadcasts[f"opt.{i}.exp_avg_sq"] == SIMULATED_GPU
