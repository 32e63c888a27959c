"""A real single-member etcd on free ports with its own data dir: the launcher's embedded etcd, the tests'
etcd (``tests/fixtures/etcd.py``), the chaos tier's and the discovery benchmark's. One class, :class:`EtcdServer`.

It listens on loopback unless told (``host``), plain or with TLS and client-certificate auth. It can be
started (waiting until ``/health`` answers), stopped (SIGTERM, then SIGKILL), restarted on the same ports
and data dir (or a wiped one), paused (SIGSTOP) and resumed; :meth:`EtcdServer.kill` ends it by pid.
:func:`etcd_data_dir_in_use` says whether a live etcd still holds a data dir, so that nothing wipes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from elastictrain import envnames
from elastictrain.errors import ToolError
from elastictrain.launcher.processes import free_port

START_DEADLINE_SECONDS = 20.0


def find_etcd() -> str:
    """The etcd binary: ``etcd`` on PATH, else ``/usr/bin/etcd`` (Debian's ``etcd-server``)."""
    return shutil.which("etcd") or "/usr/bin/etcd"


ETCD_BIN = os.environ.get(envnames.TEST_ETCD) or find_etcd()
"""The etcd binary the tests, the chaos tier and the benchmarks start: ``$ELASTICTRAIN_TEST_ETCD``, else
:func:`find_etcd`."""


class EtcdError(ToolError, RuntimeError):
    """etcd did not start or did not become healthy in time (one line, with the log's tail)."""


@dataclass(frozen=True, slots=True)
class ServerTls:
    """PEM files of an etcd that serves TLS and requires client certificates (``--client-cert-auth``)."""

    ca: Path
    """CA that signed the server and the client certificates."""
    cert: Path
    """Server certificate; it also needs the clientAuth usage, for etcd's own gateway connection."""
    key: Path
    client_cert: Path
    """A client certificate, for the health check."""
    client_key: Path


def etcd_healthy(endpoint: str, timeout: float = 0.5, context: ssl.SSLContext | None = None) -> bool:
    """Whether ``endpoint/health`` answers ``{"health": "true"}`` within ``timeout``."""
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=timeout, context=context) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def etcd_data_dir_in_use(data_dir: Path) -> bool:
    """Whether a running etcd has ``data_dir`` open: its bbolt database holds an exclusive ``flock``
    (on NFS as on a local disk, see :class:`~elastictrain.rundir.launch.RunDirLock`). The probe takes a
    shared lock and releases it."""
    try:
        fd = os.open(data_dir / "member" / "snap" / "db", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


COMPACTION_RETENTION_REVISIONS = 10_000
"""Revisions the embedded etcd keeps (compacted every five minutes): minutes of a busy job's history."""


class EtcdServer:
    """One single-member etcd on ``host`` (default ``127.0.0.1``; ``::1`` works); ``endpoint`` stays the same across
    restarts. With ``tls`` the client URL is ``https://`` and every client must present a certificate.

    ``env`` and ``preexec_fn`` go to the etcd process (the launcher passes its launch id and a parent-death
    signal); its stdin is ``/dev/null`` and it runs in a session of its own.
    """

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        binary: str = ETCD_BIN,
        host: str = "127.0.0.1",
        tls: ServerTls | None = None,
        extra_args: tuple[str, ...] = (),
        *,
        name: str = "test",
        env: Mapping[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.log_path = log_path
        self.host = host
        self.tls = tls
        self.extra_args = extra_args
        """More etcd flags, e.g. ``("--auth-token-ttl", "1")``."""
        self.name = name
        """The member's name (``--name``)."""
        self.env = dict(env) if env is not None else None
        self.preexec_fn = preexec_fn
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def _netloc_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self._netloc_host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        """The etcd command line (pure)."""
        peer = f"http://{self._netloc_host}:{self.peer_port}"
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            # The workers' beats and the outbox write and delete keys all the time: keep the last revisions only,
            # or etcd's history fills its quota (2 GiB) in about a day of a busy job and it refuses every write.
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", str(COMPACTION_RETENTION_REVISIONS),
        ]  # fmt: skip
        if self.tls is not None:
            args += [
                "--cert-file", str(self.tls.cert),
                "--key-file", str(self.tls.key),
                "--trusted-ca-file", str(self.tls.ca),
                "--client-cert-auth",
            ]  # fmt: skip
        return args + list(self.extra_args)

    def start(
        self,
        *,
        wipe: bool = False,
        deadline_seconds: float = START_DEADLINE_SECONDS,
        abort: Callable[[], bool] = lambda: False,
    ) -> None:
        """Start etcd (on the same ports and data dir as before unless ``wipe``) and wait until healthy
        (:meth:`wait_healthy`)."""
        if self.running:
            raise EtcdError(f"etcd already running as pid {self.pid}")
        if not os.access(self.binary, os.X_OK):
            raise EtcdError(f"etcd binary not found ({self.binary})")
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=self.preexec_fn,
            )
        self.wait_healthy(deadline_seconds, abort=abort)

    def wait_healthy(
        self, deadline_seconds: float = START_DEADLINE_SECONDS, abort: Callable[[], bool] = lambda: False
    ) -> None:
        """Poll until healthy; :class:`EtcdError` when etcd exits, ``deadline_seconds`` pass, or ``abort()``."""
        deadline = time.monotonic() + deadline_seconds
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdError(f"etcd exited with {self.proc.returncode}; log: {self.log_tail()}")
            if self.healthy(timeout=0.5):
                return
            if time.monotonic() > deadline or abort():
                raise EtcdError(f"etcd not healthy within {deadline_seconds:g}s; log: {self.log_tail()}")
            time.sleep(0.05)

    def healthy(self, timeout: float = 0.5) -> bool:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return etcd_healthy(self.endpoint, timeout, context)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop etcd (``sig``, then SIGKILL after ``timeout``) and reap it. Data dir is kept."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a paused etcd cannot handle SIGTERM
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self, *, wipe: bool = False) -> None:
        self.stop()
        self.start(wipe=wipe)

    def pause(self) -> None:
        """Freeze etcd with SIGSTOP: connections stay open but nothing answers."""
        if self.proc is None:
            raise EtcdError("etcd is not running")
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is None:
            raise EtcdError("etcd is not running")
        os.kill(self.proc.pid, signal.SIGCONT)

    def log_tail(self, n_bytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace")
        except OSError:
            return "<no log>"
