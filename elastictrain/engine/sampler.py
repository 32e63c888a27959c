"""Exactly-once data partitioning for a changing number of workers.

Each epoch has one permutation of the sample ids, shared by every worker (seeded by ``seed + epoch``).
The only state is the epoch and a ``cursor``: how many positions of the permutation committed steps
have consumed. A step takes the next ``global_count`` positions and splits them into contiguous
shares, one per rank: near-equal, or in proportion to per-rank weights (:func:`allocate`; the uneven
shares of ``elastic.stragglers: balance``, part of the committed state). Nothing is padded; the last
step of an epoch may be short. After any membership change the remaining positions are simply
re-split over the new world, and after a
failure the cursor rolls back with the rest of the state. So every id is used by exactly one
committed step per epoch. Stock ``ElasticSampler`` pads shares to equal length, which duplicates
samples; this planner does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch


@dataclass(slots=True)
class SamplerState:
    epoch: int = 0
    cursor: int = 0
    """Positions of this epoch's permutation consumed by committed steps."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(d["epoch"]), int(d["cursor"])


@dataclass(frozen=True, slots=True)
class StepPlan:
    epoch: int
    start: int
    """First permutation position of the step."""
    global_count: int
    """Samples in the whole step (over all workers)."""
    local_ids: list[int]
    """This rank's sample ids, in order."""
    micro_batches: list[list[int]]
    """This rank's ids split into forward/backward passes (may be empty for a rank with no share)."""


