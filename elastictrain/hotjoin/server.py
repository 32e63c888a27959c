"""Hot join's server, the zygote: ``elastictrain zygote serve``, a warm worker factory for one job and host.

Started by the node agent (``--warm-config``), it imports what a worker of its job imports and indexes its image
folders once (:func:`warm`), then forks a worker per client request (:class:`Zygote`). Its promises are the
contract in :mod:`elastictrain.hotjoin`; the wire format is :mod:`elastictrain.hotjoin.protocol`. At load time it
imports only the standard library and the protocol: everything after :func:`record_reads` is stamped as read.

Size: the warm-up, the code stamp, the checker and the serving loop guard one process's fork (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from elastictrain import envnames
from elastictrain.hotjoin.protocol import (
    ANSWER_SECONDS,
    CHECKER_NAME,
    READY_LINE,
    WARMING_POLL_SECONDS,
    ProtocolError,
    check_folder,
    close_all,
    decode,
    mark_warming,
    missing,
    path_tail,
    peer_uid,
    recv_message,
    send_message,
    socket_path,
    unmark_warming,
    valid_request,
)

CHECK_SECONDS = 3.0
"""How long one check of the checker process may take (stat of the watched files, realpath of the configs asked,
which a hung network file system never returns from); then it is killed, the requests that waited on it are
refused, and a new checker starts once it is gone."""
STAMP_CHECK_SECONDS = 2.0
"""How often the zygote compares the code it imported with the files on disk, besides before every fork."""
RESTART_RESET_SECONDS = 60.0
"""A zygote whose code changed after it had served this long re-executes at once; sooner, it counts as a restart in
a row and waits (:func:`restart_delay`)."""
RESTART = -1
"""What :meth:`Zygote.serve` returns when the code changed on disk: re-execute, do not exit."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a worker runs: its config (the real path) and ``--set`` overrides. A zygote serves only its own: the
    config its agent warmed, not another one that a worker of the same job names."""

    config: str
    overrides: tuple[str, ...]

    @classmethod
    def of(cls, config: str, overrides: list[str] | tuple[str, ...], cwd: str | None = None) -> JobSpec:
        return cls(os.path.realpath(os.path.join(cwd or os.getcwd(), config)), tuple(overrides))

    @staticmethod
    def named(request: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        """The config path a request's ``args`` name (``--config X [--set k=v ...]``), joined to its ``cwd`` but not
        resolved (``""`` when it names none), and its ``--set`` overrides."""
        args: list[str] = request["args"]
        config, overrides = "", []
        for flag, value in itertools.pairwise(args):
            if flag == "--config":
                config = value
            elif flag == "--set":
                overrides.append(value)
        return (os.path.join(request["cwd"], config) if config else ""), tuple(overrides)

    def __str__(self) -> str:
        return " ".join([self.config, *(f"--set {o}" for o in self.overrides)])


LOAD_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "OPENBLAS_", "GOTO_", "MKL_", "MALLOC_", "TORCH")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")
"""Thread counts that torch and OpenBLAS take when they load; a forked worker sets its client's
(:func:`apply_thread_counts`)."""
_SET_AFTER_FORK = frozenset({*THREAD_VARIABLES, "PYTHONUNBUFFERED", "PYTHONPATH"})


def load_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that the interpreter, the dynamic loader or a library read when they start or load
    (``PYTHON*``, ``LD_*``, OpenMP's, OpenBLAS's, MKL's, glibc's malloc tunables, torch's): a worker forked from the
    zygote has the zygote's values in effect. Not those a worker sets after the fork (the thread counts,
    ``PYTHONUNBUFFERED``), nor ``PYTHONPATH``, whose effect (``sys.path``) is compared itself."""
    return {
        k: v
        for k, v in env.items()
        if (k.startswith(LOAD_TIME_PREFIXES) or k == "GLIBC_TUNABLES") and k not in _SET_AFTER_FORK
    }


