"""Key layout and value format of host records, with no imports beyond ``json``.

``discover.sh`` runs every second, so its Python path (``discover.py`` and this module) avoids even
``dataclasses``, ``re`` and ``urllib``: each costs milliseconds of start-up on a small machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing alone costs ~10 ms
if TYPE_CHECKING:
    from typing import Any

READY = "ready"
DRAINING = "draining"
STATES = (READY, DRAINING)
DEFAULT_PREFIX = "/elastictrain"

# Horovod splits discovery lines on ':' and puts host names in ssh and Gloo addresses: keep them plain.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class MalformedRecord(ValueError):
    """A value under the hosts prefix that is not a valid host record (readers skip it)."""


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid job or host name, else raise ``ValueError`` naming it."""
    if not value or not value[0].isalnum() or not _NAME_CHARS.issuperset(value):
        raise ValueError(f"invalid {kind} name {value!r}: use letters, digits, '.', '_' or '-'")
    return value


def hosts_prefix(prefix: str, job: str) -> str:
    """``<prefix>/<job>/hosts/``: every host key of ``job`` starts with this."""
    return f"{prefix.rstrip('/')}/{job}/hosts/"


def host_key(prefix: str, job: str, host: str) -> str:
    return hosts_prefix(prefix, job) + host


def parse_value(host: str, raw: bytes | str) -> dict[str, Any]:
    """Validate a stored value; return its fields (``host`` included) or raise :class:`MalformedRecord`."""
    try:
        data: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedRecord(f"host {host!r}: value is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise MalformedRecord(f"host {host!r}: value is not a JSON object")
    try:
        check_name("host", host)
    except ValueError as e:
        raise MalformedRecord(str(e)) from None
    slots = data.get("slots")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise MalformedRecord(f"host {host!r}: slots must be a positive integer, got {slots!r}")
    state = data.get("state", READY)
    if state not in STATES:
        raise MalformedRecord(f"host {host!r}: state must be one of {STATES}, got {state!r}")
    try:
        pid = int(data.get("pid", 0))
        registered_at = float(data.get("registered_at", 0.0))
    except (TypeError, ValueError) as e:
        raise MalformedRecord(f"host {host!r}: {e}") from None
    return {
        "host": host,
        "slots": slots,
        "addr": str(data.get("addr", host)),
        "state": state,
        "pid": pid,
        "registered_at": registered_at,
    }


def discovery_lines(records: Iterable[dict[str, Any]]) -> list[str]:
    """Sorted ``host:slots`` lines of ready hosts: what ``discover.sh`` prints for horovodrun."""
    return sorted(f"{r['host']}:{r['slots']}" for r in records if r["state"] == READY)
