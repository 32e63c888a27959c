"""``stragglers``: a worker made 50% slower is named and drained; a hung worker is found and cut out.

Contenders, one job each, run alternately in one run on 4 logical hosts (quick: the same jobs, shorter windows):

- ``evict``: ``elastictrain launch`` (embedded etcd and agents) with ``elastic.stragglers: evict`` on 4 hosts
  (min 2). After a warm-up at 4 workers one non-rank-0 worker is slowed by half with chaos's SIGSTOP/SIGCONT
  duty cycle (:func:`chaos.faults.duty_cycle`, helpers included) until it is drained. On shared cores the others
  take up the time a stopped worker leaves, so the policy may keep it (the job is not predicted faster without
  it); after a ``keep`` on a window wholly at one slowdown, the slowdown goes up (300%, then 900%) so that the
  drain and the throughput after it are still measured, and the levels tried are reported. Measured: steps from the
  slowdown to the ``straggler`` event naming its host, seconds to the ``eviction`` (``drain``) and to the first
  step at 3 workers, and samples/s before / during / after (from ``metrics`` events, by time windows).
- ``fault_free_3`` and ``fault_free_4``: the same launch and config on 3 and 4 hosts, nothing injected: the
  reference rates, and the false positives (hosts named, max ``slowest_ratio`` seen).
- ``hang``: an :class:`~chaos.jobs.ElasticJob` on 4 hosts with the default ``hang_seconds``;
  a non-rank-0 worker that has trained a few steps in its ring is SIGSTOPped (never continued). Timed from the
  SIGSTOP to the ``reset`` (reason ``worker_hung``) that rank 0 writes at the next completed step. Full: two
  hangs in one job (4 -> 3 -> 2); quick: one.

Goals: named <= 100 steps after the slowdown (``window_steps`` 100, the default); 0 hosts named without a fault;
samples/s after the eviction >= 0.95 x the fault-free 3-worker job's; the slowdown costs <= 30 s of 4-worker
throughput (samples not processed from the slowdown to the end of the measurement, over the fault-free 4-worker
rate); SIGSTOP -> next completed step <= 15 s (median). The straggler profile's own cost (per-step timings on
the commit's collective) is inside ``elastic_overhead``'s ratio, whose job runs the default policy (``report``).

Size: four contenders of one measurement (three ``launch`` jobs and a hang job), the slowdown's escalation, and the
pure figures they are read by (throughput in a time window, steps until named, seconds lost), which
``tests/unit/test_bench.py`` checks on synthetic events; split, the contenders would share all of it through imports.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.core import (
    BenchContext,
    BenchError,
    Goal,
    Metric,
    Result,
    alternate,
    summary,
    threads_per_worker,
)
from chaos.jobs import ElasticJob, LaunchedJob
from elastictrain.errors import ScenarioError
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.rundir.events import Event, Eviction, Metrics, Reset, Straggler, of_kind

NAME = "stragglers"
GOAL_NAMED_STEPS = Goal("<=", 100.0)
GOAL_FALSE_POSITIVES = Goal("<=", 0.0)
GOAL_AFTER_RATIO = Goal(">=", 0.95)
GOAL_LOST_SECONDS = Goal("<=", 30.0)
GOAL_HANG_SECONDS = Goal("<=", 15.0)
WORKERS = 4
SLOWDOWN = 0.5
"""50% slower: stopped a third of the wall time (on shared cores the others take up part of that time)."""
BATCH = 16
LOG_EVERY_STEPS = 2
GLOO_TIMEOUT_SECONDS = 60  # elastictrain launch's default
ESCALATION = (SLOWDOWN, 3.0, 9.0)
"""Slowdowns tried in turn while the policy keeps the slowed host (on 2 cores the others take up its time)."""
SETTLE_SECONDS = 2.0
WINDOW_STEPS = 100
"""``elastic.window_steps``, left at its default."""
"""Left out at the start of the after-eviction window (the first steps at the new size)."""


def job_config(run_dir: Path, job: str) -> dict[str, Any]:
    """The small test CNN (16x16 synthetic images, batch 16 per worker), an epoch far longer than the run,
    ``stragglers: evict`` with the default ratio, window and cooldown, default ``hang_seconds``."""
    return {
        "job": job,
        "run_dir": str(run_dir),
        "device": "cpu",
        "data": {
            "kind": "synthetic",
            "image_size": 16,
            "batch_size": BATCH,
            "num_samples": 1_281_167,
            "augment": False,
        },
        "training": {"epochs": 1, "log_every_steps": LOG_EVERY_STEPS, "seed": 7},
        "elastic": {"commit_every_steps": 5, "min_np": 2, "max_np": WORKERS, "stragglers": "evict"},
        "checkpoint": {"enabled": False},
        "tracking": {"mlflow": False, "progress_bar": False},
        "discovery": {"ttl_seconds": 3, "heartbeat_seconds": 0.5},
    }


# ---------------------------------------------------------------------------------------------- pure figures
def metrics_samples(e: Metrics, batch: int = BATCH) -> int:
    """Samples in the interval a ``metrics`` event closes: its steps x the per-worker batch x the world size."""
    return int(e.steps or 0) * batch * int(e.world_size or 0)


def window_throughput(events: Sequence[Event], t0: float, t1: float, batch: int = BATCH) -> dict[str, Any] | None:
    """Samples/s between the first ``metrics`` event at or after ``t0`` and the last one at or before ``t1``:
    the samples of the intervals closed after the first, over the time between the two (None: fewer than two)."""
    ms = [e for e in of_kind(events, Metrics) if t0 <= e.ts <= t1]
    if len(ms) < 2:
        return None
    samples = sum(metrics_samples(e, batch) for e in ms[1:])
    seconds = ms[-1].ts - ms[0].ts
    if seconds <= 0:
        return None
    return {
        "samples_per_sec": samples / seconds,
        "samples": samples,
        "seconds": seconds,
        "steps": ms[-1].step - ms[0].step,
        "window_ts": [ms[0].ts, ms[-1].ts],
        "world_sizes": sorted({e.world_size for e in ms}),
    }


def seconds_lost(samples: float, seconds: float, reference_rate: float) -> float:
    """Seconds of ``reference_rate`` throughput not delivered: ``seconds - samples / reference_rate``."""
    return seconds - samples / reference_rate


def step_at(events: Sequence[Event], ts: float) -> int:
    """The last step the run log shows at or before ``ts`` (0 before any)."""
    return max((e.step for e in events if e.ts <= ts), default=0)


def named_hosts(events: Sequence[Event]) -> set[str]:
    """Hosts named slow by the last ``straggler`` event about each (named and not cleared since)."""
    last: dict[str, bool] = {}
    for e in of_kind(events, Straggler):
        if e.host is not None:
            last[e.host] = bool(e.slow)
    return {h for h, slow in last.items() if slow}


def steps_until_named(events: Sequence[Event], t_slow: float, host: str) -> dict[str, Any] | None:
    """The first ``straggler`` event naming ``host`` slow after ``t_slow``: its step, the step at ``t_slow``, the
    steps between and the seconds (None: not named). A host still named at ``t_slow`` (by the noise of a run
    without a fault) counts as named at 0 steps, with ``named_before`` true."""
    start = step_at(events, t_slow)
    if host in named_hosts([e for e in events if e.ts < t_slow]):
        return {"start_step": start, "named_step": start, "steps": 0, "seconds": 0.0, "ratio": None,
                "window_steps": None, "named_before": True}  # fmt: skip
    named = next((e for e in of_kind(events, Straggler) if e.ts >= t_slow and e.slow and e.host == host), None)
    if named is None:
        return None
    return {
        "start_step": start,
        "named_step": named.step,
        "steps": named.step - start,
        "seconds": named.ts - t_slow,
        "ratio": named.ratio,
        "window_steps": named.window_steps,
        "named_before": False,
    }


def false_positives(events: Sequence[Event]) -> dict[str, Any]:
    """Hosts named slow (and evictions) in a run without a fault, and the highest ``slowest_ratio`` seen."""
    named = sorted({e.host or "?" for e in of_kind(events, Straggler) if e.slow})
    ratios = [e.slowest_ratio for e in of_kind(events, Metrics) if e.slowest_ratio is not None]
    return {
        "hosts_named": named,
        "evictions": [e.host for e in of_kind(events, Eviction)],
        "max_slowest_ratio": max(ratios) if ratios else None,
    }


# ---------------------------------------------------------------------------------------------- jobs
def launch_run(workdir: Path, config: dict[str, Any], hosts: list[str]) -> LaunchedJob:
    """``elastictrain launch`` of ``config`` on ``hosts`` with its embedded etcd and agents, through chaos's harness
    (:class:`chaos.jobs.LaunchedJob`: its :meth:`~chaos.jobs.LaunchedJob.close` kills every process of the job by
    pid)."""
    flags = (
        "--hosts", ",".join(hosts),
        "--gloo-timeout-seconds", str(GLOO_TIMEOUT_SECONDS),
        "--drain-grace", "2",
        "--status-every", "0",
    )  # fmt: skip
    return LaunchedJob(workdir / "run", config, flags=flags)


def wait_events(run: LaunchedJob, find: Callable[[list[Event]], Any], timeout: float, what: str) -> Any:
    """What ``find`` returns from the run log once it is truthy; :class:`ScenarioError` after ``timeout`` seconds
    or when the launcher ends first."""
    return run.wait_for(lambda: find(run.events()), timeout, what, interval=0.2)


def _first_metrics(size: int, after_step: int) -> Callable[[list[Event]], Metrics | None]:
    def find(evs: list[Event]) -> Metrics | None:
        at_size = [e for e in of_kind(evs, Metrics) if e.world_size == size]
        if at_size and at_size[-1].step >= at_size[0].step + after_step:
            return at_size[-1]
        return None

    return find


def fault_free(workdir: Path, hosts: list[str], warmup_steps: int, measure: float, log: Callable[[str], None]) -> dict:
    """One launch on ``hosts`` with nothing injected: samples/s over ``measure`` seconds after the warm-up."""
    n = len(hosts)
    config = job_config(workdir / "run", f"bench-stragglers-ff{n}")
    job = launch_run(workdir, config, hosts)
    try:
        job.start()
        warm = wait_events(job, _first_metrics(n, warmup_steps), 300, f"{warmup_steps} steps at {n} workers")
        t0 = warm.ts
        time.sleep(measure)
        evs = job.events()
        tp = window_throughput(evs, t0, t0 + measure + 1)
        if tp is None:
            raise BenchError(f"fault-free {n}-worker job: no throughput window (see {job.run_dir / 'launch.log'})")
        if any(r.ts >= t0 for r in of_kind(evs, Reset)):
            log(f"fault-free {n}: a reset inside the window: {[r.reason for r in of_kind(evs, Reset)]}")
        out = {"throughput": tp, "false_positives": false_positives(evs), "resets": _resets(evs)}
        log(f"fault-free {n} workers: {tp['samples_per_sec']:.1f} samples/s over {tp['seconds']:.0f} s")
        return out
    finally:
        job.close()


def _resets(evs: Sequence[Event]) -> list[dict[str, Any]]:
    return [
        {"ts": r.ts, "step": r.step, "reason": r.reason, "sizes": [r.old_size, r.new_size], "lost": r.lost_steps}
        for r in of_kind(evs, Reset)
    ]


def _drain_or_kept(t0: float, host: str, from_step: int) -> Callable[[list[Event]], Eviction | bool | None]:
    """A drain decided after ``t0`` (returned), or True once the policy has kept ``host`` on a window that lies
    wholly after ``t0`` (a decision at step ``from_step`` or later)."""

    def find(evs: list[Event]) -> Eviction | bool | None:
        decisions = [e for e in of_kind(evs, Eviction) if e.ts >= t0]
        drain = next((e for e in decisions if e.action == "drain"), None)
        if drain is not None:
            return drain
        return any(e.host == host and e.action == "keep" and e.step >= from_step for e in decisions) or None

    return find


def evict_trial(
    workdir: Path,
    hosts: list[str],
    warmup_steps: int,
    before: float,
    after: float,
    level_timeout: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One launch on 4 hosts; after the warm-up and ``before`` seconds one non-rank-0 worker is slowed by half.
    While the policy keeps it (on a window of ``window_steps`` wholly at this slowdown, or ``level_timeout``
    passes without a drain) the slowdown goes up a level
    (:data:`ESCALATION`), so that the drain and the throughput after it are measured in the same job."""
    from chaos.faults import duty_cycle, target_worker
    from chaos.procs import JobRef

    config = job_config(workdir / "run", "bench-stragglers-evict")
    job = launch_run(workdir, config, hosts)
    stop = threading.Event()
    levels: list[dict[str, Any]] = []
    try:
        job.start()
        warm = wait_events(
            job, _first_metrics(WORKERS, warmup_steps), 300, f"{warmup_steps} steps at {WORKERS} workers"
        )
        t_warm = warm.ts
        time.sleep(before)
        ref = JobRef.resolve(config["job"], job.run_dir)
        r0 = ref.rank0()
        named_now = named_hosts(job.events())
        candidates = sorted(w.host for w in ref.workers() if w != r0 and w.host not in named_now)
        worker = target_worker(ref, host=candidates[-1]) if candidates else target_worker(ref, rng=None)
        host = worker.host
        t_slow = time.time()
        out: dict[str, Any] = {"host": host, "pid": worker.pid, "t_warm": t_warm, "t_slow": t_slow}
        drain: Eviction | None = None
        for slowdown in ESCALATION:
            stop = threading.Event()
            level: dict[str, Any] = {"slowdown": slowdown, "t": time.time()}
            levels.append(level)

            def slow(level: dict[str, Any] = level, stop: threading.Event = stop, slowdown: float = slowdown) -> None:
                level["duty_cycle"] = duty_cycle([worker.proc], slowdown, stop, helpers=True).record()

            thread = threading.Thread(target=slow, daemon=True)
            thread.start()
            log(f"slowing {host} (pid {worker.pid}) by {slowdown:.0%} at step {step_at(job.events(), level['t'])}")
            try:
                from_step = step_at(job.events(), level["t"]) + WINDOW_STEPS
                found = wait_events(job, _drain_or_kept(level["t"], host, from_step), level_timeout, "a drain")
            except ScenarioError as e:
                found = None
                level["no_drain"] = str(e).splitlines()[0]
            if isinstance(found, Eviction):
                drain = found
                level["drained_after_seconds"] = drain.ts - level["t"]
                break
            log(f"not drained at {slowdown:.0%}: {level.get('no_drain') or 'kept on a window wholly at this level'}")
            stop.set()
            thread.join(10)
        reset = None
        if drain is not None:
            out["eviction"] = drain.to_record()
            reset = wait_events(
                job,
                lambda evs: next(
                    (r for r in of_kind(evs, Reset) if r.ts >= drain.ts and r.new_size == WORKERS - 1), None
                ),
                120,
                f"the first step at {WORKERS - 1} workers",
            )
        stop.set()
        t_after = (reset.ts if reset is not None else time.time()) + SETTLE_SECONDS
        time.sleep(max(0.0, t_after + after - time.time()))
        t_end = time.time()
        evs = job.events()
        named = steps_until_named(evs, t_slow, host)
        t_drained = reset.ts if reset is not None else t_end
        out.update(
            {
                "t_end": t_end,
                "named": named,
                "drain_seconds": drain.ts - t_slow if drain is not None else None,
                "first_step_at_3_seconds": reset.ts - t_slow if reset is not None else None,
                "reset": _resets([reset])[0] if reset is not None else None,
                "before": window_throughput(evs, t_warm, t_slow),
                "during": window_throughput(evs, t_slow, t_drained),
                "after": window_throughput(evs, t_after, t_end) if reset is not None else None,
                "from_slowdown": window_throughput(evs, t_slow, t_end),
                "false_positives_before": false_positives([e for e in evs if e.ts < t_slow]),
                "kept": [
                    {
                        "step": e.step,
                        "ratio": e.ratio,
                        "now": e.samples_per_sec_now,
                        "without": e.samples_per_sec_without,
                    }
                    for e in of_kind(evs, Eviction)
                    if e.ts >= t_slow and e.host == host and e.action == "keep"
                ],
                "others_named": sorted(
                    {e.host or "?" for e in of_kind(evs, Straggler) if e.ts >= t_slow and e.slow and e.host != host}
                ),
                "stragglers": [e.to_record() for e in of_kind(evs, Straggler)],
                "evictions": [e.to_record() for e in of_kind(evs, Eviction)],
                "resets": _resets(evs),
                "levels": levels,
            }
        )
        log(f"named after {named['steps'] if named else '—'} steps; drained after {_f(out['drain_seconds'])} s")
        return out
    finally:
        stop.set()
        job.close()


