"""Every command line the launcher and its peers build: the ``elastictrain`` entry, a worker, an agent, a zygote,
horovodrun, and the environment horovodrun gets (pure).

:func:`elastictrain_command` is the one place that decides how to run ``elastictrain``: the console
script next to the running Python when it exists, else ``python -m elastictrain.cli``. The launcher, the
node agent (its warm zygote), the chaos tier, the demo and the benchmarks all build from it.
Import-light (standard library only), because ``discovery`` uses it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from elastictrain import envnames

if TYPE_CHECKING:
    from elastictrain.config import DiscoveryConfig
    from elastictrain.launcher.options import LaunchOptions

REPO = Path(__file__).resolve().parents[1]
DISCOVER_SCRIPT = REPO / "discovery" / "discover.sh"
ZYGOTE_CLIENT = ("-m", "elastictrain.hotjoin.client", "--")
"""After the Python: how horovodrun starts a worker through the host's warm zygote (hot join)."""
HVDRUN_MODULE = "elastictrain.horovod.hvdrun"
"""horovodrun with the two driver repairs (:mod:`elastictrain.horovod.hvdrun`), run as ``python -m``."""


def elastictrain_command(*args: str, python: str = sys.executable) -> list[str]:
    """``elastictrain ARGS``: the console script next to ``python`` when it exists, else ``python -m elastictrain.cli``
    (the same program; the script's name reads better in ``ps``)."""
    script = Path(python).parent / "elastictrain"
    entry = [str(script)] if script.exists() else [python, "-m", "elastictrain.cli"]
    return [*entry, *args]


def _with_overrides(cmd: list[str], overrides: Iterable[str], flag: str = "--set") -> list[str]:
    for assignment in overrides:
        cmd += [flag, assignment]
    return cmd


def train_command(config: Path | str, overrides: Iterable[str] = (), python: str = sys.executable) -> list[str]:
    """``elastictrain train --config X [--set k=v ...]``: the worker a user runs under horovodrun."""
    return _with_overrides(elastictrain_command("train", "--config", str(config), python=python), overrides)


def worker_command(opts: LaunchOptions, python: str = sys.executable) -> list[str]:
    """The command horovodrun starts on every slot: ``elastictrain train --config X [--set ...]``; with hot join,
    through the zygote's client (which runs that same command itself when the host has no warm zygote)."""
    cmd = train_command(opts.config.resolve(), opts.overrides, python)
    return [python, *ZYGOTE_CLIENT, *cmd] if opts.hot_join else cmd


def zygote_command(
    config: str, overrides: Iterable[str], *, job: str, host: str, etcd: str = "", prefix: str = ""
) -> list[str]:
    """``elastictrain zygote serve --config X [--set ...] --job J --host H [--etcd E --prefix P]``: a host's warm
    worker process, for the job registered in etcd ``E`` under ``P`` (its workers find it by the same)."""
    cmd = _with_overrides(elastictrain_command("zygote", "serve", "--config", config), overrides)
    cmd += ["--job", job, "--host", host]
    return cmd + (["--etcd", etcd, "--prefix", prefix] if etcd or prefix else [])


def config_validate_command(
    config: Path | str, overrides: Iterable[str], python: str = sys.executable, *, trial_seconds: float | None = None
) -> list[str]:
    """``elastictrain config validate``: checks a config, builds its task on the meta device and, with
    ``trial_seconds``, tries it on real samples within that time (``--no-trial`` without)."""
    cmd = elastictrain_command("config", "validate", "--config", str(config), python=python)
    cmd += ["--no-trial"] if trial_seconds is None else ["--trial-seconds", f"{trial_seconds:g}"]
    return _with_overrides(cmd, overrides)


def agent_command(
    discovery: DiscoveryConfig,
    *,
    etcd: str,
    job: str,
    host: str,
    drain_grace_seconds: float,
    warm_config: Path | str | None = None,
    warm_overrides: Iterable[str] = (),
) -> list[str]:
    """``elastictrain agent`` for ``host`` with the timing of the job's ``discovery`` settings (1 slot); with
    ``warm_config``, it keeps a warm zygote of that config (``--warm-config X [--warm-set k=v ...]``: hot join)."""
    ttl = max(2, round(discovery.ttl_seconds))
    cmd = elastictrain_command(
        "agent",
        "--etcd", etcd,
        "--job", job,
        "--host", host,
        "--slots", "1",
        "--ttl", str(ttl),
        "--heartbeat", f"{min(discovery.heartbeat_seconds, ttl / 3):g}",
        "--request-timeout", f"{min(2.0, ttl / 6):g}",
        "--drain-grace", f"{drain_grace_seconds:g}",
        "--prefix", discovery.prefix,
    )  # fmt: skip
    if warm_config is not None:
        cmd = _with_overrides([*cmd, "--warm-config", str(warm_config)], warm_overrides, "--warm-set")
    return cmd


def runner_command(python: str = sys.executable) -> list[str]:
    """How the launcher starts horovodrun: through :mod:`elastictrain.horovod.hvdrun` (the same horovodrun, with
    a host discovery that does not start a Python interpreter every second)."""
    return [python, "-m", HVDRUN_MODULE]


def find_horovodrun() -> str | None:
    local = Path(sys.executable).parent / "horovodrun"
    return str(local) if local.exists() else shutil.which("horovodrun")


def horovodrun_command(opts: LaunchOptions, horovodrun: Sequence[str], python: str = sys.executable) -> list[str]:
    """The full horovodrun command line for ``opts``; ``horovodrun`` is the runner's argv prefix
    (:func:`runner_command`)."""
    lo, hi = opts.blacklist_cooldown
    cmd = [
        *horovodrun,
        "-np", str(opts.min_np),
        "--min-np", str(opts.min_np),
        "--max-np", str(opts.max_np),
        "--host-discovery-script", str(DISCOVER_SCRIPT),
    ]  # fmt: skip
    if opts.embedded:
        cmd += ["--network-interfaces", "lo"]
    cmd += [
        "--gloo",
        "--gloo-timeout-seconds", str(opts.gloo_timeout_seconds),
        "--blacklist-cooldown-range", str(lo), str(hi),
        "--reset-limit", str(opts.reset_limit),
        "--elastic-timeout", str(opts.elastic_timeout_seconds),
        *opts.extra,
    ]  # fmt: skip
    return cmd + worker_command(opts, python)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launch_env(
    opts: LaunchOptions,
    *,
    etcd: str,
    job: str,
    attempt: int,
    run_dir: Path,
    prefix: str | None = None,
    launch_id: str = "",
    cores: int | None = None,
) -> dict[str, str]:
    """The variables the launcher sets for horovodrun (and so for discover.sh and every worker)."""
    env = {
        envnames.ETCD: etcd,
        envnames.JOB: job,
        envnames.ATTEMPT: str(attempt),
        envnames.MIN_NP: str(opts.min_np),
        envnames.DISCOVER_CACHE: str(run_dir / "discover-cache.json"),
    }
    if prefix and prefix != "/elastictrain":
        env[envnames.ETCD_PREFIX] = prefix
    if opts.etcd_access is not None:
        env.update(opts.etcd_access.env())
    if opts.embedded:
        # Logical hosts share this machine's cores; Horovod's local_size is 1 on each, so say it here.
        env["OMP_NUM_THREADS"] = str(max(1, (cores or usable_cores()) // opts.max_np))
    if launch_id:
        env[envnames.LAUNCH_ID] = launch_id
    return env


def format_command(env: Mapping[str, str], cmd: Sequence[str]) -> str:
    """``VAR=value ... horovodrun ...`` as a shell line a user can paste."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd)])
