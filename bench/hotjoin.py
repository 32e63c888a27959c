"""Hot join for the benchmarks' jobs: a warm zygote per logical host, as ``elastictrain agent --warm-config`` keeps.

Contract:
- :func:`warm_zygotes` writes the job's config, starts one ``elastictrain zygote serve`` per host in a fresh
  socket folder, and yields only once every zygote is warm (its ready line read). On exit it kills each
  zygote and every process under it (the workers it forked) by pid, and removes the socket folder.
- A job reaches them when its workers run :func:`hot_command` with :attr:`WarmZygotes.env` in their
  environment (the job name and the socket folder); a host with no warm zygote starts its worker cold.
- :meth:`WarmZygotes.forked` finds the live worker a host's zygote forked: the training process itself,
  which the process horovodrun started (the zygote's client) only stands in for.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import yaml

from chaos.procs import checkout_env, kill_tree
from elastictrain import envnames
from elastictrain.commands import ZYGOTE_CLIENT, train_command, zygote_command
from elastictrain.hotjoin.protocol import CHECKER_NAME, DIR_ENV, READY_LINE


def hot_command(cfg_path: Path) -> list[str]:
    """The worker command of a hot job: the zygote's client in front of ``elastictrain train``."""
    return [sys.executable, *ZYGOTE_CLIENT, *train_command(cfg_path)]


@dataclass
class WarmZygotes:
    """The warm zygotes of one job, by host."""

    job: str
    sockets: Path
    procs: dict[str, subprocess.Popen[str]]

    @property
    def env(self) -> dict[str, str]:
        """What a worker's environment needs for its client to find its host's zygote."""
        return {envnames.JOB: self.job, DIR_ENV: str(self.sockets)}

    def alive(self) -> dict[str, bool]:
        return {host: p.poll() is None for host, p in self.procs.items()}

    def forked(self, host: str) -> list[psutil.Process]:
        """The live workers that ``host``'s zygote forked (its children but its checker process; a zombie not yet
        reaped is left out)."""
        out = []
        with contextlib.suppress(psutil.NoSuchProcess, KeyError):
            for p in psutil.Process(self.procs[host].pid).children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if p.status() != psutil.STATUS_ZOMBIE and p.name() != CHECKER_NAME:
                        out.append(p)
        return out

    def close(self) -> None:
        for p in self.procs.values():
            kill_tree(p.pid)
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        shutil.rmtree(self.sockets, ignore_errors=True)


def _drain(stream: IO[str]) -> None:
    with contextlib.suppress(ValueError, OSError, RuntimeError):  # EOF once the zygote and its forks are gone
        for _ in stream:
            pass


@contextlib.contextmanager
def warm_zygotes(cfg_path: Path, config: dict[str, Any], hosts: list[str]) -> Iterator[WarmZygotes]:
    """Write ``config`` to ``cfg_path`` and keep a warm zygote of its job on each of ``hosts`` (see the module)."""
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(config))
    job = str(config["job"])
    sockets = Path(tempfile.mkdtemp(prefix="et-zy-", dir="/tmp"))  # AF_UNIX paths are short
    zygotes = WarmZygotes(job, sockets, {})
    env = {**checkout_env(), **zygotes.env}  # the workers' sys.path (chaos.jobs): else a client would start cold
    try:
        for host in hosts:
            cmd = zygote_command(str(cfg_path), (), job=job, host=host)
            zygotes.procs[host] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        for p in zygotes.procs.values():
            assert p.stdout is not None
            for line in p.stdout:  # until the zygote is warm, or it exits (the loop ends)
                if line.startswith(READY_LINE):
                    break
            else:
                raise RuntimeError(f"zygote pid {p.pid} did not get ready (exit {p.poll()})")
            # It says a line per fork from now on: read them, or a long run fills the pipe and blocks it.
            threading.Thread(target=_drain, args=(p.stdout,), name=f"zygote-{p.pid}-stdout", daemon=True).start()
        yield zygotes
    finally:
        zygotes.close()
