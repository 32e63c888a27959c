"""Slow hosts: each host's rolling window of step figures, the decisions about it (pure), and rank 0's monitor.

Every worker sums its own figures between two commits (:class:`~elastictrain.engine.profile.StepProfile`: steps,
compute seconds from a step's start to its gradients being ready, data-loading wait, step seconds, samples). They
travel with the commit's existing collective (the host-update check, one small allgather), so every rank sees
every rank's figures at the same commit, and no collective is added to a step.

- :class:`HostWindow` keeps a host's last ``window_steps`` steps as per-sample figures, so a window stays
  comparable when the world size (and so a worker's share of a fixed global batch) changes.
- :func:`judge` (pure): a host is **slow** when its median compute time per sample is at least ``slow_ratio`` x the
  median of the other hosts' medians, judged once its window is filled; a host named slow is cleared when its
  ratio falls below halfway between 1 and ``slow_ratio`` (no flapping at the threshold).
- :func:`plan_eviction` (pure): with ``elastic.stragglers: evict``, drain a slow host only when the job is
  predicted faster without it: throughput (samples/s) at ``N - slots`` workers (the measured step time scaled by the
  slowest remaining worker's per-sample work x its new share) above throughput at ``N`` with it; never below
  ``min_np``, counting only hosts that are not already leaving.
- With ``elastic.stragglers: balance`` each host's share follows its speed (:mod:`.shares`), and the prediction
  gives every host the share it would have then (:func:`predicted_balanced_samples_per_sec`): a slow host is drained
  only when even its smallest share (``share_min_per_worker``) holds the others back.
- :class:`StragglerMonitor`: fed at every commit on every rank (so a new rank 0 keeps the history); rank 0 writes
  the ``straggler`` and ``eviction`` events and asks its :class:`Evictor` to drain (in the background: training
  never waits on etcd). The registry refuses a drain that would leave the hosts discovery lists as ready with fewer
  than ``min_np`` slots (a host leaving that this monitor did not drain: a spot notice, an operator, a hung-host
  eviction); the refusal is an ``eviction`` event with action ``keep``. The drain is a spot notice's path: the
  host's etcd record goes ``draining`` with a cool-down (``straggler_cooldown_seconds`` x 2 ** earlier evictions)
  and its agent readmits it when that runs out; if it is still slow it is drained again, for longer.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from discovery.registry import BelowMinNp
from elastictrain import envnames
from elastictrain.config import ElasticConfig
from elastictrain.logconf import get_logger
from elastictrain.rundir.events import Event, Eviction, Straggler

log = get_logger("elastictrain.engine.health.stragglers")

FIGURES = ("steps", "compute_seconds", "data_seconds", "step_seconds", "samples")
"""The per-rank figures carried at a commit, in this order (sums since the previous commit)."""


@dataclass(frozen=True, slots=True)
class Figures:
    """One rank's sums over the steps since its previous commit."""

    steps: int
    compute_seconds: float
    data_seconds: float
    step_seconds: float
    samples: int

    @classmethod
    def from_row(cls, row: Sequence[float]) -> Figures | None:
        """The figures of a gathered row, or None when they are unusable (negative, non-finite, no step)."""
        if len(row) != len(FIGURES) or not all(math.isfinite(v) and v >= 0 for v in row):
            return None
        steps, compute, data, step, samples = row
        if steps < 1:
            return None
        return cls(int(steps), float(compute), float(data), float(step), int(samples))


@dataclass(frozen=True, slots=True)
class Entry:
    """One commit interval of one host, per step and per sample."""

    steps: int
    compute_per_sample: float
    data_per_sample: float
    step_seconds: float
    """Wall seconds per step (every rank's step lasts as long as the slowest's)."""
    samples_per_step: float
    """Per worker."""


@dataclass(slots=True)
class HostWindow:
    """A host's last ``window_steps`` steps (whole commit intervals; the oldest goes once the rest fill the window)."""

    window_steps: int
    slots: int = 1
    entries: deque[Entry] = field(default_factory=deque)

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        while self.entries and self.steps - self.entries[0].steps >= self.window_steps:
            self.entries.popleft()

    @property
    def steps(self) -> int:
        return sum(e.steps for e in self.entries)

    def median(self, attr: str) -> float:
        """The step-weighted median of one per-step figure over the window."""
        return weighted_median([(getattr(e, attr), e.steps) for e in self.entries])


def weighted_median(pairs: Sequence[tuple[float, int]]) -> float:
    """The median of values repeated by their weights (the lower middle for an even total); nan when empty."""
    pairs = sorted(p for p in pairs if p[1] > 0)
    total = sum(w for _, w in pairs)
    if total == 0:
        return math.nan
    half, seen = (total + 1) // 2, 0
    for value, weight in pairs:
        seen += weight
        if seen >= half:
            return value
    return pairs[-1][0]


