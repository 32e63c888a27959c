"""``elastictrain config show --config X [--set k=v ...]``: print the resolved config as YAML."""

from __future__ import annotations

import argparse
import sys

from elastictrain.config import ConfigError, load_config


class UsageError(Exception):
    """Bad command-line use; the message is one line."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports misuse as one line and exit code 2 (its default code, without the usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="elastictrain config")
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config as YAML")
    add_config_args(show)
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return report_config_error(e)
    sys.stdout.write(cfg.to_yaml())
    return 0
