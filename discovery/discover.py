"""Print the ready hosts of a job for ``horovodrun --host-discovery-script`` (run by discover.sh).

horovodrun runs it every second, so start-up time is the budget: it imports only light standard
modules (no ``typing``, ``dataclasses``, ``urllib`` or gRPC) and reads etcd through its v3 JSON
gateway, ``POST /v3/kv/range``, in one HTTP/1.0 exchange on a socket (TLS for ``https://`` endpoints,
``ssl`` imported only then). With a user, it first logs in (``POST /v3/auth/authenticate``) and sends
the token it gets in the ``Authorization`` header; the token lives only as long as the call. stdout gets sorted
``host:slots`` lines and nothing else; warnings and errors go to stderr, one line each.

Environment:
  ELASTICTRAIN_ETCD               etcd endpoints, ``http(s)://HOST:PORT[,...]`` (required)
  ELASTICTRAIN_ETCD_CACERT        CA bundle of etcd's server certificates (https; default: system store)
  ELASTICTRAIN_ETCD_CERT          client certificate (with ELASTICTRAIN_ETCD_KEY, its key)
  ELASTICTRAIN_ETCD_USER          etcd user (with ELASTICTRAIN_ETCD_PASSWORD_FILE, a file holding its password)
  ELASTICTRAIN_JOB                job name (required)
  ELASTICTRAIN_ETCD_PREFIX        key prefix (default ``/elastictrain``)
  ELASTICTRAIN_DISCOVER_CACHE     cache file
                                  (default ``${XDG_CACHE_HOME:-~/.cache}/elastictrain/discover-<job>.json``)
  ELASTICTRAIN_DISCOVER_STALENESS seconds the cache may be served during an etcd outage (default 30)
  ELASTICTRAIN_DISCOVER_TIMEOUT   seconds to wait for each etcd endpoint (default 1)

Exit codes: 0 hosts printed (from etcd, or from a fresh enough cache during an outage); 1 etcd
unreachable and no fresh cache; 2 bad environment.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import sys
import time

from discovery.endpoints import Endpoint, EtcdAccess, parse_endpoints
from discovery.wire import DEFAULT_PREFIX, MalformedRecord, discovery_lines, hosts_prefix, parse_value

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing alone costs ~10 ms
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

PROG = "discover"
DEFAULT_STALENESS_SECONDS = 30.0
DEFAULT_TIMEOUT_SECONDS = 1.0
MAX_REPLY_BYTES = 64 << 20


class ConfigError(ValueError):
    """A bad or missing environment variable (exit 2)."""


class EtcdUnreachable(RuntimeError):
    """No endpoint answered the range request."""


class DiscoverConfig:
    """Settings of one call, from the environment (a plain class: ``dataclasses`` is slow to import)."""

    __slots__ = ("access", "cache_path", "endpoints", "job", "prefix", "staleness_seconds", "timeout_seconds")

    def __init__(
        self,
        *,
        endpoints: list[Endpoint],
        job: str,
        cache_path: str,
        prefix: str = DEFAULT_PREFIX,
        staleness_seconds: float = DEFAULT_STALENESS_SECONDS,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        access: EtcdAccess | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.access = access or EtcdAccess()
        self.job = job
        self.cache_path = cache_path
        self.prefix = prefix
        self.staleness_seconds = staleness_seconds
        self.timeout_seconds = timeout_seconds

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DiscoverConfig:
        spec = env.get("ELASTICTRAIN_ETCD", "")
        if not spec.strip():
            raise ConfigError("ELASTICTRAIN_ETCD is not set (expected http(s)://HOST:PORT[,...])")
        try:
            endpoints = parse_endpoints(spec)
        except ValueError as e:
            raise ConfigError(f"ELASTICTRAIN_ETCD: {e}") from None
        try:
            access = EtcdAccess.from_env(env).check(endpoints, names="env")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        job = env.get("ELASTICTRAIN_JOB", "")
        if not job or "/" in job:
            raise ConfigError(f"ELASTICTRAIN_JOB must name the job, got {job!r}")
        cache = env.get("ELASTICTRAIN_DISCOVER_CACHE")
        if not cache:
            base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            cache = os.path.join(base, "elastictrain", f"discover-{job}.json")
        return cls(
            endpoints=endpoints,
            job=job,
            cache_path=cache,
            prefix=env.get("ELASTICTRAIN_ETCD_PREFIX") or DEFAULT_PREFIX,
            staleness_seconds=_seconds(env, "ELASTICTRAIN_DISCOVER_STALENESS", DEFAULT_STALENESS_SECONDS),
            timeout_seconds=_seconds(env, "ELASTICTRAIN_DISCOVER_TIMEOUT", DEFAULT_TIMEOUT_SECONDS),
            access=access,
        )


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


class Session:
    """How one call talks to etcd's gateway: the TLS context (built once) and the log-in token per endpoint."""

    __slots__ = ("_context", "access", "timeout")

    def __init__(self, access: EtcdAccess, timeout: float) -> None:
        self.access = access
        self.timeout = timeout
        self._context: object = None

    def context(self) -> object:
        if self._context is None:
            import ssl  # only for https: it costs a few ms of start-up

            ctx = ssl.create_default_context(cafile=self.access.cacert)
            if self.access.cert:
                ctx.load_cert_chain(self.access.cert, self.access.key)
            self._context = ctx
        return self._context

    def post(self, ep: Endpoint, path: str, payload: object, token: str | None = None) -> Any:
        return json.loads(_post(ep, path, json.dumps(payload).encode(), self.timeout, self, token))

    def token(self, ep: Endpoint) -> str | None:
        """Log in when a user is set: the token for ``ep``'s requests (None without a user)."""
        if not self.access.user:
            return None
        password = self.access.password()
        reply = self.post(ep, "/v3/auth/authenticate", {"name": self.access.user, "password": password})
        token = reply.get("token") if isinstance(reply, dict) else None
        if not isinstance(token, str) or not token or not token.isprintable() or len(token) > 4096:
            raise ValueError("etcd's log-in reply has no valid token")
        return token


