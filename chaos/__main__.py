"""``python -m chaos <action>``: fault primitives against one job, and ``run`` for scenarios.

Every action acts only on processes of the named job (by pid and environment) and appends a
timestamped JSON line to the chaos events file (``--events FILE``; default ``run_dir/chaos.jsonl``
with ``--run-dir``). The job is ``--job NAME`` or the one whose launcher wrote ``run_dir/launch.json``.

    python -m chaos kill-worker --run-dir D (--rank R | --random) [--signal KILL|TERM]
    python -m chaos kill-host HOST --run-dir D        # agent + every worker on HOST, SIGKILL
    python -m chaos kill-agent HOST --run-dir D       # the agent only: the host leaves at lease expiry
    python -m chaos preempt-host HOST --run-dir D     # SIGTERM to its agent: drain
    python -m chaos freeze-worker --rank R --seconds S --run-dir D
    python -m chaos slow-worker (--rank R | --host H) --slowdown 0.5 [--seconds S] --run-dir D  # stop/cont cycle
    python -m chaos quota-worker (--rank R | --host H) --cpu 0.5 [--seconds S] --run-dir D  # cgroup CPU quota
    python -m chaos hang-worker (--rank R | --host H) --run-dir D    # SIGSTOP, never continued
    python -m chaos etcd-outage --seconds S --run-dir D [--etcd-pid PID]
    python -m chaos kill-during-checkpoint --run-dir D
    python -m chaos kill-during-commit --run-dir D
    python -m chaos kill-job --run-dir D
    python -m chaos partition-host HOST --seconds S --veth VETH --job J    # multi-node tier (chaos/netns.py)
    python -m chaos run node-killed | node-partitioned   # the multi-node tier: namespaces, sshd, agents (root)
    python -m chaos loop --mtbf S --seed N --actions a,b,c [--duration S] --run-dir D
    python -m chaos run SCENARIO [--run-dir D] [--quick]   # see `python -m chaos run --list`
    python -m chaos campaign --faults N --seed S [--run-dir D] [--out F] [--plan]   # chaos/campaign.py
    python -m chaos resets --resets N --seed S [--run-dir D] [--out F] [--fault term|kill|drain|preempt]  # memory

Exit codes: 0 done (``run``: every invariant holds), 1 an invariant broke or the fault found nothing to
hit, 2 bad flags or a fault that cannot run here (``quota-worker`` without a CPU cgroup; ``run``: a scenario
that cannot run here, e.g. the multi-node tier without root or network namespaces; one line says why).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from chaos import faults
from chaos.procs import JobNotFound, JobRef
from elastictrain.cliutil import OneLineParser

PROG = "python -m chaos"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Fault injection for elastictrain jobs, and chaos scenarios.")
    sub = p.add_subparsers(dest="action", required=True, parser_class=OneLineParser)

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        a = sub.add_parser(name, help=help_)
        a.add_argument("--job", help="job name (default: from run_dir/launch.json)")
        a.add_argument("--run-dir", help="the job's run dir (launch.json, checkpoints, ledger)")
        a.add_argument("--events", help="chaos events file (default run_dir/chaos.jsonl)")
        return a

    def worker_target(a: argparse.ArgumentParser) -> None:
        g = a.add_mutually_exclusive_group(required=True)
        g.add_argument("--rank", type=int, help="0 = the current rank 0; others: the rank the worker started with")
        g.add_argument("--host", help="the (first) worker on this host")

    a = action("kill-worker", "signal one worker")
    g = a.add_mutually_exclusive_group(required=True)
    g.add_argument("--rank", type=int, help="0 = the current rank 0; others: the rank the worker started with")
    g.add_argument("--random", action="store_true")
    a.add_argument("--signal", default="KILL", choices=["KILL", "TERM"])
    a.add_argument("--seed", type=int, default=None, help="for --random")
    for name, help_ in [
        ("kill-host", "SIGKILL a host's agent and every worker on it"),
        ("kill-agent", "SIGKILL a host's agent only"),
        ("preempt-host", "SIGTERM a host's agent (drain)"),
    ]:
        action(name, help_).add_argument("host")
    a = action("freeze-worker", "SIGSTOP a worker, SIGCONT after --seconds")
    a.add_argument("--rank", type=int, required=True)
    a.add_argument("--seconds", type=float, required=True)
    a = action("slow-worker", "slow one worker down by a SIGSTOP/SIGCONT duty cycle")
    worker_target(a)
    a.add_argument("--slowdown", type=float, required=True, help="0.5: 50%% slower (stopped 1/3 of the time)")
    a.add_argument("--seconds", type=float, default=None, help="how long (default: until the worker exits or Ctrl-C)")
    a.add_argument("--period-seconds", type=float, default=0.1, help="length of one stop-and-run cycle")
    a = action("quota-worker", "put one worker's processes under a CPU quota (cgroup v2 cpu.max or v1 cfs_quota_us)")
    worker_target(a)
    a.add_argument("--cpu", type=float, required=True, help="share of one core it may use (0.5 = half a core)")
    a.add_argument("--seconds", type=float, default=None, help="how long (default: until the worker exits or Ctrl-C)")
    a = action("hang-worker", "SIGSTOP one worker and never continue it (a hung worker)")
    worker_target(a)
    a = action("etcd-outage", "suspend the job's etcd for --seconds")
    a.add_argument("--seconds", type=float, required=True)
    a.add_argument("--etcd-pid", type=int, default=None, help="etcd's pid (default: from run_dir/launch.json)")
    a = action("kill-during-checkpoint", "SIGKILL rank 0 and its writer while a checkpoint is written")
    a.add_argument("--timeout", type=float, default=120.0)
    a = action("kill-during-commit", "SIGKILL a worker when rank 0 commits (needs the ledger)")
    a.add_argument("--rank", type=int, default=0)
    a.add_argument("--timeout", type=float, default=120.0)
    action("kill-job", "SIGKILL the launcher and every process of the job")
    a = action("partition-host", "multi-node tier: take HOST's veth down for --seconds")
    a.add_argument("host")
    a.add_argument("--seconds", type=float, required=True)
    a.add_argument("--veth", required=True, help="the host's veth on the bridge (chaos/netns.py names them)")
    a = action("loop", "a seeded random schedule of faults")
    a.add_argument("--mtbf", type=float, required=True, help="mean seconds between faults")
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--actions", required=True, help=f"comma-separated, from {','.join(faults.LOOP_ACTIONS)}")
    a.add_argument("--duration", type=float, default=600.0)
    a.add_argument("--fixed", action="store_true", help="exactly every --mtbf seconds")

    r = sub.add_parser("run", help="run a scenario and check the invariants")
    r.add_argument("scenario", nargs="?")
    r.add_argument("--run-dir", default=None)
    r.add_argument("--quick", action="store_true", help="shortened soak")
    r.add_argument("--list", action="store_true", help="list the scenarios")
    r.add_argument("--report", action="store_true", help="also write the timeline PNG (elastictrain report)")

    from chaos import campaign, resets

    campaign.add_arguments(sub.add_parser("campaign", help="N faults aimed at every phase of one job, and figures"))
    resets.add_arguments(sub.add_parser("resets", help="survivors' memory, fds and threads across N resets"))
    return p


def _run(args: argparse.Namespace) -> int:
    from chaos.scenarios import SCENARIOS, ScenarioError, run_scenario, write_report

    if args.list or not args.scenario:
        for s in SCENARIOS.values():
            tier = "netns" if s.nodes else "ci" if s.ci else "long"
            print(f"{s.name:<24} {tier:<5} {s.description}")
        return 0 if args.list else 2
    if args.scenario not in SCENARIOS:
        print(f"{PROG} run: error: unknown scenario {args.scenario!r} (choose from {', '.join(SCENARIOS)})")
        return 2
    try:
        result = run_scenario(args.scenario, Path(args.run_dir) if args.run_dir else None, quick=args.quick)
    except ScenarioError as e:
        print(f"{PROG} run: error: {e}", file=sys.stderr)
        return 2
    if args.report or args.scenario == "soak":
        write_report(result.run_dir)
        print(f"report: {result.run_dir / 'report.png'}, {result.run_dir / 'report.json'}")
    print(result.table)
    return 0 if result.ok else 1


def _stop_on_signals() -> threading.Event:
    """An event that Ctrl-C or SIGTERM sets (the handlers only set it; the fault ends its cycle and cleans up)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action in ("run", "campaign", "resets"):
        # SIGTERM (a CI timeout, a user) unwinds like Ctrl-C, so the runner's `finally` blocks stop the jobs
        # it started (the fault-free reference run included) instead of leaving them behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        if args.action == "campaign":
            from chaos import campaign

            return campaign.main(args)
        if args.action == "resets":
            from chaos import resets

            signal.signal(signal.SIGTERM, resets.on_sigterm)  # the samples so far are still reported
            return resets.run(args)
        return _run(args)
    try:
        job = JobRef.resolve(args.job, args.run_dir)
    except JobNotFound as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    events = args.events or (job.run_dir / "chaos.jsonl" if job.run_dir else None)
    log = faults.ChaosLog(events, echo=True)
    try:
        if args.action == "kill-worker":
            rng = random.Random(args.seed)
            faults.kill_worker(job, log, rank=None if args.random else args.rank, rng=rng, sig=args.signal)
        elif args.action == "kill-host":
            faults.kill_host(job, log, args.host)
        elif args.action == "kill-agent":
            faults.kill_agent(job, log, args.host)
        elif args.action == "preempt-host":
            faults.preempt_host(job, log, args.host)
        elif args.action == "freeze-worker":
            faults.freeze_worker(job, log, rank=args.rank, seconds=args.seconds)
        elif args.action == "slow-worker":
            faults.slow_worker(
                job,
                log,
                host=args.host,
                rank=args.rank,
                slowdown=args.slowdown,
                seconds=args.seconds,
                period_seconds=args.period_seconds,
                stop=_stop_on_signals(),
            )
        elif args.action == "quota-worker":
            faults.quota_worker(
                job,
                log,
                host=args.host,
                rank=args.rank,
                cpu_fraction=args.cpu,
                seconds=args.seconds,
                stop=_stop_on_signals(),
            )
        elif args.action == "hang-worker":
            faults.hang_worker(job, log, host=args.host, rank=args.rank)
        elif args.action == "etcd-outage":
            faults.etcd_outage(job, log, seconds=args.seconds, etcd_pid=args.etcd_pid)
        elif args.action == "kill-during-checkpoint":
            faults.kill_during_checkpoint(job, log, timeout=args.timeout)
        elif args.action == "kill-during-commit":
            faults.kill_during_commit(job, log, rank=args.rank, timeout=args.timeout)
        elif args.action == "kill-job":
            faults.kill_job(job, log)
        elif args.action == "partition-host":
            faults.partition_host(log, job, args.host, seconds=args.seconds, veth=args.veth)
        elif args.action == "loop":
            try:
                plan = faults.LoopPlan(
                    seed=args.seed,
                    mtbf=args.mtbf,
                    actions=tuple(a.strip() for a in args.actions.split(",") if a.strip()),
                    duration=args.duration,
                    fixed=args.fixed,
                )
            except ValueError as e:
                print(f"{PROG} loop: error: {e}", file=sys.stderr)
                return 2
            faults.run_loop(plan, lambda a, rng: faults.default_action(job, log, a, rng), log, job=job)
    except JobNotFound as e:
        print(f"{PROG} {args.action}: {e}", file=sys.stderr)
        return 1
    except faults.QuotaUnavailable as e:
        print(f"{PROG} {args.action}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{PROG} {args.action}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