@dataclass(frozen=True, slots=True)
class Startup:
    """What a Python process fixed when it started and a worker forked from it keeps: its installation
    (``sys.prefix``), ``sys.path`` after its first entry, and :func:`load_time_env` of its environment."""

    prefix: str
    path: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @classmethod
    def here(cls) -> Startup:
        return cls(sys.prefix, tuple(path_tail(sys.path)), tuple(sorted(load_time_env(os.environ).items())))

    @classmethod
    def of_request(cls, request: dict[str, Any]) -> Startup:
        """The start-up of the cold worker that a (valid) request stands for."""
        return cls(request["prefix"], tuple(request["path"]), tuple(sorted(load_time_env(request["env"]).items())))

    def difference(self, client: Startup) -> str | None:
        """What a worker forked from this process would have other than the cold worker ``client``, in one line;
        None when nothing."""
        if client.prefix != self.prefix:
            return f"the client's Python is {client.prefix}, the zygote's {self.prefix}"
        mine, theirs = dict(self.env), dict(client.env)
        for name in sorted(mine.keys() | theirs.keys()):
            if mine.get(name) != theirs.get(name):
                return f"{name} is {_shown(theirs.get(name))} for the client, {_shown(mine.get(name))} in the zygote"
        if client.path != self.path:
            extra = [p for p in client.path if p not in self.path]
            missing = [p for p in self.path if p not in client.path]
            where = (
                f"{extra[0]} only in the client's"
                if extra
                else f"{missing[0]} only in the zygote's"
                if missing
                else "in another order"
            )
            return f"the client's sys.path differs from the zygote's ({where})"
        return None


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value[:60])


