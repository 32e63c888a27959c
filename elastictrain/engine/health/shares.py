"""Shares that follow speed (``elastic.stragglers: balance``): each host's part of a step's samples, decided from the
speeds every rank measures and gathers at a commit.

The API (pure functions over a :class:`ShareState`; the trainer holds one :class:`Balancer`):

- :class:`ShareState`: part of the committed state (checkpointed, synced, rolled back): each host's smoothed speed
  (``speeds``, samples per second of one of its workers), the steps that measured it (``steps``), the largest share
  it was measured at (``largest``), and the ``applied`` weights the planner splits each step by (per worker of a
  host; empty: equal shares).
- :func:`measure` ``(rows, rank_hosts)`` -> ``{host: Measurement(speed, steps, share)}``: one commit interval of
  each host from the gathered figures (rows in :data:`~elastictrain.engine.health.stragglers.FIGURES` order); the
  slowest rank of a host speaks for it; a host that processed nothing is left out (its speed stays as it was).
- :func:`decide` ``(state, measured, rank_hosts, global_batch, policy, caps)`` -> :class:`ShareDecision`: the next
  state. Speeds are smoothed with a half-life in steps (``policy.halflife_steps``, so the smoothing does not depend
  on how often commits come); the applied weights move to the speeds only when some host's fraction of the step
  would change by more than ``policy.threshold`` of its current fraction, or of an equal fraction when that is
  larger (hysteresis: noise, or one sample more or less for a host down to a few, does not make shares
  oscillate), and only once every host of the ring has been measured over ``policy.warmup_steps`` (the first
  steps after a start are slower).
- :func:`rank_shares` ``(state, rank_hosts, global_batch, policy, caps)``: per-rank integer shares of a full step,
  summing exactly to ``global_batch``: in proportion to the applied weights, each at least ``policy.min_share``
  and at most its host's cap, per worker: the smallest of ``elastic.share_max_per_worker``, ``caps[host]`` (an API for a
  cap measured elsewhere, e.g. memory: nothing fills it yet; 0 makes a host's share zero) and the measured one,
  ``policy.growth`` x the largest share the host has been measured at (``ShareState.largest``: a speed measured at
  one share is not trusted far beyond it, so a share at most doubles per change). A host the state does not know
  (it joined) gets the mean weight; hosts that left are forgotten at the next decision.
- :class:`Balancer`: when to call what. ``observe`` at the commit's gather (every rank, same rows, same result),
  ``apply_pending`` at the next commit before the state is saved (so a rollback or a resume replays the same split
  as the steps it replays), ``discard_pending`` after every sync; ``weights`` for the planner.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from elastictrain.config import ElasticConfig
from elastictrain.engine.health.stragglers import Figures
from elastictrain.engine.sampler import allocate
from elastictrain.rundir.events import Event, Shares

MAX_HOSTS = 4096
"""Hosts a loaded state may name (a checkpoint is input: bounded before it is used)."""


@dataclass(frozen=True, slots=True)
class SharePolicy:
    halflife_steps: float = 10.0
    """Steps after which a change of a host's speed is half taken into account."""
    threshold: float = 0.15
    """Shares move only when some host's fraction of a step would change by more than this part of it."""
    min_share: int = 1
    """Samples every worker gets at least (so a slow host stays measured), unless its cap is 0."""
    max_share: int | None = None
    """Samples one worker gets at most per step (``elastic.share_max_per_worker``); None: no cap."""
    warmup_steps: int = 20
    """Steps a host is measured before its speed counts (the first steps after a start are slower)."""
    growth: float = 2.0
    """A worker's share is at most this many times the largest share its host has been measured at."""

    @classmethod
    def from_config(cls, elastic: ElasticConfig) -> SharePolicy:
        return cls(
            halflife_steps=elastic.share_halflife_steps,
            threshold=elastic.share_threshold,
            min_share=elastic.share_min_per_worker,
            max_share=elastic.share_max_per_worker,
            warmup_steps=max(1, round(2 * elastic.share_halflife_steps)),
        )


