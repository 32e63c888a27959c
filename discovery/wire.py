"""Key layout and value format of host records, with no imports beyond ``json``.

A host's value is a JSON object: ``slots`` (required, integer in [1, 4096]), ``addr`` (host name or IP
address; default the host), ``state`` (``ready`` or ``draining``; default ``ready``), ``pid`` (integer in
[0, 2**32); default 0), ``registered_at`` (Unix time; default 0), and an eviction's fields:
``drain_reason`` (``""``, or up to 32 of ``[a-z0-9_-]`` such as ``straggler`` when an evictor drained the
host; default ``""``), ``drain_until`` (Unix time at which the host's agent marks it ready again; 0, the
default, means never by itself) and ``evictions`` (how many times the host was evicted; default 0), and a cloud's
preemption notice: ``notice`` (``""``, or up to 32 of ``[a-z0-9_-]`` naming the cloud and the event, such as
``aws-spot-terminate``; default ``""``) and ``notice_time`` (Unix time at which the cloud ends the instance; 0, the
default, when there is no notice). Absent
fields take their defaults, so values written before a field existed still parse; unknown fields are
ignored. Anything else is a :class:`MalformedRecord` with a one-line message naming the field.

``discover.sh`` runs every second, so its Python path (``discover.py`` and this module) avoids even
``dataclasses``, ``re`` and ``urllib``: each costs milliseconds of start-up on a small machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from elastictrain.errors import InputError

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing alone costs ~10 ms
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

READY = "ready"
DRAINING = "draining"
STATES = (READY, DRAINING)
DEFAULT_PREFIX = "/elastictrain"
_MAX_TIME = 1e11
"""Upper bound of a Unix time (year 5138): anything above it (inf included) is garbage."""

# Horovod splits discovery lines on ':' and puts host names in ssh and Gloo addresses: keep them plain.
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_NAME_CHARS = _ALNUM | frozenset("._-")
# An address is a host name, an IPv4 address or an IPv6 address (brackets and a zone index allowed).
_ADDR_CHARS = _NAME_CHARS | frozenset(":[]%")
MAX_NAME_LENGTH = 253
"""Longest job, host or address (a DNS name's limit)."""
MAX_SLOTS = 4096
"""Most slots one host may advertise (an upper bound against a garbage value, far above any machine)."""
MAX_DRAIN_REASON_LENGTH = 32
"""Longest ``drain_reason`` (a short token such as ``straggler`` or ``hung``)."""
_DRAIN_REASON_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")
MAX_EVICTIONS = 1 << 31
"""Bound of ``evictions`` (exclusive), against a garbage value."""
MAX_NOTICE_LENGTH = 32
"""Longest ``notice`` (a token such as ``aws-spot-terminate``: the same characters as a ``drain_reason``)."""


class MalformedRecord(InputError):
    """A value under the hosts prefix that is not a valid host record (readers skip it)."""


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid job or host name, else raise ``ValueError`` naming it.

    The one rule for job and host names everywhere (config, launcher, agent, registry, discovery):
    1 to 253 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit. So a name is
    never a path component like ``..``, never read as a flag (``-x``), and is safe in etcd keys,
    ``host:slots`` lines, ssh arguments and terminals.
    """
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_NAME_LENGTH
        or value[0] not in _ALNUM
        or not _NAME_CHARS.issuperset(value)
    ):
        shown = ascii(value)[:80]
        raise ValueError(
            f"invalid {kind} name {shown}: use 1 to {MAX_NAME_LENGTH} ASCII letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def check_addr(value: object) -> str:
    """Return ``value`` if it is a plausible host name or IP address, else raise ``ValueError``.

    Characters are limited to those of names and IP addresses (no spaces, control characters or
    terminal escapes), since ``hosts list`` prints the address as stored.
    """
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_LENGTH or not _ADDR_CHARS.issuperset(value):
        raise ValueError(f"invalid address {ascii(value)[:80]}: expected a host name or an IP address")
    return value


def check_slots(value: object) -> int:
    """Return ``value`` if it is an integer in ``[1, MAX_SLOTS]``, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SLOTS:
        raise ValueError(f"slots must be an integer in [1, {MAX_SLOTS}], got {ascii(value)[:40]}")
    return value


def check_drain_reason(value: object) -> str:
    """Return ``value`` if it is a valid ``drain_reason`` (``""`` or a short token), else raise ``ValueError``."""
    if not isinstance(value, str) or len(value) > MAX_DRAIN_REASON_LENGTH or not _DRAIN_REASON_CHARS.issuperset(value):
        raise ValueError(
            f"drain_reason must be at most {MAX_DRAIN_REASON_LENGTH} of [a-z0-9_-], got {ascii(value)[:40]}"
        )
    return value


def check_notice(value: object) -> str:
    """Return ``value`` if it is a valid ``notice`` (``""`` or a token such as ``gcp-preempted``), else raise
    ``ValueError``."""
    if not isinstance(value, str) or len(value) > MAX_NOTICE_LENGTH or not _DRAIN_REASON_CHARS.issuperset(value):
        raise ValueError(f"notice must be at most {MAX_NOTICE_LENGTH} of [a-z0-9_-], got {ascii(value)[:40]}")
    return value


def check_time(field: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite Unix time >= 0, else raise ``ValueError`` naming ``field``.

    ``json.loads`` accepts NaN and Infinity; a non-finite time would make every comparison false.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < _MAX_TIME:
        raise ValueError(f"{field} must be a finite Unix time >= 0, got {ascii(value)[:40]}")
    return float(value)


def check_evictions(value: object) -> int:
    """Return ``value`` if it is an integer in ``[0, MAX_EVICTIONS)``, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_EVICTIONS:
        raise ValueError(f"evictions must be an integer in [0, 2**31), got {ascii(value)[:40]}")
    return value


def hosts_prefix(prefix: str, job: str) -> str:
    """``<prefix>/<job>/hosts/``: every host key of ``job`` starts with this."""
    return f"{prefix.rstrip('/')}/{job}/hosts/"


def host_key(prefix: str, job: str, host: str) -> str:
    return hosts_prefix(prefix, job) + host


_RAW_DECODE = json.JSONDecoder().raw_decode


def _loads(raw: bytes | str) -> Any:
    """``json.loads(raw)``, at half its cost for the usual value (UTF-8 with no whitespace around it): discovery
    parses every value of a job at every call. Any other value goes through ``json.loads`` itself, so the result
    and the errors are exactly its own."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        data, end = _RAW_DECODE(text)
        if end == len(text):
            return data
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        pass
    return json.loads(raw)


def parse_value(host: str, raw: bytes | str) -> dict[str, Any]:
    """Validate a stored value; return its fields (``host`` included) or raise :class:`MalformedRecord`."""
    try:
        data: Any = _loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedRecord(f"host {host!r}: value is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise MalformedRecord(f"host {host!r}: value is not a JSON object")
    try:
        check_name("host", host)
    except ValueError as e:
        raise MalformedRecord(str(e)) from None
    try:
        slots = check_slots(data.get("slots"))
        addr = check_addr(data.get("addr", host))
    except ValueError as e:
        raise MalformedRecord(f"host {host!r}: {e}") from None
    state = data.get("state", READY)
    if state not in STATES:
        raise MalformedRecord(f"host {host!r}: state must be one of {STATES}, got {ascii(state)[:40]}")
    pid = data.get("pid", 0)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 1 << 32:
        raise MalformedRecord(f"host {host!r}: pid must be an integer in [0, 2**32), got {ascii(pid)[:40]}")
    try:
        registered_at = check_time("registered_at", data.get("registered_at", 0.0))
        drain_reason = check_drain_reason(data.get("drain_reason", ""))
        drain_until = check_time("drain_until", data.get("drain_until", 0.0))
        evictions = check_evictions(data.get("evictions", 0))
        notice = check_notice(data.get("notice", ""))
        notice_time = check_time("notice_time", data.get("notice_time", 0.0))
    except ValueError as e:
        raise MalformedRecord(f"host {host!r}: {e}") from None
    return {
        "host": host,
        "slots": slots,
        "addr": addr,
        "state": state,
        "pid": pid,
        "registered_at": registered_at,
        "drain_reason": drain_reason,
        "drain_until": drain_until,
        "evictions": evictions,
        "notice": notice,
        "notice_time": notice_time,
    }


def drop_case_duplicates(items: Iterable[Any], name: Callable[[Any], str]) -> tuple[list[Any], list[str]]:
    """Keep one item per host name compared without case; return ``(kept, warnings)`` in name order.

    Host names are DNS names, which ignore case, so ``Node1`` and ``node1`` are one machine: listing
    both would start two sets of workers there under names Horovod treats as different hosts. Of
    names that differ only in case, the first in byte order (the order of etcd's keys) is kept and
    each other one is skipped with a warning. Every reader (``discover.sh``, the registry, so the
    launcher and ``hosts list``) applies this same rule.
    """
    kept: dict[str, Any] = {}
    warnings: list[str] = []
    for item in sorted(items, key=name):
        folded = name(item).lower()
        first = kept.get(folded)
        if first is None:
            kept[folded] = item
        else:
            warnings.append(f"host {name(item)!r}: differs from {name(first)!r} only in case (one machine)")
    return list(kept.values()), warnings


def discovery_lines(records: Iterable[dict[str, Any]]) -> list[str]:
    """Sorted ``host:slots`` lines of ready hosts: what ``discover.sh`` prints for horovodrun."""
    return sorted(f"{r['host']}:{r['slots']}" for r in records if r["state"] == READY)
