"""A small causal transformer language model on the Python standard library's own source, as an elastictrain task.

``task: char_lm:build`` (this file's folder is on ``sys.path`` because the config sits in it). The text is the
``.py`` files of the standard library of the interpreter that runs the job (``sysconfig``'s ``stdlib`` path,
files in sorted order, at most ``max_bytes``), read as bytes: the vocabulary is the 256 byte values. Sample
``i`` is the window ``text[i*seq_len : (i+1)*seq_len + 1]``: inputs are its first ``seq_len`` bytes, targets
the next byte at each position. The text is read on first use, not when the task is built, so checking the
task is instant.

The loss is the mean next-byte cross-entropy of each window (one value per sample, as the Task API asks).
Validation reports ``val_loss`` and, per window, ``bits_per_byte`` and ``perplexity`` (``exp`` of the window's
mean loss; all windows have the same length, so ``exp(val_loss)`` is the perplexity of the whole validation text).
The optimizer is the task's own: AdamW, with weight decay on matrices only.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import elastictrain

VOCAB = 256


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's ``.py`` files (top level of ``Lib/``, sorted by name), up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    text = b"".join(out)[:max_bytes]
    if len(text) < 1024:
        raise RuntimeError(f"found only {len(text)} bytes of Python source under {root}")
    return text


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes of ``text[start:stop]`` (read lazily)."""

    def __init__(self, max_bytes: int, seq_len: int, start: float, stop: float) -> None:
        self.max_bytes, self.seq_len, self.start, self.stop = max_bytes, seq_len, start, stop
        self._data: torch.Tensor | None = None

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            text = stdlib_text(self.max_bytes)
            a, b = int(len(text) * self.start), int(len(text) * self.stop)
            self._data = torch.frombuffer(bytearray(text[a:b]), dtype=torch.uint8).to("cpu", torch.long)
        return self._data

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return w[:-1], w[1:]


class CausalLM(nn.Module):
    """Byte embedding + learned positions, pre-norm transformer blocks with a causal mask, tied output head."""

    def __init__(self, seq_len: int, d_model: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.blocks(self.embed(x) + self.pos[:t], mask=mask, is_causal=True)
        return self.norm(h) @ self.embed.weight.t()  # logits [batch, time, 256]


def window_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean next-byte cross-entropy of each window: shape ``[batch]``."""
    x, y = batch
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none").view(y.shape).mean(1)


def metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    nll = window_loss(model, batch)
    return {"bits_per_byte": nll / math.log(2), "perplexity": nll.exp()}


def build(
    seq_len: int = 128,
    d_model: int = 128,
    layers: int = 4,
    heads: int = 4,
    dropout: float = 0.1,
    max_bytes: int = 2_000_000,
    val_fraction: float = 0.05,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
) -> elastictrain.Task:
    """The task; ``lr`` is the AdamW learning rate at ``elastic.base_world_size`` workers."""
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    model = CausalLM(seq_len, d_model, layers, heads, dropout)

    def optimizer(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    return elastictrain.Task(
        model=model,
        train_data=ByteWindows(max_bytes, seq_len, 0.0, 1.0 - val_fraction),
        val_data=ByteWindows(max_bytes, seq_len, 1.0 - val_fraction, 1.0),
        loss=window_loss,
        metrics=metrics,
        optimizer=optimizer,
    )
