"""``elastictrain config show|validate --config X [--set k=v ...]``: print the resolved config as YAML, or check it.

Both check the task too (import it and build it on the meta device; :func:`elastictrain.task.validate_task`):
a bad task is one line and exit code 2. ``show --no-task-check`` prints the config without importing the task.
``validate`` then tries the task on real samples (:mod:`elastictrain.engine.task_trial`: collate, loss, metrics),
within ``--trial-seconds`` (``--no-trial`` skips it).
"""

from __future__ import annotations

import argparse
import sys

from elastictrain.cliutil import OneLineParser, number
from elastictrain.config import ConfigError, JobConfig, load_config


def report_config_error(e: ConfigError, prog: str = "elastictrain") -> int:
    """Print a config error as its one line on stderr; return the exit code for bad input (2)."""
    print(f"{prog}: config error: {e}", file=sys.stderr)
    return 2


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML job config")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set training.base_lr=0.05 (repeatable)",
    )


DEFAULT_TRIAL_SECONDS = 60.0
"""How long ``config validate`` (and so ``launch``) may spend trying the task on real samples."""


def check_task(cfg: JobConfig, config_path: str, trial_seconds: float | None = None) -> str:
    """Import and dry-run the config's task (see :func:`elastictrain.task.validate_task`); with ``trial_seconds``,
    also try it on real samples within that time (:func:`elastictrain.engine.task_trial.try_task`). One line about it.
    Raises :class:`ConfigError`."""
    from elastictrain.task import add_import_paths, describe, validate_task  # torch: only when asked

    add_import_paths(config_path)
    built = validate_task(cfg)
    about = describe(built)
    if trial_seconds is not None:
        from elastictrain.engine.task_trial import time_limit, try_task

        with time_limit(trial_seconds):
            about += f"; {try_task(cfg, built)}"
    return about


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="elastictrain config")
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config as YAML (after checking its task)")
    add_config_args(show)
    show.add_argument("--no-task-check", action="store_true", help="do not import and dry-run the task")
    validate = sub.add_parser("validate", help="check the config and its task; print one line")
    add_config_args(validate)
    validate.add_argument(
        "--trial-seconds",
        type=number(float, positive=True),
        default=DEFAULT_TRIAL_SECONDS,
        metavar="S",
        help="time limit for trying the task's loss and metrics on real samples (%(default)g)",
    )
    validate.add_argument("--no-trial", action="store_true", help="only import and build the task; run none of it")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.action == "validate":
            about = check_task(cfg, args.config, None if args.no_trial else args.trial_seconds)
        elif not args.no_task_check:
            about = check_task(cfg, args.config)
    except ConfigError as e:
        return report_config_error(e)
    if args.action == "validate":
        print(f"config ok: task {cfg.task}: {about}")
    else:
        sys.stdout.write(cfg.to_yaml())
    return 0
