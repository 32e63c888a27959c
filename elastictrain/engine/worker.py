"""``elastictrain train --config X [--set ...]``: the command horovodrun starts on every slot.

Exit 0 only when training is complete (Horovod takes a 0 as the end of the whole job); 2 for a bad config or input, or a
Horovod that is not the patched build (:mod:`elastictrain.horovod.build_check`), with one line; 143 when stopped by
SIGTERM. A worker whose training raised writes why (:mod:`elastictrain.rundir.worker_error`) before it exits, so the
launcher can name the cause last.
"""

from __future__ import annotations

import sys

from elastictrain.cliutil import OneLineParser
from elastictrain.config import ConfigError, load_config
from elastictrain.config_cli import add_config_args, report_config_error
from elastictrain.horovod.build_check import UnpatchedHorovod, check_patched_horovod
from elastictrain.logconf import configure_logging


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="elastictrain train", description=__doc__.splitlines()[0] if __doc__ else None)
    add_config_args(p)
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return report_config_error(e)
    configure_logging(job=cfg.job)
    try:
        check_patched_horovod()  # before Horovod is imported: a stock wheel would run without the repairs
    except UnpatchedHorovod as e:
        from elastictrain.rundir.worker_error import record_worker_error

        record_worker_error(cfg.run_path, e)
        print(f"elastictrain train: error: {e}", file=sys.stderr)
        return 2
    from elastictrain.engine.health.hang import announce
    from elastictrain.engine.health.signals import STARTUP
    from elastictrain.engine.health.transport import open_signals
    from elastictrain.rundir.outbox import open_outbox

    try:
        signals = open_signals(cfg)  # elastic.signals: the run_dir's files or the job's etcd
        outbox = open_outbox(cfg.elastic.outputs)  # elastic.outputs: None = the run_dir's files
    except ConfigError as e:
        return report_config_error(e)
    announce(signals, STARTUP)  # before torch, horovod and hvd.init
    from elastictrain.engine import compose  # torch + horovod: imported only once the config is good
    from elastictrain.rundir.worker_error import record_worker_error
    from elastictrain.task import add_import_paths

    add_import_paths(args.config)  # the task module may sit next to the config or in the working directory

    try:
        return compose.run(cfg)
    except ConfigError as e:
        record_worker_error(cfg.run_path, e, outbox)
        return report_config_error(e)
    except Exception as e:
        record_worker_error(cfg.run_path, e, outbox)
        raise