def shares(count: int, world_size: int) -> list[int]:
    """Split ``count`` samples into ``world_size`` near-equal contiguous shares (larger ones first)."""
    base, extra = divmod(count, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def allocate(
    total: int, weights: Sequence[float], *, floor: int = 0, caps: Sequence[int | None] | None = None
) -> list[int]:
    """Split ``total`` into integers in proportion to ``weights``: each at least ``floor`` and at most its cap (pure,
    exact: the same inputs give the same split on every rank).

    The real-valued split is ``clamp(x * weight, floor, cap)`` with the one ``x`` that makes it sum to ``total``
    (what a bounded entry cannot take goes to the others in proportion), computed on exact fractions; then the
    largest remainders get the samples left (ties to the lower index). A zero weight gets the floor only; with
    every weight zero the split is equal. A floor that ``total`` cannot give to everyone is dropped, and so are
    caps that cannot hold ``total`` together (the step's samples must all go somewhere). Equal weights give
    :func:`shares`'s split.
    """
    n = len(weights)
    assert n >= 1 and total >= 0 and floor >= 0
    assert all(math.isfinite(w) and w >= 0 for w in weights), weights
    w = [Fraction(x) for x in weights]
    if not any(w):
        w = [Fraction(1)] * n
    hi = [total if c is None else max(0, min(int(c), total)) for c in (caps or [None] * n)]
    assert len(hi) == n
    lo = [min(floor, c) for c in hi]
    if sum(lo) > total:
        lo = [0] * n
    if sum(hi[i] if w[i] else lo[i] for i in range(n)) < total:
        hi, lo = [total] * n, [min(floor, total)] * n
        if sum(lo) > total:
            lo = [0] * n

    def split(x: Fraction) -> list[Fraction]:
        return [min(max(x * w[i], Fraction(lo[i])), Fraction(hi[i])) for i in range(n)]

    if not any(lo) and all(h == total for h in hi):  # unbounded: one proportion (the planner's every step)
        x = Fraction(total) / sum(w)
    else:  # f(x) = sum(split(x)) is piecewise linear and non-decreasing: find the piece where it reaches total
        points = sorted({Fraction(0)} | {Fraction(b) / w[i] for i in range(n) if w[i] for b in (lo[i], hi[i])})
        below, above = 0, len(points) - 1  # f(points[above]) >= total (caps hold it); bisect to adjacent points
        if sum(split(points[0])) >= total:
            above = 0
        while above - below > 1:
            mid = (below + above) // 2
            below, above = (below, mid) if sum(split(points[mid])) >= total else (mid, above)
        x = points[above]
        if above > 0:
            a, b = points[below], points[above]
            slope = sum(w[i] for i in range(n) if w[i] and lo[i] < (a + b) / 2 * w[i] < hi[i])
            if slope:
                x = a + (total - sum(split(a))) / slope
    quota = split(x)
    out = [int(q) for q in quota]
    extra = total - sum(out)
    for i in sorted(range(n), key=lambda i: (-(quota[i] - out[i]), i))[:extra]:
        out[i] += 1
    return out


class ExactlyOncePlanner:
    """Plans the sample ids of each step from ``(epoch, cursor, world_size, rank)`` alone."""

    def __init__(self, num_samples: int, seed: int, drop_last: bool = False) -> None:
        if num_samples < 1:
            raise ValueError("num_samples must be >= 1")
        self.num_samples = num_samples
        self.seed = seed
        self.drop_last = drop_last
        self._perm_epoch = -1
        self._perm: list[int] = []

    def permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm

    def epoch_done(self, state: SamplerState, global_batch: int) -> bool:
        remaining = self.num_samples - state.cursor
        return remaining <= 0 or (self.drop_last and remaining < global_batch)

    def plan(
        self,
        state: SamplerState,
        *,
        global_batch: int,
        world_size: int,
        rank: int,
        micro_batch: int,
        weights: Sequence[float] | None = None,
    ) -> StepPlan:
        """The next step after ``state``; call only when not :meth:`epoch_done`. ``weights`` (one per rank, or None
        for near-equal shares) split each step in proportion: with integer weights summing to ``global_batch`` a
        full step's shares are the weights themselves, a short last step's are scaled down."""
        assert 0 <= rank < world_size and global_batch >= 1 and micro_batch >= 1
        assert weights is None or len(weights) == world_size, "one weight per rank"
        count = min(global_batch, self.num_samples - state.cursor)
        assert count > 0, "plan() called at the end of an epoch"
        if weights is None:
            sizes = shares(count, world_size)
        elif sum(weights) == count and all(float(w).is_integer() for w in weights):
            sizes = [int(w) for w in weights]  # a full step under the balancer's shares
        else:
            sizes = allocate(count, weights)
        offset = state.cursor + sum(sizes[:rank])
        ids = self.permutation(state.epoch)[offset : offset + sizes[rank]]
        micro = [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]
        return StepPlan(state.epoch, state.cursor, count, ids, micro)

    def steps_left(self, state: SamplerState, global_batch: int) -> int:
        remaining = max(0, self.num_samples - state.cursor)
        return remaining // global_batch if self.drop_last else -(-remaining // global_batch)


# ---------------------------------------------------------------------------------------------- ledger
@dataclass(slots=True)
class StepLog:
    """The last steps' ``(step, epoch, start, count)``: part of the committed state when the audit is on.

    Every rank keeps it, so whichever process holds rank 0 after a sync can write ledger entries that a
    dead rank 0 never wrote (its peers may have committed steps it had not recorded yet).
    """

    maxlen: int = 0
    entries: list[tuple[int, int, int, int]] | None = None

    def append(self, step: int, epoch: int, start: int, count: int) -> None:
        if self.maxlen <= 0:
            return
        if self.entries is None:
            self.entries = []
        self.entries.append((step, epoch, start, count))
        del self.entries[: max(0, len(self.entries) - self.maxlen)]

    def state_dict(self) -> list[tuple[int, int, int, int]]:
        return list(self.entries or [])

    def load_state_dict(self, entries: list[Any] | None) -> None:
        self.entries = [(int(a), int(b), int(c), int(d)) for a, b, c, d in entries or []]


def iter_plans(
    planner: ExactlyOncePlanner,
    state: SamplerState,
    *,
    global_batch: int,
    world_size: int,
    rank: int,
    micro_batch: int,
    weights: Sequence[float] | None = None,
) -> Iterator[StepPlan]:
    """Plans of the rest of the current epoch, assuming each step commits (for prefetching loaders); ``weights`` as
    in :meth:`ExactlyOncePlanner.plan`."""
    shadow = SamplerState(state.epoch, state.cursor)
    while not planner.epoch_done(shadow, global_batch):
        p = planner.plan(
            shadow,
            global_batch=global_batch,
            world_size=world_size,
            rank=rank,
            micro_batch=micro_batch,
            weights=weights,
        )
        yield p
        shadow.cursor += p.global_count