def _post(ep: Endpoint, path: str, body: bytes, timeout: float, session: Session, token: str | None) -> bytes:
    """One HTTP/1.0 POST (so the reply is never chunked and ends at EOF); the reply body."""
    deadline = time.monotonic() + timeout
    auth = f"Authorization: {token}\r\n" if token else ""
    request = (
        f"POST {path} HTTP/1.0\r\nHost: {ep.netloc}\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    chunks: list[bytes] = []
    size = 0
    with socket.create_connection((ep.host, ep.port), timeout=timeout) as raw:
        sock = session.context().wrap_socket(raw, server_hostname=ep.host) if ep.tls else raw  # type: ignore[attr-defined]
        sock.sendall(request)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no complete reply within {timeout:g}s")
            sock.settimeout(remaining)
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                raise ValueError(f"reply larger than {MAX_REPLY_BYTES} bytes")
    reply = b"".join(chunks)
    head, sep, payload = reply.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if not sep or len(status) < 2 or status[1] != b"200":
        raise ValueError(f"HTTP status {b' '.join(status[1:]).decode(errors='replace') or 'missing'}{_why(payload)}")
    return payload


def _why(payload: bytes) -> str:
    """``: <etcd's reason>`` from an error reply (its JSON ``error``, else its first line), printable ASCII only
    and short: the reply is untrusted."""
    try:
        reply = json.loads(payload)
        message = reply.get("error") or reply.get("message") if isinstance(reply, dict) else None
    except ValueError:
        message = payload[:300].decode("ascii", errors="replace").strip().split("\n", 1)[0]
    if not isinstance(message, str):
        return ""
    clean = "".join(ch if ch.isascii() and ch.isprintable() else "?" for ch in message[:200])
    return f": {clean}" if clean else ""


def range_prefix(session: Session, ep: Endpoint, prefix: str) -> list[tuple[str, bytes]]:
    """``(key, value)`` pairs under ``prefix`` from one endpoint's JSON gateway (etcd >= 3.4)."""
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])  # the prefix ends in '/', so no carry
    body = {"key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()}
    reply = session.post(ep, "/v3/kv/range", body, session.token(ep))
    return [
        (base64.b64decode(kv["key"]).decode(errors="replace"), base64.b64decode(kv.get("value", "")))
        for kv in reply.get("kvs", [])
    ]


def fetch(cfg: DiscoverConfig) -> tuple[list[str], list[str]]:
    """``(lines, warnings)`` from the first endpoint that answers; :class:`EtcdUnreachable` if none."""
    start = hosts_prefix(cfg.prefix, cfg.job)
    session = Session(cfg.access, cfg.timeout_seconds)
    errors: list[str] = []
    for ep in cfg.endpoints:
        try:
            pairs = range_prefix(session, ep, start)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # timeouts and TLS errors are OSErrors
            errors.append(f"{ep.url}: {type(e).__name__}: {e}")
            continue
        records, warnings = [], []
        for key, value in pairs:
            try:
                records.append(parse_value(key[len(start) :], value))
            except MalformedRecord as e:
                warnings.append(f"skipping malformed value at {key}: {e}")
        return discovery_lines(records), warnings
    raise EtcdUnreachable("; ".join(errors))


def write_cache(path: str, job: str, lines: list[str]) -> None:
    """Record a successful answer; the file's mtime is the time of the last successful read.

    Unchanged membership only touches the file. A change is written atomically: temp file in the
    same folder, fsync, ``os.replace``, fsync of the folder.
    """
    payload = json.dumps({"job": job, "hosts": lines}, separators=(",", ":")).encode()
    try:
        with open(path, "rb") as f:
            if f.read() == payload:
                os.utime(path)
                return
    except OSError:
        pass
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_cache(path: str, job: str, now: float) -> tuple[list[str], float] | None:
    """``(lines, age_seconds)`` of the cache, or ``None`` when missing, unreadable or another job's."""
    try:
        age = now - os.stat(path).st_mtime
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("job") != job or not isinstance(data.get("hosts"), list):
        return None
    return [h for h in data["hosts"] if isinstance(h, str)], max(0.0, age)


def run(env: Mapping[str, str], now: float | None = None) -> tuple[int, list[str], list[str]]:
    """One discovery: ``(exit_code, stdout_lines, stderr_lines)``."""
    try:
        cfg = DiscoverConfig.from_env(env)
    except ConfigError as e:
        return 2, [], [f"{PROG}: error: {e}"]
    try:
        lines, warnings = fetch(cfg)
    except EtcdUnreachable as e:
        cached = read_cache(cfg.cache_path, cfg.job, time.time() if now is None else now)
        if cached is None:
            return 1, [], [f"{PROG}: error: etcd unreachable and no cached membership for job {cfg.job!r}: {e}"]
        cached_lines, age = cached
        if age > cfg.staleness_seconds:
            return (
                1,
                [],
                [
                    f"{PROG}: error: etcd unreachable and the cached membership of job {cfg.job!r} is {age:.0f}s "
                    f"old (> ELASTICTRAIN_DISCOVER_STALENESS={cfg.staleness_seconds:g}s): {e}"
                ],
            )
        return 0, cached_lines, [f"{PROG}: warning: etcd unreachable; serving membership cached {age:.1f}s ago"]
    messages = [f"{PROG}: warning: {w}" for w in warnings]
    try:
        write_cache(cfg.cache_path, cfg.job, lines)
    except OSError as e:
        messages.append(f"{PROG}: warning: cannot write cache {cfg.cache_path}: {e}")
    return 0, lines, messages


def main() -> int:
    code, out, err = run(os.environ)
    if out:
        sys.stdout.write("\n".join(out) + "\n")
    for line in err:
        sys.stderr.write(line + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
