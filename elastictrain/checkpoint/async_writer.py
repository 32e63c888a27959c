"""Background writers: where a snapshot is serialised (torch.save) and written to storage.

- :class:`ProcessWriter`: a separate process (preferred: on a small machine a writer thread fights
  the training loop for the GIL while pickling and hashing). Started from a ``forkserver`` that has
  torch preloaded, so a start or a restart after a crash costs milliseconds, and the child inherits
  nothing of the trainer (no CUDA context, no Horovod threads). It receives the shared pool once,
  at start, and then one small :class:`WriteJob` per save over a pipe.
- :class:`InlineWriter`: writes in the calling thread (the checkpointer's ``thread`` and ``sync`` modes).

Both expose ``run(job) -> WriteResult`` (blocking; raises on failure, :class:`WriterDied` when the
process vanished).

The writer process dies with its trainer (:class:`TrainerFence`). A thread of the writer waits on a
pidfd of the trainer and SIGKILLs the writer when the trainer exits. Its parent is the fork server,
which exits once no process holds the server's liveness pipe: the writer closes its inherited copy, and
holds a parent-death SIGKILL. Both signals can come late (armed after the fork; a pidfd needs Linux
5.3), so right before it moves ``latest`` and before it prunes the writer checks again that its parent
is the one it started with and that the trainer is alive; if not, it leaves without touching either.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import select
import signal
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from elastictrain.checkpoint.format import WriteResult, write_checkpoint
from elastictrain.checkpoint.snapshot import SharedPool, Snapshot, materialize
from elastictrain.checkpoint.storage import CheckpointStorage
from elastictrain.errors import CheckpointError
from elastictrain.lifeline import set_parent_death_signal

_FORKSERVER_PRELOAD = ["torch", "elastictrain.checkpoint.async_writer"]


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One save, as sent to a writer: the snapshot skeleton plus the manifest fields."""

    snapshot: Snapshot
    step: int
    epoch: int
    world_size: int
    config_hash: str
    meta: dict[str, Any] = field(default_factory=dict)
    keep_last: int | None = None


class WriterDied(CheckpointError, RuntimeError):
    """The writer process exited (killed, out of memory) before answering."""


class WriteFailed(CheckpointError, RuntimeError):
    """The writer reported an exception; the message carries its type, text and traceback."""


class TrainerGone(CheckpointError, RuntimeError):
    """The trainer that started this writer is gone: the writer must neither move ``latest`` nor prune."""


class TrainerFence:
    """In the writer process: arms the parent-death SIGKILL and tells whether the trainer is still there.

    Build it first thing in the writer. Calling it raises :class:`TrainerGone` when the writer's parent is
    no longer the one it started with (the fork server exited: the writer was re-parented) or the trainer
    process itself has exited (a pidfd on Linux, else a signal-0 probe).
    """

    def __init__(self, trainer_pid: int) -> None:
        self.parent = os.getppid()
        self.trainer_pid = trainer_pid
        set_parent_death_signal(signal.SIGKILL)
        _release_fork_server()
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(trainer_pid)
        if self._pidfd is not None:
            threading.Thread(target=self._kill_self_when_trainer_exits, name="trainer-watch", daemon=True).start()

    def _kill_self_when_trainer_exits(self) -> None:
        assert self._pidfd is not None
        select.select([self._pidfd], [], [])  # readable once the trainer has exited
        os.kill(os.getpid(), signal.SIGKILL)

    def gone(self) -> str | None:
        """Why the trainer counts as gone, or None while it is alive and the parent unchanged."""
        if os.getppid() != self.parent:
            return f"the writer's parent {self.parent} exited (now {os.getppid()})"
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            if readable:
                return f"the trainer (pid {self.trainer_pid}) exited"
            return None
        try:
            os.kill(self.trainer_pid, 0)
        except ProcessLookupError:
            return f"the trainer (pid {self.trainer_pid}) exited"
        except PermissionError:
            pass
        return None

    def __call__(self) -> None:
        reason = self.gone()
        if reason is not None:
            raise TrainerGone(f"{reason}; leaving latest and the other checkpoints alone")


