"""How to reach etcd: endpoint URLs, TLS files and credentials, parsed and checked in one place.

Every client of the project's etcd (the registry, the agent, ``hosts``, ``launch``, ``status`` and
``discover.sh``) parses endpoints with :func:`parse_endpoints` and its TLS and
auth settings with :class:`EtcdAccess`. The names follow etcdctl's so that operators reuse what they
have: flags ``--cacert --cert --key --user --password-file``, and for processes that get only an
environment (``discover.sh``) the variables in :data:`ENV_VARS`.

Rules, each refused with one line (``ValueError``) that never contains a secret:

- an endpoint is ``http://HOST[:PORT]`` or ``https://HOST[:PORT]`` (no scheme means ``http://``; the
  port defaults to 2379; IPv6 literals in brackets: ``http://[::1]:2379``); no path, query or
  credentials: a password in a URL lands in logs, process lists and shell history;
- all endpoints share one scheme; ``--cacert``, ``--cert`` and ``--key`` need ``https://`` endpoints;
  ``--cert`` and ``--key`` go together;
- ``--user`` needs ``--password-file`` (and the reverse); the password is read from the file when a
  connection is made, so a rotated secret is picked up on the next reconnect; a user name with ``:``
  (etcdctl's ``user:password`` form) is refused;
- a password is sent over ``http://`` only to a loopback address.

Like ``wire.py`` this module is on ``discover.sh``'s start-up path: standard modules only, nothing
heavier than ``os``.
"""

from __future__ import annotations

import os

from elastictrain import envnames

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing alone costs ~10 ms
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

DEFAULT_PORT = 2379
SCHEMES = ("http", "https")

CACERT_ENV = envnames.ETCD_CACERT
CERT_ENV = envnames.ETCD_CERT
KEY_ENV = envnames.ETCD_KEY
USER_ENV = envnames.ETCD_USER
PASSWORD_FILE_ENV = envnames.ETCD_PASSWORD_FILE
ENV_VARS = (CACERT_ENV, CERT_ENV, KEY_ENV, USER_ENV, PASSWORD_FILE_ENV)
"""The variables that carry :class:`EtcdAccess` to a process that reads only its environment."""

_FIELDS = ("cacert", "cert", "key", "user", "password_file")
_FLAGS = {"cacert": "--cacert", "cert": "--cert", "key": "--key", "user": "--user", "password_file": "--password-file"}
_ENV_OF = dict(zip(_FIELDS, ENV_VARS, strict=True))
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")
_IPV6_CHARS = frozenset("0123456789abcdefABCDEF:.")
_LOOPBACK_NAMES = ("localhost", "::1")


