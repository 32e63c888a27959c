"""Reads the cloud's preemption notice from this instance's metadata service: one watch per cloud.

The agent's ``--preemption-notice {none,auto,aws,gcp,azure}`` builds a :class:`NoticeWatch` (:func:`build`); its
threads poll the metadata service and the agent's cycle reads :meth:`NoticeWatch.notice` (it never blocks), then
marks the host ``draining`` with the notice recorded in its etcd record (``notice``, ``notice_time``). What an
answer means is :mod:`discovery.notice`'s.

Contract:

- :func:`http_request` bounds every answer: at most :data:`MAX_BODY` bytes, headers as ``http.client`` bounds them,
  and the whole exchange within its deadline (the socket is shut down at the deadline, so a server that drips
  bytes is cut off too).
- A source that answers badly (garbage, too big, too slow, an HTTP error, a GCP answer without
  ``Metadata-Flavor: Google``) changes nothing: the watch logs one warning line per source and new error and keeps
  polling.
- A notice, once read, holds for the watch's life: the instance is going away.
- :func:`probe` (``auto``) asks each cloud's service a cheap question with a short deadline and returns the first
  cloud, in the order aws, gcp, azure, whose service answers as that cloud's does; ``None`` off-cloud.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from discovery.notice import (
    CLOUDS,
    Notice,
    NoticeError,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gcp_maintenance,
    parse_gcp_preempted,
    plain_text,
)
from elastictrain import envnames
from elastictrain.logconf import get_logger

CHOICES = ("none", "auto", *CLOUDS)
"""Values of ``--preemption-notice``."""

DEFAULT_ENDPOINTS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
"""Each cloud's metadata service; overridden by :data:`ENDPOINT_ENV` (tests point the agent at local servers)."""
ENDPOINT_ENV = {"aws": envnames.AWS_METADATA, "gcp": envnames.GCP_METADATA, "azure": envnames.AZURE_METADATA}

MAX_BODY = 64 * 1024
"""Largest answer read from a metadata service (the real answers are a few hundred bytes)."""
AWS_TOKEN_TTL_SECONDS = 21600
"""Lifetime asked for an IMDSv2 session token (AWS's maximum, 6 hours); a new one is taken at half of it."""
GCP_WAIT_SECONDS = 60
"""``timeout_sec`` of a GCP wait-for-change request: the longest one hanging GET lasts."""
AZURE_API_VERSION = "2020-07-01"


# -- HTTP with bounds ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """A metadata service's answer, read whole within its bounds."""

    status: int
    headers: Mapping[str, str]
    """Header names in lower case."""
    body: bytes


Request = Callable[[str, str, Mapping[str, str], float], Answer]
"""``(method, url, headers, timeout) -> Answer``: what a source sends through (tests may pass a fake)."""


