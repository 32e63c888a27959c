"""Memory across resets: ``python -m chaos.resets --resets N --seed S [--run-dir D] [--out F] [--fault F]``.

One job under ``elastictrain launch`` (4 workers on the local tier's logical hosts, ``min_np`` 2, hot join)
is driven through ``N`` resets by one fault repeated on one host that is not rank 0's; each cycle is a reset
down and a reset up. The other hosts' workers, the *survivors*, must live through every reset in one
process life each. The faults (``--fault``):

- ``term`` (default): SIGTERM to the host's worker, which leaves at the end of its step (exit 143); Horovod
  blacklists the host for the launcher's cooldown (1-2 s), then the host's warm zygote forks a new worker.
- ``kill``: the same with SIGKILL. A SIGKILL now and then aborts a survivor in Gloo (``EnforceNotMet:
  op.preamble.length <= op.nbytes``, exit 134, horovod/horovod#3264; about 1 in 10 kills here), which ends
  the measurement: that is the fault campaign's finding, not a memory one.
- ``drain``: an operator's drain of the host in etcd, then the undrain once its worker has gone.
- ``preempt``: SIGTERM to the host's agent (a spot notice), then the agent started again (a cold zygote).

Each fault is aimed by watching the run log (``reset`` events, the world size), never by a fixed sleep.
After each reset the tool records every survivor's RSS, USS, open fds, threads and memory mappings (by
pid, psutil) into ``run_dir/resets.jsonl`` and checks that no survivor's pid changed. At the end it
writes per survivor the drift from reset ``--first`` (10) to the last one it reached (:func:`drift`; a run
stopped early reports the resets it covered, per survivor): the JSON goes
to ``--out`` (default ``bench/results/<date>-<host>-resets.json``, never an existing file) with a
markdown table beside it, and ``run_dir/resets-detail.json`` holds each survivor's fd targets, thread
names and resident memory by mapping near the first and the last reset, to say what grew.

Exit codes: 0 every survivor's RSS drift is within ``--max-rss-drift-pct`` (2) and its fds and threads
are flat; 1 they are not, a survivor died, or the job failed before ``N`` resets; 2 bad flags.

Size: one measurement end to end: the driver, the per-reset records, the drift and its report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from chaos import faults
from chaos.jobs import LAUNCH_FLAGS, LaunchedJob
from chaos.procs import REPO, Worker, read_launch_state, tree
from chaos.scenarios import DEFAULT_RUNS, FOUR_WORKERS, base_config
from elastictrain.errors import ScenarioError
from elastictrain.fileio import write_atomic
from elastictrain.launcher.processes import is_alive
from elastictrain.rundir import layout
from elastictrain.rundir.events import Reset
from elastictrain.tools.live_view import EventTail

T = TypeVar("T")
SAMPLES_FILE = "resets.jsonl"
DETAIL_FILE = "resets-detail.json"
RESULTS_DIR = REPO / "bench" / "results"
SCHEMA = "elastictrain-resets/1"
CYCLE_TIMEOUT_SECONDS = 180.0
"""Longest wait for one cycle's resets (a reset down and up takes seconds; a hang shows here)."""
LINGER_SECONDS = 2.0
"""``--fault drain``: how long a drained worker may take to exit once its host has left the ring."""
STEPS_PER_EPOCH = 60
"""``base_config``'s epoch: 2880 samples at a global batch of 48."""


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One survivor's figures just after one reset (a line of ``resets.jsonl``)."""

    reset: int
    """How many resets the run log showed when the sample was taken (1 = after the first)."""
    ts: float
    pid: int
    host: str
    world_size: int
    """The world size after that reset: samples are compared only at the same size."""
    rss: int
    """Resident set size, bytes."""
    uss: int | None
    """Unique set size, bytes (memory only this process holds), when readable."""
    fds: int
    threads: int
    maps: int
    """Lines of ``/proc/<pid>/maps``: a mapping per thread stack, shared library, arena..."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Drift:
    """One survivor from reset ``first`` to reset ``last``: medians of ``window`` samples at each end."""

    pid: int
    host: str
    first: int
    last: int
    world_size: int
    rss_first: int
    rss_last: int
    rss_pct: float
    uss_pct: float | None
    fds_first: float
    fds_last: float
    fds_delta: float
    threads_first: float
    threads_last: float
    threads_delta: float
    maps_delta: float
    rss_bytes_per_reset: float
    """Least-squares slope of RSS over the samples from ``first`` on, bytes per reset."""

    def ok(self, max_rss_pct: float) -> bool:
        return self.rss_pct <= max_rss_pct and self.fds_delta <= 0 and self.threads_delta <= 0


# ---------------------------------------------------------------------------------------------- pure parts
def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def drift(samples: Sequence[Sample], *, first: int = 10, window: int = 5) -> dict[int, Drift]:
    """Per survivor pid: the drift from the samples at reset ``first`` on to the last ones (pure).

    Only samples at one world size count (a reset down and a reset up leave the process in different states:
    more or fewer Gloo peers): the size most of the pid's samples from ``first`` on share, the latest of them
    on a tie. A run stopped early by a failure leaves a last sample or two at a size the run never held
    otherwise; they do not decide. Each end is the median of ``window`` such samples: the first ``window``
    from reset ``first`` on, and the last ``window``; :attr:`Drift.first` and :attr:`Drift.last` are the
    resets the drift covers. A pid with no sample from ``first`` on has no drift."""
    by_pid: dict[int, list[Sample]] = {}
    for s in sorted(samples, key=lambda s: (s.reset, s.ts)):
        by_pid.setdefault(s.pid, []).append(s)
    out: dict[int, Drift] = {}
    for pid, ss in by_pid.items():
        measured = [s for s in ss if s.reset >= first]
        if not measured:
            continue
        counts = Counter(s.world_size for s in measured)
        size = max(reversed(measured), key=lambda s: counts[s.world_size]).world_size
        same = [s for s in measured if s.world_size == size]
        head, tail = same[:window], same[-window:]

        def med(part: list[Sample], key: str) -> float:
            return _median([float(getattr(s, key)) for s in part])

        rss0, rss1 = med(head, "rss"), med(tail, "rss")
        uss_pct = None
        if all(s.uss is not None for s in head + tail):
            uss0, uss1 = med(head, "uss"), med(tail, "uss")
            uss_pct = round(100.0 * (uss1 - uss0) / uss0, 3) if uss0 else None
        out[pid] = Drift(
            pid=pid,
            host=ss[-1].host,
            first=head[0].reset,
            last=tail[-1].reset,
            world_size=size,
            rss_first=round(rss0),
            rss_last=round(rss1),
            rss_pct=round(100.0 * (rss1 - rss0) / rss0, 3) if rss0 else 0.0,
            uss_pct=uss_pct,
            fds_first=med(head, "fds"),
            fds_last=med(tail, "fds"),
            fds_delta=med(tail, "fds") - med(head, "fds"),
            threads_first=med(head, "threads"),
            threads_last=med(tail, "threads"),
            threads_delta=med(tail, "threads") - med(head, "threads"),
            maps_delta=med(tail, "maps") - med(head, "maps"),
            rss_bytes_per_reset=round(_slope([float(s.reset) for s in same], [float(s.rss) for s in same]), 1),
        )
    return out


def verdict(drifts: Mapping[int, Drift], *, max_rss_pct: float, survivors: int) -> bool:
    """Every survivor measured, each with RSS drift within ``max_rss_pct`` and fds and threads flat (pure)."""
    return len(drifts) >= survivors and all(d.ok(max_rss_pct) for d in drifts.values())


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def markdown_table(report: Mapping[str, Any]) -> str:
    """The results of one run as a short paragraph and a table, a row per survivor (pure)."""
    resets, asked = report["resets"], report["resets_asked"]
    reached = f"{resets} resets" if resets >= asked else f"{resets} of {asked} resets (stopped early, see below)"
    lines = [
        f"`python -m chaos resets --resets {asked} --seed {report['seed']} --fault {report['fault']}`"
        f" on {str(report['date'])[:10]}, {report['host']}: {reached} in {report['wall_seconds']:.0f} s; drift "
        f"per survivor from reset {report['first']} to the last reset it reached (its resets column), at the world "
        f"size most of its samples share, medians of {report['window']} samples at each end; goal RSS <= "
        f"{report['max_rss_drift_pct']:g}%, fds and threads flat: {'met' if report['ok'] else 'NOT met'}.",
        "",
        "| survivor (pid, host) | resets | RSS MiB | RSS drift | USS drift | RSS slope | fds | threads | maps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in report["survivors"]:
        uss = "—" if d["uss_pct"] is None else f"{d['uss_pct']:+.2f}%"
        lines.append(
            f"| {d['pid']} {d['host']} | {d['first']}→{d['last']} ({d['world_size']} workers) "
            f"| {_mib(d['rss_first'])}→{_mib(d['rss_last'])} "
            f"| {d['rss_pct']:+.2f}% | {uss} | {d['rss_bytes_per_reset'] / 1024:+.1f} KiB/reset "
            f"| {d['fds_first']:g}→{d['fds_last']:g} | {d['threads_first']:g}→{d['threads_last']:g} "
            f"| {d['maps_delta']:+g} |"
        )
    if report.get("error"):
        lines += ["", f"Stopped early: {report['error']}"]
    return "\n".join(lines) + "\n"


def free_result_path(out_dir: Path, stem: str) -> Path:
    """``out_dir/<stem>.json``, or ``<stem>-2.json``, ``-3``... when one of the pair (.json/.md) exists."""
    for n in range(1, 1000):
        name = stem if n == 1 else f"{stem}-{n}"
        path = out_dir / f"{name}.json"
        if not path.exists() and not path.with_suffix(".md").exists():
            return path
    raise FileExistsError(f"{out_dir}: no free name for {stem}")


def epochs_for(resets: int, *, seconds_per_reset: float = 6.0, seconds_per_step: float = 0.08) -> int:
    """Epochs for a job that outlasts ``resets`` resets with a margin of 2 (the launcher is stopped at the end)."""
    seconds = 2 * resets * seconds_per_reset + 120
    return max(4, round(seconds / (seconds_per_step * STEPS_PER_EPOCH)))


# ---------------------------------------------------------------------------------------------- probes
def measure(proc: psutil.Process, *, reset: int, host: str, world_size: int) -> Sample:
    """A :class:`Sample` of a live process (raises ``psutil.Error`` when it is gone)."""
    with proc.oneshot():
        rss = proc.memory_info().rss
        uss = None
        with contextlib.suppress(psutil.AccessDenied, OSError):
            uss = proc.memory_full_info().uss
        fds = proc.num_fds()
        threads = proc.num_threads()
    try:
        with open(f"/proc/{proc.pid}/maps", "rb") as f:
            maps = sum(1 for _ in f)
    except OSError:
        maps = 0
    return Sample(
        reset=reset,
        ts=time.time(),
        pid=proc.pid,
        host=host,
        world_size=world_size,
        rss=rss,
        uss=uss,
        fds=fds,
        threads=threads,
        maps=maps,
    )


def fd_kind(target: str) -> str:
    """What an fd points at, with numbers left out so that like fds count together (pure)."""
    for prefix in ("socket:", "pipe:", "anon_inode:"):
        if target.startswith(prefix):
            return prefix.rstrip(":") if prefix != "anon_inode:" else target
    if target.startswith("/dev/shm/"):
        return "/dev/shm/*"
    head, sep, name = target.rpartition("/")
    return head + sep + "".join("#" if c.isdigit() else c for c in name)


def detail(pid: int) -> dict[str, Any]:
    """What a survivor holds: fd targets and thread names, counted (for telling what grew)."""
    fds: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                fds[fd_kind(os.readlink(f"/proc/{pid}/fd/{fd}"))] += 1
    threads: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                threads[Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()] += 1
    return {"fds": dict(fds.most_common()), "threads": dict(threads.most_common()), "rss_kib": rss_by_mapping(pid)}


def rss_by_mapping(pid: int, top: int = 20) -> dict[str, int]:
    """Resident KiB per kind of mapping (``[heap]``, ``[anon]``, a file's name...) from ``/proc/<pid>/smaps``."""
    kib: Counter[str] = Counter()
    kind = "[anon]"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if (
                    head and "-" in head[0] and len(head) >= 5
                ):  # a mapping's header: range perms offset dev inode [path]
                    path = head[5].strip() if len(head) > 5 else ""
                    kind = path.rsplit("/", 1)[-1] if path.startswith("/") else path or "[anon]"
                elif head and head[0] == "Rss:":
                    kib[kind] += int(head[1])
    except OSError:
        return {}
    return dict(kib.most_common(top))


# ---------------------------------------------------------------------------------------------- the run
@dataclass(slots=True)
class Survivor:
    host: str
    proc: psutil.Process
    create_time: float


class ResetDriver:
    """Drives one :class:`LaunchedJob` through resets and records the survivors after each."""

    def __init__(self, run: LaunchedJob, *, fault: str, rng: random.Random, out: Any = print) -> None:
        self.run = run
        self.fault = fault
        self.rng = rng
        self.out = out
        self.tail = EventTail(run.run_dir / layout.EVENTS)
        self.resets: list[Reset] = []
        self.world_size: int | None = None
        self.step = 0
        self.survivors: dict[int, Survivor] = {}
        self.victim = ""
        self.samples_path = run.run_dir / SAMPLES_FILE
        self.samples: list[Sample] = []
        self.details: dict[str, dict[str, Any]] = {}
        self.cycles = 0
        self.lingered = 0
        """``--fault drain``: drained workers still alive :data:`LINGER_SECONDS` after their host left the ring."""

    # -- watching
    def poll(self) -> list[Reset]:
        new: list[Reset] = []
        for e in self.tail.poll():
            self.step = max(self.step, e.step)
            self.world_size = e.world_size
            if isinstance(e, Reset):
                self.resets.append(e)
                new.append(e)
        return new

    def wait(self, predicate: Callable[[], T], timeout: float, what: str) -> T:
        """Poll the log until ``predicate()``; survivors are sampled after each reset seen meanwhile."""

        got: list[T] = []

        def check() -> bool:
            if self.poll():
                self.sample()
            value = predicate()
            if value:
                got.append(value)
            return bool(value)

        self.run.wait_for(check, timeout, what, interval=0.1)
        return got[0]

    # -- survivors
    def choose(self) -> None:
        """The victim host (not rank 0's, chosen by the seed) and the other hosts' workers: the survivors."""
        job = self.run.job()
        workers = job.workers()
        r0 = job.rank0()
        hosts = sorted({w.host for w in workers if r0 is None or w.pid != r0.pid})
        if len(workers) < FOUR_WORKERS or not hosts:
            raise ScenarioError(f"expected {FOUR_WORKERS} workers, found {len(workers)}")
        self.victim = self.rng.choice(hosts)
        for w in workers:
            if w.host != self.victim:
                self.survivors[w.pid] = Survivor(w.host, w.proc, w.proc.create_time())
        self.run.log.log(
            "resets",
            phase="start",
            job=self.run.job_name,
            victim=self.victim,
            survivors={pid: s.host for pid, s in self.survivors.items()},
        )

    def sample(self) -> None:
        n = len(self.resets)
        lines = []
        try:
            for pid, s in self.survivors.items():
                try:
                    if s.proc.create_time() != s.create_time:
                        raise psutil.NoSuchProcess(pid)
                    sample = measure(s.proc, reset=n, host=s.host, world_size=self.world_size or 0)
                except psutil.Error:
                    raise ScenarioError(f"survivor {pid} on {s.host} is gone after reset {n}") from None
                self.samples.append(sample)
                lines.append(json.dumps(asdict(sample)))
        finally:  # the file holds every sample the report uses, those taken before a survivor was found gone too
            with self.samples_path.open("a") as f:
                f.write("".join(line + "\n" for line in lines))

    def keep_detail(self, label: str) -> None:
        self.details[label] = {"reset": len(self.resets), **{str(pid): detail(pid) for pid in self.survivors}}

    # -- faults
    def victim_worker(self) -> Worker | None:
        return next((w for w in self.run.job().workers() if w.host == self.victim), None)

    def cycle(self) -> None:
        """One fault on the victim host, then until the log shows it back (world size 4 after a newer reset)."""
        before = len(self.resets)
        if self.fault in ("kill", "term"):
            self._kill("KILL" if self.fault == "kill" else "TERM")
        elif self.fault == "drain":
            self._drain()
        else:
            self._preempt()
        # Usually two resets (down, then up once the host's blacklist cooldown ends); one when both fall in one.
        self.wait(
            lambda: len(self.resets) > before and self.resets[-1].new_size == FOUR_WORKERS,
            CYCLE_TIMEOUT_SECONDS,
            f"the resets after the fault at reset {before} (down and back to {FOUR_WORKERS} workers)",
        )
        self.cycles += 1

    def _kill(self, sig: str) -> None:
        self.wait(self.victim_worker, CYCLE_TIMEOUT_SECONDS, f"a worker on {self.victim}")
        faults.kill_worker(self.run.job(), self.run.log, rng=_OnHost(self.victim), sig=sig)

    def _drain(self) -> None:
        """An operator's drain of the victim host in etcd (``hosts drain``); once the log shows it gone, the undrain.
        Its agent and warm zygote live on: the worker leaves gracefully and a new one is forked when it returns."""
        from discovery.wire import DRAINING, READY

        worker = self.wait(self.victim_worker, CYCLE_TIMEOUT_SECONDS, f"a worker on {self.victim}")
        assert worker is not None
        before = len(self.resets)
        self._set_state(DRAINING)
        self.wait(lambda: len(self.resets) > before, CYCLE_TIMEOUT_SECONDS, f"the drain of {self.victim}")
        # The undrain only once the drained worker is gone: one still waiting in hvd.init when its host is back
        # joins beside the host's new worker, and the job hung in hvd.init (seen with a retried hvd.init). One
        # still there after LINGER_SECONDS is SIGKILLed (it is out of the ring: no connection to the survivors)
        # and counted in the results.
        with contextlib.suppress(ScenarioError):
            self.wait(lambda: not is_alive(worker.proc), LINGER_SECONDS, f"the drained worker {worker.pid} to exit")
        if is_alive(worker.proc):
            self.lingered += 1
            self.run.log.log("drained-worker-lingers", job=self.run.job_name, **worker.describe())
            procs = [*tree(worker.proc), *([worker.client] if worker.client is not None else [])]
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            self.wait(
                lambda: not is_alive(worker.proc), CYCLE_TIMEOUT_SECONDS, f"the drained worker {worker.pid} to die"
            )
        self._set_state(READY)

    def _set_state(self, state: str) -> None:
        from discovery.registry import EtcdRegistry, set_state

        etcd = str((read_launch_state(self.run.run_dir) or {}).get("etcd", ""))
        with EtcdRegistry(etcd, self.run.job_name, timeout_seconds=5.0) as registry:
            set_state(registry, self.victim, state)
        self.run.log.log("host-state", job=self.run.job_name, host=self.victim, state=state)

    def _preempt(self) -> None:
        before = len(self.resets)
        faults.preempt_host(self.run.job(), self.run.log, self.victim)
        self.wait(lambda: len(self.resets) > before, CYCLE_TIMEOUT_SECONDS, f"the drain of {self.victim}")
        self.run.restart_agent(self.victim)

    def drive(self, resets: int, first: int) -> None:
        self.wait(
            lambda: self.world_size == FOUR_WORKERS and self.step >= 20, 300, f"{FOUR_WORKERS} workers at step 20"
        )
        self.choose()
        self.out(
            f"resets: victim {self.victim}; survivors "
            + ", ".join(f"{pid} ({s.host})" for pid, s in self.survivors.items())
        )
        self.sample()  # reset 0: the state before any fault
        t0 = time.monotonic()
        while len(self.resets) < resets:
            self.cycle()
            if len(self.resets) >= first and "first" not in self.details:
                self.keep_detail("first")
            n = len(self.resets)
            if n % 20 < 2:
                self.out(f"resets: {n} in {time.monotonic() - t0:.0f} s, step {self.step}")
            # a random pause of up to 5 steps' time, so that faults land in every part of a step
            target = self.step + self.rng.randint(0, 5)
            with contextlib.suppress(ScenarioError):
                self.wait(lambda: self.step >= target, 10, "a few steps")  # noqa: B023 - called in this iteration
        self.keep_detail("last")


class _OnHost:
    """A ``choice`` that picks the worker on one host."""

    def __init__(self, host: str) -> None:
        self.host = host

    def choice(self, seq: Sequence[Worker]) -> Worker:
        hits = [w for w in seq if w.host == self.host]
        if not hits:
            raise ScenarioError(f"no worker on {self.host}")
        return hits[0]


def job_config(epochs: int) -> dict[str, Any]:
    cfg = base_config(epochs=epochs)
    cfg["elastic"] = {**cfg["elastic"], "max_np": FOUR_WORKERS, "min_np": 2}
    return cfg


def stop(run: LaunchedJob, timeout: float = 120.0) -> int | None:
    """SIGINT to the launcher (it stops the workers, rank 0 checkpoints), then its exit code."""
    if run.launcher is None or run.launcher.poll() is not None:
        return run.launcher.returncode if run.launcher is not None else None
    run.launcher.send_signal(signal.SIGINT)
    try:
        return run.wait_exit(timeout)
    except ScenarioError:
        return None


# ---------------------------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resets", type=int, default=200, help="resets to drive the job through (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="chooses the victim host and the pause between faults")
    parser.add_argument("--run-dir", default=None, help="a fresh run dir (default runs/chaos/resets-<time>)")
    parser.add_argument(
        "--out", default=None, help="results JSON (default bench/results/<date>-<host>-resets.json, never replaced)"
    )
    parser.add_argument(
        "--fault",
        choices=["kill", "term", "drain", "preempt"],
        default="term",
        help="how the victim host leaves: SIGKILL (kill) or SIGTERM (term: it stops at a step's end, exit 143) of its "
        "worker, which returns through hot join; drain: an operator's "
        "drain in etcd, then the undrain; preempt: SIGTERM to its agent, then the agent started again",
    )
    parser.add_argument("--first", type=int, default=10, help="the reset the drift is measured from (default 10)")
    parser.add_argument("--window", type=int, default=5, help="samples whose median is taken at each end")
    parser.add_argument("--max-rss-drift-pct", type=float, default=2.0)
    parser.add_argument(
        "--gloo-timeout-seconds",
        type=int,
        default=None,
        help="the launcher's (default: the chaos runs' 15); with --fault drain each return waits this long once",
    )
    parser.add_argument("--epochs", type=int, default=None, help="the job's epochs (default: outlasts the resets)")


def _out_path(args: argparse.Namespace, started: float) -> Path:
    if args.out:
        path = Path(args.out)
        if path.exists() or path.with_suffix(".md").exists():
            raise FileExistsError(f"--out {path}: exists (or its .md does); name a new file")
        return path
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"
    return free_result_path(RESULTS_DIR, f"{time.strftime('%Y-%m-%d', time.gmtime(started))}-{host}-resets")


def run(args: argparse.Namespace) -> int:
    if args.resets < args.first + args.window or args.first < 1 or args.window < 1:
        print(f"resets: error: --resets {args.resets} must be >= --first + --window", file=sys.stderr)
        return 2
    started = time.time()
    try:
        out_path = _out_path(args, started)
    except FileExistsError as e:
        print(f"resets: error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or DEFAULT_RUNS / f"resets-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        print(f"resets: error: --run-dir {run_dir} is not empty (a fresh run dir is needed)", file=sys.stderr)
        return 2
    epochs = args.epochs or epochs_for(args.resets)
    job = f"chaos-resets-{os.urandom(3).hex()}"
    # horovodrun fails the job after --reset-limit resets (the launcher's default: 100)
    flags: tuple[str, ...] = (*LAUNCH_FLAGS, "--reset-limit", str(3 * args.resets + 100))
    if args.gloo_timeout_seconds is not None:
        flags = (*flags, "--gloo-timeout-seconds", str(args.gloo_timeout_seconds))  # the last one counts
    r = LaunchedJob(run_dir, {"job": job, **job_config(epochs)}, flags=flags)
    driver = ResetDriver(r, fault=args.fault, rng=random.Random(args.seed))
    print(f"resets: job {job} ({epochs} epochs) in {run_dir}")
    error = None
    exit_code: int | None = None
    t0 = time.monotonic()
    try:
        r.start()
        driver.drive(args.resets, args.first)
    except (ScenarioError, KeyboardInterrupt) as e:
        error = str(e) or "interrupted"
        r.log.log("scenario-error", job=job, error=error)
        print(f"resets: {e}", file=sys.stderr)
    finally:
        wall = time.monotonic() - t0
        exit_code = stop(r)
        leftovers = r.close()
    drifts = drift(driver.samples, first=args.first, window=args.window)
    ok = (
        error is None
        and not leftovers
        and verdict(drifts, max_rss_pct=args.max_rss_drift_pct, survivors=len(driver.survivors))
    )
    report = {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "host": socket.gethostname(),
        "argv": ["python", "-m", "chaos", "resets", *sys.argv[1:]],
        "seed": args.seed,
        "fault": args.fault,
        "resets_asked": args.resets,
        "resets": len(driver.resets),
        "first": args.first,
        "window": args.window,
        "max_rss_drift_pct": args.max_rss_drift_pct,
        "wall_seconds": round(wall, 1),
        "faults": driver.cycles,
        "drained_workers_lingering": driver.lingered,
        "steps": driver.step,
        "epochs": epochs,
        "run_dir": str(run_dir),
        "victim": driver.victim,
        "launcher_exit": exit_code,
        "leftovers": leftovers,
        "error": error,
        "ok": ok,
        "recovery_seconds_median": _median([e.recovery_seconds for e in driver.resets if e.recovery_seconds])
        if any(e.recovery_seconds for e in driver.resets)
        else None,
        "survivors": [asdict(d) for d in drifts.values()],
    }
    table = markdown_table(report)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out_path, json.dumps(report, indent=1) + "\n")
    write_atomic(out_path.with_suffix(".md"), table)
    write_atomic(run_dir / DETAIL_FILE, json.dumps(driver.details, indent=1) + "\n")
    sys.stdout.write(table)
    print(f"wrote {out_path} and {out_path.with_suffix('.md')}; samples in {driver.samples_path}", file=sys.stderr)
    return 0 if ok else 1


def on_sigterm(signum: int, frame: Any) -> None:
    """Unwind like Ctrl-C: the run's ``finally`` stops the job, and the samples so far are still reported."""
    raise ScenarioError("stopped by SIGTERM")


def main(argv: Sequence[str] | None = None) -> int:
    from elastictrain.cliutil import OneLineParser

    parser = OneLineParser(prog="python -m chaos resets", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
