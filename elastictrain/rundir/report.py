"""``elastictrain report --run-dir D``: a timeline PNG and a goodput summary of a run, from events.jsonl; the
run_dir's read-side summaries (``status`` uses :func:`straggler_summary` too; rank 0 writes the report at the end).

:func:`summarize` is a pure function of the event list (goodput as defined in docs/events.md);
:func:`build_figure` draws world size, throughput and loss over time with failures, resets,
checkpoints and (re)starts marked as vertical lines; :func:`main` writes ``report.png`` and
``report.json`` into the run dir and prints a summary table. The run's state is the last lifecycle event,
checked against ``launch.json`` by :func:`elastictrain.rundir.launch.checked_state` (the same rule as ``status``:
``stopped (no live process)`` when every process of a ``running`` job is gone).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastictrain.cliutil import OneLineParser
from elastictrain.fileio import atomic_file, write_atomic
from elastictrain.rundir import layout
from elastictrain.rundir.events import (
    Checkpoint,
    CheckpointFailed,
    Done,
    Event,
    EventKind,
    Eviction,
    Failure,
    Metrics,
    Reset,
    Shares,
    Start,
    Straggler,
    lifecycle,
    of_kind,
    read_events,
)
from elastictrain.rundir.launch import checked_state

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Vertical marks on the timeline: event -> (colour, line style, legend label).
MARK_STYLES: dict[str, tuple[str, str, str]] = {
    EventKind.START: ("tab:blue", "-", "start / relaunch"),
    EventKind.FAILURE: ("tab:red", "--", "failure"),
    EventKind.RESET: ("tab:orange", "-.", "reset"),
    EventKind.CHECKPOINT: ("tab:green", ":", "checkpoint"),
}


def straggler_summary(events: Sequence[Event]) -> dict[str, object]:
    """What the run log says about slow hosts, for ``status`` and ``report``: the slowest host by the last
    ``metrics`` that judged one, the hosts named slow and not cleared since, and every ``straggler`` and
    ``eviction`` decision with its numbers."""
    slowest: dict[str, object] | None = None
    named: list[str] = []
    decisions: list[dict[str, object]] = []
    for e in events:
        if isinstance(e, Metrics) and e.slowest_host and e.slowest_ratio is not None:
            slowest = {"host": e.slowest_host, "ratio": e.slowest_ratio, "step": e.step}
        elif isinstance(e, Straggler) and e.host:
            named = [h for h in named if h != e.host] + ([e.host] if e.slow else [])
            decisions.append({"event": e.name, "step": e.step, **e.fields()})
        elif isinstance(e, Eviction):
            decisions.append({"event": e.name, "step": e.step, **e.fields()})
    return {"slowest": slowest, "named": named, "decisions": decisions}


def shares_summary(events: Sequence[Event]) -> dict[str, object] | None:
    """Each host's share of a step by the last ``shares`` event (``elastic.stragglers: balance``), or None when the
    run has none (equal shares): ``{"step", "global_batch", "shares": {host: samples per step}, "speeds"}``."""
    last = next((e for e in reversed(events) if isinstance(e, Shares) and e.shares), None)
    if last is None:
        return None
    return {"step": last.step, "global_batch": last.global_batch, "shares": last.shares, "speeds": last.speeds}


def format_shares(summary: object) -> str:
    """``h1 20, h2 20, h3 8 of 48 (step 120)`` or ``equal``: one line for ``status`` and ``report``."""
    if not isinstance(summary, dict) or not isinstance(summary.get("shares"), dict):
        return "equal"
    parts = ", ".join(f"{h} {n}" for h, n in sorted(summary["shares"].items()))
    return f"{parts} of {summary.get('global_batch')} (step {summary.get('step')})"


def format_slowest(summary: dict[str, object]) -> str:
    """``h3 1.52x (named slow; drain at step 140)`` or ``-``: one line for ``status`` and ``report``."""
    slowest = summary.get("slowest")
    if not isinstance(slowest, dict):
        return "-"
    host = slowest["host"]
    text = f"{host} {float(slowest['ratio']):.2f}x"
    notes = []
    if host in summary.get("named", []):  # type: ignore[operator]
        notes.append("named slow")
    for d in summary.get("decisions", []):  # type: ignore[attr-defined]
        if d.get("event") == "eviction" and d.get("host") == host:
            notes.append(f"{d.get('action')} at step {d.get('step')}")
    return text + (f" ({'; '.join(notes[-2:])})" if notes else "")


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"count": 0, "total": 0.0, "median": None, "max": None}
    return {
        "count": len(values),
        "total": sum(values),
        "median": statistics.median(values),
        "max": max(values),
    }


def kept_step_seconds(events: Sequence[Event]) -> tuple[float, int]:
    """Productive seconds and re-run steps, from the ``metrics`` events alone.

    Each ``metrics`` event covers steps ``(step - steps, step]`` at ``step_seconds`` each. A later
    interval that starts at or below a step already covered means those steps (and every one after
    them) were rolled back: their earlier time is lost and only the last run of a step counts.
    """
    segments: list[tuple[int, int, float]] = []  # (first step exclusive, last step inclusive, seconds each)
    rerun = 0
    for ev in of_kind(events, Metrics):
        end, n, sec = ev.step, ev.steps, ev.step_seconds
        if n is None or n <= 0 or sec is None:
            continue
        lo = end - n
        kept: list[tuple[int, int, float]] = []
        for a, b, s in segments:
            if b <= lo:
                kept.append((a, b, s))
            elif a < lo:
                rerun += b - lo
                kept.append((a, lo, s))
            else:
                rerun += b - a
        kept.append((lo, end, sec))
        segments = kept
    return sum((b - a) * s for a, b, s in segments), rerun


def summarize(events: Sequence[Event]) -> dict[str, Any]:
    """The run's summary: goodput, recovery per reset, lost steps, checkpoint stall, marks (seconds
    since the first event) and the latest state. Pure: the same events give the same dict."""
    if not events:
        raise ValueError("no events")
    t0 = next((e.ts for e in of_kind(events, Start)), events[0].ts)
    dones = of_kind(events, Done)
    t_end = dones[-1].ts if dones else events[-1].ts
    wall = max(0.0, t_end - t0)
    productive, rerun = kept_step_seconds(events)

    marks: dict[str, list[float]] = {kind: [] for kind in MARK_STYLES}
    resets: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    relaunches: list[dict[str, Any]] = []
    stalls: list[float] = []
    writes: list[float] = []
    checkpoint_failures = 0
    last_failure_ts: float | None = None
    max_step = -1
    last_metrics: Metrics | None = None
    starts = 0
    last_attempt: Any = None
    for ev in events:
        ts = ev.ts
        t = ts - t0
        step = ev.step
        if ev.KIND in marks:
            marks[ev.KIND].append(t)
        if isinstance(ev, Start):
            starts += 1
            resumed = ev.resumed_from_step
            attempt = ev.attempt
            # A relaunch is a new launcher attempt; a new rank-0 process within one attempt is not.
            new_attempt = attempt != last_attempt if attempt is not None else isinstance(resumed, int)
            last_attempt = attempt
            if starts > 1 and new_attempt:
                lost = max(0, max_step - resumed) if isinstance(resumed, int) else max(0, max_step)
                relaunches.append({"t": t, "resumed_from_step": resumed, "lost_steps": lost})
        elif isinstance(ev, Failure):
            last_failure_ts = ts
            failures.append({"t": t, "step": step, "reason": ev.reason, "error": ev.error})
        elif isinstance(ev, Reset):
            recovery = ev.recovery_seconds
            if recovery is None and last_failure_ts is not None:
                recovery = ts - last_failure_ts
            resets.append(
                {
                    "t": t,
                    "step": step,
                    "reason": ev.reason,
                    "old_size": ev.old_size,
                    "new_size": ev.world_size if ev.new_size is None else ev.new_size,
                    "recovery_seconds": recovery,
                    "lost_steps": ev.lost_steps or 0,
                }
            )
            last_failure_ts = None
        elif isinstance(ev, Checkpoint):
            if ev.stall_seconds is not None:
                stalls.append(ev.stall_seconds)
            if ev.write_seconds is not None:
                writes.append(ev.write_seconds)
        elif isinstance(ev, CheckpointFailed):
            checkpoint_failures += 1
        elif isinstance(ev, Metrics):
            last_metrics = ev
        max_step = max(max_step, step)

    last = events[-1]
    throughput = [e.samples_per_sec for e in of_kind(events, Metrics) if e.samples_per_sec]
    recoveries = [r["recovery_seconds"] for r in resets if r["recovery_seconds"] is not None]
    lost_by_resets = sum(r["lost_steps"] for r in resets)
    lost_by_relaunch = sum(r["lost_steps"] for r in relaunches)
    return {
        "state": lifecycle(events).value,
        "step": last.step,
        "epoch": last.epoch,
        "world_size": last.world_size,
        "wall_seconds": wall,
        "productive_seconds": productive,
        "goodput": productive / wall if wall > 0 else None,
        "final_loss": dones[-1].final_loss if dones else last_metrics.loss if last_metrics else None,
        "starts": starts,
        "failures": failures,
        "resets": resets,
        "relaunches": relaunches,
        "recovery_seconds": _stats(recoveries),
        "lost_steps": lost_by_resets + lost_by_relaunch,
        "lost_steps_by_resets": lost_by_resets,
        "lost_steps_by_relaunches": lost_by_relaunch,
        "rerun_steps_logged": rerun,
        "checkpoints": {
            "count": len(stalls) if stalls else len(marks[EventKind.CHECKPOINT]),
            "failed": checkpoint_failures,
            "stall_seconds": _stats(stalls),
            "write_seconds": _stats(writes),
        },
        "samples_per_sec": {
            "mean": statistics.fmean(throughput) if throughput else None,
            "last": throughput[-1] if throughput else None,
        },
        "marks": {str(k): v for k, v in marks.items()},
        "stragglers": straggler_summary(events),
        "shares": shares_summary(events),
    }


def build_figure(events: Sequence[Event], summary: dict[str, Any] | None = None) -> Figure:
    """The timeline: world size, samples/s and loss against minutes since start, with marks.

    Every mark is an ``axvline`` whose gid is ``mark-<kind>`` (kind as in :data:`MARK_STYLES`), drawn
    on each of the three axes. Uses the Agg canvas directly (no pyplot, no global backend switch).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = summary if summary is not None else summarize(events)
    t0 = next((e.ts for e in of_kind(events, Start)), events[0].ts)

    def minutes(e: Event) -> float:
        return (e.ts - t0) / 60.0

    sized = list(events)
    metrics = of_kind(events, Metrics)
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_ws, ax_tp, ax_loss = fig.subplots(3, 1, sharex=True)
    ax_ws.step([minutes(e) for e in sized], [e.world_size for e in sized], where="post", color="black")
    ax_ws.set_ylabel("world size")
    ax_ws.set_ylim(bottom=0)
    tp = [(minutes(e), v) for e in metrics if (v := e.samples_per_sec) is not None]
    ax_tp.plot([x for x, _ in tp], [y for _, y in tp], marker=".", color="tab:purple")
    ax_tp.set_ylabel("samples/s")
    loss = [(minutes(e), v) for e in metrics if (v := e.loss) is not None]
    ax_loss.plot([x for x, _ in loss], [y for _, y in loss], marker=".", color="tab:brown")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("minutes since start")
    for ax in (ax_ws, ax_tp, ax_loss):
        ax.grid(True, alpha=0.3)
        for kind, times in summary["marks"].items():
            color, style, label = MARK_STYLES[kind]
            for i, t in enumerate(times):
                ax.axvline(
                    t / 60.0,
                    color=color,
                    linestyle=style,
                    linewidth=1.0,
                    alpha=0.8,
                    gid=f"mark-{kind}",
                    label=label if i == 0 else None,
                )
    if any(summary["marks"].values()):
        ax_ws.legend(loc="lower left", fontsize="small", ncols=4)
    goodput = summary["goodput"]
    fig.suptitle(
        ("goodput n/a" if goodput is None else f"goodput {goodput:.1%}")
        + f" · {len(summary['resets'])} resets · {summary['lost_steps']} lost steps"
    )
    return fig


