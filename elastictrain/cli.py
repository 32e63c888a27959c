"""The ``elastictrain`` command.

Subcommands dispatch lazily so that ``elastictrain agent`` and ``elastictrain hosts`` never import
torch, horovod or mlflow. Every user error exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, help). Each module has ``main(argv: list[str]) -> int`` that parses its own flags.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "config": ("elastictrain.config_cli", "show the resolved config of a job"),
    "train": ("elastictrain.engine.worker", "the training worker that horovodrun starts on every slot"),
    "agent": ("discovery.agent", "node agent: register this host in etcd and drain on SIGTERM"),
    "hosts": ("discovery.hosts_cli", "list, drain, undrain or remove hosts of a job"),
    "zygote": ("elastictrain.hotjoin.server", "hot join: a host's warm worker factory (serve) and its thin client"),
    "launch": ("elastictrain.launcher.main", "run a job: embedded etcd and agents, horovodrun, supervision"),
    "status": ("elastictrain.tools.status", "show the state of a run from its run_dir"),
    "report": ("elastictrain.rundir.report", "timeline PNG and goodput summary of a run"),
    "audit": ("elastictrain.tools.audit", "check a run's sample ledger: every sample exactly once per epoch"),
    "export": ("elastictrain.tools.export", "write a run's trained model as a plain state_dict plus its config"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastictrain", description=__doc__.splitlines()[0] if __doc__ else None)
    from elastictrain import __version__

    p.add_argument("--version", action="version", version=f"elastictrain {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] not in SUBCOMMANDS:
        if args and not args[0].startswith("-"):
            parser.print_usage(sys.stderr)
            print(
                f"elastictrain: error: unknown command {args[0]!r} (choose from {', '.join(SUBCOMMANDS)})",
                file=sys.stderr,
            )
            return 2
        parser.parse_args(args)  # --help / --version exit here
        parser.print_help(sys.stderr)
        return 2
    module_name, _ = SUBCOMMANDS[args[0]]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"elastictrain: error: command {args[0]!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    entry: Callable[[list[str]], int] = module.main
    return int(entry(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