def host_entry(figures: Sequence[Figures]) -> Entry | None:
    """One host's interval from its ranks' figures: the slowest rank speaks for the host (a step waits for it)."""
    if not figures:
        return None
    steps = min(f.steps for f in figures)
    samples = sum(f.samples for f in figures) / len(figures) / max(1, steps)
    per = max(1.0, samples)
    return Entry(
        steps=steps,
        compute_per_sample=max(f.compute_seconds / f.steps for f in figures) / per,
        data_per_sample=max(f.data_seconds / f.steps for f in figures) / per,
        step_seconds=max(f.step_seconds / f.steps for f in figures),
        samples_per_step=samples,
    )


@dataclass(frozen=True, slots=True)
class StragglerPolicy:
    mode: str
    """``off`` | ``report`` | ``evict`` | ``balance``."""
    slow_ratio: float = 1.3
    window_steps: int = 100
    cooldown_seconds: float = 300.0
    min_np: int = 1
    min_share: int = 1
    """``balance``: samples each worker gets at least (``elastic.share_min_per_worker``)."""

    @classmethod
    def from_config(cls, elastic: ElasticConfig, env: Mapping[str, str]) -> StragglerPolicy:
        """The job's policy; ``min_np`` is the larger of ``elastic.min_np`` and the launcher's ``--min-np``."""
        try:
            launched = int(env.get(envnames.MIN_NP, "0"))
        except ValueError:
            launched = 0
        return cls(
            mode=elastic.stragglers,
            slow_ratio=elastic.slow_ratio,
            window_steps=elastic.window_steps,
            cooldown_seconds=elastic.straggler_cooldown_seconds,
            min_np=max(elastic.min_np, launched),
            min_share=elastic.share_min_per_worker,
        )

    @property
    def clear_ratio(self) -> float:
        """A named host is no longer slow below this ratio (halfway between 1 and ``slow_ratio``)."""
        return 1.0 + (self.slow_ratio - 1.0) / 2

    def cooldown(self, earlier_evictions: int) -> float:
        """Seconds out for an eviction after ``earlier_evictions`` earlier ones (doubling, at most 64x)."""
        return self.cooldown_seconds * 2 ** min(max(0, earlier_evictions), 6)


@dataclass(frozen=True, slots=True)
class Judgement:
    host: str
    ratio: float
    compute_seconds: float
    """Median compute seconds per step (per sample x samples per step)."""
    others_seconds: float
    data_seconds: float
    window_steps: int


def judge(windows: dict[str, HostWindow], policy: StragglerPolicy) -> dict[str, Judgement]:
    """Every judged host's ratio: its median compute time per sample over the others' median (pure).

    A host is judged once its window holds ``window_steps`` steps (a few noisy steps name nobody); the others'
    median takes the hosts judged. With fewer than two judged hosts nobody is judged.
    """
    ready = {h: w for h, w in windows.items() if w.steps >= policy.window_steps}
    medians = {h: w.median("compute_per_sample") for h, w in ready.items()}
    out: dict[str, Judgement] = {}
    for host, w in ready.items():
        others = [m for h, m in medians.items() if h != host]
        if not others:
            continue
        base = _median(others)
        if not base > 0:
            continue
        per_step = w.median("samples_per_step")
        out[host] = Judgement(
            host=host,
            ratio=medians[host] / base,
            compute_seconds=medians[host] * per_step,
            others_seconds=base * per_step,
            data_seconds=w.median("data_per_sample") * per_step,
            window_steps=w.steps,
        )
    return out


def _median(values: Sequence[float]) -> float:
    return weighted_median([(v, 1) for v in values])


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    action: str
    """``drain`` or ``keep``."""
    reason: str
    samples_per_sec_now: float
    samples_per_sec_without: float


def predicted_samples_per_sec(
    windows: dict[str, HostWindow], hosts: Sequence[str], *, global_batch: int | None, per_worker_batch: int
) -> float:
    """Predicted throughput of ``hosts``: the step time measured now (every host of ``windows``), scaled by the
    critical worker's work: the largest per-sample time x share of the global batch (fixed, or per worker), with
    ``hosts`` against with every host now. A step is synchronous, so it runs at the pace of its slowest worker, all
    of it (a worker slowed down is slow in its part of the allreduce and the commit too, not only in its compute)."""
    workers = sum(windows[h].slots for h in hosts)
    if workers == 0:
        return 0.0
    share = global_batch / workers if global_batch is not None else float(per_worker_batch)
    batch = global_batch if global_batch is not None else per_worker_batch * workers
    per_sample = {h: windows[h].median("compute_per_sample") + windows[h].median("data_per_sample") for h in windows}
    now_step = _median([windows[h].median("step_seconds") for h in windows])
    now_work = max(per_sample[h] * windows[h].median("samples_per_step") for h in windows)
    if not now_work > 0:
        return 0.0
    step = now_step * max(per_sample[h] * share for h in hosts) / now_work
    return batch / step if step > 0 else 0.0


