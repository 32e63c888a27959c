"""The training metrics between two logging steps: summed locally every step, reduced over the world when logged."""

from __future__ import annotations

import time

import torch

from elastictrain.engine.collective import Collective


class MetricsWindow:
    """Loss, samples and step time since the last log. The loss sum stays on the training device (no host sync
    per step); :meth:`reduce` is a collective (every rank calls it at the same step) and starts a new window."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start()

    def start(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.count = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.started = time.perf_counter()

    def add(self, loss_sum: torch.Tensor, count: int, seconds: float) -> None:
        self.loss += loss_sum.double()
        self.count += count
        self.steps += 1
        self.step_seconds += seconds

    def reduce(self, collective: Collective) -> dict[str, float]:
        """``loss`` (mean per sample over the world), ``samples_per_sec``, ``step_seconds`` (mean) and ``steps``
        of this window; then a new window starts."""
        local = torch.tensor([float(self.loss), float(self.count)], dtype=torch.float64)
        loss_sum, samples = collective.allreduce_sum(local, name="metrics").tolist()
        now = time.perf_counter()
        steps = max(1, self.steps)
        out = {
            "loss": loss_sum / max(1.0, samples),
            "samples_per_sec": samples / max(1e-9, now - self.started),
            "step_seconds": self.step_seconds / steps,
            "steps": float(self.steps),
        }
        self.start()
        return out
