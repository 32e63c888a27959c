"""A real single-member etcd on free ports (loopback unless told) with its own data dir (the discovery benchmark, and
the integration tests through ``tests/fixtures/etcd.py``), plain or with TLS and client-certificate auth.

:class:`EtcdServer` can be stopped, restarted (same ports and data dir, or a wiped one), paused
(SIGSTOP) and resumed; :meth:`EtcdServer.kill` ends it by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from elastictrain.bench.procs import free_port
from elastictrain.errors import ToolError

ETCD_BIN = os.environ.get("ELASTICTRAIN_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")
"""The etcd binary: ``$ELASTICTRAIN_TEST_ETCD``, else ``etcd`` on PATH, else ``/usr/bin/etcd``."""
START_DEADLINE_SECONDS = 20.0


class EtcdError(ToolError, RuntimeError):
    """etcd did not start or did not become healthy in time."""


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


class EtcdServer:
    """One single-member etcd on ``host`` (default ``127.0.0.1``; ``::1`` works); ``endpoint`` stays the same across
    restarts. With ``tls`` the client URL is ``https://`` and every client must present a certificate."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        binary: str = ETCD_BIN,
        host: str = "127.0.0.1",
        tls: ServerTls | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.log_path = log_path
        self.host = host
        self.tls = tls
        self.extra_args = extra_args
        """More etcd flags, e.g. ``("--auth-token-ttl", "1")``."""
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def _netloc_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self._netloc_host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, *, wipe: bool = False, deadline_seconds: float = START_DEADLINE_SECONDS) -> None:
        """Start etcd (on the same ports and data dir as before unless ``wipe``) and wait until healthy."""
        if self.running:
            raise EtcdError(f"etcd already running as pid {self.pid}")
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        peer = f"http://{self._netloc_host}:{self.peer_port}"
        args = [
            self.binary,
            "--name", "test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.tls is not None:
            args += [
                "--cert-file", str(self.tls.cert),
                "--key-file", str(self.tls.key),
                "--trusted-ca-file", str(self.tls.ca),
                "--client-cert-auth",
            ]  # fmt: skip
        args += self.extra_args
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.wait_healthy(deadline_seconds)

    def wait_healthy(self, deadline_seconds: float = START_DEADLINE_SECONDS) -> None:
        deadline = time.monotonic() + deadline_seconds
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdError(f"etcd exited with {self.proc.returncode}; log: {self.log_tail()}")
            if self.healthy(timeout=0.5):
                return
            if time.monotonic() > deadline:
                raise EtcdError(f"etcd not healthy within {deadline_seconds}s; log: {self.log_tail()}")
            time.sleep(0.05)

    def healthy(self, timeout: float = 0.5) -> bool:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=timeout, context=context) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after ``timeout``) and reap it. Data dir is kept."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
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