def write_png(fig: Figure, out: str | os.PathLike[str]) -> None:
    with atomic_file(out, durable=False) as f:
        fig.savefig(f, format="png", dpi=100)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def format_table(summary: dict[str, Any]) -> str:
    """The summary as aligned ``name  value`` lines, then one line per reset."""
    goodput = summary["goodput"]
    rec, stall = summary["recovery_seconds"], summary["checkpoints"]["stall_seconds"]
    rows = [
        ("state", summary["state"]),
        *([("liveness", summary["liveness"])] if summary.get("liveness") else []),
        ("step / epoch", f"{summary['step']} / {summary['epoch']}"),
        ("world size", summary["world_size"]),
        ("wall time", _fmt(summary["wall_seconds"], " s")),
        ("productive time", _fmt(summary["productive_seconds"], " s")),
        ("goodput", f"{goodput:.1%}" if goodput is not None else "-"),
        ("starts", summary["starts"]),
        ("failures", len(summary["failures"])),
        ("resets", len(summary["resets"])),
        ("recovery s (median / max)", f"{_fmt(rec['median'])} / {_fmt(rec['max'])}"),
        (
            "lost steps (resets + relaunches)",
            f"{summary['lost_steps']} ({summary['lost_steps_by_resets']} + {summary['lost_steps_by_relaunches']})",
        ),
        ("checkpoints (failed)", f"{summary['checkpoints']['count']} ({summary['checkpoints']['failed']})"),
        ("checkpoint stall s (median / max)", f"{_fmt(stall['median'])} / {_fmt(stall['max'])}"),
        (
            "samples/s (mean / last)",
            f"{_fmt(summary['samples_per_sec']['mean'])} / {_fmt(summary['samples_per_sec']['last'])}",
        ),
        ("final loss", _fmt(summary["final_loss"])),
        ("slowest host", format_slowest(summary["stragglers"]) if "stragglers" in summary else "-"),
        ("shares (samples per step)", format_shares(summary.get("shares"))),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    for i, r in enumerate(summary["resets"], 1):
        lines.append(
            f"  reset {i}: t={r['t']:.1f}s {r['reason']} {r['old_size']}->{r['new_size']} "
            f"recovery={_fmt(r['recovery_seconds'], 's')} lost_steps={r['lost_steps']}"
        )
    return "\n".join(lines) + "\n"


def report(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    events: Sequence[Event] | None = None,
) -> dict[str, Any]:
    """Write ``report.png`` (or ``out``) and ``report.json`` for ``run_dir``; return the summary.
    ``events``: the run's events when already read (default: read ``events.jsonl``)."""
    run_dir = Path(run_dir)
    events = read_events(run_dir / layout.EVENTS) if events is None else events
    summary = summarize(events)
    summary["state"], summary["live"], summary["liveness"] = checked_state(summary["state"], run_dir)
    png = Path(out) if out is not None else run_dir / layout.REPORT_PNG
    write_png(build_figure(events, summary), png)
    summary["png"] = str(png)
    write_atomic(run_dir / layout.REPORT_JSON, json.dumps(summary, indent=2) + "\n", durable=False)
    return summary


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="elastictrain report", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--run-dir", required=True, help="the job's run_dir (holds events.jsonl)")
    p.add_argument("--out", help=f"where to write the PNG (default: RUN_DIR/{layout.REPORT_PNG})")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    events_path = run_dir / layout.EVENTS
    if not run_dir.is_dir():
        sys.stderr.write(f"elastictrain report: --run-dir {run_dir}: not a directory\n")
        return 2

    def skipped(line: int, reason: str) -> None:
        sys.stderr.write(f"elastictrain report: warning: {events_path} line {line}: {reason}; skipped\n")

    try:
        events = read_events(events_path, on_skip=skipped)
        if not events:
            sys.stderr.write(f"elastictrain report: {events_path}: no events yet\n")
            return 2
        summary = report(run_dir, args.out, events)
    except FileNotFoundError:
        sys.stderr.write(f"elastictrain report: {events_path}: not found (is {run_dir} a run_dir?)\n")
        return 2
    except OSError as e:
        sys.stderr.write(f"elastictrain report: {e.filename or run_dir}: {e.strerror}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        where = f"timeline: {summary['png']}\nsummary:  {run_dir / layout.REPORT_JSON}\n"
        sys.stdout.write(format_table(summary) + where)
    return 0
