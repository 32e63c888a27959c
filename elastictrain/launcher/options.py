"""What ``elastictrain launch`` is asked to do: :class:`LaunchOptions`, its flags, and :func:`parse`.

The options dataclass is the one source of every default: :func:`build_parser` reads the flags' defaults
from its fields, so ``--help``, the README and the code cannot disagree. :func:`parse` turns flags and
config into validated options, or raises :class:`LaunchError` (one line, exit 2) or
:class:`~elastictrain.config.ConfigError` before anything is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery import endpoints as etcd_endpoints
from discovery.endpoints import EtcdAccess
from elastictrain.cliutil import OneLineParser
from elastictrain.config import JobConfig, load_config
from elastictrain.errors import LaunchError
from elastictrain.launcher.hosts import is_local, local_logical_hosts

PROG = "elastictrain launch"


@dataclass(kw_only=True, frozen=True, slots=True)
class LaunchOptions:
    """What ``elastictrain launch`` was asked to do, validated."""

    config: Path
    """The job's YAML config (passed to every worker as an absolute path)."""
    overrides: tuple[str, ...] = ()
    """``--set`` assignments, applied here and passed to every worker."""
    min_np: int = 1
    max_np: int = 1
    etcd: str | None = None
    """The cluster's etcd endpoints; None means an embedded etcd and local agents."""
    etcd_access: EtcdAccess | None = None
    """TLS files and credentials for the cluster's etcd (``--cacert`` ...), passed to discover.sh as
    ``ELASTICTRAIN_ETCD_*`` paths and the user name; the password stays in its file."""
    hosts: tuple[str, ...] = ()
    """Logical hosts to run agents for in the embedded mode."""
    extra: tuple[str, ...] = ()
    """horovodrun flags given after ``--``."""
    gloo_timeout_seconds: int = 60
    """Gloo timeout. It bounds the rendezvous in which old workers wait for a new one to start (import torch,
    init), so it must be generous on a slow machine. Survivors of a dead worker do not wait it out: the
    worker's collective watchdog aborts their blocked receives once a peer failure is known."""
    blacklist_cooldown: tuple[int, int] = (5, 60)
    """horovodrun ``--blacklist-cooldown-range``: a failed host returns after this many seconds (backing off)."""
    reset_limit: int = 100
    """horovodrun ``--reset-limit``: most resets within one horovodrun."""
    elastic_timeout_seconds: int = 600
    """horovodrun ``--elastic-timeout``: how long it waits for ``--min-np`` slots before failing."""
    hot_join: bool = True
    """Each agent keeps a warm worker process (:mod:`elastictrain.hotjoin`) and horovodrun starts workers through
    its thin client, so a joining worker does not start an interpreter and import torch while the others wait.
    On by default; ``--no-hot-join`` starts every worker cold. A host without a warm zygote (a cluster agent
    without ``--warm-config``) starts its workers cold either way."""
    task_trial: bool = True
    """Before anything starts, try the task's collate, loss and metrics on real samples on the CPU
    (:mod:`elastictrain.engine.task_trial`); ``--no-task-trial`` only imports and builds it."""
    task_trial_seconds: float = 60.0
    """Time limit of that trial (a task whose first samples are slow to load: raise it, or skip the trial)."""
    wait_hosts_seconds: float = 300.0
    """After a preemption: how long to wait for ``--min-np`` ready slots before giving up (exit 3)."""
    max_relaunches: int = 5
    """Relaunches after preemptions before giving up (exit 4)."""
    stop_timeout_seconds: float = 60.0
    """After SIGTERM to the workers: how long they may take (rank 0 checkpoints) before SIGKILL."""
    drain_grace_seconds: float = 10.0
    """Of the embedded agents: seconds between SIGTERM (draining) and revoking the lease."""
    status_every_seconds: float = 30.0
    """Live view (:mod:`elastictrain.tools.live_view`): a JSON status line this often when stdout is not a terminal
    (on a terminal one line is rewritten every second); 0 turns it off."""

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise LaunchError(f"--min-np must be >= 1, got {self.min_np}")
        if self.max_np < self.min_np:
            raise LaunchError(f"--max-np ({self.max_np}) must be >= --min-np ({self.min_np})")
        lo, hi = self.blacklist_cooldown
        if not 1 <= lo <= hi:
            raise LaunchError(f"--blacklist-cooldown-range must satisfy 1 <= MIN <= MAX, got {lo} {hi}")
        if self.gloo_timeout_seconds < 1:
            raise LaunchError(f"--gloo-timeout-seconds must be >= 1, got {self.gloo_timeout_seconds}")
        if self.max_relaunches < 0:
            raise LaunchError(f"--max-relaunches must be >= 0, got {self.max_relaunches}")
        for name, value in (
            ("--wait-hosts-seconds", self.wait_hosts_seconds),
            ("--stop-timeout", self.stop_timeout_seconds),
            ("--drain-grace", self.drain_grace_seconds),
            ("--status-every", self.status_every_seconds),
            ("--elastic-timeout", self.elastic_timeout_seconds),
            ("--reset-limit", self.reset_limit),
        ):
            if not (math.isfinite(value) and value >= 0):  # NaN fails every comparison: test it first
                raise LaunchError(f"{name} must be a finite number >= 0, got {value!r}")

        if not (math.isfinite(self.task_trial_seconds) and self.task_trial_seconds > 0):
            raise LaunchError(f"--task-trial-seconds must be a finite number > 0, got {self.task_trial_seconds!r}")

    @property
    def embedded(self) -> bool:
        return self.etcd is None

    @property
    def stall_seconds(self) -> float:
        """No worker alive this long, with enough hosts ready, means horovodrun is stuck: Gloo timeout +
        longest blacklist cooldown + a minute for workers to start."""
        return self.gloo_timeout_seconds + self.blacklist_cooldown[1] + 60


DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(LaunchOptions)}
"""Field name -> default of :class:`LaunchOptions`: the defaults of ``launch``'s flags."""


def build_parser() -> argparse.ArgumentParser:
    """``launch``'s flags; every default is the :class:`LaunchOptions` field's (``%(default)s`` in the help)."""
    d = DEFAULTS
    p = OneLineParser(
        prog=PROG,
        description="Run a job: embedded etcd and agents (unless --etcd), horovodrun, relaunch after preemption.",
        epilog="Flags after `--` go to horovodrun unchanged.",
    )
    p.add_argument("--config", required=True, help="YAML job config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    p.add_argument("--min-np", type=int, default=None, help="fewest workers (default elastic.min_np)")
    p.add_argument("--max-np", type=int, default=None, help="most workers (default elastic.max_np)")
    p.add_argument("--etcd", default=d["etcd"], metavar="URL", help="the cluster's etcd; none: start an embedded one")
    p.add_argument("--job", default=None, help="job name (default: the config's job)")
    p.add_argument("--hosts", default=None, help="embedded mode: logical hosts to run agents for (default: all)")
    # (flag, LaunchOptions field, type, help): the default is the field's, shown by ``%(default)s``.
    tuned: tuple[tuple[str, str, type, str], ...] = (
        ("--gloo-timeout-seconds", "gloo_timeout_seconds", int, "horovodrun Gloo timeout; bounds the rendezvous "
         "with a starting worker (%(default)s)"),
        ("--reset-limit", "reset_limit", int, "horovodrun --reset-limit (%(default)s)"),
        ("--elastic-timeout", "elastic_timeout_seconds", int, "horovodrun --elastic-timeout (%(default)s)"),
        ("--wait-hosts-seconds", "wait_hosts_seconds", float, "after a preemption (%(default)g)"),
        ("--max-relaunches", "max_relaunches", int, "relaunches after preemptions (%(default)s)"),
        ("--stop-timeout", "stop_timeout_seconds", float, "SIGTERM to SIGKILL of workers (%(default)g)"),
        ("--drain-grace", "drain_grace_seconds", float, "embedded agents' drain grace (%(default)g)"),
        ("--status-every", "status_every_seconds", float, "live view: a JSON status line every S seconds when "
         "stdout is not a terminal; 0: off (%(default)g)"),
        ("--task-trial-seconds", "task_trial_seconds", float, "time limit for trying the task on real samples "
         "before anything starts (%(default)g)"),
    )  # fmt: skip
    for flag, name, kind, help_ in tuned:
        metavar = "S" if kind is float or name.endswith("_seconds") else None
        p.add_argument(flag, dest=name, type=kind, default=d[name], metavar=metavar, help=help_)
    lo, hi = d["blacklist_cooldown"]
    p.add_argument(
        "--blacklist-cooldown-range",
        dest="blacklist_cooldown",
        type=int,
        nargs=2,
        default=[lo, hi],
        metavar=("MIN", "MAX"),
        help=f"({lo} {hi})",
    )
    p.add_argument(
        "--hot-join",
        action=argparse.BooleanOptionalAction,
        default=d["hot_join"],
        help="start workers from a warm process per host (embedded agents keep one), so a scale-up waits for no "
        "interpreter start; hosts without one start workers cold (on by default; --no-hot-join: every worker cold)",
    )
    p.add_argument(
        "--task-trial",
        action=argparse.BooleanOptionalAction,
        default=d["task_trial"],
        help="try the task's collate, loss and metrics on 2 real samples on the CPU before anything starts "
        "(on by default; --no-task-trial: only import and build it, for tasks whose first samples are expensive)",
    )
    etcd_endpoints.add_arguments(p)  # --cacert --cert --key --user --password-file, for --etcd
    return p


def parse(argv: Sequence[str]) -> tuple[LaunchOptions, JobConfig]:
    """Flags and config -> options; raises :class:`LaunchError` or :class:`ConfigError` (nothing is started)."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.job is not None:
        overrides.append(f"job={args.job}")
    cfg = load_config(args.config, overrides)
    min_np = args.min_np if args.min_np is not None else cfg.elastic.min_np
    max_np = args.max_np if args.max_np is not None else cfg.elastic.max_np
    if args.max_np is None and max_np < min_np:
        max_np = min_np  # --min-np above the config's max_np raises the default max
    hosts: tuple[str, ...] = ()
    access: EtcdAccess | None = None
    if args.etcd is not None:
        if args.hosts is not None:
            raise LaunchError("--hosts applies to the embedded mode only (with --etcd every node runs its agent)")
        try:
            parsed = etcd_endpoints.parse_endpoints(args.etcd)
        except ValueError as e:
            raise LaunchError(f"--etcd: {e}") from None
        try:
            access = etcd_endpoints.from_args(args, os.environ).check(parsed)
        except ValueError as e:
            raise LaunchError(str(e)) from None
    elif not etcd_endpoints.from_args(args, {}).empty:
        raise LaunchError(
            "--cacert, --cert, --key, --user and --password-file apply with --etcd only "
            "(the embedded etcd listens on loopback without TLS or auth)"
        )
    else:
        if args.hosts is not None:
            hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
            for h in hosts:
                if not is_local(h):
                    raise LaunchError(f"--hosts: {h!r} does not resolve to this machine (the embedded mode is local)")
            if len(set(hosts)) != len(hosts):
                raise LaunchError(f"--hosts: duplicate names in {args.hosts!r}")
        else:
            hosts = tuple(local_logical_hosts(max(max_np, 1)))
    opts = LaunchOptions(
        config=Path(args.config),
        overrides=tuple(overrides),
        min_np=min_np,
        max_np=max_np,
        etcd=args.etcd,
        etcd_access=access,
        hosts=hosts,
        extra=tuple(extra),
        gloo_timeout_seconds=args.gloo_timeout_seconds,
        blacklist_cooldown=(args.blacklist_cooldown[0], args.blacklist_cooldown[1]),
        reset_limit=args.reset_limit,
        elastic_timeout_seconds=args.elastic_timeout_seconds,
        wait_hosts_seconds=args.wait_hosts_seconds,
        max_relaunches=args.max_relaunches,
        stop_timeout_seconds=args.stop_timeout_seconds,
        drain_grace_seconds=args.drain_grace_seconds,
        hot_join=args.hot_join,
        task_trial=args.task_trial,
        task_trial_seconds=args.task_trial_seconds,
        status_every_seconds=args.status_every_seconds,
    )
    if opts.embedded and len(hosts) < opts.min_np:
        raise LaunchError(
            f"--min-np {opts.min_np} needs {opts.min_np} logical hosts but this machine has {len(hosts)} "
            f"({', '.join(hosts) or 'none'}); lower --min-np or pass --etcd for a cluster"
        )
    return opts, cfg
