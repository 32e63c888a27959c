"""``peers``: elastictrain against what users pick instead (stock Horovod elastic, torchrun, TorchFT), one run.

One task (``bench/peers/task.py``: the small CNN, synthetic 32x32 images, 32 per worker, SGD lr 0.05 momentum
0.9, seed 42; CPU, Gloo over loopback, one worker per logical host) runs under each contender with the settings
its own documentation recommends; each contender's script lives in ``bench/peers/`` and writes the common
per-step log (``bench/peers/steplog.py``), from which this module measures every contender by the same rule:

1. ``elastictrain``: ``elastictrain train`` of the task (``elastictrain_task:build``) as ``launch`` runs it: hot
   join (a warm zygote per host), ``elastic.rollback: none``, Gloo timeout 30 s, blacklist cooldown 5-60 s
   (``elastic.lr_scaling: none``, so that the LR is the others');
2. ``horovod``: stock Horovod elastic (``horovod_train.py``: ``TorchState`` + ``ElasticSampler``, commit every
   10 steps) under Horovod's own ``horovodrun`` with the same discovery, timeout and cooldown;
3. ``torchrun``: one ``torchrun`` agent per logical host (``--nnodes 1:MAX --rdzv-backend c10d --max-restarts
   100``), DDP, rank 0 checkpointing every 10 steps (``torchrun_train.py``);
4. ``torchft`` and ``torchft-hb1s``: TorchFT (``torchft-nightly``, ``make peers-env``) as its ``train_ddp.py``:
   the Lighthouse of its README and one replica group per logical host, each a one-process torchrun that restarts
   it, checkpointing model, optimizer, manager state and data position every 10 steps (``torchft_train.py``); the
   lighthouse's heartbeat timeout at its default (5000 ms) and tuned (1000 ms).

torchrun and TorchFT run from ``.peers-venv``; without it they are reported ``blocked`` with that hint, and the
others are measured. Each contender runs (alternating, A B C D, D C B A, ...):

* a trial job started on 3 hosts (max 4): steady samples/s over a window after step 30; the 4th host listed
  and the pause that the running job sees; then SIGKILLs of one training process (seeded), each timed to the
  end of the first step the job began after it, with the steps redone or thrown away after each and whether the
  survivors lived (:func:`survival`: the same pids, steps at the smaller world before the killed one rejoined);
* a goodput job on 3 hosts (max 3): a seeded SIGKILL every 60 s for 10 minutes (quick: 30 s, 2 minutes), the
  killed host back through the contender's own restart path; goodput by :func:`goodput` (kept steps' compute, no
  waits), and exactly once per completed epoch by :func:`audit`.

Every kill's figures (recovery, redone, thrown away) and their p50/p95/max go to the JSON and the table. A
contender whose design promises survivors but whose survivors never lived through a kill gets no goodput, and
the table says so in words.

Goals (elastictrain against the others, medians in the same run): SIGKILL recovery >= 10x faster than
torchrun's and >= 1x TorchFT's (its better heartbeat setting); scale-up pause <= 0.25x torchrun's; goodput ahead
of every contender; samples/s >= 0.97x the fastest contender's; exactly once per epoch.

Size: the shared rule over the step log (pure functions, tested in ``tests/unit/test_peers_goodput.py`` and
``tests/unit/test_peers_contenders.py``) and one small job class per contender, which only make sense side by side.

Size: one race of four contenders: each one's launch, its log's reading and the one goodput rule, side by side.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from bench.core import (
    BenchContext,
    BenchError,
    Goal,
    Metric,
    Result,
    alternate,
    library_versions,
    summary,
)
from chaos.procs import REPO, kill_tree
from elastictrain.launcher.processes import free_port

NAME = "peers"
PEERS_DIR = REPO / "bench" / "peers"
PEERS_VENV = REPO / ".peers-venv"
TORCHFT_TUNED = "torchft-hb1s"
"""TorchFT with its lighthouse's heartbeat timeout tuned (:data:`TORCHFT_TUNED_HEARTBEAT_MS`); ``torchft`` keeps the
default."""
CONTENDERS = ("elastictrain", "horovod", "torchrun", "torchft", TORCHFT_TUNED)
PEER_ENV_CONTENDERS = ("torchrun", "torchft", TORCHFT_TUNED)
"""The contenders that run from ``.peers-venv``."""
LOSSY_BY_DOCS = {
    name: "its train_ddp.py shards data per replica group 'with the assumption that the majority of groups will be "
    "available so few batches will be dropped'"
    for name in ("torchft", TORCHFT_TUNED)
}
"""Contenders whose own documentation says their sampler may drop samples, and where it says so."""
RESTART_BY_DESIGN = ("torchrun",)
"""Contenders whose design restarts every worker on a fault (the others promise that survivors go on)."""
NUM_SAMPLES = 15_360  # bench/peers/task.py
SEED = 25

GOAL_RECOVERY_VS_TORCHRUN = Goal(">=", 10.0)
GOAL_RECOVERY_VS_TORCHFT = Goal(">=", 1.0)
GOAL_PAUSE_VS_TORCHRUN = Goal("<=", 0.25)
GOAL_GOODPUT_VS_BEST = Goal(">=", 1.0)
GOAL_THROUGHPUT_VS_FASTEST = Goal(">=", 0.97)
GOAL_EXACTLY_ONCE = Goal(">=", 1.0)


# ============================================================================ the rule over the common step log
@dataclass(frozen=True, slots=True)
class Line:
    """One step of one process, as ``bench/peers/steplog.py`` writes it."""

    writer: str
    step: int
    epoch: int
    t0: float
    t1: float
    world: int
    committed: bool = True
    ids: tuple[int, ...] = ()

    @classmethod
    def parse(cls, writer: str, obj: dict[str, Any]) -> Line:
        return cls(
            writer=writer,
            step=int(obj["step"]),
            epoch=int(obj["epoch"]),
            t0=float(obj["t0"]),
            t1=float(obj["t1"]),
            world=int(obj["world"]),
            committed=bool(obj.get("committed", True)),
            ids=tuple(int(i) for i in obj.get("ids", ())),
        )


@dataclass(frozen=True, slots=True)
class Begin:
    """A process's begin line: the start of a step (its line's ``t0``) and the ids it trains on."""

    writer: str
    t0: float
    ids: tuple[int, ...]
    epoch: int | None = None

    @classmethod
    def parse(cls, writer: str, obj: dict[str, Any]) -> Begin:
        epoch = obj.get("epoch")
        return cls(
            writer=writer,
            t0=float(obj["begin"]),
            ids=tuple(int(i) for i in obj["ids"]),
            epoch=None if epoch is None else int(epoch),
        )


class StepLogReader:
    """Reads a step-log folder incrementally (only what was appended since the last call); a torn last line of
    a process that is still writing or was killed is read again next time, or never. Step lines go to
    :attr:`lines`, begin lines to :attr:`begins`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.offsets: dict[Path, int] = {}
        self.lines: list[Line] = []
        self.begins: list[Begin] = []

    def read(self) -> list[Line]:
        for path in sorted(self.folder.glob("*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for text in data[:end].decode(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    obj = json.loads(text)
                    if "begin" in obj:
                        self.begins.append(Begin.parse(path.stem, obj))
                    else:
                        self.lines.append(Line.parse(path.stem, obj))
        return self.lines


@dataclass
class Replay:
    """What :func:`replay` found: kept lines, redone ones (their work was lost: a rollback, a restart from an older
    state, a replica that healed from a peer), thrown away ones (``committed: false``)."""

    kept: list[Line] = field(default_factory=list)
    redone: list[Line] = field(default_factory=list)
    thrown_away: list[Line] = field(default_factory=list)
    rollbacks: list[tuple[float, int]] = field(default_factory=list)
    """Each lost branch of steps: (the start of the first other step begun after its last one ended, or that end
    when none did; the distinct steps it lost)."""


@dataclass(eq=False)
class _Completion:
    """Committed lines of one step that overlap in time (a collective joins them): one step of one state."""

    step: int
    lines: list[Line]
    parent: _Completion | None = None
    children: list[_Completion] = field(default_factory=list)

    @property
    def t0(self) -> float:
        return min(ln.t0 for ln in self.lines)

    @property
    def t1(self) -> float:
        return max(ln.t1 for ln in self.lines)


def _group(committed: list[Line]) -> tuple[list[_Completion], dict[int, _Completion]]:
    """The completions of ``committed`` (by step, lines chained by overlap) and each line's (keyed by ``id``)."""
    nodes: list[_Completion] = []
    of: dict[int, _Completion] = {}
    for step, group in itertools.groupby(sorted(committed, key=lambda x: (x.step, x.t0)), key=lambda x: x.step):
        current: _Completion | None = None
        for ln in group:
            if current is None or ln.t0 > current.t1:
                current = _Completion(step, [])
                nodes.append(current)
            current.lines.append(ln)
            of[id(ln)] = current
    return nodes, of


def _link(lines: list[Line], nodes: list[_Completion], of: dict[int, _Completion]) -> None:
    """Each completion's parent: the state its step began from, read from each writer's own counter. A line whose
    step is one more than its writer's previous committed line continues that writer's state; any other line
    (a process's first, or its counter moved back to a restored state or forward to a peer's healed one) began
    from the latest completion of the step before that ended before the line did (none for step 1: the start)."""
    previous: dict[str, Line] = {}
    proposals: dict[int, tuple[list[_Completion], list[Line]]] = {}
    for ln in sorted((x for x in lines if x.committed), key=lambda x: x.t1):
        cont, other = proposals.setdefault(id(of[id(ln)]), ([], []))
        prev = previous.get(ln.writer)
        if prev is not None and prev.step == ln.step - 1:
            cont.append(of[id(prev)])
        else:
            other.append(ln)
        previous[ln.writer] = ln
    ends: dict[int, list[tuple[float, int]]] = {}
    for i, n in enumerate(nodes):
        ends.setdefault(n.step, []).append((n.t1, i))
    for v in ends.values():
        v.sort()
    for n in nodes:
        cont, other = proposals[id(n)]
        if cont:
            n.parent = max(cont, key=lambda c: c.t1)
        elif other:
            before = ends.get(n.step - 1, [])
            k = bisect.bisect_left(before, (min(ln.t1 for ln in other), -1))
            n.parent = nodes[before[k - 1][1]] if k else None
        if n.parent is not None:
            n.parent.children.append(n)


def _final(lines: list[Line], nodes: list[_Completion]) -> _Completion | None:
    """The completion the job's state is at the end. A leaf (no step began from it) was abandoned when no writer
    of it wrote again only uncommitted lines (a replica stuck in a failing step still holds that state) and
    either one of them went on with a committed line (its counter moved to another state) or all fell silent
    while another step began after it. Among the leaves not abandoned: the highest step (replicas that meet heal
    to the highest one), then the latest."""
    if not nodes:
        return None
    after: dict[str, list[Line]] = {}
    for ln in lines:
        after.setdefault(ln.writer, []).append(ln)
    latest_start = max(n.t0 for n in nodes)

    def abandoned(leaf: _Completion) -> bool:
        moved = False
        for w in {ln.writer for ln in leaf.lines}:
            later = [x for x in after[w] if x.t1 > leaf.t1]
            if later and not any(x.committed for x in later):
                return False
            moved = moved or bool(later)
        return moved or latest_start > leaf.t1

    leaves = [n for n in nodes if not n.children]
    live = [n for n in leaves if not abandoned(n)] or leaves
    return max(live, key=lambda n: (n.step, n.t1))


def replay(lines: Iterable[Line]) -> Replay:
    """The rule, the same for every contender and reading each one's own counter per process: committed lines of
    one step that overlap in time are one completion; each completion began from the state of a completion of
    the step before (:func:`_link`); the kept lines are those of the completions from which the job's final state
    (:func:`_final`) descends. Every other committed line is redone: its work was lost (a rollback to a commit, a
    restart from a checkpoint or from scratch, a replica's own steps before it healed from a peer's state).
    ``committed: false`` lines are thrown away, never kept."""
    lines = list(lines)
    out = Replay(thrown_away=sorted((ln for ln in lines if not ln.committed), key=lambda x: x.t1))
    nodes, of = _group([ln for ln in lines if ln.committed])
    _link(lines, nodes, of)
    path: set[int] = set()
    node = _final(lines, nodes)
    while node is not None:
        path.add(id(node))
        node = node.parent
    lost = [n for n in nodes if id(n) not in path]
    out.kept = sorted((ln for n in nodes if id(n) in path for ln in n.lines), key=lambda x: x.t1)
    out.redone = sorted((ln for n in lost for ln in n.lines), key=lambda x: x.t1)
    for n in lost:
        if n.parent is not None and id(n.parent) not in path:
            continue  # inside a lost branch, counted with the branch's first step
        stack, branch = [n], []
        while stack:
            m = stack.pop()
            branch.append(m)
            stack.extend(m.children)
        end = max(m.t1 for m in branch)
        inside = {id(m) for m in branch}
        went_on = [c.t0 for c in nodes if id(c) not in inside and c.t0 >= end]
        out.rollbacks.append((min(went_on, default=end), len({m.step for m in branch})))
    out.rollbacks.sort()
    return out


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def kept_steps(lines: Iterable[Line]) -> list[tuple[float, float]]:
    """The kept steps' spans, in step order: from the first start of a step's lines (or the previous kept step's end,
    when later: processes a collective apart overlap) to their last end."""
    spans: dict[int, tuple[float, float]] = {}
    for ln in replay(lines).kept:
        a, b = spans.get(ln.step, (ln.t0, ln.t1))
        spans[ln.step] = (min(a, ln.t0), max(b, ln.t1))
    out: list[tuple[float, float]] = []
    for k in sorted(spans):
        a, b = spans[k]
        out.append((min(b, max(a, out[-1][1])) if out else a, b))
    return out


def steady_step_seconds(lines: Iterable[Line]) -> float | None:
    """The contender's steady step time: the median span of its kept steps (most steps of a run wait for nothing)."""
    spans = kept_steps(lines)
    return statistics.median(b - a for a, b in spans) if spans else None


def goodput(lines: Iterable[Line], t_start: float, t_end: float, step_seconds: float | None = None) -> float:
    """Compute in kept steps ÷ wall time: each kept step inside ``[t_start, t_end]`` counts its span clipped to the
    window and capped at ``step_seconds`` (the contender's steady step time, by default :func:`steady_step_seconds`
    of ``lines``), so a wait inside a kept step (a quorum, a heartbeat timeout, a rendezvous, a peer's restart) earns
    nothing; redone and thrown-away steps count nothing."""
    if t_end <= t_start:
        raise ValueError(f"goodput window must be positive, got [{t_start}, {t_end}]")
    lines = list(lines)
    spans = kept_steps(lines)
    cap = step_seconds if step_seconds is not None else steady_step_seconds(lines)
    if cap is None:
        return 0.0
    inside = (min(b, t_end) - max(a, t_start) for a, b in spans)
    return sum(min(d, cap) for d in inside if d > 0) / (t_end - t_start)


def survival(lines: Iterable[Line], kill_ts: float, killed: str, until: float) -> dict[str, Any]:
    """Did the processes that the kill of writer ``killed`` (``<host>-<pid>``) at ``kill_ts`` spared live through it?
    Survivors: the other writers of the last step completed before the kill (its world is the world before).
    ``lived``: those that wrote a committed line begun after the kill (the same writer, so the same pid) up to
    ``until``; ``steps_at_smaller_world``: steps they committed at a smaller world, before the first step back at
    the world before (the killed one's return; none when another host joined during the recovery). ``survived``:
    every survivor lived."""
    lines = [ln for ln in lines if ln.committed]
    done = [ln for ln in lines if ln.t1 <= kill_ts]
    last = max(done, key=lambda x: x.t1, default=None)
    of_last = [ln for ln in done if last is not None and ln.step == last.step and ln.t0 <= last.t1 and ln.t1 >= last.t0]
    world = max((ln.world for ln in of_last), default=0)
    spared = sorted({ln.writer for ln in of_last} - {killed})
    after = sorted((ln for ln in lines if kill_ts <= ln.t0 and ln.t1 <= until), key=lambda x: x.t1)
    back = next((ln.t1 for ln in after if ln.world >= world), float("inf"))
    lived = sorted({ln.writer for ln in after} & set(spared))
    smaller = {ln.step for ln in after if ln.writer in spared and ln.world < world and ln.t1 < back}
    return {
        "world_before": world,
        "survivors": len(spared),
        "lived": len(lived),
        "steps_at_smaller_world": len(smaller),
        "survived": bool(spared) and len(lived) == len(spared),
    }


def first_step_after(lines: Iterable[Line], t: float) -> Line | None:
    """The first committed step (by its end) begun at or after ``t``: a fault's recovery ends there."""
    after = [ln for ln in lines if ln.committed and ln.t0 >= t]
    return min(after, key=lambda x: x.t1) if after else None


def completions(lines: Iterable[Line]) -> list[tuple[float, int]]:
    """The job's step completions ``(t1, world)``: overlapping lines of one step are one completion (its last end)."""
    out: list[list[float]] = []
    latest: dict[int, int] = {}  # step -> index in out of its latest completion
    for ln in sorted((x for x in lines if x.committed), key=lambda x: x.t1):
        i = latest.get(ln.step)
        if i is not None and ln.t0 < out[i][0]:
            out[i] = [max(out[i][0], ln.t1), max(out[i][1], ln.world)]
            continue
        latest[ln.step] = len(out)
        out.append([ln.t1, ln.world])
    return sorted((t1, int(w)) for t1, w in out)


def pause(lines: Iterable[Line], t_listed: float, new_world: int) -> dict[str, float] | None:
    """The running job's pause at a scale-up listed at ``t_listed``: the longest gap between its step completions
    from the last one before the listing to the first at ``new_world`` workers, less the median gap of the 20
    before the listing. None when no step at ``new_world`` followed, or none preceded."""
    done = completions(lines)
    before = [t for t, _ in done if t < t_listed]
    first_new = next((t for t, w in done if t >= t_listed and w >= new_world), None)
    if first_new is None or not before:
        return None
    recent = before[-21:]
    gaps = [b - a for a, b in itertools.pairwise(recent)]
    normal = statistics.median(gaps) if gaps else 0.0
    times = [before[-1], *[t for t, _ in done if t_listed <= t <= first_new]]
    longest = max(b - a for a, b in itertools.pairwise(times))
    return {
        "pause_seconds": max(0.0, longest - normal),
        "longest_gap_seconds": longest,
        "normal_gap_seconds": normal,
        "first_new_size_seconds": first_new - t_listed,
    }


def samples_per_second(lines: Iterable[Line], t_from: float, t_to: float) -> float | None:
    """Samples of the kept steps that ended in ``(t_from, t_to]`` ÷ the time from ``t_from`` to the last such end."""
    kept = [ln for ln in replay(lines).kept if t_from < ln.t1 <= t_to]
    last = max((ln.t1 for ln in kept), default=t_from)
    return sum(len(ln.ids) for ln in kept) / (last - t_from) if last > t_from else None


def unended(lines: Iterable[Line], begins: Iterable[Begin]) -> dict[int, list[Begin]]:
    """Begin lines whose step line was never written (the process died in the step), by the step they began: one
    more than their writer's last line before them (a process's first step has no such line and is left out)."""
    mine: dict[str, list[Line]] = {}
    for ln in lines:
        mine.setdefault(ln.writer, []).append(ln)
    ends = {w: sorted(v, key=lambda x: x.t1) for w, v in mine.items()}
    ended = {(ln.writer, ln.t0) for ln in lines}
    out: dict[int, list[Begin]] = {}
    for b in begins:
        if (b.writer, b.t0) in ended:
            continue
        before = [ln for ln in ends.get(b.writer, []) if ln.t1 <= b.t0]
        if before:
            out.setdefault(before[-1].step + 1, []).append(b)
    return out


def _host(writer: str) -> str:
    """The logical host of a writer (``<host>-<pid>``)."""
    return writer.rsplit("-", 1)[0]


def audit(lines: Iterable[Line], num_samples: int, begins: Iterable[Begin] = ()) -> dict[int, dict[str, int]]:
    """Per completed epoch (a kept line of a later epoch exists, and no host that trained in it went on in it after
    that line began: a TorchFT replica group keeps an epoch of its own): ids trained, ids never trained, duplicates,
    ``unlogged``: processes that took part in a kept step (its lines say a world larger than their number) and wrote
    no line for it, and ``recovered``: how many of those left a begin line. A process writes its step line after its
    optimizer step, so one killed between its gradients' sum and that line took part (a collective of that world
    needs every member); its begin line, written before the step, gives its ids, which count as trained. Unlogged
    batches without a begin line count as missing."""
    lines = list(lines)
    kept = replay(lines).kept
    orphans = unended(lines, begins)
    ids: dict[int, list[int]] = {}
    later: dict[str, int] = {}
    hosts_of: dict[int, set[str]] = {}
    per_step: dict[int, list[Line]] = {}
    for ln in kept:
        ids.setdefault(ln.epoch, []).extend(ln.ids)
        later[_host(ln.writer)] = max(later.get(_host(ln.writer), ln.epoch), ln.epoch)
        hosts_of.setdefault(ln.epoch, set()).add(_host(ln.writer))
        per_step.setdefault(ln.step, []).append(ln)
    unlogged: dict[int, int] = {}
    recovered: dict[int, int] = {}
    for step, ls in per_step.items():
        short = max(ln.world for ln in ls) - len(ls)
        if short <= 0:
            continue
        epoch = min(ln.epoch for ln in ls)
        unlogged[epoch] = unlogged.get(epoch, 0) + short
        writers, end = {ln.writer for ln in ls}, max(ln.t1 for ln in ls)
        found = sorted((b for b in orphans.get(step, []) if b.writer not in writers and b.t0 <= end),
                       key=lambda b: b.t0)[-short:]  # fmt: skip
        for b in found:
            e = epoch if b.epoch is None else b.epoch
            recovered[e] = recovered.get(e, 0) + 1
            ids.setdefault(e, []).extend(b.ids)
    out: dict[int, dict[str, int]] = {}
    last_end: dict[str, float] = {}
    for ln in kept:
        last_end[_host(ln.writer)] = max(last_end.get(_host(ln.writer), ln.t1), ln.t1)
    for epoch in sorted(hosts_of):
        next_start = min((ln.t0 for ln in kept if ln.epoch > epoch), default=None)
        if next_start is None or any(later[h] <= epoch and last_end[h] > next_start for h in hosts_of[epoch]):
            continue  # no later epoch yet, or a host still in this one (it left no later line but went on after)
        distinct = set(ids[epoch])
        out[epoch] = {
            "seen": len(ids[epoch]),
            "missing": len(set(range(num_samples)) - distinct),
            "duplicated": len(ids[epoch]) - len(distinct),
            "unlogged": unlogged.get(epoch, 0),
            "recovered": recovered.get(epoch, 0),
        }
    return out


def losses_after(rep: Replay, kills: list[float], t_end: float) -> list[dict[str, int]]:
    """Per kill: steps rolled back (redone) and steps thrown away between it and the next kill (or ``t_end``)."""
    out = []
    for i, k in enumerate(kills):
        nxt = kills[i + 1] if i + 1 < len(kills) else t_end
        redone = sum(n for t, n in rep.rollbacks if k <= t < nxt)
        thrown = len({ln.step for ln in rep.thrown_away if k <= ln.t1 < nxt})
        out.append({"redone": redone, "thrown_away": thrown})
    return out


def kill_figures(kills: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every kill's recovery (s; a kill with no step after it has none), steps redone and thrown away, each as a
    :func:`bench.core.summary` (the values in kill order, median = p50, p95, max)."""
    kills = list(kills)
    return {
        "recovery": summary([k["recovery_seconds"] for k in kills if k.get("recovery_seconds") is not None], "s"),
        "redone": summary([k.get("redone", 0) for k in kills], "steps"),
        "thrown_away": summary([k.get("thrown_away", 0) for k in kills], "steps"),
    }


def _with_survival(lines: list[Line], kills: list[dict[str, Any]], t_end: float) -> None:
    """Add :func:`survival` to each kill (up to the next kill or ``t_end``)."""
    for i, k in enumerate(kills):
        until = kills[i + 1]["ts"] if i + 1 < len(kills) else t_end
        k["survival"] = survival(lines, k["ts"], f"{k['host']}-{k['pid']}", until)


# ============================================================================ processes
@contextlib.contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``updates`` for the block (the hot-join zygotes take their environment from it)."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def peers_python() -> Path:
    return PEERS_VENV / "bin" / "python"


def peers_blocked() -> str | None:
    """Why torchrun and TorchFT cannot run here (None when they can): the peers environment is missing or broken."""
    py = peers_python()
    if not py.exists():
        return f"no {PEERS_VENV.relative_to(REPO)}/ (run `make peers-env` to create it)"
    probe = subprocess.run(
        [str(py), "-c", "import torch, torchft"], capture_output=True, text=True, timeout=300, check=False
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"`{py} -c 'import torch, torchft'` failed: {last} (run `make peers-env`)"
    return None


def peer_versions() -> dict[str, str]:
    """torch's and TorchFT's installed versions in ``.peers-venv`` (TorchFT by its distribution's name: the nightly
    is ``torchft-nightly``, a release ``torchft``)."""
    code = (
        "import importlib.metadata as m\n"
        "def v(*names):\n"
        "    for n in names:\n"
        "        try:\n"
        "            return n + '==' + m.version(n)\n"
        "        except m.PackageNotFoundError:\n"
        "            pass\n"
        "    return '?'\n"
        "print(m.version('torch'), v('torchft-nightly', 'torchft'))"
    )
    out = subprocess.run([str(peers_python()), "-c", code], capture_output=True, text=True, timeout=300, check=False)
    torch_v, _, torchft_v = out.stdout.strip().partition(" ")
    return {"torch": torch_v, "torchft": torchft_v}


class Job:
    """One contender's job over logical hosts; every process it starts is killed by pid in :meth:`close`."""

    name = ""

    def __init__(self, workdir: Path, max_hosts: int) -> None:
        self.workdir = workdir
        self.steplog = workdir / "steplog"
        self.steplog.mkdir(parents=True, exist_ok=True)
        self.max_hosts = max_hosts
        self.reader = StepLogReader(self.steplog)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[str]] = []

    def env(self, host: str = "") -> dict[str, str]:
        return {
            **os.environ,
            "PEERS_STEPLOG": str(self.steplog),
            "PEERS_HOST": host,
            "PYTHONPATH": str(PEERS_DIR),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
        }

    def popen(self, cmd: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / log_name, "w")  # noqa: SIM115 - closed in close()
        self.logs.append(log)
        p = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir, start_new_session=True
        )
        self.procs.append(p)
        return p

    def start(self, hosts: list[str]) -> None:
        raise NotImplementedError

    def add_host(self, host: str) -> None:
        raise NotImplementedError

    def workers(self) -> list[tuple[str, psutil.Process]]:
        """The training processes (host, process), sorted by host."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise when the job's launcher ended (the job failed)."""

    def command(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        for p in self.procs:
            kill_tree(p.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for log in self.logs:
            log.close()

    def tail(self, n: int = 15) -> str:
        out = []
        for path in sorted(self.workdir.glob("*.log")):
            out += [f"{path.name}: {x}" for x in path.read_text(errors="replace").splitlines()[-n:]]
        return "\n".join(out[-3 * n :])


def _children_running(pid: int, marker: str) -> list[psutil.Process]:
    out = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for c in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if c.status() != psutil.STATUS_ZOMBIE and any(marker in part for part in c.cmdline()):
                    out.append(c)
    return out


class HorovodJob(Job):
    """elastictrain (hot join) or stock Horovod elastic, through the benchmarks' ElasticJob harness."""

    def __init__(self, workdir: Path, max_hosts: int, *, product: bool) -> None:
        super().__init__(workdir, max_hosts)
        self.product = product
        self.name = "elastictrain" if product else "horovod"
        self.stack = contextlib.ExitStack()
        self.job: Any = None
        self.zygotes: Any = None
        self.all_hosts: list[str] = []
        """Every host the job may use (a warm zygote on each, for elastictrain)."""

    def config(self) -> dict[str, Any]:
        return {
            "job": f"bench-peers-{self.name}",
            "run_dir": str(self.workdir / "run"),
            "device": "cpu",
            "task": "elastictrain_task:build",
            "data": {"batch_size": 32},
            "training": {"epochs": 100_000},
            "elastic": {"min_np": 1, "max_np": self.max_hosts, "rollback": "none", "lr_scaling": "none"},
        }

    def start(self, hosts: list[str]) -> None:
        from bench.hotjoin import hot_command, warm_zygotes
        from chaos.jobs import HOROVODRUN, STOCK_HOROVODRUN, ElasticJob

        env = self.env()
        extra = {k: env[k] for k in ("PEERS_STEPLOG", "PYTHONPATH", "GLOO_SOCKET_IFNAME")}
        self.stack.enter_context(_environ(extra))
        config = self.config()
        if self.product:
            self.zygotes = self.stack.enter_context(warm_zygotes(self.workdir / "job.yaml", config, self.all_hosts))
            extra = {**extra, **self.zygotes.env}
        self.job = ElasticJob(
            self.workdir,
            config,
            list(hosts),
            min_np=1,
            max_np=self.max_hosts,
            gloo_timeout=30,
            cooldown=(5, 60),
            threads=1,
            command=hot_command if self.product else (lambda _cfg: [sys.executable, "-m", "horovod_train"]),
            extra_env=extra,
            launcher=list(HOROVODRUN if self.product else STOCK_HOROVODRUN),
        )
        self.stack.callback(self.job.close)  # before the zygotes are killed
        self.job.start()

    def add_host(self, host: str) -> None:
        self.job.set_hosts([*self.job.hosts, host])

    def workers(self) -> list[tuple[str, psutil.Process]]:
        out = []
        for p in self.job.workers():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
                host = p.environ()["HOROVOD_HOSTNAME"]
                forked = self.zygotes.forked(host) if self.zygotes is not None else []
                out.append((host, forked[0] if forked else p))
        return sorted(out, key=lambda hp: hp[0])

    def check(self) -> None:
        if self.job is not None and self.job.proc is not None and self.job.proc.poll() is not None:
            raise BenchError(f"{self.name}: horovodrun exited {self.job.proc.returncode}:\n{self.job.tail(15)}")

    def command(self) -> str:
        worker = (
            "zygote client + elastictrain train (task elastictrain_task:build)"
            if self.product
            else ("python -m horovod_train")
        )
        runner = "horovodrun (elastictrain.horovod.hvdrun)" if self.product else "horovodrun"
        return (
            f"{runner} -np 3 --min-np 1 --max-np {self.max_hosts} --host-discovery-script D --network-interfaces lo "
            f"--gloo --gloo-timeout-seconds 30 --blacklist-cooldown-range 5 60 {worker}"
        )

    def tail(self, n: int = 15) -> str:
        return self.job.tail(n) if self.job is not None else ""

    def close(self) -> None:
        self.stack.close()
        super().close()


AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torch's own opt-out of sharing the rendezvous store with the workers. With sharing on (the default since 2.5), an
agent that joins a running job waits forever for the new round's ``MASTER_ADDR``: rank 0 publishes it only at its
first rendezvous (``DynamicRendezvousHandler.next_rendezvous`` caches it; see pytorch/pytorch#135712), so torchrun's
scale-up timed out after 60 s here in every try."""


class TorchrunJob(Job):
    """One torchrun agent per logical host over a c10d rendezvous; DDP; rank 0 checkpoints every 10 steps."""

    name = "torchrun"

    def __init__(self, workdir: Path, max_hosts: int) -> None:
        super().__init__(workdir, max_hosts)
        self.port = free_port()
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.store_host = ""

    def agent_command(self, host: str) -> list[str]:
        return [
            str(PEERS_VENV / "bin" / "torchrun"),
            "--nnodes", f"1:{self.max_hosts}",
            "--nproc-per-node", "1",
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", "peers",
            "--max-restarts", "100",
            # On a cluster only the endpoint's machine matches the endpoint; here every logical host would, and two
            # agents serving the store on one port (SO_REUSEPORT) split the rendezvous: the first host serves it.
            "--rdzv-conf", f"is_host={'1' if not self.agents or host == self.store_host else '0'}",
            "--local-addr", host,
            str(PEERS_DIR / "torchrun_train.py"),
            "--checkpoint", str(self.workdir / "ckpt.pt"),
        ]  # fmt: skip

    def start(self, hosts: list[str]) -> None:
        for h in hosts:
            self.add_host(h)

    def add_host(self, host: str) -> None:
        self.store_host = self.store_host or host
        self.agents[host] = self.popen(self.agent_command(host), f"agent-{host}.log", {**self.env(host), **AGENT_ENV})

    def workers(self) -> list[tuple[str, psutil.Process]]:
        return sorted(
            ((h, c) for h, a in self.agents.items() for c in _children_running(a.pid, "torchrun_train.py")),
            key=lambda hp: hp[0],
        )

    def check(self) -> None:
        dead = [h for h, a in self.agents.items() if a.poll() is not None]
        if dead:
            raise BenchError(
                f"torchrun: the agent of {dead[0]} exited {self.agents[dead[0]].returncode}:\n{self.tail()}"
            )

    def command(self) -> str:
        cmd = self.agent_command("HOST")
        env = " ".join(f"{k}={v}" for k, v in AGENT_ENV.items())
        return " ".join([env, "torchrun", *cmd[1:-3], "torchrun_train.py", "--checkpoint", "ckpt.pt"]).replace(
            "is_host=1", "is_host=1|0"
        )


TORCHFT_TUNED_HEARTBEAT_MS = 1000
"""The tuned variant's lighthouse ``--heartbeat_timeout_ms``: 10 of the Manager's 100 ms heartbeats. Its default, 5000
ms, is what its docs give (the README's lighthouse command passes none; ``LighthouseOpt`` defaults to 5000); a dead
group stays in the quorum's view that long."""


class TorchftJob(Job):
    """TorchFT's Lighthouse and one replica group per logical host (a one-process torchrun that restarts it); the
    lighthouse's heartbeat timeout at its default (``heartbeat_ms=None``) or at ``heartbeat_ms``."""

    def __init__(self, workdir: Path, max_hosts: int, heartbeat_ms: int | None = None) -> None:
        super().__init__(workdir, max_hosts)
        self.name = "torchft" if heartbeat_ms is None else TORCHFT_TUNED
        self.heartbeat_ms = heartbeat_ms
        self.port = free_port()
        self.groups: dict[str, subprocess.Popen[bytes]] = {}

    def lighthouse_command(self) -> list[str]:
        tuned = [] if self.heartbeat_ms is None else ["--heartbeat_timeout_ms", str(self.heartbeat_ms)]
        return [
            str(PEERS_VENV / "bin" / "torchft_lighthouse"),
            "--min_replicas", "1",
            "--quorum_tick_ms", "100",
            "--join_timeout_ms", "10000",
            *tuned,
            "--bind", f"127.0.0.1:{self.port}",
        ]  # fmt: skip

    def group_command(self, group: int) -> list[str]:
        return [
            str(PEERS_VENV / "bin" / "torchrun"),
            "--standalone", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "100",
            str(PEERS_DIR / "torchft_train.py"),
            "--checkpoint", str(self.workdir / f"ckpt-{group}.pt"),
        ]  # fmt: skip

    def start(self, hosts: list[str]) -> None:
        self.lighthouse = self.popen(self.lighthouse_command(), "lighthouse.log", self.env())
        for h in hosts:
            self.add_host(h)

    def add_host(self, host: str) -> None:
        group = len(self.groups)
        env = {
            **self.env(host),
            "REPLICA_GROUP_ID": str(group),
            "NUM_REPLICA_GROUPS": str(self.max_hosts),
            "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
        }
        self.groups[host] = self.popen(self.group_command(group), f"group-{host}.log", env)

    def workers(self) -> list[tuple[str, psutil.Process]]:
        return sorted(
            ((h, c) for h, a in self.groups.items() for c in _children_running(a.pid, "torchft_train.py")),
            key=lambda hp: hp[0],
        )

    def check(self) -> None:
        dead = [h for h, a in self.groups.items() if a.poll() is not None]
        if dead or self.lighthouse.poll() is not None:
            what = "group " + dead[0] if dead else "the lighthouse"
            raise BenchError(f"{self.name}: {what} exited:\n{self.tail()}")

    def command(self) -> str:
        lh = " ".join(["torchft_lighthouse", *self.lighthouse_command()[1:-2]])
        group = " ".join(["torchrun", *self.group_command(0)[1:-3], "torchft_train.py --checkpoint ckpt-G.pt"])
        return (
            f"{lh}; per host G: REPLICA_GROUP_ID=G NUM_REPLICA_GROUPS={self.max_hosts} "
            f"TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT {group}"
        )


def make_job(name: str, workdir: Path, hosts: list[str], max_hosts: int) -> Job:
    job: Job
    if name in ("elastictrain", "horovod"):
        hj = HorovodJob(workdir, max_hosts, product=name == "elastictrain")
        hj.all_hosts = hosts[:max_hosts]
        job = hj
    elif name == "torchrun":
        job = TorchrunJob(workdir, max_hosts)
    elif name == "torchft":
        job = TorchftJob(workdir, max_hosts)
    elif name == TORCHFT_TUNED:
        job = TorchftJob(workdir, max_hosts, heartbeat_ms=TORCHFT_TUNED_HEARTBEAT_MS)
    else:
        raise ValueError(f"unknown contender {name!r}, expected one of {', '.join(CONTENDERS)}")
    return job


# ============================================================================ measurements
def _wait(job: Job, what: str, timeout: float, found: Callable[[list[Line]], Any]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        lines = job.reader.read()
        out = found(lines)
        if out is not None and out is not False:
            return out
        job.check()
        if time.monotonic() > deadline:
            raise BenchError(f"{job.name}: no {what} within {timeout:.0f} s:\n{job.tail()}")
        time.sleep(0.2)


def _steps_after(t: float, n: int) -> Callable[[list[Line]], bool]:
    """A :func:`_wait` condition: ``n`` distinct committed steps begun after ``t``."""
    return lambda lines: len({ln.step for ln in lines if ln.committed and ln.t0 > t}) >= n


def _first_at(t: float, world: int) -> Callable[[list[Line]], Line | None]:
    return lambda lines: first_step_at(lines, t, world)


def _first_after(t: float) -> Callable[[list[Line]], Line | None]:
    return lambda lines: first_step_after(lines, t)


def _kill(job: Job, rng: random.Random) -> dict[str, Any]:
    """SIGKILL one training process, drawn by ``rng`` among the running ones (sorted by host)."""
    for _ in range(100):
        workers = job.workers()
        if workers:
            host, proc = workers[rng.randrange(len(workers))]
            t = time.time()
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
                return {"ts": t, "host": host, "pid": proc.pid, "workers": len(workers)}
        job.check()
        time.sleep(0.1)
    raise BenchError(f"{job.name}: no training process to kill")


def trial(name: str, workdir: Path, hosts: list[str], quick: bool, seed: int, log: Callable[[str], None]) -> dict:
    """Steady samples/s at 3 workers, the pause at 3 -> 4, then SIGKILLs (see the module docstring)."""
    job = make_job(name, workdir, hosts, 4)
    rng = random.Random(seed)
    steady_seconds = 15.0 if quick else 30.0
    kills_n = 3
    try:
        job.start(hosts[:3])
        _wait(job, "step 30 at 3 workers", 300, lambda ls: any(ln.step >= 30 and ln.world >= 3 for ln in ls))
        t_a = time.time()
        time.sleep(steady_seconds)  # the measured window itself; the job runs meanwhile
        t_b = time.time()
        lines = job.reader.read()
        steady = samples_per_second(lines, t_a, t_b)
        worlds = [ln.world for ln in lines if t_a < ln.t1 <= t_b]
        log(f"{name}: {steady or 0:.0f} samples/s at {statistics.median(worlds) if worlds else '?'} workers")
        t_listed = time.time()
        job.add_host(hosts[3])
        _wait(job, "a step at 4 workers", 300, lambda ls: first_step_at(ls, t_listed, 4))
        scale = pause(job.reader.read(), t_listed, 4)
        log(f"{name}: scale-up 3 -> 4 pause {scale['pause_seconds'] if scale else float('nan'):.2f} s")
        kills: list[dict[str, Any]] = []
        for _ in range(kills_n):
            last = max(ln.t1 for ln in job.reader.read())
            _wait(job, "10 steps", 120, _steps_after(last, 10))
            # back at the full size first (the previous kill's host returned: after its cooldown, its restart or its
            # heal), so that every kill meets the same job and the survivors' steps at the smaller world end at that
            # return; after 120 s the kill goes ahead at whatever size the job has
            with contextlib.suppress(BenchError):
                _wait(job, "a step at 4 workers", 120, _first_at(time.time(), 4))
            kill = _kill(job, rng)
            first = _wait(job, "a step after the kill", 300, _first_after(kill["ts"]))
            kill.update(recovery_seconds=first.t1 - kill["ts"], world_after=first.world)
            log(f"{name}: SIGKILL on {kill['host']} -> next step {kill['recovery_seconds']:.2f} s (at {first.world})")
            kills.append(kill)
        _wait(job, "10 steps", 120, _steps_after(time.time(), 10))
        lines = job.reader.read()
        t_last = max(ln.t1 for ln in lines)
        losses = losses_after(replay(lines), [k["ts"] for k in kills], t_last)
        for k, lost in zip(kills, losses, strict=True):
            k.update(lost)
        _with_survival(lines, kills, t_last)
        return {"samples_per_sec": steady, "world": statistics.median(worlds) if worlds else None,
                "scale_up": scale, "kills": kills}  # fmt: skip
    finally:
        job.close()


def first_step_at(lines: list[Line], t: float, world: int) -> Line | None:
    at = [ln for ln in lines if ln.committed and ln.t0 >= t and ln.world >= world]
    return min(at, key=lambda x: x.t1) if at else None


def goodput_run(name: str, workdir: Path, hosts: list[str], quick: bool, log: Callable[[str], None]) -> dict:
    """Seeded SIGKILLs every 60 s for 10 min (quick: 30 s, 2 min) on 3 hosts; goodput and the exactly-once audit."""
    window, every = (120.0, 30.0) if quick else (600.0, 60.0)
    job = make_job(name, workdir, hosts, 3)
    rng = random.Random(SEED)
    try:
        job.start(hosts[:3])
        first = _wait(job, "a first step", 300, lambda ls: min((ln.t1 for ln in ls), default=None))
        t_start, kills = first, []
        t_end = t_start + window
        next_kill = t_start + every
        while time.time() < t_end:
            if time.time() >= next_kill and next_kill < t_end - 1:
                kills.append(_kill(job, rng))
                next_kill += every
            job.check()
            time.sleep(0.2)
        lines = [ln for ln in job.reader.read() if ln.t1 <= t_end]
    finally:
        job.close()
    rep = replay(lines)
    losses = losses_after(rep, [k["ts"] for k in kills], t_end)
    per_kill = []
    for k, lost in zip(kills, losses, strict=True):
        nxt = first_step_after(lines, k["ts"])
        per_kill.append({**k, "t": k["ts"] - t_start, "recovery_seconds": nxt.t1 - k["ts"] if nxt else None, **lost})
    _with_survival(lines, per_kill, t_end)
    epochs = audit(lines, NUM_SAMPLES, job.reader.begins)
    once = bool(epochs) and all(e["missing"] == 0 and e["duplicated"] == 0 for e in epochs.values())
    step_seconds = steady_step_seconds(lines)
    value = goodput(lines, t_start, t_end, step_seconds)
    unlogged = sum(e["unlogged"] for e in epochs.values())
    log(f"{name}: goodput {value:.3f}, {len(kills)} kills, {sum(n for _, n in rep.rollbacks)} steps redone, "
        f"exactly once {once} over {len(epochs)} epochs ({unlogged} batches unlogged)")  # fmt: skip
    return {
        "goodput": value,
        "steady_step_seconds": step_seconds,
        "window_seconds": window,
        "kill_every_seconds": every,
        "kills": per_kill,
        "losses": losses,
        "redone_steps": sum(n for _, n in rep.rollbacks),
        "thrown_away_steps": len({(ln.step, round(ln.t1)) for ln in rep.thrown_away}),
        "epochs_audited": epochs,
        "exactly_once": once,
    }


def _guarded(fn: Callable[[int], dict], log: Callable[[str], None], name: str) -> Callable[[int], dict]:
    def run_one(r: int) -> dict:
        try:
            return fn(r)
        except Exception as e:  # one contender's failure is a result; the others go on
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            log(f"{name}: failed: {first}")
            return {"error": f"{type(e).__name__}: {first}", "detail": str(e)[-3000:]}

    return run_one


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def survives_in_words(name: str, kills: list[dict[str, Any]]) -> str:
    """Whether a contender's survivors lived through its kills, in words for the table (the trial's kills and the
    goodput run's)."""
    judged = [k["survival"] for k in kills if k.get("survival", {}).get("survivors")]
    if not judged:
        return "not measured (no kill had survivors to judge)"
    lived = sum(1 for v in judged if v["survived"])
    if name in RESTART_BY_DESIGN:
        return f"restarts every worker by design (survivors lived through {lived} of {len(judged)} kills)"
    if lived == len(judged):
        smaller = sum(1 for v in judged if v["steps_at_smaller_world"])
        return f"yes: survivors kept their pids in all {len(judged)} kills ({smaller} with steps at the smaller world)"
    if lived == 0:
        return f"no: in none of {len(judged)} kills did the survivors go on (they restarted or stopped)"
    return f"partly: survivors went on in {lived} of {len(judged)} kills"


def once_in_words(g: dict[str, Any]) -> str:
    """The exactly-once audit of one contender in words: epochs clean of all audited, and its documented loss."""
    epochs = g.get("epochs_audited") or {}
    clean = sum(1 for e in epochs.values() if e["missing"] == 0 and e["duplicated"] == 0)
    words = f"{clean} of {len(epochs)} epochs" if epochs else "no completed epoch"
    lossy = g.get("sampler_documented_lossy")
    return f"{words}; lossy by its docs: {lossy}" if lossy else words


def summarize(name: str, trials: list[dict], good: dict) -> dict[str, Any]:
    """One contender's figures from its trials and its goodput run (the JSON's ``per_contender``)."""
    ok = [t for t in trials if "error" not in t]
    trial_kills = [{**k, "phase": "trial"} for t in ok for k in t["kills"]]
    all_kills = trial_kills + [{**k, "phase": "goodput"} for k in good.get("kills", [])]
    judged = [k["survival"] for k in all_kills if k.get("survival", {}).get("survivors")]
    never_survived = name not in RESTART_BY_DESIGN and bool(judged) and not any(v["survived"] for v in judged)
    return {
        "recovery": summary([k["recovery_seconds"] for k in trial_kills], "s"),
        "redone_per_kill": _median(k["redone"] for k in trial_kills),
        "thrown_away_per_kill": _median(k["thrown_away"] for k in trial_kills),
        "per_kill": [
            {
                key: k.get(key)
                for key in ("phase", "host", "t", "world_after", "recovery_seconds", "redone", "thrown_away")
            }
            | {"survived": k.get("survival", {}).get("survived")}
            for k in all_kills
        ],
        "kills": kill_figures(all_kills),
        "survives_kills": survives_in_words(name, all_kills),
        "never_survived": never_survived,
        "scale_up_pause": summary([t["scale_up"]["pause_seconds"] for t in ok if t["scale_up"]], "s"),
        "samples_per_sec": summary([t["samples_per_sec"] for t in ok if t["samples_per_sec"]], "samples/s"),
        "goodput": None if never_survived else good.get("goodput"),
        "goodput_as_measured": good.get("goodput"),
        "steady_step_seconds": good.get("steady_step_seconds"),
        "exactly_once": good.get("exactly_once"),
        "epochs_audited": good.get("epochs_audited"),
        "sampler_documented_lossy": LOSSY_BY_DOCS.get(name),
        "errors": [t["error"] for t in [*trials, good] if "error" in t],
    }


def _triple(s: dict[str, Any], fmt: str) -> str:
    return " / ".join("—" if s.get(k) is None else format(s[k], fmt) for k in ("median", "p95", "max"))


def run(ctx: BenchContext) -> Result:
    from elastictrain.launcher.hosts import local_logical_hosts

    hosts = local_logical_hosts()
    if len(hosts) < 4:
        raise BenchError(f"needs 4 logical hosts, this machine has {hosts}")
    blocked = peers_blocked()
    names = [n for n in CONTENDERS if not (blocked and n in PEER_ENV_CONTENDERS)]
    if blocked:
        ctx.progress(f"{', '.join(PEER_ENV_CONTENDERS)} blocked: {blocked}")
    trials = 1 if ctx.quick else 3

    def trial_fn(name: str) -> Callable[[int], dict]:
        return _guarded(
            lambda r: trial(name, ctx.scratch(f"{name}-trial-{r}"), hosts, ctx.quick, SEED + r, ctx.progress),
            ctx.progress,
            name,
        )

    def goodput_fn(name: str) -> Callable[[int], dict]:
        return _guarded(
            lambda r: goodput_run(name, ctx.scratch(f"{name}-goodput"), hosts, ctx.quick, ctx.progress),
            ctx.progress,
            name,
        )

    trials_out = alternate([(n, trial_fn(n)) for n in names], trials, ctx.progress)
    goodput_out = alternate([(n, goodput_fn(n)) for n in names], 1, ctx.progress)

    per: dict[str, dict[str, Any]] = {n: summarize(n, trials_out[n], goodput_out[n][0]) for n in names}
    for b in PEER_ENV_CONTENDERS:
        if b not in per:
            per[b] = {"blocked": blocked}

    def med(n: str, key: str) -> float | None:
        s = per.get(n, {}).get(key)
        return s.get("median") if isinstance(s, dict) else None

    et = "elastictrain"
    others = [n for n in names if n != et]
    best_goodput = max((per[n]["goodput"] for n in others if per[n].get("goodput") is not None), default=None)
    fastest = max((med(n, "samples_per_sec") or 0.0 for n in others), default=0.0) or None
    once_elsewhere = [n for n in others if per[n].get("exactly_once")]
    torchft_recoveries = [r for r in (med(n, "recovery") for n in ("torchft", TORCHFT_TUNED)) if r is not None]
    best_torchft = min(torchft_recoveries, default=None)

    def goodput_words(n: str) -> str:
        g = per[n]
        if g.get("never_survived"):
            return f"{n}: no goodput, it did not survive a kill"
        return f"{n} {g['goodput']:.3f}" if g.get("goodput") is not None else f"{n} —"

    metrics = [
        Metric("SIGKILL → next step, elastictrain median", med(et, "recovery"), "s",
               note="; ".join(f"{n} {med(n, 'recovery') or float('nan'):.2f} s" for n in others)),
        Metric("recovery speedup vs torchrun, medians", _ratio(med("torchrun", "recovery"), med(et, "recovery")),
               "x", GOAL_RECOVERY_VS_TORCHRUN),
        Metric("recovery speedup vs TorchFT (its better heartbeat setting), medians",
               _ratio(best_torchft, med(et, "recovery")), "x", GOAL_RECOVERY_VS_TORCHFT),
        Metric("scale-up pause 3 → 4 ÷ torchrun's (medians)", _ratio(med(et, "scale_up_pause"),
               med("torchrun", "scale_up_pause")), "", GOAL_PAUSE_VS_TORCHRUN,
               note="; ".join(f"{n} {med(n, 'scale_up_pause') or float('nan'):.2f} s" for n in names)),
        Metric("goodput (kept steps' compute, no waits) ÷ best contender's", _ratio(per[et].get("goodput"),
               best_goodput), "", GOAL_GOODPUT_VS_BEST, note="; ".join(goodput_words(n) for n in names)),
        Metric("samples/s ÷ fastest contender's", _ratio(med(et, "samples_per_sec"), fastest), "",
               GOAL_THROUGHPUT_VS_FASTEST,
               note="; ".join(f"{n} {med(n, 'samples_per_sec') or float('nan'):.0f}" for n in names)),
        Metric("exactly once per epoch, elastictrain (1 = yes)", float(bool(per[et].get("exactly_once"))), "",
               GOAL_EXACTLY_ONCE, note=f"also exactly once: {', '.join(once_elsewhere) or 'no contender'}"),
        Metric("steps redone or thrown away per SIGKILL, elastictrain median",
               (per[et]["redone_per_kill"] or 0) + (per[et]["thrown_away_per_kill"] or 0), "steps",
               note="; ".join(f"{n} {per[n]['redone_per_kill']} redone + {per[n]['thrown_away_per_kill']} thrown away"
                              for n in others)),
    ]  # fmt: skip
    # per contender, in words and per kill (the table shows a metric's name: the figures ride in it)
    for n in names:
        g, k = per[n], per[n]["kills"]
        metrics += [
            Metric(f"{n}: survives a kill? {g['survives_kills']}", None, ""),
            Metric(f"{n}: goodput" + (" — none: it did not survive a kill" if g["never_survived"] else ""),
                   g["goodput"], ""),
            Metric(f"{n}: every sample exactly once per completed epoch, from the step and begin lines "
                   f"({once_in_words(g)})", float(bool(g["exactly_once"])), ""),
            Metric(f"{n}: every kill's SIGKILL → next step (s) p50 / p95 / max = {_triple(k['recovery'], '.2f')}; "
                   f"redone p50 / p95 / max = {_triple(k['redone'], 'g')}; thrown away max "
                   f"{_triple(k['thrown_away'], 'g').rsplit(' / ', 1)[-1]} (n = {k['redone']['n']})",
                   k["recovery"]["median"], "s"),
        ]  # fmt: skip
    jobs = {n: make_job(n, ctx.workdir / "describe", hosts, 3) for n in names}
    versions: dict[str, Any] = {"elastictrain+horovod": library_versions(("elastictrain", "horovod", "torch"))}
    if not blocked:
        versions["peers"] = peer_versions()
    return Result(
        NAME,
        metrics=metrics,
        contenders={f"{n} recovery": per[n]["recovery"] for n in names},
        detail={
            "per_contender": per,
            "commands": {n: j.command() for n, j in jobs.items()},
            "torchft_heartbeat_timeout_ms": {
                "torchft": "5000 (the lighthouse's default; its README's command passes none)",
                TORCHFT_TUNED: f"{TORCHFT_TUNED_HEARTBEAT_MS} (tuned: 10 of the Manager's 100 ms heartbeats)",
            },
            "goodput_rule": "each kept step's span (clipped to the window, overlap with the previous kept step "
            "removed) capped at the contender's steady step time (median kept span); committed = the system's own "
            "commit outcome",
            "versions": versions,
            "blocked": blocked,
            "trials": trials_out,
            "goodput": goodput_out,
            "hosts": hosts,
        },
    )