@dataclass(slots=True)
class ShareState:
    """The committed part of balancing (see the module); plain values only, so a checkpoint loads it weights-only."""

    speeds: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    applied: dict[str, float] = field(default_factory=dict)
    largest: dict[str, int] = field(default_factory=dict)
    """The largest share (samples per step of one worker) each host has been measured at."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "speeds": dict(self.speeds),
            "steps": dict(self.steps),
            "applied": dict(self.applied),
            "largest": dict(self.largest),
        }

    def load_state_dict(self, d: Mapping[str, Any] | None) -> None:
        """Load a committed or checkpointed state (None: none yet); entries that are not a host name with a finite
        positive number are dropped."""
        d = d if isinstance(d, Mapping) else {}
        self.speeds = _positive(d.get("speeds"), float)
        self.steps = {h: int(v) for h, v in _positive(d.get("steps"), int).items()}
        self.applied = _positive(d.get("applied"), float)
        self.largest = {h: int(v) for h, v in _positive(d.get("largest"), int).items()}


def _positive(value: object, kind: type) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        return {}
    out: dict[str, Any] = {}
    for host, v in list(value.items())[:MAX_HOSTS]:
        ok = isinstance(host, str) and len(host) <= 255 and isinstance(v, int | float) and not isinstance(v, bool)
        if ok and math.isfinite(v) and v > 0:
            out[host] = kind(v)
    return out


@dataclass(frozen=True, slots=True)
class ShareDecision:
    state: ShareState
    changed: bool
    """The applied weights changed (the planner must re-split)."""
    reason: str
    """A sentence: what was decided and why (logged, asserted in tests)."""


class Measurement(NamedTuple):
    """One commit interval of one host."""

    speed: float
    """Samples per second of one worker (compute and data-loading time)."""
    steps: int
    share: int
    """Samples per step of one worker."""


def measure(rows: Sequence[Sequence[float]], rank_hosts: Sequence[str]) -> dict[str, Measurement]:
    """Each host's speed over one commit interval: its slowest rank's samples / (compute + data seconds). Hosts whose
    ranks processed nothing or reported unusable figures are left out; rows and hosts must match."""
    out: dict[str, Measurement] = {}
    if len(rows) != len(rank_hosts):
        return out
    for row, host in zip(rows, rank_hosts, strict=True):
        f = Figures.from_row(row)
        seconds = f.compute_seconds + f.data_seconds if f is not None else 0.0
        if f is None or f.samples < 1 or not seconds > 0:
            continue
        m = Measurement(f.samples / seconds, f.steps, f.samples // f.steps)
        old = out.get(host)
        out[host] = (
            m if old is None else Measurement(min(m.speed, old.speed), min(m.steps, old.steps), max(m.share, old.share))
        )
    return out


def rank_weights(state: ShareState, rank_hosts: Sequence[str]) -> list[float] | None:
    """Each rank's weight from the applied per-worker weights (a host not in them: their mean); None when nothing
    is applied (equal shares)."""
    known = [state.applied[h] for h in rank_hosts if h in state.applied]
    if not known:
        return None
    mean = sum(known) / len(known)
    return [state.applied.get(h, mean) for h in rank_hosts]


def rank_shares(
    state: ShareState,
    rank_hosts: Sequence[str],
    global_batch: int,
    policy: SharePolicy,
    caps: Mapping[str, int] | None = None,
) -> list[int]:
    """Per-rank integer shares of a full step (see the module): they sum to ``global_batch`` exactly."""
    weights = rank_weights(state, rank_hosts) or [1.0] * len(rank_hosts)
    limits = _rank_caps(state, rank_hosts, policy, caps)
    return allocate(global_batch, weights, floor=policy.min_share, caps=limits)


def _rank_caps(
    state: ShareState, rank_hosts: Sequence[str], policy: SharePolicy, caps: Mapping[str, int] | None
) -> list[int | None]:
    out: list[int | None] = []
    for h in rank_hosts:
        grown = int(policy.growth * state.largest[h]) if h in state.largest else None
        limits = [c for c in (policy.max_share, (caps or {}).get(h), grown) if c is not None]
        out.append(min(limits) if limits else None)
    return out


def _fractions(weights: Mapping[str, float], rank_hosts: Sequence[str]) -> dict[str, float]:
    """Each host's fraction of a step (all its workers) under per-worker ``weights``."""
    total = sum(weights[h] for h in rank_hosts)
    return {h: rank_hosts.count(h) * weights[h] / total for h in set(rank_hosts)} if total > 0 else {}