def _release_fork_server() -> None:
    """Close this child's copy of the fork server's liveness pipe (every forkserver child inherits one, to
    start children of its own; the writer starts none). The server exits when the trainer's copy closes, and
    a parent-death signal then reaches the writer."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def execute(
    storage: CheckpointStorage, pool: SharedPool, job: WriteJob, fence: Callable[[], None] | None = None
) -> WriteResult:
    """Rebuild the state from the pool and write it; shared by every writer kind (``fence``: see write_checkpoint)."""
    return write_checkpoint(
        storage,
        materialize(job.snapshot, pool),
        step=job.step,
        epoch=job.epoch,
        world_size=job.world_size,
        config_hash=job.config_hash,
        meta=job.meta,
        keep_last=job.keep_last,
        fence=fence,
    )


class InlineWriter:
    """Writes in the calling thread."""

    pid: int | None = None

    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self._pool: SharedPool | None = None

    def ensure(self, pool: SharedPool) -> str | None:
        self._pool = pool
        return None

    def run(self, job: WriteJob) -> WriteResult:
        assert self._pool is not None, "ensure(pool) first"
        return execute(self.storage, self._pool, job)

    def stop(self, timeout: float | None = None) -> None:
        self._pool = None

    def kill(self) -> None:
        self._pool = None


def _writer_main(
    conn: multiprocessing.connection.Connection,
    storage: CheckpointStorage,
    pool: SharedPool,
    nice: int,
    trainer_pid: int,
) -> None:
    """Body of the writer process: one job at a time until ``None`` or the trainer goes away."""
    fence = TrainerFence(trainer_pid)
    if fence.gone() is not None:
        return  # the trainer died before the parent-death signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    with contextlib.suppress(OSError):
        os.nice(nice)
    torch.set_num_threads(1)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if job is None:
            return
        try:
            result = execute(storage, pool, job, fence)
        except TrainerGone:
            return  # nobody to answer; latest and the other checkpoints are left as they are
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        else:
            conn.send(("ok", result))


@contextlib.contextmanager
def _no_main_reimport() -> Iterator[None]:
    """Start children without re-running the parent's ``__main__`` in them.

    ``forkserver`` (like ``spawn``) re-imports the main script in each child, which in a trainer would
    import Horovod, MLflow and the whole worker again, and re-run an unguarded script. The writer
    needs none of it, so the main module is hidden for the few milliseconds of ``start()``.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


def prestart_forkserver(wait: bool = True) -> None:
    """Start the fork server (once per process); it imports torch in a process of its own.

    ``wait``: until that import is done (a second or two; much longer on loaded cores), so the writer's first
    start does not pay for it. Without: return at once, and the first start waits only for what is left.
    """
    ctx = _context()  # sets the preload list
    multiprocessing.forkserver.ensure_running()
    if not wait:
        return
    with _no_main_reimport():
        probe = ctx.Process(target=os.getpid, name="elastictrain-checkpoint-warmup", daemon=True)
        probe.start()
    probe.join(120)
    probe.close()


class ProcessWriter:
    """A writer process holding one pool. Driven by one thread at a time (the checkpointer keeps it so)."""

    def __init__(self, storage: CheckpointStorage, *, nice: int = 10) -> None:
        self.storage = storage
        self.nice = nice
        self._proc: Any = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._pool: SharedPool | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def ensure(self, pool: SharedPool) -> str | None:
        """Make sure a live writer holds ``pool``; (re)start it if needed.

        Returns a sentence when a previous writer was found dead (the caller counts it), else None.
        """
        died = None
        if self._proc is not None and not self._proc.is_alive():
            died = f"checkpoint writer process {self._proc.pid} had died (exit code {self._proc.exitcode})"
            self._discard()
        if self._proc is not None and self._pool is not pool:
            self.stop()
        if self._proc is None:
            self._start(pool)
        return died

    def _start(self, pool: SharedPool) -> None:
        ctx = _context()
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_writer_main,
            args=(child, self.storage, pool, self.nice, os.getpid()),
            name="elastictrain-checkpoint-writer",
            daemon=True,
        )
        with _no_main_reimport():
            proc.start()
        child.close()
        self._proc, self._conn, self._pool = proc, parent, pool

    def run(self, job: WriteJob) -> WriteResult:
        assert self._proc is not None and self._conn is not None, "ensure(pool) first"
        proc, conn = self._proc, self._conn
        try:
            conn.send(job)
            multiprocessing.connection.wait([conn, proc.sentinel])
            reply = conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            reply = None
        if reply is None:
            pid = proc.pid
            proc.join(5)
            code = proc.exitcode
            self._discard()
            raise WriterDied(f"checkpoint writer process {pid} died during the save (exit code {code})")
        if reply[0] == "ok":
            result: WriteResult = reply[1]
            return result
        raise WriteFailed(f"{reply[1]}\n{reply[2]}")

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            with contextlib.suppress(ValueError):
                self._proc.close()
        self._proc = self._conn = self._pool = None

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask an idle writer to exit; kill it when it does not within ``timeout`` seconds."""
        if self._proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert self._conn is not None
            self._conn.send(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._discard()

    def kill(self) -> None:
        """SIGKILL the writer (a stuck save at close); what it was writing is lost, ``latest`` is intact.

        Only signals: the thread inside :meth:`run` sees the death and cleans up.
        """
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