def _at_size(size: int) -> Callable[[Metrics], bool]:
    return lambda e: e.world_size == size


def _hung_after(ts: float) -> Callable[[Reset], bool]:
    return lambda r: r.ts >= ts and r.reason == "worker_hung"


def hang_trial(workdir: Path, hosts: list[str], hangs: int, log: Callable[[str], None]) -> dict[str, Any]:
    """One ElasticJob on 4 hosts (min 2); ``hangs`` times a non-rank-0 worker is SIGSTOPped after a few steps at
    the current size. Returns seconds from each SIGSTOP to the next completed step (the ``worker_hung`` reset)."""
    config = job_config(workdir / "run", "bench-stragglers-hang")
    job = ElasticJob(
        workdir,
        config,
        hosts,
        min_np=2,
        max_np=WORKERS,
        gloo_timeout=GLOO_TIMEOUT_SECONDS,
        cooldown=(5, 60),
        threads=threads_per_worker(WORKERS),
    )
    out: list[dict[str, Any]] = []
    stopped: list[int] = []
    try:
        job.start()
        size = WORKERS
        for _ in range(hangs):
            at = job.wait_event(Metrics, _at_size(size), timeout=300, what=f"{size} workers")
            job.wait_step(at.step + 6, timeout=120)  # a few steps in this ring
            victims = [p for p in job.workers() if p.pid not in stopped and p.environ().get("HOROVOD_RANK") != "0"]
            if not victims:
                raise BenchError("no non-rank-0 worker to stop")
            victim = max(victims, key=lambda p: int(p.environ().get("HOROVOD_RANK", "0")))
            host = victim.environ().get("HOROVOD_HOSTNAME")
            t_stop = time.time()
            step = job.step()
            victim.send_signal(signal.SIGSTOP)
            stopped.append(victim.pid)
            reset = job.wait_event(
                Reset,
                _hung_after(t_stop),
                timeout=180,
                what="a worker_hung reset",
            )
            rec = {
                "seconds": reset.ts - t_stop,
                "recovery_seconds": reset.recovery_seconds,
                "step_at_stop": step,
                "reset": _resets([reset])[0],
                "host": host,
            }
            log(
                f"SIGSTOP -> next completed step: {rec['seconds']:.2f} s (worker's recovery {reset.recovery_seconds} s)"
            )
            out.append(rec)
            # the hung machine leaves discovery (as a dead machine's agent key expires): no re-add after the
            # blacklist cooldown inside the next hang's measurement
            job.set_hosts([h for h in job.hosts if h != host])
            size = reset.new_size or size - 1
        return {"hangs": out, "resets": _resets(job.events())}
    finally:
        for pid in stopped:  # a stopped process ignores SIGTERM: SIGKILL it by pid
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        job.close()