def decide(
    state: ShareState,
    measured: Mapping[str, Measurement],
    rank_hosts: Sequence[str],
    global_batch: int,
    policy: SharePolicy,
    caps: Mapping[str, int] | None = None,
) -> ShareDecision:
    """The next state after one commit interval's :func:`measure` (pure; see the module for the rules)."""
    hosts = sorted(set(rank_hosts))
    speeds = {h: v for h, v in state.speeds.items() if h in hosts}
    steps = {h: n for h, n in state.steps.items() if h in hosts}
    largest = {h: n for h, n in state.largest.items() if h in hosts}
    for h in hosts:
        m = measured.get(h)
        if m is None or not (math.isfinite(m.speed) and m.speed > 0 and m.steps >= 1):
            continue
        old = speeds.get(h)
        if old is None or steps.get(h, 0) < policy.warmup_steps:
            speeds[h] = m.speed  # still warming up: the latest interval only (the first steps are slower)
        else:
            keep_old = 0.5 ** (m.steps / policy.halflife_steps)
            speeds[h] = keep_old * old + (1 - keep_old) * m.speed
        steps[h] = min(steps.get(h, 0) + m.steps, 2**31)
        largest[h] = max(largest.get(h, 0), m.share)
    applied = {h: w for h, w in state.applied.items() if h in hosts}
    warm = {h: speeds[h] for h in hosts if h in speeds and steps.get(h, 0) >= policy.warmup_steps}
    keep = ShareState(speeds, steps, applied, largest)
    if len(hosts) < 2:
        return ShareDecision(keep, False, "one host: nothing to balance")
    if len(warm) < len(hosts):
        cold = [h for h in hosts if h not in warm]
        return ShareDecision(keep, False, f"waiting for measurements of {', '.join(cold)}")
    target = dict(warm)
    mean = sum(applied.values()) / len(applied) if applied else 1.0
    before = {h: applied.get(h, mean) for h in hosts}
    now, then = _fractions(target, rank_hosts), _fractions(before, rank_hosts)
    # measured against the host's fraction, or an equal one when that is larger: a host down to a few samples
    # does not flap by one sample (1 -> 2 would be a 100% move)
    equal = {h: rank_hosts.count(h) / len(rank_hosts) for h in hosts}
    moved = {h: abs(now[h] - then[h]) / max(then[h], equal[h]) for h in hosts if then.get(h)}
    worst = max(moved, key=lambda h: (moved[h], h)) if moved else None
    if worst is None or moved[worst] <= policy.threshold:
        note = f"{worst} would move {moved[worst]:.0%}" if worst else "nothing measured"
        return ShareDecision(keep, False, f"shares kept ({note}, threshold {policy.threshold:.0%})")
    new = ShareState(speeds, steps, target, largest)
    shares = rank_shares(new, rank_hosts, global_batch, policy, caps)
    if shares == rank_shares(keep, rank_hosts, global_batch, policy, caps):
        return ShareDecision(keep, False, f"shares kept ({worst} moves less than one sample)")
    return ShareDecision(new, True, f"shares follow speed ({worst} moved {moved[worst]:.0%})")


