"""``elastictrain launch``'s entry point: parse, check what can be checked before anything starts, then supervise.

:func:`main` exits 2 with one line for bad flags, a bad config or task, a missing horovodrun or etcd, a Horovod
that is not the patched build (:mod:`elastictrain.horovod.build_check`), an unreachable ``--etcd`` and a run_dir that
another launcher drives; nothing is started then. A run_dir
whose latest verified checkpoint already holds the whole training exits 0 without starting anything.
Otherwise it takes the run_dir lock and hands over to :class:`~elastictrain.launcher.supervisor.Launcher`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from discovery.endpoints import EtcdAccess
from discovery.registry import EtcdRegistry, RegistryError, RegistryUnavailable
from elastictrain.cliutil import EXIT_USAGE
from elastictrain.commands import REPO, config_validate_command, find_horovodrun, runner_command
from elastictrain.config import ConfigError, JobConfig
from elastictrain.config_cli import report_config_error
from elastictrain.errors import LaunchError
from elastictrain.horovod.build_check import UnpatchedHorovod, check_patched_horovod
from elastictrain.launcher.options import PROG, LaunchOptions, parse
from elastictrain.launcher.supervisor import Launcher
from elastictrain.rundir.launch import RunDirLock

TASK_CHECK_TIMEOUT_SECONDS = 300.0
"""How long the task check may take beyond the trial's own limit (starting Python, importing torch and the task,
building it twice)."""


def check_etcd(
    endpoints: str, job: str, prefix: str, timeout_seconds: float = 3.0, access: EtcdAccess | None = None
) -> None:
    """Raise :class:`LaunchError` unless the cluster's etcd answers a range request."""
    registry = EtcdRegistry(endpoints, job, prefix, timeout_seconds=timeout_seconds, access=access)
    try:
        registry.list_hosts()
    except RegistryError as e:
        how = "unreachable" if isinstance(e, RegistryUnavailable) else "refused the job's hosts range"
        raise LaunchError(f"--etcd {endpoints}: {how} ({str(e).splitlines()[0] if str(e) else 'no answer'})") from None
    finally:
        with contextlib.suppress(Exception):
            registry.close()


def run_complete(cfg: JobConfig) -> str | None:
    """One line saying that the run_dir's latest checkpoint already holds the whole training, else None.

    The workers would resume from that checkpoint and train nothing; a damaged one (the workers fall back
    to an older one) or a longer training (more epochs, a higher ``max_steps``) is not complete.
    """
    if not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        return None
    from elastictrain.checkpoint.location import storage_for
    from elastictrain.engine.policy import schedule_finished
    from elastictrain.tools.status import latest_checkpoint

    storage = storage_for(cfg.checkpoint.location, cfg.run_path)
    ck = latest_checkpoint(cfg.run_path, time.time(), storage)
    if not ck or ck.get("error") or not isinstance(ck.get("step"), int) or not isinstance(ck.get("epoch"), int):
        return None
    if not schedule_finished(cfg.training, ck["epoch"], ck["step"]):
        return None
    from elastictrain.checkpoint import CheckpointDamaged, verify_checkpoint

    try:
        verify_checkpoint(storage, str(ck["name"]))
    except (CheckpointDamaged, OSError, ValueError):
        return None
    t = cfg.training
    target = f"epoch {ck['epoch']} of {t.epochs}" + (f", step {ck['step']} of {t.max_steps}" if t.max_steps else "")
    return f"run complete: {cfg.run_path} already holds the whole training ({target}); nothing to train"


def check_task(opts: LaunchOptions, python: str = sys.executable) -> None:
    """Raise :class:`ConfigError` unless the config's task imports, builds (on the meta device) and, unless
    ``--no-task-trial``, runs on real samples (``elastictrain config validate``, in a child process, so the launcher
    imports neither torch nor the user's code)."""
    trial = opts.task_trial_seconds if opts.task_trial else None
    cmd = config_validate_command(opts.config, opts.overrides, python, trial_seconds=trial)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    limit = (trial or 0) + TASK_CHECK_TIMEOUT_SECONDS
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"task: checking the task of {opts.config} took over {limit:g}s") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"the task check exited {done.returncode}"
        raise ConfigError(last.removeprefix("elastictrain: config error: "))


def main(argv: list[str]) -> int:
    try:
        opts, cfg = parse(argv)
        if (complete := run_complete(cfg)) is not None:
            print(f"{PROG}: {complete}", flush=True)
            return 0
        if find_horovodrun() is None:
            raise LaunchError("horovodrun not found next to this Python or on PATH (run `make setup`)")
        check_patched_horovod()
        check_task(opts)
        if opts.etcd is not None:
            check_etcd(opts.etcd, cfg.job, cfg.discovery.prefix, access=opts.etcd_access)
    except ConfigError as e:
        report_config_error(e, PROG)
        return EXIT_USAGE
    except (LaunchError, UnpatchedHorovod) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        lock = RunDirLock.acquire(cfg.run_path.resolve())
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        launcher = Launcher(opts, cfg, horovodrun=runner_command())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, launcher.on_signal)
        code = launcher.run()
        print(f"{PROG}: exit {code}", flush=True)
        if launcher.worker_error is not None:  # the cause, as the last line (Horovod's traceback is above it)
            print(f"{PROG}: {launcher.worker_error.line()}", file=sys.stderr, flush=True)
        return code
    finally:
        lock.release()