def predicted_balanced_samples_per_sec(
    windows: dict[str, HostWindow],
    hosts: Sequence[str],
    *,
    global_batch: int | None,
    per_worker_batch: int,
    min_share: int,
) -> float:
    """As :func:`predicted_samples_per_sec`, with shares that follow speed (``balance``): each worker of ``hosts``
    takes a part of the batch in proportion to its speed (1 / its per-sample time), at least ``min_share``; the
    critical work is then the largest share x per-sample time."""
    workers = sum(windows[h].slots for h in hosts)
    if workers == 0:
        return 0.0
    batch = global_batch if global_batch is not None else per_worker_batch * workers
    per_sample = {h: windows[h].median("compute_per_sample") + windows[h].median("data_per_sample") for h in windows}
    if not all(per_sample[h] > 0 for h in hosts):
        return predicted_samples_per_sec(windows, hosts, global_batch=global_batch, per_worker_batch=per_worker_batch)
    now_step = _median([windows[h].median("step_seconds") for h in windows])
    now_work = max(per_sample[h] * windows[h].median("samples_per_step") for h in windows)
    if not now_work > 0:
        return 0.0
    speed = sum(windows[h].slots / per_sample[h] for h in hosts)
    work = max(max(float(min_share), batch / per_sample[h] / speed) * per_sample[h] for h in hosts)
    step = now_step * work / now_work
    return batch / step if step > 0 else 0.0


def plan_eviction(
    windows: dict[str, HostWindow],
    slow: str,
    policy: StragglerPolicy,
    *,
    global_batch: int | None,
    per_worker_batch: int,
    leaving: Collection[str] = (),
) -> EvictionPlan:
    """Drain ``slow`` or keep it (pure): drain when the hosts without it are predicted to process more samples per
    second than all of them with it, and the hosts that stay, not counting ``leaving`` (hosts of the ring already
    on their way out, e.g. drained before), hold at least ``policy.min_np`` slots."""
    hosts = sorted(windows)
    world = sum(windows[h].slots for h in hosts if h not in leaving)
    rest = [h for h in hosts if h != slow]
    if policy.mode == "balance":
        now, without = (
            predicted_balanced_samples_per_sec(
                windows, group, global_batch=global_batch, per_worker_batch=per_worker_batch, min_share=policy.min_share
            )
            for group in (hosts, rest)
        )
    else:
        now = predicted_samples_per_sec(windows, hosts, global_batch=global_batch, per_worker_batch=per_worker_batch)
        without = predicted_samples_per_sec(windows, rest, global_batch=global_batch, per_worker_batch=per_worker_batch)
    if world - windows[slow].slots < policy.min_np:
        left = world - windows[slow].slots
        return EvictionPlan("keep", f"draining it would leave {left} < min_np {policy.min_np}", now, without)
    if without <= now:
        return EvictionPlan("keep", "the job is not predicted faster without it", now, without)
    return EvictionPlan("drain", "straggler", now, without)


class Evictor(Protocol):
    """Drains a host for a cool-down (``evict`` in :mod:`discovery.registry`, through etcd)."""

    def evict(self, host: str, reason: str, cooldown: Callable[[int], float]) -> tuple[int, float]:
        """Drain ``host``; ``cooldown(earlier_evictions)`` gives its seconds out. Returns (evictions so far, this
        one included; the cool-down applied). Raises :class:`~discovery.registry.BelowMinNp` when the drain would
        take the job below min_np, anything else on failure."""


