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

While etcd answers, what it says now decides: every value of the reply is parsed and checked at every call, and
nothing read from the cache file enters the answer. The cache holds the last answer (``host:slots`` lines) and when
it was read by this machine's clocks (monotonic time qualified by the boot id, and wall time), never by the file's
mtime, which an NFS server stamps with its own clock. It is read only when etcd is unreachable, and served then only
when the file belongs to the user running discovery, is the job's, is young enough, and only its lines that are
valid as etcd's would be (invalid ones are skipped with a warning).

Exit codes: 0 hosts printed (from etcd, or from a fresh enough cache during an outage); 1 etcd
unreachable and no fresh cache; 2 bad environment.
"""

from __future__ import annotations

import binascii  # not base64: it imports re, and wraps these two calls
import json
import os
import socket
import sys
import time

from discovery.endpoints import Endpoint, EtcdAccess, parse_endpoints
from discovery.wire import (
    DEFAULT_PREFIX,
    MalformedRecord,
    check_name,
    check_slots,
    discovery_lines,
    drop_case_duplicates,
    hosts_prefix,
    parse_value,
)
from elastictrain import envnames
from elastictrain.errors import ConfigError as ConfigError
from elastictrain.errors import InputError, RegistryUnavailable
from elastictrain.fileio import write_atomic

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing alone costs ~10 ms
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

PROG = "discover"
DEFAULT_STALENESS_SECONDS = 30.0
DEFAULT_TIMEOUT_SECONDS = 1.0
MAX_REPLY_BYTES = 64 << 20


class EtcdUnreachable(RegistryUnavailable):
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
        spec = env.get(envnames.ETCD, "")
        if not spec.strip():
            raise ConfigError(f"{envnames.ETCD} is not set (expected http(s)://HOST:PORT[,...])")
        try:
            endpoints = parse_endpoints(spec)
        except ValueError as e:
            raise ConfigError(f"{envnames.ETCD}: {e}") from None
        try:
            access = EtcdAccess.from_env(env).check(endpoints, names="env")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        job = env.get(envnames.JOB, "")
        try:
            check_name("job", job)
        except ValueError as e:
            raise ConfigError(f"{envnames.JOB} must name the job: {e}") from None
        cache = env.get(envnames.DISCOVER_CACHE)
        if not cache:
            base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            cache = os.path.join(base, "elastictrain", f"discover-{job}.json")
        return cls(
            endpoints=endpoints,
            job=job,
            cache_path=cache,
            prefix=env.get(envnames.ETCD_PREFIX) or DEFAULT_PREFIX,
            staleness_seconds=_seconds(env, envnames.DISCOVER_STALENESS, DEFAULT_STALENESS_SECONDS),
            timeout_seconds=_seconds(env, envnames.DISCOVER_TIMEOUT, DEFAULT_TIMEOUT_SECONDS),
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
    b64 = binascii.b2a_base64
    body = {"key": b64(start, newline=False).decode(), "range_end": b64(end, newline=False).decode()}
    reply = session.post(ep, "/v3/kv/range", body, session.token(ep))
    return [
        (binascii.a2b_base64(kv["key"]).decode(errors="replace"), binascii.a2b_base64(kv.get("value", "")))
        for kv in reply.get("kvs", [])
    ]


def fetch(cfg: DiscoverConfig) -> tuple[list[str], list[str]]:
    """``(lines, warnings)`` from the first endpoint that answers; :class:`EtcdUnreachable` if none.

    Every value is parsed and checked (:func:`discovery.wire.parse_value`): the lines are what etcd says now.
    """
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
            except MalformedRecord as e:  # ascii(): a key may hold a newline or a terminal escape
                warnings.append(f"skipping malformed value at {key!a}: {e}")
        records, duplicates = drop_case_duplicates(records, lambda r: r["host"])
        warnings += [f"skipping {w}" for w in duplicates]
        return discovery_lines(records), warnings
    raise EtcdUnreachable("; ".join(errors))


def boot_id() -> str:
    """This boot of this machine (Linux), or "" where unknown: it qualifies monotonic stamps."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError:
        return ""


class Clock:
    """What a cache stamp is made of: wall time, monotonic time and the boot they belong to."""

    __slots__ = ("boot", "mono", "wall")

    def __init__(self, wall: float, mono: float, boot: str) -> None:
        self.wall = wall
        self.mono = mono
        self.boot = boot

    @classmethod
    def now(cls) -> Clock:
        return cls(time.time(), time.monotonic(), boot_id())


