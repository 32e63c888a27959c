"""The argument parser every elastictrain command uses: misuse is one line on stderr and exit code 2.

Import-light by contract (argparse only), so that ``discovery`` (which must never import torch) and
``chaos`` use it as well.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

EXIT_USAGE = 2
"""Exit code for command-line misuse and bad input."""
EXIT_STOPPED = 143
"""Exit code (128 + SIGTERM) of a worker or launcher stopped by SIGTERM after it saved: not a completed job."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports misuse as ``PROG: error: MESSAGE`` (one line, no usage block) and exits 2.

    Pass it on to subcommands with ``add_subparsers(parser_class=OneLineParser)``.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def number(kind: type, *, positive: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite ``kind`` (int or float), above 0 when ``positive``; NaN and inf are refused."""

    def parse(value: str) -> float:
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {value!r}")
        if positive and not x > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
        return x

    return parse