@dataclass(slots=True)
class StragglerMonitor:
    """Windows of every host of the world, fed at each commit; rank 0 reports and evicts (see the module)."""

    policy: StragglerPolicy
    emit: Callable[[Event], None]
    evictor: Evictor | None = None
    windows: dict[str, HostWindow] = field(default_factory=dict)
    named: set[str] = field(default_factory=set)
    decided: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Hosts rank 0 decided about while they stay slow: (action, ratio then). A kept host is planned again once its
    ratio has grown by a tenth (a slowdown that worsens), a drained one never while it is in the world."""
    threads: list[threading.Thread] = field(default_factory=list)
    refused: deque[tuple[str, float]] = field(default_factory=deque)
    """Drains the registry refused (below min_np), posted by the drain threads: at the next commit their host counts
    as kept, not leaving (only :meth:`observe`'s thread touches :attr:`decided`)."""

    def observe(
        self,
        rows: Sequence[Sequence[float]],
        rank_hosts: Sequence[str],
        *,
        is_rank0: bool,
        step: int,
        epoch: int,
        global_batch: int | None,
        per_worker_batch: int,
    ) -> None:
        """One commit's gathered figures (``rows[r]`` of rank ``r``, whose host is ``rank_hosts[r]``)."""
        if self.policy.mode == "off" or len(rows) != len(rank_hosts):
            return
        by_host: dict[str, list[Figures]] = {}
        for row, host in zip(rows, rank_hosts, strict=True):
            f = Figures.from_row(row)
            if f is not None:
                by_host.setdefault(host, []).append(f)
        while self.refused:
            host, ratio = self.refused.popleft()
            if self.decided.get(host, ("", 0.0))[0] == "drain":
                self.decided[host] = ("keep", ratio)
        for gone in set(self.windows) - set(rank_hosts):
            del self.windows[gone]
            self.named.discard(gone)
            self.decided.pop(gone, None)
        slots = {h: rank_hosts.count(h) for h in set(rank_hosts)}
        for host, figures in by_host.items():
            entry = host_entry(figures)
            if entry is None:
                continue
            w = self.windows.setdefault(host, HostWindow(self.policy.window_steps))
            w.slots = slots[host]
            w.add(entry)
        if not is_rank0:
            return
        world = len(rank_hosts)
        for host, j in sorted(judge(self.windows, self.policy).items()):
            first_rank = rank_hosts.index(host)
            if host not in self.named and j.ratio >= self.policy.slow_ratio:
                self.named.add(host)
                self._emit_straggler(j, first_rank, True, step, epoch, world)
                log.warning("straggler", host=host, ratio=round(j.ratio, 3), window_steps=j.window_steps)
            elif host in self.named and j.ratio < self.policy.clear_ratio:
                self.named.discard(host)
                self.decided.pop(host, None)
                self._emit_straggler(j, first_rank, False, step, epoch, world)
            last = self.decided.get(host)
            again = last is None or (last[0] == "keep" and j.ratio >= 1.1 * last[1])
            if host in self.named and again and self.policy.mode in ("evict", "balance"):
                drained = {h for h, (action, _) in self.decided.items() if action == "drain"}
                plan = plan_eviction(
                    self.windows,
                    host,
                    self.policy,
                    global_batch=global_batch,
                    per_worker_batch=per_worker_batch,
                    leaving=drained,
                )
                self.decided[host] = (plan.action, j.ratio)
                self._act(host, j, plan, step, epoch, world)

    def slowest(self) -> Judgement | None:
        """The host with the highest ratio now, if any is judged."""
        judged = judge(self.windows, self.policy)
        return max(judged.values(), key=lambda j: j.ratio) if judged else None

    def _emit_straggler(self, j: Judgement, rank: int, slow: bool, step: int, epoch: int, world: int) -> None:
        self.emit(
            Straggler(
                step=step,
                epoch=epoch,
                world_size=world,
                host=j.host,
                rank=rank,
                slow=slow,
                ratio=round(j.ratio, 4),
                compute_seconds=round(j.compute_seconds, 6),
                others_seconds=round(j.others_seconds, 6),
                data_seconds=round(j.data_seconds, 6),
                window_steps=j.window_steps,
            )
        )

    def _act(self, host: str, j: Judgement, plan: EvictionPlan, step: int, epoch: int, world: int) -> None:
        def event(**fields: object) -> Eviction:
            return Eviction(
                step=step,
                epoch=epoch,
                world_size=world,
                host=host,
                ratio=round(j.ratio, 4),
                samples_per_sec_now=round(plan.samples_per_sec_now, 3),
                samples_per_sec_without=round(plan.samples_per_sec_without, 3),
                min_np=self.policy.min_np,
                **fields,  # type: ignore[arg-type]
            )

        if plan.action == "keep" or self.evictor is None:
            reason = plan.reason if self.evictor is not None else "no etcd to drain it through"
            self.emit(event(action="keep", reason=reason))
            return
        evictor = self.evictor

        def drain() -> None:
            try:
                evictions, cooldown = evictor.evict(host, "straggler", self.policy.cooldown)
            except BelowMinNp as e:  # a host left that this monitor did not drain
                self.refused.append((host, j.ratio))
                self.emit(event(action="keep", reason=str(e)))
                log.warning("straggler kept", host=host, reason=str(e))
                return
            except Exception as e:  # etcd down: reported, training goes on with the slow host
                self.emit(event(action="drain", reason="straggler", error=str(e).splitlines()[0][:300]))
                log.warning("straggler drain failed", host=host, error=str(e))
                return
            self.emit(event(action="drain", reason="straggler", cooldown_seconds=cooldown, evictions=evictions))
            log.warning("straggler drained", host=host, cooldown_seconds=cooldown, evictions=evictions)

        t = threading.Thread(target=drain, name="straggler-drain", daemon=True)
        t.start()
        self.threads.append(t)
