"""Processes of a launch: start them so they die with the launcher, recognise workers, track and end them by pid.

Every process the launcher starts gets a parent-death signal (:func:`die_with_parent`, through
:mod:`elastictrain.lifeline`) and the launch id in its environment (:data:`elastictrain.envnames.LAUNCH_ID`).
:class:`ProcessTracker` remembers every descendant it has seen by pid and create time, so a reused pid is
never signalled. :func:`runs_train` and :func:`is_worker` say which processes are workers; ``chaos``, the
demo and the tests use them too. Import-light: psutil and the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil

from elastictrain.commands import ZYGOTE_CLIENT
from elastictrain.lifeline import set_parent_death_signal


def die_with_parent(sig: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when the launcher dies, SIGKILL and OOM included.

    Linux delivers it when the thread that forked the child exits; the launcher starts every process
    from its main thread. A launcher that died between fork and ``prctl`` is caught by the parent check.
    """
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def set_child_subreaper() -> None:
    """Orphaned descendants (e.g. a worker whose horovodrun middleman died) re-parent to us, so we find them."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def process_runs_train(proc: psutil.Process) -> bool:
    """:func:`runs_train` of ``proc``'s command line; False when it is gone."""
    try:
        return runs_train(proc.cmdline())
    except psutil.Error:
        return False


def runs_train(cmd: Sequence[str]) -> bool:
    """``[python] .../elastictrain train ...``, ``python -m elastictrain.cli train ...``, or either behind the
    zygote's client (the process horovodrun started; it relays signals to the warm-forked worker). Not
    horovodrun, whose command line contains the worker's further on (pure)."""
    if is_zygote_client(cmd):
        cmd = cmd[1 + len(ZYGOTE_CLIENT) :]
    for i, arg in enumerate(cmd[:3]):
        if (arg == "elastictrain" or arg.endswith("/elastictrain")) and cmd[i + 1 : i + 2] == ["train"]:
            return True
    return cmd[1:4] == ["-m", "elastictrain.cli", "train"]


def is_worker(proc: psutil.Process) -> bool:
    """An ``elastictrain train`` process: not the shell around it, nor a forked helper of it (checkpoint writer)."""
    if not process_runs_train(proc):
        return False
    try:
        parent = proc.parent()
    except psutil.Error:
        return True
    return parent is None or not process_runs_train(parent)


def is_zygote_client(cmd: Sequence[str]) -> bool:
    """``python -m elastictrain.hotjoin.client -- ...``: what horovodrun started for a hot-joined worker (pure)."""
    return tuple(cmd[1 : 1 + len(ZYGOTE_CLIENT)]) == ZYGOTE_CLIENT


def _std_fds(pid: int) -> tuple[str, str, str] | None:
    try:
        return tuple(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in range(3))  # type: ignore[return-value]
    except OSError:
        return None


def forked_worker(client: psutil.Process, candidates: Iterable[psutil.Process]) -> psutil.Process | None:
    """The training process a warm zygote forked for ``client`` (a zygote client), among ``candidates``; None when
    there is none (the client started its worker cold, by exec, or the fork has not happened yet).

    The zygote hands the client's fds 0, 1 and 2 (horovodrun's pipes, one set per worker) to the fork, so the
    worker is the process other than the client (and its ancestors) that holds the same three and whose parent
    (the zygote) does not; its own children (a checkpoint writer, loader workers) inherit them from it. A fault
    aimed at a worker (SIGSTOP, above all, which the client cannot relay) must reach that process, not the client.
    """
    want = _std_fds(client.pid)
    if want is None:
        return None
    try:
        not_it = {client.pid, *(a.pid for a in client.parents())}  # a shell around the client holds them too
    except psutil.Error:
        return None
    for p in candidates:
        with contextlib.suppress(psutil.Error):
            if p.pid in not_it or _std_fds(p.pid) != want:
                continue
            parent = p.parent()
            if parent is None or _std_fds(parent.pid) != want:
                return p
    return None


def ssh_runs_train(cmd: Sequence[str]) -> bool:
    """``ssh [opts] HOST '... elastictrain train ...'``: how horovodrun runs a worker on another host (pure)."""
    return bool(cmd) and Path(cmd[0]).name == "ssh" and any("elastictrain" in a and " train " in a for a in cmd[1:])


def is_remote_worker(proc: psutil.Process) -> bool:
    """An ssh client of horovodrun's that runs a worker on another host (the worker is not our descendant)."""
    try:
        return ssh_runs_train(proc.cmdline())
    except psutil.Error:
        return False


class ProcessTracker:
    """Every process the launcher started, and every descendant of them it has seen (identified by pid
    and create time, so a reused pid is never signalled)."""

    def __init__(self) -> None:
        self.seen: dict[int, psutil.Process] = {}
        self.popens: dict[int, subprocess.Popen[bytes]] = {}

    def add(self, popen: subprocess.Popen[bytes]) -> None:
        self.popens[popen.pid] = popen
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen[popen.pid] = psutil.Process(popen.pid)

    def refresh(self) -> None:
        """Record the current descendants of this process; reap orphans that re-parented to it."""
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for p in children:
            self.seen.setdefault(p.pid, p)
        for p in psutil.Process().children():
            if p.pid not in self.popens:
                with contextlib.suppress(OSError, psutil.Error):
                    if p.status() == psutil.STATUS_ZOMBIE:
                        os.waitpid(p.pid, os.WNOHANG)
        for pid, p in list(self.seen.items()):
            if not is_alive(p):
                del self.seen[pid]

    def alive(self) -> list[psutil.Process]:
        self.refresh()
        return [p for p in self.seen.values() if is_alive(p)]

    def descendants(self, pid: int) -> list[psutil.Process]:
        try:
            return psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def tree(self, pid: int) -> list[psutil.Process]:
        """``pid`` and its descendants."""
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_all(self, procs: Iterable[psutil.Process] | None = None) -> None:
        targets = list(self.alive() if procs is None else procs)
        for p in targets:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(targets, timeout=5)
        for popen in self.popens.values():
            with contextlib.suppress(Exception):
                popen.wait(timeout=1)
        self.refresh()


def is_alive(p: psutil.Process) -> bool:
    """Whether ``p`` runs (a zombie does not)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def terminate(popen: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Send ``sig`` to ``popen`` and reap it; SIGKILL if it outlives ``timeout``."""
    if popen is None or popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        popen.send_signal(sig)
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            popen.kill()
        popen.wait(timeout=5)


def create_time(pid: int) -> float | None:
    """When ``pid`` started (psutil's clock), so a reader of launch.json can tell a reused pid; None if gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on ``host`` (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