def apply_thread_counts(env: Mapping[str, str]) -> None:
    """Give the libraries that the zygote loaded the thread counts that ``env`` gives them when they load in a cold
    worker: torch's intra-op threads (``MKL_NUM_THREADS``, else ``OMP_NUM_THREADS``; with neither, torch's default,
    which the zygote kept by loading torch without them) and OpenBLAS's (``OPENBLAS_NUM_THREADS``, else
    ``GOTO_NUM_THREADS``, else ``OMP_NUM_THREADS``, else one per processor; at most one per processor)."""
    torch = sys.modules.get("torch")
    threads = _count(env.get("MKL_NUM_THREADS")) or _count(env.get("OMP_NUM_THREADS"))
    if torch is not None and threads:
        torch.set_num_threads(threads)
    for set_num_threads, get_num_procs in _openblas():
        procs = get_num_procs()
        wanted = next(
            (n for v in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS") if (n := _count(env.get(v)))),
            procs,
        )
        set_num_threads(max(1, min(wanted, procs)))


def _count(value: str | None) -> int | None:
    try:
        n = int(value or "")
    except ValueError:
        return None
    return n if n > 0 else None


def _openblas() -> list[tuple[Any, Any]]:
    """``(set_num_threads, get_num_procs)`` of every OpenBLAS this process has loaded (numpy's is scipy-openblas)."""
    import ctypes

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = []
    libraries = {line.split()[-1] for line in maps.splitlines() if "openblas" in line.rsplit("/", 1)[-1]}
    for library in sorted(libraries):
        try:
            lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        for prefix, suffix in itertools.product(("openblas_", "scipy_openblas_"), ("", "64_")):
            set_num_threads = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
            get_num_procs = getattr(lib, f"{prefix}get_num_procs{suffix}", None)
            if set_num_threads is not None and get_num_procs is not None:
                found.append((set_num_threads, get_num_procs))
                break
    return found


_READ: dict[str, tuple[int, int] | None] = {}
"""``(st_mtime_ns, st_size)`` of source files as this process read them, by the path it read them at
(:func:`record_reads`, :func:`note_read`)."""
_PATH_STATS: Any = None
"""``SourceFileLoader.path_stats`` as it was before :func:`record_reads` replaced it."""


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def note_read(path: str) -> None:
    """Record ``path`` as it is now, before it is read."""
    _READ[path] = _stat(path)


def record_reads() -> None:
    """From now on, record each module's source file as the import system reads it: its stat when the import system
    asks for it (``SourceFileLoader.path_stats``, before it reads the source or checks the cached bytecode against
    it). The modules loaded already are recorded as they are now. Idempotent; :func:`stop_recording` ends it."""
    global _PATH_STATS
    from importlib.machinery import SourceFileLoader

    if _PATH_STATS is not None:
        return
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.endswith(".py") and path not in _READ:
            note_read(path)

    def path_stats(self: SourceFileLoader, path: str) -> dict[str, Any]:
        st = os.stat(path)
        _READ[path] = (st.st_mtime_ns, st.st_size)
        return {"mtime": st.st_mtime, "size": st.st_size}

    _PATH_STATS = SourceFileLoader.path_stats
    SourceFileLoader.path_stats = path_stats  # type: ignore[method-assign]


def stop_recording() -> None:
    global _PATH_STATS
    from importlib.machinery import SourceFileLoader

    if _PATH_STATS is not None:
        SourceFileLoader.path_stats = _PATH_STATS  # type: ignore[method-assign]
        _PATH_STATS = None


class CodeStamp:
    """The source files a zygote's code came from, with their ``(st_mtime_ns, st_size)`` as it read them.

    :meth:`take` records every loaded module of ``elastictrain`` and ``discovery``, of the task's top-level
    package, and every module whose file lies outside the Python installation (the user's code, an editable
    install), plus the ``extra`` files (the config). Installed third-party packages (torch, Horovod) are not
    watched: upgrading them means restarting the agents. A file's stamp is what the process saw when it read it
    (:func:`record_reads`, :func:`note_read`), else what is on disk when the stamp is taken; no clock is compared,
    so a file whose mtime lies in the future (a server's clock ahead, a tarball's timestamps) is not a change.
    """

    def __init__(self, files: dict[str, tuple[int, int] | None]) -> None:
        self.files = files

    @classmethod
    def take(cls, packages: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> CodeStamp:
        """The stamp of what is loaded now: a file edited after it was read counts as changed at once."""
        import site
        import sysconfig

        installed = {
            os.path.realpath(p)
            for p in (
                sys.prefix,
                sys.base_prefix,
                sys.exec_prefix,
                *sysconfig.get_paths().values(),
                *site.getsitepackages(),
                site.getusersitepackages(),
            )
            if p
        }
        watched = {"elastictrain", "discovery", *packages}
        files: dict[str, tuple[int, int] | None] = {}
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if not isinstance(path, str) or not path.endswith(".py"):
                continue  # builtins, extension modules (installed binaries), namespace packages
            real = os.path.realpath(path)
            outside = not any(real.startswith(root + os.sep) for root in installed)
            if name.partition(".")[0] in watched or outside:
                files[real] = _READ[path] if path in _READ else _stat(real)
        for path in extra:
            files[os.path.realpath(path)] = _READ[path] if path in _READ else _stat(path)
        return cls(files)

    def changed(self) -> str | None:
        """The first watched file whose mtime or size differs from when the stamp was taken (or that is gone),
        else None. A module imported only later (by a forked worker) is not watched: it is read fresh anyway."""
        for path, seen in self.files.items():
            if _stat(path) != seen:
                return path
        return None


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def warm(config: str, overrides: list[str]) -> CodeStamp:
    """Import what a worker of this job imports and index its image folders; start no thread. Returns the
    stamp of the code it imported (:class:`CodeStamp`)."""
    record_reads()
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy loads: OpenBLAS starts its pool at import
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.pop(name, None)  # torch takes its default at import: the one a worker without them has
    note_read(config)
    from elastictrain.config import load_config
    from elastictrain.task import add_import_paths, resolve_builder

    cfg = load_config(config, overrides)
    add_import_paths(config)
    import horovod.torch  # noqa: F401
    import torch._dynamo  # noqa: F401  - a worker's first optimizer imports it lazily: seconds of CPU, no thread

    with contextlib.suppress(ImportError):  # a task without images may run where torchvision is not installed
        import torchvision.datasets.folder  # noqa: F401  - an image dataset's first sample imports it: 0.4 s
        from PIL import Image

        Image.init()  # every image plugin, which the first decode would import

    from elastictrain.engine import worker  # noqa: F401
    from elastictrain.engine.folder_index import folder_index

    resolve_builder(cfg.task)  # imports the task's module; building it would run torch ops (threads)
    for key in ("path", "val_path"):
        path = cfg.task_args.get(key)
        if isinstance(path, str) and Path(path).is_dir():
            with contextlib.suppress(OSError):
                folder_index(path)
    package = cfg.task.partition(":")[0].partition(".")[0]
    return CodeStamp.take(packages=(package,), extra=(config,))


WARM_SLOT_WAIT_SECONDS = 60.0
"""How long a zygote waits for a warm-up slot of its machine before it warms anyway."""


@contextlib.contextmanager
def warm_slot(folder: Path, slots: int, wait: float) -> Iterator[bool]:
    """Hold one of the machine's ``slots`` warm-up slots (``warm-<i>.lock`` in the zygote ``folder``, taken with
    ``flock``, so a dead holder frees its slot) while the block runs; yields False when none was free within
    ``wait`` seconds (the block runs anyway): zygotes that start at once are warm one after another, not all
    late together."""
    deadline, fd = time.monotonic() + wait, None
    try:
        while fd is None:
            for i in range(slots):
                f = os.open(folder / f"warm-{i}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(f)
                    continue
                fd = f
                break
            else:
                if time.monotonic() >= deadline:
                    break
                time.sleep(WARMING_POLL_SECONDS)
    except OSError:  # a slot file that cannot be opened: the slots only pace warm-ups, so warm without one
        pass
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def listen(path: Path) -> socket.socket:
    """Bind the socket at ``path``; a live zygote already serving there is an error, a stale socket is replaced."""
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_folder(folder)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # nobody listens: a stale socket of a zygote that died
    else:
        raise FileExistsError(f"a zygote already serves {path}")
    finally:
        probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


@dataclass(eq=False)
class _Conn:
    """A client's connection until its request is answered."""

    sock: socket.socket
    deadline: float
    """When it is answered with an error if it has not been answered yet (:data:`ANSWER_SECONDS` after accept)."""
    frame: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    request: dict[str, Any] | None = None
    """The request, once it is all here (it then waits for a check)."""


@dataclass(eq=False)
class _Checker:
    """The zygote's checker process (:func:`_check_forever`) and the check it runs."""

    pid: int
    sock: socket.socket
    frame: bytearray = field(default_factory=bytearray)
    asked: list[_Conn] | None = None
    """The requests the check in flight is for (``[]``: a periodic check); None while the checker is idle."""
    deadline: float = math.inf


class Zygote:
    """The serving loop: one thread, a selector over the listener, the connections, the checker and a SIGCHLD
    wake-up pipe; nothing in it waits on one connection or on the file system."""

    def __init__(
        self,
        listener: socket.socket,
        path: Path,
        stamp: CodeStamp | None = None,
        job: JobSpec | None = None,
        startup: Startup | None = None,
    ) -> None:
        import selectors

        self.listener, self.path = listener, path
        self.stamp = stamp
        self.job = job
        """The config and ``--set`` overrides this zygote warmed; a request for another job is refused."""
        self.startup = startup or Startup.here()
        """What this process fixed when it started; a request whose cold worker would differ is refused."""
        self.stale: str | None = None
        """The file whose change made this zygote's code old (it then restarts), or None."""
        self.clock = time.monotonic
        self.inode = os.stat(path).st_ino
        self.parent = os.getppid()
        self.conns: set[_Conn] = set()
        """Accepted connections not answered yet."""
        self.waiting: list[_Conn] = []
        """Complete requests waiting for the next check."""
        self.children: dict[int, socket.socket] = {}
        """Running workers and their client's connection."""
        self.checker: _Checker | None = None
        self.killed_checkers: set[int] = set()
        """Checkers killed and not reaped yet (one stuck in a hung file system): no new one starts meanwhile."""
        self.next_check = self.clock() + STAMP_CHECK_SECONDS
        self.next_checker = 0.0
        self.stopping = False
        self.signalled = False
        """SIGTERM or SIGINT came: exit when the workers have, whatever the code on disk."""
        self.sel = selectors.DefaultSelector()
        self.EVENT_READ = selectors.EVENT_READ
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_w = wake_w
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        listener.setblocking(False)
        self.sel.register(listener, self.EVENT_READ, "accept")
        self.sel.register(self.wake_r, self.EVENT_READ, "wake")

    def _stop(self, *_: Any) -> None:
        self.stopping = self.signalled = True

    def unlink(self) -> None:
        """Remove our socket, not one a newer zygote bound at the same path since."""
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                self.path.unlink()

    def serve(self) -> int:
        """Serve until stopped (0), or until the code changed on disk and no worker runs (:data:`RESTART`)."""
        try:
            while not (self.stopping and not self.children):
                self._cycle()
        finally:
            self._end_checker()
        restart = self.stale is not None and not self.signalled and os.getppid() == self.parent
        return RESTART if restart else 0

    def _cycle(self) -> None:
        if os.getppid() != self.parent:
            self.stopping = True  # the agent died: take no more requests, let the running workers finish
        if self.stopping:
            self._stop_listening()
        now = self.clock()
        self._tend_checker(now)
        for conn in [c for c in self.conns if now >= c.deadline]:
            self._refuse(conn, f"no answer within {ANSWER_SECONDS:g}s of connecting")
        for key, _ in self.sel.select(timeout=self._timeout(now)):
            try:
                self._ready(key.data)
            except Exception as e:  # one bad request must not take the running workers down with us
                _say(f"zygote: request refused: {type(e).__name__}: {str(e)[:200]}")
        self._reap()

    def _timeout(self, now: float) -> float:
        deadlines = [now + 1.0, *(c.deadline for c in self.conns)]
        if self.checker is not None:
            deadlines.append(self.checker.deadline if self.checker.asked is not None else self.next_check)
        elif self._checks() and not self.stopping:
            deadlines.append(self.next_checker)
        return max(0.0, min(deadlines) - now)

    def _ready(self, data: Any) -> None:
        if data == "accept":
            self._accept()
        elif data == "wake":
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
        elif isinstance(data, _Checker):
            self._checker_answers(data)
        elif isinstance(data, _Conn):
            self._conn_readable(data)
        else:
            self._client_closed(data)

    # -- requests

    def _accept(self) -> None:
        while self.listener.fileno() >= 0:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            conn = _Conn(sock, self.clock() + ANSWER_SECONDS)
            self.conns.add(conn)
            self.sel.register(sock, self.EVENT_READ, conn)
            if (uid := peer_uid(sock)) != os.getuid():
                self._refuse(conn, f"peer uid {uid} is not ours")

    def _conn_readable(self, conn: _Conn) -> None:
        if conn not in self.conns:
            return  # answered by an earlier event of this cycle
        try:
            if conn.request is not None:  # a client sends nothing after its request: it left (or misbehaves)
                raise ProtocolError("the client sent more than its request, or left")
            while (need := missing(conn.frame)) > 0:
                try:
                    data, fds, flags, _ = socket.recv_fds(conn.sock, min(need, 1 << 16), 3)
                except (BlockingIOError, InterruptedError):
                    return
                conn.fds += fds
                if flags & socket.MSG_CTRUNC or len(conn.fds) > 3:
                    raise ProtocolError("more than 3 fds")
                if not data:
                    raise ProtocolError("connection closed inside a message" if conn.frame else "no request")
                conn.frame += data
            conn.request = valid_request(decode(bytes(conn.frame[4:])), conn.fds)
        except (OSError, ProtocolError) as e:
            self._refuse(conn, str(e))
            return
        self._requested(conn)

    def _requested(self, conn: _Conn) -> None:
        """A complete request: refuse it, or wait for a check, or (nothing to check) fork its worker."""
        assert conn.request is not None
        if (why := self.startup.difference(Startup.of_request(conn.request))) is not None:
            self._refuse(conn, f"{why}: a worker forked from the zygote would not run in the client's environment")
        elif not self._checks():
            self._start_worker(conn)
        elif self.checker is None:
            self._refuse(conn, "the zygote cannot check its code on disk now (its checker did not answer)")
        else:
            self.waiting.append(conn)

    def _checked(self, conn: _Conn, config: str) -> None:
        """The check a request waited for came back, with the real path of the config it names."""
        if conn not in self.conns or conn.request is None:
            return  # answered meanwhile (its deadline passed, its client left)
        overrides = JobSpec.named(conn.request)[1]
        if self.job is not None and (asked := JobSpec(config, overrides)) != self.job:
            self._refuse(conn, f"this zygote warmed {self.job}, not {asked}")
        else:
            self._start_worker(conn)

    def _refuse(self, conn: _Conn, why: str) -> None:
        self.conns.discard(conn)
        with contextlib.suppress(ValueError):
            self.waiting.remove(conn)
        with contextlib.suppress(Exception):
            send_message(conn.sock, {"error": why[:500]})
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()
        close_all(conn.fds)
        conn.fds = []

    def _start_worker(self, conn: _Conn) -> None:
        assert conn.request is not None
        if self.stale is not None:
            return self._refuse(conn, f"{self.stale} changed since the zygote warmed; it restarts")
        if self.stopping:
            return self._refuse(conn, "the zygote is stopping")
        if thread_count() != 1:
            return self._refuse(conn, f"zygote has {thread_count()} threads; a fork would not be safe")
        if _cuda_initialized():
            return self._refuse(conn, "CUDA was initialised in the zygote; a forked worker could not use it")
        self.conns.discard(conn)
        fds, conn.fds = conn.fds, []
        try:
            pid = self._fork_worker(conn.request, fds)
        except OSError as e:  # no fork (memory, process limit): the client starts cold
            return self._refuse(conn, f"fork failed: {e}")
        finally:
            close_all(fds)  # the worker has its own copies
        self.children[pid] = conn.sock  # from here on, its client's end is its end
        self.sel.modify(conn.sock, self.EVENT_READ, pid)
        try:
            send_message(conn.sock, {"pid": pid})
        except OSError:  # the client is gone (it started the worker cold): this one must not run too
            _kill_worker(pid)
            return None
        _say(f"zygote forked worker pid {pid}")
        return None

    def _stop_listening(self) -> None:
        if self.listener.fileno() < 0:
            return
        self.sel.unregister(self.listener)
        self.listener.close()
        self.unlink()
        why = "the zygote is stopping" if self.stale is None else f"{self.stale} changed since the zygote warmed"
        for conn in list(self.conns):
            self._refuse(conn, why)
        self._end_checker()

    # -- the checker: the zygote's file-system work, in a process of its own

    def _checks(self) -> bool:
        return self.stamp is not None or self.job is not None

    def _tend_checker(self, now: float) -> None:
        """Replace a checker that did not answer in time; start one when there is none (and no killed one is still
        there); hand it the requests that wait, or the periodic check."""
        if not self._checks() or self.stopping:
            return
        checker = self.checker
        if checker is not None and checker.asked is not None and now >= checker.deadline:
            self._checker_failed(f"it did not answer within {CHECK_SECONDS:g}s")
            return
        if checker is None:
            if not self.killed_checkers and now >= self.next_checker:
                self._start_checker()
            return
        if checker.asked is None and (self.waiting or now >= self.next_check):
            asked, self.waiting = self.waiting, []
            checker.asked, checker.deadline = asked, now + CHECK_SECONDS
            try:
                send_message(checker.sock, {"configs": [JobSpec.named(c.request or {})[0] for c in asked]})
            except OSError as e:
                self._checker_failed(str(e))

    def _start_checker(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            pid = self._fork()
        except OSError as e:
            ours.close()
            theirs.close()
            self.next_checker = self.clock() + STAMP_CHECK_SECONDS
            _say(f"zygote: cannot start its checker ({e}); requests start cold until it can")
            return
        if pid == 0:
            ours.close()
            _check_forever(theirs, self.stamp)
        theirs.close()
        ours.setblocking(False)
        self.checker = _Checker(pid, ours)
        self.sel.register(ours, self.EVENT_READ, self.checker)

    def _checker_answers(self, checker: _Checker) -> None:
        if checker is not self.checker:
            return
        try:
            while (need := missing(checker.frame)) > 0:
                try:
                    data = checker.sock.recv(min(need, 1 << 16))
                except (BlockingIOError, InterruptedError):
                    return
                if not data:
                    raise ProtocolError("it exited")
                checker.frame += data
            answer = decode(bytes(checker.frame[4:]))
            asked, changed, configs = checker.asked, answer.get("changed"), answer.get("configs")
            if asked is None or not isinstance(configs, list) or len(configs) != len(asked):
                raise ProtocolError("it answered what was not asked")
        except (OSError, ProtocolError) as e:
            self._checker_failed(str(e))
            return
        checker.frame.clear()
        checker.asked, checker.deadline = None, math.inf
        self.next_check = self.clock() + STAMP_CHECK_SECONDS
        if isinstance(changed, str) and self.stale is None:
            self.stale = changed
            self.stopping = True
            _say(f"zygote: {changed} changed since it warmed; restarting once its workers have exited")
        for conn, config in zip(asked, configs, strict=True):
            self._checked(conn, str(config))

    def _checker_failed(self, why: str) -> None:
        """The checker is gone or of no use: kill it, refuse what waited on it; a new one starts once it is gone."""
        checker, self.checker = self.checker, None
        if checker is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(checker.pid, signal.SIGKILL)
        self.killed_checkers.add(checker.pid)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(checker.sock)
        checker.sock.close()
        self.next_checker = self.clock() + STAMP_CHECK_SECONDS
        waited, self.waiting = [*(checker.asked or []), *self.waiting], []
        for conn in waited:
            if conn in self.conns:
                self._refuse(conn, f"the zygote could not check its code on disk: {why}")
        if not self.stopping:
            _say(f"zygote: its code check failed ({why}); requests start cold until a new checker answers")

    def _end_checker(self) -> None:
        """No more checks (the zygote stops): the checker exits at the end of its stream, or is killed."""
        if self.checker is not None:
            self._checker_failed("the zygote stops")

    # -- processes

    def _fork(self) -> int:
        """``os.fork()``; the child (0) first makes the defaults its handlers of SIGTERM, SIGINT and SIGCHLD, then
        closes what it inherited of the serving loop. SIGTERM and SIGINT are blocked across the fork and unblocked
        in the child only once its handlers are the defaults: one sent to it at once (a client relays as soon as it
        knows the pid) is not taken by the zygote's handler in the child and lost."""
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        if pid:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            return pid
        try:  # nothing in here may return into the serving loop
            _die_with(parent)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self._close_inherited()
        except BaseException:
            os._exit(1)
        return 0

    def _close_inherited(self) -> None:
        """In a child: close the serving loop's sockets, pipes and the fds of requests not answered yet."""
        for key in list(self.sel.get_map().values()):
            with contextlib.suppress(OSError):
                if isinstance(key.fileobj, socket.socket):
                    key.fileobj.close()
                else:
                    os.close(key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno())
        self.sel.close()
        os.close(self.wake_w)
        self.listener.close()
        for sock in self.children.values():  # one whose client left is no longer in the selector
            sock.close()
        for conn in self.conns:
            close_all(conn.fds)

    def _fork_worker(self, request: dict[str, Any], fds: list[int]) -> int:
        pid = self._fork()
        if pid:
            return pid
        code = 1
        try:  # the worker: nothing in here may return into the serving loop
            os.setsid()  # its own process group: killed as a group, untouched by the agent's terminal
            stop_recording()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            close_all([fd for fd in fds if fd > 2])
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.path[:] = ([] if request["path0"] is None else [request["path0"]]) + request["path"]
            apply_thread_counts(request["env"])
            if os.environ.get("PYTHONUNBUFFERED"):
                sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
                sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
            sys.argv = ["elastictrain", "train", *request["args"]]
            from elastictrain.engine import worker

            code = worker.main(list(request["args"]))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            import atexit

            with contextlib.suppress(BaseException):
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _client_closed(self, pid: int) -> None:
        conn = self.children.get(pid)
        if conn is None:
            return
        try:
            if conn.recv(4096):
                return  # a client sends nothing after its request: stray bytes are dropped until it closes
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        _kill_worker(pid)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.checker is not None and pid == self.checker.pid:
                self._checker_failed("it exited")
            self.killed_checkers.discard(pid)
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                send_message(conn, {"exit": os.waitstatus_to_exitcode(status)})
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn)
            conn.close()


def _check_forever(sock: socket.socket, stamp: CodeStamp | None) -> NoReturn:
    """The checker's loop (a child of the zygote): for each ``{"configs": [...]}``, answer ``{"changed": the first
    watched file that changed or null, "configs": their real paths}``; exit at the end of the stream."""
    code = 0
    try:
        with contextlib.suppress(OSError):
            Path("/proc/self/comm").write_text(CHECKER_NAME)
        while (msg := recv_message(sock)[0]) is not None:
            configs = [str(c) for c in msg.get("configs", [])]
            changed = stamp.changed() if stamp is not None else None
            send_message(sock, {"changed": changed, "configs": [os.path.realpath(c) if c else "" for c in configs]})
    except BaseException:
        code = 1
    os._exit(code)


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # a half-imported torch: nothing was initialised through it
        return False


def _kill_worker(pid: int) -> None:
    """SIGKILL a forked worker and its process group (its loader workers, its checkpoint writer); the pid first,
    in case it has not made its own group yet."""
    for kill in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _say(line: str) -> None:
    """A line on stdout for the agent's log; a closed stdout (the agent died) must not fail a request."""
    with contextlib.suppress(OSError, ValueError):
        print(line, flush=True)


def _die_with(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def serve_main(argv: list[str]) -> int:
    record_reads()  # first: every module imported from here on is stamped as the import system read it
    startup = Startup.here()  # before warm() changes sys.path and the thread variables
    import argparse

    from elastictrain.cliutil import OneLineParser
    from elastictrain.commands import usable_cores
    from elastictrain.config import ConfigError
    from elastictrain.config_cli import add_config_args, report_config_error

    p = OneLineParser(prog="elastictrain zygote serve", description="a warm worker factory for one job and host")
    add_config_args(p)
    p.add_argument("--job", required=True, help="job name (the client finds the socket by job, host and etcd)")
    p.add_argument("--host", required=True, help="host name, as horovodrun names it (HOROVOD_HOSTNAME)")
    p.add_argument(
        "--etcd", default="", help="the etcd endpoints the host's agent registers in (the workers' ELASTICTRAIN_ETCD)"
    )
    p.add_argument("--prefix", default="", help="the agent's etcd key prefix (default /elastictrain)")
    args: argparse.Namespace = p.parse_args(argv)
    path = socket_path(args.job, args.host, args.etcd, args.prefix)
    restarts = int(os.environ.get(envnames.ZYGOTE_RESTARTS, "0") or 0)
    mark = None
    try:
        mark = mark_warming(path)  # clients that come meanwhile wait for us (they find no socket yet)
        with warm_slot(path.parent, usable_cores(), WARM_SLOT_WAIT_SECONDS):
            # before listening: nobody queues what a busy zygote cannot answer
            stamp = warm(args.config, args.overrides)
        listener = listen(path)
    except Exception as e:
        unmark_warming(path, mark)
        if restarts:  # the new code does not warm yet (a half-saved file?): try again later, do not give up hot join
            _say(f"zygote: warming the changed code failed ({type(e).__name__}: {str(e)[:300]}); "
                 f"trying again in {restart_delay(restarts):g}s")  # fmt: skip
            return restart_later(restarts, lambda: False)
        if isinstance(e, ConfigError):
            return report_config_error(e, "elastictrain zygote")
        if isinstance(e, OSError | ImportError):
            print(f"elastictrain zygote: error: {e}", file=sys.stderr)
            return 1
        raise
    unmark_warming(path, mark)
    zygote = Zygote(listener, path, stamp, JobSpec.of(args.config, args.overrides), startup)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked across a restart (see restart()); handled now
    _say(f"{READY_LINE} {path} pid {os.getpid()}")
    ready = time.monotonic()
    try:
        code = zygote.serve()
    finally:
        zygote.unlink()
    if code != RESTART:
        return code
    in_a_row = restarts_in_a_row(restarts, time.monotonic() - ready)
    if in_a_row:
        _say(f"zygote: its code changed within {RESTART_RESET_SECONDS:g}s of warming; restarting in "
             f"{restart_delay(in_a_row):g}s")  # fmt: skip
    return restart_later(in_a_row, lambda: zygote.signalled)


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
MAX_RETRY_SECONDS = 60.0


def restarts_in_a_row(restarts: int, served_seconds: float) -> int:
    """How many restarts in a row a zygote that was started after ``restarts`` of them, and served
    ``served_seconds`` before its code changed, has behind it: none once it served :data:`RESTART_RESET_SECONDS`."""
    return restarts if served_seconds < RESTART_RESET_SECONDS else 0


def restart_delay(restarts: int) -> float:
    """Seconds a zygote waits before it re-executes itself after ``restarts`` restarts in a row: none after none,
    then 2, 4, ... up to :data:`MAX_RETRY_SECONDS` (a file that keeps changing, new code that does not warm yet)."""
    return 0.0 if restarts <= 0 else min(MAX_RETRY_SECONDS, 2.0**restarts)


def restart_later(restarts: int, signalled: Any) -> int:
    """Wait :func:`restart_delay` of ``restarts``, then :func:`restart`; SIGTERM or SIGINT meanwhile, or the agent's
    death, ends the zygote (exit 0)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    parent, deadline = os.getppid(), time.monotonic() + restart_delay(restarts)
    while (left := deadline - time.monotonic()) > 0:
        if signal.sigtimedwait(STOP_SIGNALS, min(1.0, left)) is not None or os.getppid() != parent:
            return 0
    return restart(signalled, restarts)


def restart(signalled: Any, restarts: int) -> int:
    """Replace this process with a fresh ``elastictrain zygote serve`` of the same arguments (same pid, so the
    agent keeps its handle and its pipe), which counts ``restarts + 1`` restarts in a row; only called with no worker
    running. SIGTERM and SIGINT are blocked first and stay pending across the exec, so a stop that comes now is
    handled by the new image, not lost; one that already came (``signalled()``) means exit 0 instead."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if signalled():
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[envnames.ZYGOTE_RESTARTS] = str(restarts + 1)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # only stdin, stdout and stderr (the agent's pipe) go on
    os.execv(sys.executable, sys.orig_argv)
    return 1  # not reached


def main(argv: list[str]) -> int:
    """``elastictrain zygote serve ...`` | ``elastictrain zygote client -- COMMAND...``."""
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    if argv[:1] == ["client"]:
        from elastictrain.hotjoin import client

        return client.main(argv[1:])
    print(
        "elastictrain zygote: error: usage: zygote serve --config X --job J --host H | client -- CMD", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
