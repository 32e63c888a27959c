"""``elastictrain status --run-dir D [--json] [--etcd URL --job J]``: the state of a run, read from files.

Reads ``run_dir/events.jsonl``, ``latest`` (+ that folder's ``manifest.json``) where the run keeps its checkpoints
(``run_dir/checkpoints``, or the ``checkpoint.location`` its ``config.yaml`` names, e.g. ``s3://...``) and
``run_dir/mlflow_run_id``; each may be absent. With ``--etcd`` and ``--job`` it also lists the hosts
registered in etcd.

Liveness: a run whose events say ``running`` is checked against ``run_dir/launch.json`` (written by
``elastictrain launch``). When that file names this host, and none of its pids is alive with the create
time recorded there (a reused pid does not count), the state is ``stopped (no live process)`` and ``live``
is false. When the file is absent, older (no ``host``/``create_times``) or from another host, nothing is
claimed: ``live`` is null and ``liveness`` says why.

It never imports torch, horovod or mlflow, so it answers in well under a second.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from elastictrain.checkpoint.location import storage_for_run_dir
from elastictrain.checkpoint.manifest import CheckpointDamaged, read_latest, read_manifest
from elastictrain.checkpoint.storage import CheckpointStorage
from elastictrain.cliutil import OneLineParser
from elastictrain.errors import ToolError
from elastictrain.rundir import layout
from elastictrain.rundir.events import (
    Checkpoint,
    Event,
    Failure,
    Lifecycle,
    Metrics,
    Reset,
    Start,
    lifecycle,
    read_events,
)
from elastictrain.rundir.launch import checked_state
from elastictrain.rundir.report import format_shares, format_slowest, shares_summary, straggler_summary


class StatusError(ToolError):
    """The run dir cannot be read; the message is one line for the user."""


def latest_checkpoint(run_dir: Path, now: float, storage: CheckpointStorage | None = None) -> dict[str, Any] | None:
    """What ``checkpoints/latest`` names, with its manifest fields and age; None when there is none. Read and
    checked by :mod:`elastictrain.checkpoint.manifest` (what is wrong goes to ``error``); files are not hashed."""
    if storage is None:
        try:
            storage = storage_for_run_dir(run_dir)
        except ValueError as e:  # a config.yaml naming a bad location
            return {"name": None, "path": str(layout.RunDir.of(run_dir).config), "error": str(e)}
    invalid: list[str] = []
    name = read_latest(storage, on_invalid=invalid.append)
    if name is None:
        return {"name": None, "path": storage.describe(layout.LATEST), "error": invalid[0]} if invalid else None
    info: dict[str, Any] = {"name": name, "path": storage.describe(name)}
    try:
        manifest = read_manifest(storage, name)
    except CheckpointDamaged as e:
        info["error"] = f"manifest unreadable: {e}"
        return info
    for key in ("step", "epoch", "world_size", "created_at"):
        info[key] = manifest.get(key)
    created = manifest.get("created_at")
    if isinstance(created, int | float):
        info["age_seconds"] = max(0.0, now - float(created))
    return info


def summarize_status(events: Sequence[Event], checkpoint: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """The status dict from events (oldest first), the latest checkpoint (or None) and the time."""
    out: dict[str, Any] = {
        "state": Lifecycle.NOT_STARTED.value,
        "step": None,
        "epoch": None,
        "world_size": None,
        "hosts": [],
        "samples_per_sec": None,
        "loss": None,
        "last_event": None,
        "attempts": 0,
        "failures": 0,
        "resets": [],
        "checkpoint": checkpoint,
    }
    last_ckpt_event: Checkpoint | None = None
    for ev in events:
        if isinstance(ev, Start | Reset) and ev.hosts is not None:
            out["hosts"] = list(ev.hosts)
        if isinstance(ev, Start):
            out["attempts"] += 1
        elif isinstance(ev, Failure):
            out["failures"] += 1
        elif isinstance(ev, Reset):
            out["resets"].append(
                {
                    "ts": ev.ts,
                    "step": ev.step,
                    "reason": ev.reason,
                    "old_size": ev.old_size,
                    "new_size": ev.world_size if ev.new_size is None else ev.new_size,
                    "recovery_seconds": ev.recovery_seconds,
                    "lost_steps": ev.lost_steps,
                }
            )
        elif isinstance(ev, Metrics):
            out["samples_per_sec"] = ev.samples_per_sec
            out["loss"] = ev.loss
        elif isinstance(ev, Checkpoint):
            last_ckpt_event = ev
    out["stragglers"] = straggler_summary(events)
    out["shares"] = shares_summary(events)
    if events:
        last = events[-1]
        out["step"], out["epoch"], out["world_size"] = last.step, last.epoch, last.world_size
        out["last_event"] = {"event": last.name, "ts": last.ts, "age_seconds": max(0.0, now - last.ts)}
        out["state"] = lifecycle(events).value
    if out["checkpoint"] is None and last_ckpt_event is not None:  # no checkpoints/ folder readable here
        e = last_ckpt_event
        out["checkpoint"] = {
            "name": Path(e.path or "").name or None,
            "path": e.path,
            "step": e.step,
            "epoch": e.epoch,
            "world_size": e.world_size,
            "created_at": e.ts,
            "age_seconds": max(0.0, now - e.ts),
            "source": "events",
        }
    return out


def read_status(
    run_dir: str | Path, now: float | None = None, on_skip: Callable[[int, str], None] | None = None
) -> dict[str, Any]:
    """The status of ``run_dir``. Raises :class:`StatusError` when it is not a readable run dir.
    ``on_skip``: told of each unusable line of events.jsonl (:func:`elastictrain.rundir.events.read_events`)."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    if not run_dir.is_dir():
        raise StatusError(f"--run-dir {run_dir}: not a directory")
    events_path = run_dir / layout.EVENTS
    try:
        events = read_events(events_path, on_skip)
    except FileNotFoundError:
        events = []
    except OSError as e:
        raise StatusError(f"{events_path}: cannot read ({e.strerror})") from None
    checkpoint = latest_checkpoint(run_dir, now)
    if not events and checkpoint is None and not events_path.exists():
        raise StatusError(
            f"--run-dir {run_dir}: no {layout.EVENTS} and no {layout.CHECKPOINTS}/{layout.LATEST}: not a run_dir"
        )
    status = summarize_status(events, checkpoint, now)
    status["run_dir"] = str(run_dir)
    status["state"], status["live"], status["liveness"] = checked_state(status["state"], run_dir)
    try:
        status["mlflow_run_id"] = (run_dir / layout.MLFLOW_RUN_ID).read_text().strip() or None
    except OSError:
        status["mlflow_run_id"] = None
    return status