def http_request(method: str, url: str, headers: Mapping[str, str], timeout: float) -> Answer:
    """One HTTP exchange finished within ``timeout`` seconds and :data:`MAX_BODY` bytes, else :class:`NoticeError`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise NoticeError(f"{url}: only http://HOST[:PORT] metadata endpoints are read")
    what = f"{method} {parts.path}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    expired = threading.Event()
    timer = threading.Timer(timeout, _shutdown, (conn, expired))
    timer.daemon = True
    timer.start()
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path, headers={**headers, "Connection": "close"})
        resp = conn.getresponse()
        body = resp.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            raise NoticeError(f"{what}: the answer is larger than {MAX_BODY // 1024} KiB")
        if expired.is_set():  # the socket was shut down under the read: what was read may be partial
            raise NoticeError(f"{what}: no complete answer within {timeout:g}s")
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body)
    except (OSError, http.client.HTTPException) as e:  # timeouts, refusals, resets, bad status lines
        if expired.is_set() or isinstance(e, TimeoutError):
            raise NoticeError(f"{what}: no complete answer within {timeout:g}s") from None
        shown = "".join(c if c.isprintable() else "?" for c in str(e)[:120])  # what the server sent, printed safely
        raise NoticeError(f"{what}: {type(e).__name__}: {shown}") from None
    finally:
        timer.cancel()
        conn.close()


def _shutdown(conn: http.client.HTTPConnection, expired: threading.Event) -> None:
    expired.set()
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


# -- sources: one protocol each ---------------------------------------------------------------------------


class Source:
    """One thing to poll. :meth:`poll` returns the notice it reads now (or None), or raises :class:`NoticeError`."""

    name = ""
    gap_seconds = 1.0
    """Wait between two polls that answered."""

    def poll(self) -> Notice | None:
        raise NotImplementedError


def _check(answer: Answer, what: str, *ok: int) -> None:
    if answer.status not in ok:
        raise NoticeError(f"{what}: HTTP {answer.status}")


@dataclass
class AwsSource(Source):
    """IMDSv2: a session token from ``PUT /latest/api/token``, then ``spot/instance-action`` (404: no notice) and
    the rebalance recommendation (logged once, never a drain: it is a risk, not a notice)."""

    base: str
    request: Request = http_request
    timeout_seconds: float = 2.0
    gap_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic
    log: Any = None
    name: str = "aws"
    token: str = ""
    token_at: float = 0.0
    rebalance_seen: float = 0.0

    def _token(self) -> str:
        if self.token and self.clock() - self.token_at < AWS_TOKEN_TTL_SECONDS / 2:
            return self.token
        headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_SECONDS)}
        answer = self.request("PUT", f"{self.base}/latest/api/token", headers, self.timeout_seconds)
        _check(answer, "aws PUT /latest/api/token", 200)
        token = plain_text(answer.body, "aws PUT /latest/api/token")
        if not token:
            raise NoticeError("aws PUT /latest/api/token: empty token")
        self.token, self.token_at = token, self.clock()
        return token

    def _get(self, path: str) -> Answer:
        answer = self.request(
            "GET", f"{self.base}{path}", {"X-aws-ec2-metadata-token": self._token()}, self.timeout_seconds
        )
        if answer.status == 401:  # the token expired or was refused: take a new one next time
            self.token = ""
        _check(answer, f"aws GET {path}", 200, 404)
        return answer

    def poll(self) -> Notice | None:
        answer = self._get("/latest/meta-data/spot/instance-action")
        if answer.status == 200:
            return parse_aws_instance_action(answer.body)  # a notice wins: the rebalance read cannot lose it
        rebalance = self._get("/latest/meta-data/events/recommendations/rebalance")
        if rebalance.status == 200:
            at = parse_aws_rebalance(rebalance.body)
            if at != self.rebalance_seen:
                self.rebalance_seen = at
                (self.log or get_logger("notice")).warning(
                    "aws rebalance recommendation: this spot instance is at elevated risk of interruption "
                    "(not drained: no interruption notice yet)",
                    notice_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)),
                )
        return None


@dataclass
class GcpSource(Source):
    """One key under ``/computeMetadata/v1/instance/`` read with wait-for-change: the first GET returns the value
    and its ``ETag``; each next one passes ``last_etag`` and hangs until the value changes or ``timeout_sec``."""

    base: str
    key: str
    """``preempted`` or ``maintenance-event``."""
    parse: Callable[[bytes, float], Notice | None]
    request: Request = http_request
    timeout_seconds: float = 2.0
    wait_seconds: int = GCP_WAIT_SECONDS
    wall_clock: Callable[[], float] = time.time
    gap_seconds: float = 0.5
    etag: str = ""
    waiting: bool = False
    """Set after the first answer: the first GET reads the value as it is (a wait-for-change with no ETag would
    hang until the next change, missing a notice already given); every next GET waits for a change."""

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"gcp {self.key}"

    def poll(self) -> Notice | None:
        query, deadline = "", self.timeout_seconds
        if self.waiting:
            query, deadline = f"?wait_for_change=true&timeout_sec={self.wait_seconds}", deadline + self.wait_seconds
            if self.etag:
                query += f"&last_etag={urllib.parse.quote(self.etag, safe='')}"
        what = f"gcp GET instance/{self.key}"
        answer = self.request(
            "GET", f"{self.base}/computeMetadata/v1/instance/{self.key}{query}", {"Metadata-Flavor": "Google"}, deadline
        )
        if answer.headers.get("metadata-flavor") != "Google":
            raise NoticeError(f"{what}: the answer has no 'Metadata-Flavor: Google' header (not GCP's server)")
        _check(answer, what, 200)
        notice = self.parse(answer.body, self.wall_clock())
        etag = answer.headers.get("etag", "")
        self.etag = etag if len(etag) <= 64 and etag.isprintable() else ""
        self.waiting = True
        return notice


@dataclass
class AzureSource(Source):
    """Scheduled Events: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``; this VM's
    name (to match an event's ``Resources``) from ``/metadata/instance/compute/name`` once. Events are not
    acknowledged: an acknowledgement lets Azure end the VM sooner."""

    base: str
    request: Request = http_request
    timeout_seconds: float = 2.0
    gap_seconds: float = 1.0
    wall_clock: Callable[[], float] = time.time
    name: str = "azure"
    vm_name: str = ""

    def _get(self, path: str) -> Answer:
        answer = self.request("GET", f"{self.base}{path}", {"Metadata": "true"}, self.timeout_seconds)
        _check(answer, f"azure GET {path.split('?')[0]}", 200)
        return answer

    def poll(self) -> Notice | None:
        if not self.vm_name:
            body = self._get("/metadata/instance/compute/name?api-version=2021-02-01&format=text").body
            name = plain_text(body, "azure compute/name")
            if not name:
                raise NoticeError("azure compute/name: empty VM name")
            self.vm_name = name
        body = self._get(f"/metadata/scheduledevents?api-version={AZURE_API_VERSION}").body
        return parse_azure_events(body, self.vm_name, self.wall_clock())


def sources(cloud: str, base: str, *, timeout_seconds: float, poll_seconds: float) -> list[Source]:
    """The sources that watch ``cloud``'s metadata service at ``base``."""
    if cloud == "aws":
        return [AwsSource(base, timeout_seconds=timeout_seconds, gap_seconds=poll_seconds)]
    if cloud == "gcp":
        return [
            GcpSource(base, "preempted", parse_gcp_preempted, timeout_seconds=timeout_seconds),
            GcpSource(base, "maintenance-event", parse_gcp_maintenance, timeout_seconds=timeout_seconds),
        ]
    if cloud == "azure":
        return [AzureSource(base, timeout_seconds=timeout_seconds, gap_seconds=poll_seconds)]
    raise ValueError(f"--preemption-notice: unknown cloud {cloud!r}; expected one of {CLOUDS}")


# -- the watch ----------------------------------------------------------------------------------------


class NoticeReader(Protocol):
    """What the agent needs of a notice watch (tests pass a fake)."""

    def notice(self) -> Notice | None:
        """The notice read so far, or None; never blocks."""
        ...


@dataclass
class NoticeWatch:
    """Polls its sources, one thread each, until :meth:`stop`. The first notice read is kept."""

    cloud: str
    sources: list[Source]
    error_gap_seconds: float = 2.0
    """Wait after a failed poll (also for a GCP source, whose answered polls follow each other at once)."""
    log: Any = None
    _notice: Notice | None = None
    _errors: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def notice(self) -> Notice | None:
        """The notice read so far, or None. Never blocks on the network."""
        with self._lock:
            return self._notice

    def poll_once(self, source: Source) -> bool:
        """Poll ``source`` once, record what it says, and return whether it answered (for the wait that follows)."""
        log = self.log or get_logger("notice")
        try:
            notice = source.poll()
        except Exception as e:  # a NoticeError, or any surprise in a hostile answer: a failed poll, never a dead watch
            if not isinstance(e, NoticeError):
                e = NoticeError(f"{source.name}: {type(e).__name__}: {str(e)[:200]}")
            if self._errors.get(source.name) != str(e):
                log.warning("cannot read the preemption notice; polling on", source=source.name, error=str(e))
            self._errors[source.name] = str(e)
            return False
        if self._errors.pop(source.name, None) is not None:
            log.info("preemption notice readable again", source=source.name)
        if notice is not None:
            with self._lock:
                first = self._notice is None
                if first:
                    self._notice = notice
            if first:
                log.warning(notice.describe(), notice=notice.token, notice_time=notice.time)
        return True

    def _loop(self, source: Source) -> None:
        while not self._stopping.is_set():
            answered = self.poll_once(source)
            self._stopping.wait(source.gap_seconds if answered else self.error_gap_seconds)

    def start(self) -> NoticeWatch:
        for source in self.sources:
            t = threading.Thread(target=self._loop, args=(source,), name=f"notice-{source.name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop polling (a GCP request in flight ends by its own deadline: the threads are daemons)."""
        self._stopping.set()


# -- the agent's choice -------------------------------------------------------------------------------


def clouds_of(choice: str) -> tuple[str, ...]:
    """The clouds whose services ``--preemption-notice choice`` may read."""
    return CLOUDS if choice == "auto" else (choice,) if choice in CLOUDS else ()


def endpoint(cloud: str, env: Mapping[str, str] = os.environ) -> str:
    """``cloud``'s metadata base URL: its environment variable, else the cloud's own address; ``ValueError`` for
    a value that is not ``http://HOST[:PORT]``."""
    name = ENDPOINT_ENV[cloud]
    url = env.get(name) or DEFAULT_ENDPOINTS[cloud]
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        parts = parts._replace(scheme="")
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"{name}={ascii(url)[:80]}: expected http://HOST[:PORT] (a metadata service)")
    return url.rstrip("/")


def _answers_as(cloud: str, env: Mapping[str, str], timeout: float, request: Request) -> bool:
    """Whether ``cloud``'s metadata service answers a cheap question as that cloud's does."""
    base = endpoint(cloud, env)
    try:
        if cloud == "aws":
            headers = {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
            return request("PUT", f"{base}/latest/api/token", headers, timeout).status == 200
        if cloud == "gcp":
            a = request("GET", f"{base}/computeMetadata/v1/instance/id", {"Metadata-Flavor": "Google"}, timeout)
            return a.status == 200 and a.headers.get("metadata-flavor") == "Google"
        path = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
        return request("GET", f"{base}{path}", {"Metadata": "true"}, timeout).status == 200
    except NoticeError:
        return False


def probe(
    env: Mapping[str, str] = os.environ, timeout_seconds: float = 1.0, request: Request = http_request
) -> str | None:
    """The cloud whose metadata service answers as that cloud's does (aws, gcp, azure in that order), or None.
    The three are asked at once, each in a daemon thread, and a question not answered by ``timeout_seconds`` (plus
    a little) counts as no: a name lookup (``metadata.google.internal`` off-cloud) is not bounded by the request's
    deadline, and must delay neither the start nor the exit."""
    answers: dict[str, bool] = {}

    def ask(cloud: str) -> None:
        answers[cloud] = _answers_as(cloud, env, timeout_seconds, request)

    threads = [threading.Thread(target=ask, args=(c,), name=f"probe-{c}", daemon=True) for c in CLOUDS]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_seconds + 0.5
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return next((c for c in CLOUDS if answers.get(c)), None)


def build(
    choice: str,
    *,
    env: Mapping[str, str] = os.environ,
    timeout_seconds: float = 2.0,
    poll_seconds: float = 1.0,
    log: Any = None,
) -> NoticeWatch | None:
    """The watch ``--preemption-notice choice`` asks for (not started), or None (``none``, or ``auto`` off-cloud).
    ``ValueError`` (one line) for a bad choice or endpoint."""
    if choice not in CHOICES:
        raise ValueError(f"--preemption-notice must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "none":
        return None
    log = log or get_logger("notice")
    cloud: str | None = choice
    for c in clouds_of(choice):
        endpoint(c, env)  # a bad override is an error, not a cloud that does not answer
    if choice == "auto":
        cloud = probe(env, timeout_seconds=min(timeout_seconds, 1.0))
        log.info(
            f"--preemption-notice auto: {cloud or 'no'} metadata service answered"
            + ("" if cloud else "; not watching for preemption notices")
        )
        if cloud is None:
            return None
    assert cloud is not None
    base = endpoint(cloud, env)
    return NoticeWatch(
        cloud,
        sources(cloud, base, timeout_seconds=timeout_seconds, poll_seconds=poll_seconds),
        error_gap_seconds=max(poll_seconds, 1.0),
        log=log,
    )
