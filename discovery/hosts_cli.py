"""``elastictrain hosts``: list, drain, undrain or remove the hosts of a job.

``drain`` marks a host ``draining`` (discovery stops listing it, Horovod removes it gracefully) and
``undrain`` marks it ``ready`` again; both compare-and-set on the key's revision and keep its lease. Neither
is timed: ``drain`` of an evicted host keeps it draining until an ``undrain`` (its cool-down is dropped), and
``undrain`` of one readmits it at once. ``remove`` deletes the key; a live agent sees its key gone while its
lease lives and exits. ``list`` shows an evicted host's state as ``draining (<reason>, readmit in <time>,
evictions <n>)``.

Exit codes: 0 done; 1 etcd unreachable or a concurrent change won; 2 bad flags or unknown host.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from discovery import endpoints
from discovery.record import DEFAULT_PREFIX, DRAINING, READY, HostRecord, MalformedRecord
from discovery.registry import EtcdRegistry, HostNotFound, HostRegistry, Listing, RegistryError, set_state
from elastictrain import envnames
from elastictrain.cliutil import OneLineParser

PROG = "elastictrain hosts"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="List, drain, undrain or remove the hosts of a job.")
    p.add_argument("--etcd", required=True, metavar="URL", help="etcd endpoint(s), http(s)://HOST:PORT[,...]")
    p.add_argument("--job", required=True, help="job name")
    p.add_argument(
        "--prefix",
        default=os.environ.get(envnames.ETCD_PREFIX) or DEFAULT_PREFIX,
        help="etcd key prefix (default $ELASTICTRAIN_ETCD_PREFIX or /elastictrain)",
    )
    p.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS", help="deadline per etcd request")
    endpoints.add_arguments(p)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=OneLineParser)
    sub.add_parser("list", help="table of hosts: host, slots, state (an eviction's reason and cool-down), age")
    for name, help_ in (
        ("drain", "mark HOST draining: Horovod removes it gracefully"),
        ("undrain", "mark HOST ready again"),
        ("remove", "delete HOST's key (its agent exits)"),
    ):
        sub.add_parser(name, help=help_).add_argument("host", metavar="HOST")
    return p


def format_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d"


def format_state(record: HostRecord, now: float) -> str:
    """The STATE cell: the state, and for an evicted host its reason, the time left to its readmission (by its
    agent, at ``drain_until``) and its eviction count; for a host with a preemption notice, the notice and the time
    left until the cloud ends the instance."""
    if record.notice:
        ends = math.ceil(record.notice_time - now)
        return f"{record.state} ({record.notice}, {f'ends in {format_age(ends)}' if ends > 0 else 'ending'})"
    if not record.evicted:
        return record.state
    left = record.drain_until - now
    when = f"readmit in {format_age(math.ceil(left))}" if left > 0 else "readmit due"
    return f"{record.state} ({record.drain_reason or 'evicted'}, {when}, evictions {record.evictions})"


def format_table(listing: Listing, now: float) -> list[str]:
    """Rows of the ``list`` table, header first, columns aligned."""
    rows = [("HOST", "SLOTS", "STATE", "AGE", "PID", "ADDR")]
    for e in listing.entries:
        r = e.record
        age = format_age(now - r.registered_at) if r.registered_at else "?"
        rows.append((r.host, str(r.slots), format_state(r, now), age, str(r.pid or "?"), r.addr))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def run(registry: HostRegistry, args: argparse.Namespace, now: float) -> tuple[int, list[str], list[str]]:
    """One command: ``(exit_code, stdout_lines, stderr_lines)``."""
    if args.action == "list":
        listing = registry.list_hosts()
        warnings = [f"{PROG}: warning: skipping {m}" for m in listing.malformed]
        return 0, format_table(listing, now), warnings
    host = args.host
    if args.action == "remove":
        if not registry.delete(host):
            return 2, [], [f"{PROG}: error: no host {host!r} in job {registry.job!r}"]
        return 0, [f"{host}: removed"], []
    new_state = DRAINING if args.action == "drain" else READY
    old, new = set_state(registry, host, new_state)
    return 0, [f"{host}: {old} -> {new}" if old != new else f"{host}: already {new}"], []


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        access = endpoints.from_args(args, os.environ)
        registry = EtcdRegistry(args.etcd, args.job, args.prefix, timeout_seconds=args.timeout, access=access)
    except ValueError as e:
        parser.error(str(e))
    try:
        code, out, err = run(registry, args, time.time())
    except HostNotFound as e:
        code, out, err = 2, [], [f"{PROG}: error: {e}"]
    except MalformedRecord as e:
        code, out, err = 1, [], [f"{PROG}: error: malformed value: {e}"]
    except RegistryError as e:
        code, out, err = 1, [], [f"{PROG}: error: {e}"]
    finally:
        registry.close()
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return code