def host_shares(rank_hosts: Sequence[str], shares: Sequence[int]) -> dict[str, int]:
    """Samples per step of each host (all its workers) from per-rank shares."""
    out: dict[str, int] = {}
    for h, n in zip(rank_hosts, shares, strict=True):
        out[h] = out.get(h, 0) + n
    return out


@dataclass(slots=True)
class Balancer:
    """One worker's holder of the committed :class:`ShareState` (``policy`` None: balancing off, equal shares)."""

    policy: SharePolicy | None
    state: ShareState
    emit: Callable[[Event], None]
    caps: Mapping[str, int] = field(default_factory=dict)
    """Measured per-worker caps of hosts (a host absent has only the config's)."""
    pending: tuple[ShareDecision, int] | None = None
    """The decision of the last commit's gather and the global batch it was made for; applied at the next commit."""
    version: int = 0
    """Counts applied changes and syncs: a planner that planned under another version re-plans."""

    @property
    def uneven(self) -> bool:
        """Whether shares are applied (else every worker has an equal share)."""
        return self.policy is not None and bool(self.state.applied)

    def weights(self, rank_hosts: Sequence[str], global_batch: int) -> list[float] | None:
        """Per-rank shares for the planner (integers summing to ``global_batch``), or None for equal shares."""
        if self.policy is None or not self.state.applied:
            return None
        return [float(n) for n in rank_shares(self.state, rank_hosts, global_batch, self.policy, self.caps)]

    def observe(self, rows: Sequence[Sequence[float]], rank_hosts: Sequence[str], global_batch: int) -> None:
        """At a commit's gather, on every rank (the same rows, so the same decision): decide the next shares; they
        apply at the next commit (:meth:`apply_pending`)."""
        if self.policy is None or len(rows) != len(rank_hosts):
            return
        d = decide(self.state, measure(rows, rank_hosts), rank_hosts, global_batch, self.policy, self.caps)
        self.pending = (d, global_batch)

    def apply_pending(self, *, step: int, epoch: int, rank_hosts: Sequence[str]) -> bool:
        """At a commit, before the state is saved: adopt the previous commit's decision; True when the shares
        changed (a ``shares`` event then goes to rank 0's log)."""
        pending, self.pending = self.pending, None
        if pending is None or self.policy is None:
            return False
        d, global_batch = pending
        before = self.weights(rank_hosts, global_batch)
        self.state.speeds, self.state.steps = dict(d.state.speeds), dict(d.state.steps)
        self.state.largest = dict(d.state.largest)  # a larger measured share raises a host's cap
        if d.changed:
            self.state.applied = dict(d.state.applied)
        elif self.weights(rank_hosts, global_batch) == before:
            return False
        self.version += 1  # the split changed: the planner plans again, as a rollback or resume will
        reason = d.reason if d.changed else "a host's cap grew with the share it was measured at"
        self.announce(step=step, epoch=epoch, rank_hosts=rank_hosts, global_batch=global_batch, reason=reason)
        return True

    def discard_pending(self) -> None:
        """After a sync: a decision not yet applied is dropped (ranks may not all have made it)."""
        self.pending = None
        self.version += 1

    def announce(self, *, step: int, epoch: int, rank_hosts: Sequence[str], global_batch: int, reason: str) -> None:
        """A ``shares`` event with each host's samples per step now (rank 0's event log; others' drop it)."""
        if self.policy is None:
            return
        shares = rank_shares(self.state, rank_hosts, global_batch, self.policy, self.caps)
        self.emit(
            Shares(
                step=step,
                epoch=epoch,
                world_size=len(rank_hosts),
                global_batch=global_batch,
                shares=host_shares(rank_hosts, shares),
                speeds={h: round(v, 3) for h, v in sorted(self.state.speeds.items()) if h in rank_hosts},
                reason=reason,
            )
        )