# ---------------------------------------------------------------------------------------------- run
def run(ctx: BenchContext) -> Result:
    hosts = local_logical_hosts()
    if len(hosts) < WORKERS:
        raise BenchError(f"stragglers needs {WORKERS} logical hosts, this machine has {hosts}")
    hosts = hosts[:WORKERS]
    warmup = 20 if ctx.quick else 40
    measure = 25.0 if ctx.quick else 60.0
    after = 25.0 if ctx.quick else 60.0
    hangs = 1 if ctx.quick else 2
    level_timeout = 90.0 if ctx.quick else 150.0  # window_steps (100) at a few steps/s, with room
    before = 15.0 if ctx.quick else 30.0
    log = ctx.progress

    runs = alternate(
        [
            ("fault_free_4", lambda r: fault_free(ctx.scratch(f"ff4-{r}"), hosts, warmup, measure, log)),
            (
                "evict",
                lambda r: evict_trial(ctx.scratch(f"evict-{r}"), hosts, warmup, before, after, level_timeout, log),
            ),
            ("fault_free_3", lambda r: fault_free(ctx.scratch(f"ff3-{r}"), hosts[:3], warmup, measure, log)),
            ("hang", lambda r: hang_trial(ctx.scratch(f"hang-{r}"), hosts, hangs, log)),
        ],
        1,
        log,
    )
    ff4, ev, ff3, hang = runs["fault_free_4"][0], runs["evict"][0], runs["fault_free_3"][0], runs["hang"][0]
    rate4 = ff4["throughput"]["samples_per_sec"]
    rate3 = ff3["throughput"]["samples_per_sec"]

    def rate(phase: str) -> float | None:
        w = ev.get(phase)
        return w["samples_per_sec"] if w else None

    after_rate = rate("after")
    lost = None
    if ev.get("from_slowdown"):
        w = ev["from_slowdown"]
        lost = seconds_lost(w["samples"], w["seconds"], rate4)
    named_fp = sorted(
        {h for f in (ff4, ff3) for h in f["false_positives"]["hosts_named"]}
        | set(ev["false_positives_before"]["hosts_named"])
    )
    ratios = [
        r
        for r in (
            ff4["false_positives"]["max_slowest_ratio"],
            ff3["false_positives"]["max_slowest_ratio"],
            ev["false_positives_before"]["max_slowest_ratio"],
        )
        if r is not None
    ]
    hang_secs = [h["seconds"] for h in hang["hangs"]]
    named = ev.get("named")
    phases = {p: rate(p) for p in ("before", "during", "after")}
    return Result(
        NAME,
        metrics=[
            Metric(
                "slowdown → straggler named",
                float(named["steps"]) if named else None,
                "steps",
                GOAL_NAMED_STEPS,
                note=_named_note(named) + f"drained after {_f(ev.get('drain_seconds'))} s, first step at 3 after "
                f"{_f(ev.get('first_step_at_3_seconds'))} s"
                + _kept_note(ev)
                + _levels_note(ev)
                + (f"; also named during the slowdown: {', '.join(ev['others_named'])}" if ev["others_named"] else ""),
            ),
            Metric(
                "hosts named without a fault",
                float(len(named_fp)),
                "hosts",
                GOAL_FALSE_POSITIVES,
                note=f"max slowest_ratio {max(ratios) if ratios else '—'} (fault-free 3 and 4, evict before the "
                "slowdown)",
            ),
            Metric(
                "samples/s after eviction / fault-free 3 workers",
                after_rate / rate3 if after_rate is not None else None,
                "",
                GOAL_AFTER_RATIO,
                note=f"before {_f(phases['before'])} · during {_f(phases['during'])} · after {_f(after_rate)} "
                f"samples/s; fault-free 3: {rate3:.1f}, 4: {rate4:.1f}",
            ),
            Metric(
                "4-worker throughput lost to the slowdown",
                lost,
                "s",
                GOAL_LOST_SECONDS,
                note=f"from the slowdown (escalations included) to {after:.0f} s after the first step at 3 workers, "
                f"at {rate4:.1f} samples/s",
            ),
            Metric(
                "SIGSTOP → next completed step, median",
                statistics.median(hang_secs) if hang_secs else None,
                "s",
                GOAL_HANG_SECONDS,
                note=f"n {len(hang_secs)}, default hang_seconds; the worker's recovery_seconds "
                f"{[h['recovery_seconds'] for h in hang['hangs']]}",
            ),
            Metric(
                "straggler profile's cost",
                None,
                "",
                note="inside elastic_overhead's ratio (its job runs the default policy, report)",
            ),
        ],
        contenders={
            "fault_free_4": summary([rate4], "samples/s"),
            "fault_free_3": summary([rate3], "samples/s"),
            "evict_after": summary([after_rate] if after_rate is not None else [], "samples/s"),
            "hang": summary(hang_secs, "s"),
        },
        detail={
            "config": job_config(Path("<run_dir>"), "bench-stragglers-<contender>"),
            "slowdown": SLOWDOWN,
            "hosts": hosts,
            "warmup_steps": warmup,
            "measure_seconds": measure,
            "after_seconds": after,
            "phases_samples_per_sec": phases,
            "runs": runs,
        },
    )


def _named_note(named: dict[str, Any] | None) -> str:
    if named is None:
        return "not named; "
    noise = (
        " (under half its window slowed: noise, see the false positives)" if named["steps"] < WINDOW_STEPS / 2 else ""
    )
    return f"{named['seconds']:.1f} s, ratio {named['ratio']}{noise}; "


def _levels_note(ev: dict[str, Any]) -> str:
    """The slowdowns tried, and which one was drained (and how fast, from its start)."""
    levels = ev.get("levels") or []
    parts = [
        f"{lv['slowdown']:.0%}: "
        + (f"drained after {lv['drained_after_seconds']:.1f} s" if "drained_after_seconds" in lv else "not drained")
        for lv in levels
    ]
    return f"; slowdowns tried: {', '.join(parts)}" if parts else ""


def _kept_note(ev: dict[str, Any]) -> str:
    """Why there is no drain: the policy's last ``keep`` for the slowed host (predicted samples/s with and without)."""
    if not ev["kept"]:
        return ""
    k = ev["kept"][-1]
    return (
        f"; kept {len(ev['kept'])}x (last at ratio {k['ratio']}: predicted {_f(k['now'])} samples/s now vs "
        f"{_f(k['without'])} without)"
    )


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"