class Endpoint:
    """One etcd endpoint: scheme, host (an IPv6 literal without brackets) and port."""

    __slots__ = ("host", "port", "scheme")

    def __init__(self, scheme: str, host: str, port: int) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def netloc(self) -> str:
        """``host:port``, the host in brackets when it is an IPv6 literal (gRPC targets, HTTP Host headers)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    @property
    def loopback(self) -> bool:
        return self.host in _LOOPBACK_NAMES or self.host.startswith("127.")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Endpoint):
            return NotImplemented
        return (self.scheme, self.host, self.port) == (other.scheme, other.host, other.port)

    def __hash__(self) -> int:
        return hash((self.scheme, self.host, self.port))

    def __repr__(self) -> str:
        return f"Endpoint({self.url!r})"


def _shown(part: str) -> str:
    """``part`` as an error message may show it: any user info and anything after the host cut out."""
    scheme, sep, rest = part.partition("://")
    if not sep:
        scheme, rest = "", part
    if "@" in rest:
        rest = "<credentials>@" + rest.rpartition("@")[2]
    for i, ch in enumerate(rest):
        if ch in "/?#":
            rest = rest[:i] + ("/..." if rest[i:].strip("/") else "")
            break
    return f"{scheme}{sep}{rest}"


def parse_endpoint(part: str) -> Endpoint:
    """One ``[http[s]://]HOST[:PORT]``; ``ValueError`` with one line (no secret in it) when it is not."""
    shown = _shown(part)
    scheme, sep, rest = part.partition("://")
    if not sep:
        scheme, rest = "http", part
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"invalid etcd endpoint {shown!r}: the scheme must be http or https")
    if "@" in rest:
        raise ValueError(
            f"invalid etcd endpoint {shown!r}: credentials do not belong in an endpoint URL; "
            "use --user and --password-file (ELASTICTRAIN_ETCD_USER, ELASTICTRAIN_ETCD_PASSWORD_FILE)"
        )
    rest = rest.rstrip("/")
    if any(ch in rest for ch in "/?#"):
        raise ValueError(f"invalid etcd endpoint {shown!r}: expected {scheme}://HOST:PORT without a path or query")
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or ":" not in host or not _IPV6_CHARS.issuperset(host) or (tail and tail[0] != ":"):
            raise ValueError(f"invalid etcd endpoint {shown!r}: expected {scheme}://[IPV6]:PORT")
        port_text = tail[1:] if tail else ""
    else:
        if rest.count(":") > 1:
            raise ValueError(f"invalid etcd endpoint {shown!r}: put an IPv6 address in brackets, {scheme}://[::1]:2379")
        host, _, port_text = rest.partition(":")
        if not host or not _HOST_CHARS.issuperset(host) or host[0] in ".-" or host[-1] == "-":
            raise ValueError(f"invalid etcd endpoint {shown!r}: bad host name")
    if port_text == "" and ":" not in rest.rpartition("]")[2]:
        port = DEFAULT_PORT
    elif port_text.isdigit() and port_text.isascii() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise ValueError(f"invalid etcd endpoint {shown!r}: the port must be a number in 1..65535")
    return Endpoint(scheme, host, port)


def parse_endpoints(spec: str) -> list[Endpoint]:
    """``http://h1:2379,https://[::1]:2379`` -> endpoints; ``ValueError`` (one line, no secret) when invalid.

    All endpoints must share one scheme.
    """
    out = [parse_endpoint(p.strip()) for p in spec.split(",") if p.strip()]
    if not out:
        raise ValueError(f"invalid etcd endpoints {_shown(spec)!r}: expected http(s)://HOST:PORT[,...]")
    if len({e.scheme for e in out}) > 1:
        raise ValueError("invalid etcd endpoints: mix of http:// and https://; use one scheme for all")
    return out