def load_cache(path: str) -> object:
    """The cache file's JSON as it is (None when missing or unreadable); callers check what they use."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def write_cache(path: str, job: str, lines: list[str], clock: Clock, old: object = None) -> None:
    """Record a successful answer and when it was read, by this machine's clocks (not the file's mtime,
    which a file server stamps with its own clock).

    The file is replaced atomically each time (:func:`elastictrain.fileio.atomic_file`); only a change
    of membership (compared with ``old``, the file as read before, or as read now when not given) is
    fsynced, since a lost refresh of the stamp only makes the cache look older.
    """
    stamp = {"wall": clock.wall, "monotonic": clock.mono, "boot_id": clock.boot}
    data = {"job": job, "hosts": lines, "read_at": stamp}
    payload = json.dumps(data, separators=(",", ":")).encode()
    old = load_cache(path) if old is None else old
    changed = not isinstance(old, dict) or old.get("job") != job or old.get("hosts") != lines
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, payload, durable=changed)


def cache_age(stamp: object, clock: Clock) -> float | None:
    """Seconds since the cache's answer was read from etcd, or None when the stamp cannot tell.

    On the boot that wrote it, the monotonic clock measures the age: no change of wall time moves
    it. Otherwise (after a reboot, or another machine's write) the writer's wall time is compared
    with ours. An age below zero (a stamp from the future) is not trusted.
    """
    if not isinstance(stamp, dict):
        return None
    mono, wall = _number(stamp.get("monotonic")), _number(stamp.get("wall"))
    if clock.boot and stamp.get("boot_id") == clock.boot and mono is not None:
        age = clock.mono - mono
    elif wall is not None:
        age = clock.wall - wall
    else:
        return None
    return age if 0 <= age < float("inf") else None


def _number(x: object) -> float | None:
    """``x`` as a float when it is a JSON number other than NaN, else None."""
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and x == x else None


def valid_line(line: object) -> bool:
    """Whether a cached line is ``host:slots`` with a host name and slots that etcd's values would pass."""
    if not isinstance(line, str):
        return False
    host, sep, slots = line.rpartition(":")
    if not sep or not slots.isascii() or not slots.isdigit() or len(slots) > 5:
        return False
    try:
        check_name("host", host)
        check_slots(int(slots))
    except ValueError:
        return False
    return True


class CacheRefused(InputError):
    """The cache file exists but is not served; the message says why (one line)."""


def read_cache(path: str, job: str, clock: Clock) -> tuple[list[str], float | None, list[str]] | None:
    """``(lines, age_seconds, warnings)`` of the cache, or ``None`` when missing, unreadable or another job's.

    Raises :class:`CacheRefused` when the file belongs to another user than the one running discovery (the cache
    may sit in a shared run_dir: another user who can write the folder can replace the file, never as us). Lines
    are validated as host names from etcd are (:func:`valid_line`): horovodrun puts host names into shell commands,
    so an invalid line is skipped with a warning, never printed. ``age_seconds`` is None when the stamp cannot tell
    (:func:`cache_age`).
    """
    try:
        with open(path, "rb") as f:
            owner, me = os.fstat(f.fileno()).st_uid, os.geteuid()
            if owner != me:
                raise CacheRefused(f"cache file {path} is owned by uid {owner}, not by this user (uid {me})")
            data = json.loads(f.read())
    except CacheRefused:
        raise
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("job") != job or not isinstance(data.get("hosts"), list):
        return None
    lines, warnings = [], []
    for line in data["hosts"]:
        if valid_line(line):
            lines.append(line)
        else:
            warnings.append(f"skipping invalid cached host line {ascii(line)[:120]}")
    kept, duplicates = drop_case_duplicates(set(lines), lambda line: line.rpartition(":")[0])
    warnings += [f"skipping cached {w}" for w in duplicates]
    return sorted(kept), cache_age(data.get("read_at"), clock), warnings


def run(env: Mapping[str, str], clock: Clock | None = None) -> tuple[int, list[str], list[str]]:
    """One discovery: ``(exit_code, stdout_lines, stderr_lines)``."""
    try:
        cfg = DiscoverConfig.from_env(env)
    except ConfigError as e:
        return 2, [], [f"{PROG}: error: {e}"]
    clock = Clock.now() if clock is None else clock
    try:
        lines, warnings = fetch(cfg)
    except EtcdUnreachable as e:
        try:
            cached = read_cache(cfg.cache_path, cfg.job, clock)
        except CacheRefused as refused:
            return 1, [], [f"{PROG}: error: etcd unreachable and the {refused}, so it is not served: {e}"]
        if cached is None:
            return 1, [], [f"{PROG}: error: etcd unreachable and no cached membership for job {cfg.job!r}: {e}"]
        cached_lines, age, cache_warnings = cached
        if age is None or age > cfg.staleness_seconds:
            shown = "of unknown age" if age is None else f"{age:.0f}s old"
            return (
                1,
                [],
                [
                    f"{PROG}: error: etcd unreachable and the cached membership of job {cfg.job!r} is {shown} "
                    f"(> ELASTICTRAIN_DISCOVER_STALENESS={cfg.staleness_seconds:g}s): {e}"
                ],
            )
        messages = [f"{PROG}: warning: {w}" for w in cache_warnings]
        messages.append(f"{PROG}: warning: etcd unreachable; serving membership cached {age:.1f}s ago")
        return 0, cached_lines, messages
    messages = [f"{PROG}: warning: {w}" for w in warnings]
    try:
        write_cache(cfg.cache_path, cfg.job, lines, clock)
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