def registered_hosts(etcd: str, job: str, prefix: str) -> list[dict[str, Any]]:
    """The hosts registered for ``job`` in etcd (``<prefix>/<job>/hosts/*``), sorted by name."""
    from discovery.registry import EtcdRegistry

    with EtcdRegistry(etcd, job, prefix) as registry:
        listing = registry.list_hosts()
    hosts = [
        {
            "host": e.record.host,
            "slots": e.record.slots,
            "state": e.record.state,
            "addr": e.record.addr,
            "pid": e.record.pid,
            "registered_at": e.record.registered_at,
        }
        for e in listing.entries
    ]
    hosts += [{"host": None, "malformed": m} for m in listing.malformed]
    return hosts


def _age(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s ago"
    if s < 7200:
        return f"{s // 60}m ago"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m ago"


def format_status(st: dict[str, Any]) -> str:
    """Human-readable lines for a terminal."""
    last = st.get("last_event") or {}
    sps = st.get("samples_per_sec")
    rows: list[tuple[str, str]] = [
        ("run dir", st["run_dir"]),
        (
            "state",
            f"{st['state']}" + (f" (last event {last.get('event')}, {_age(last.get('age_seconds'))})" if last else ""),
        ),
        *([("liveness", str(st["liveness"]))] if st.get("liveness") else []),
        ("step / epoch", f"{st['step']} / {st['epoch']}"),
        ("world size", str(st["world_size"])),
        ("hosts", ", ".join(st["hosts"]) or "-"),
        ("throughput", f"{sps:.1f} samples/s" if isinstance(sps, int | float) else "-"),
        ("loss", f"{st['loss']:.4f}" if isinstance(st.get("loss"), int | float) else "-"),
        ("starts", str(st["attempts"])),
        ("failures", str(st["failures"])),
        ("resets", str(len(st["resets"]))),
        ("slowest host", format_slowest(st["stragglers"]) if "stragglers" in st else "-"),
        ("shares", format_shares(st.get("shares"))),
    ]
    ck = st.get("checkpoint")
    if ck:
        where = f"{ck.get('name')} (step {ck.get('step')}, {_age(ck.get('age_seconds'))})"
        if ck.get("error"):
            where += f" [{ck['error']}]"
        rows.append(("last checkpoint", where))
    else:
        rows.append(("last checkpoint", "none"))
    rows.append(("mlflow run", st.get("mlflow_run_id") or "-"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for i, r in enumerate(st["resets"], 1):
        rec = r.get("recovery_seconds")
        lines.append(
            f"  reset {i}: step {r.get('step')} {r.get('reason')} {r.get('old_size')}->{r.get('new_size')}"
            + (f" recovered in {rec:.1f}s" if isinstance(rec, int | float) else "")
            + (f", {r['lost_steps']} steps lost" if isinstance(r.get("lost_steps"), int) else "")
        )
    if "registered_hosts" in st:
        lines.append(f"registered hosts ({st.get('job')}):")
        for h in st["registered_hosts"]:
            if h.get("host") is None:
                lines.append(f"  malformed: {h.get('malformed')}")
            else:
                lines.append(f"  {h['host']:<24} slots={h['slots']} {h['state']:<9} addr={h['addr']}")
        if not st["registered_hosts"]:
            lines.append("  none")
    if st.get("registered_hosts_error"):
        lines.append(f"registered hosts: unavailable ({st['registered_hosts_error']})")
    return "\n".join(lines) + "\n"


def main(
    argv: list[str],
    *,
    hosts_reader: Callable[[str, str, str], list[dict[str, Any]]] = registered_hosts,
) -> int:
    p = OneLineParser(prog="elastictrain status", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--run-dir", required=True, help="the job's run_dir")
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    p.add_argument("--etcd", help="etcd endpoint(s), http(s)://HOST:PORT[,...]: also list the registered hosts")
    p.add_argument("--job", help="the job's name (its etcd prefix); needed with --etcd")
    p.add_argument("--prefix", default="/elastictrain", help="etcd key prefix (default: /elastictrain)")
    args = p.parse_args(argv)
    if bool(args.etcd) != bool(args.job):
        sys.stderr.write("elastictrain status: --etcd and --job go together (both or neither)\n")
        return 2

    def skipped(line: int, reason: str) -> None:
        sys.stderr.write(f"elastictrain status: warning: {layout.EVENTS} line {line}: {reason}; skipped\n")

    try:
        st = read_status(args.run_dir, on_skip=skipped)
    except StatusError as e:
        sys.stderr.write(f"elastictrain status: {e}\n")
        return 2
    rc = 0
    if args.etcd:
        st["job"] = args.job
        try:
            st["registered_hosts"] = hosts_reader(args.etcd, args.job, args.prefix)
        except ValueError as e:  # a bad endpoint or job name
            sys.stderr.write(f"elastictrain status: {e}\n")
            return 2
        except Exception as e:  # etcd down: show the rest, say so, exit 1
            st["registered_hosts_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            rc = 1
    sys.stdout.write(json.dumps(st, indent=2) + "\n" if args.json else format_status(st))
    return rc