def read_password(path: str) -> str:
    """The password in ``path`` (one trailing newline dropped); ``ValueError`` naming the file, never its content."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4097)
    except OSError as e:
        raise ValueError(f"cannot read the etcd password file {path}: {e.strerror or e}") from None
    if len(raw) > 4096:
        raise ValueError(f"the etcd password file {path} is larger than 4096 bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"the etcd password file {path} is not UTF-8") from None
    if text.endswith("\n"):
        text = text[:-1]
        if text.endswith("\r"):
            text = text[:-1]
    if not text or "\n" in text:
        raise ValueError(f"the etcd password file {path} must hold the password on one line")
    return text


class EtcdAccess:
    """TLS files and credentials of an etcd client (all optional; none means plain, anonymous access)."""

    __slots__ = _FIELDS

    def __init__(
        self,
        *,
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password_file: str | None = None,
    ) -> None:
        self.cacert = cacert or None
        """CA bundle that signed the etcd servers' certificates (default: the system's trust store)."""
        self.cert = cert or None
        """Client certificate (PEM) presented to etcd."""
        self.key = key or None
        """Private key (PEM, unencrypted) of ``cert``."""
        self.user = user or None
        """etcd user name."""
        self.password_file = password_file or None
        """File holding the etcd user's password on one line."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EtcdAccess:
        """From the ``ELASTICTRAIN_ETCD_*`` variables of :data:`ENV_VARS` (what ``discover.sh`` reads)."""
        return cls(**{f: env.get(_ENV_OF[f]) for f in _FIELDS})

    @property
    def empty(self) -> bool:
        return not any(getattr(self, f) for f in _FIELDS)

    def check(self, endpoints: list[Endpoint], *, names: str = "flags") -> EtcdAccess:
        """Return self if the settings fit each other and ``endpoints``; else ``ValueError`` (one line).

        ``names`` picks how settings are named in messages: ``flags`` (``--cacert``) or ``env``.
        """

        def name(f: str) -> str:
            return _ENV_OF[f] if names == "env" else _FLAGS[f]

        if bool(self.cert) != bool(self.key):
            raise ValueError(f"{name('cert')} and {name('key')} go together (a client certificate and its key)")
        if bool(self.user) != bool(self.password_file):
            raise ValueError(f"{name('user')} and {name('password_file')} go together")
        if self.user is not None and (":" in self.user or not self.user.isprintable()):
            raise ValueError(
                f"{name('user')} takes the user name only: put the password in the file {name('password_file')} names"
            )
        tls_files = [name(f) for f in ("cacert", "cert", "key") if getattr(self, f)]
        if tls_files and not all(e.tls for e in endpoints):
            raise ValueError(f"{', '.join(tls_files)} need https:// etcd endpoints")
        if self.user and not all(e.tls or e.loopback for e in endpoints):
            raise ValueError(
                f"{name('user')} over http:// would send the password in clear; use https:// etcd endpoints"
            )
        for f in ("cacert", "cert", "key", "password_file"):
            path = getattr(self, f)
            if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ValueError(f"{name(f)} {path}: not a readable file")
        return self

    def password(self) -> str | None:
        """The password read from ``password_file`` now (``ValueError`` when unreadable), or None."""
        return read_password(self.password_file) if self.password_file else None

    def env(self) -> dict[str, str]:
        """The :data:`ENV_VARS` that carry these settings (absolute paths), for ``discover.sh``."""
        out = {}
        for f in _FIELDS:
            value = getattr(self, f)
            if value:
                out[_ENV_OF[f]] = value if f == "user" else os.path.abspath(value)
        return out

    def argv(self) -> list[str]:
        """The same settings as command-line flags (paths and the user name; never the password)."""
        out: list[str] = []
        for f in _FIELDS:
            value = getattr(self, f)
            if value:
                out += [_FLAGS[f], value if f == "user" else os.path.abspath(value)]
        return out

    def describe(self) -> str:
        """What is in use, for logs: ``tls, client cert, user NAME`` (no paths' contents, no password)."""
        parts = []
        if self.cacert or self.cert:
            parts.append("tls" + (" with client cert" if self.cert else ""))
        if self.user:
            parts.append(f"user {self.user}")
        return ", ".join(parts) or "no credentials"

    def __repr__(self) -> str:
        return f"EtcdAccess({self.describe()})"


def add_arguments(parser: Any) -> None:
    """Add ``--cacert --cert --key --user --password-file`` to an argparse parser.

    Each defaults to its ``ELASTICTRAIN_ETCD_*`` variable; :func:`from_args` builds the settings.
    """
    helps = {
        "cacert": "CA bundle that signed etcd's server certificates (https:// endpoints)",
        "cert": "client certificate presented to etcd",
        "key": "private key of --cert",
        "user": "etcd user name (the password comes from --password-file)",
        "password_file": "file holding the etcd user's password on one line",
    }
    for f in _FIELDS:
        parser.add_argument(
            _FLAGS[f],
            dest=f"etcd_{f}",
            default=None,
            metavar="NAME" if f == "user" else "FILE",
            help=f"{helps[f]} (default ${_ENV_OF[f]})",
        )


def from_args(args: Any, env: Mapping[str, str]) -> EtcdAccess:
    """The settings of :func:`add_arguments`'s flags, each falling back on its variable in ``env``."""
    return EtcdAccess(**{f: getattr(args, f"etcd_{f}", None) or env.get(_ENV_OF[f]) for f in _FIELDS})
