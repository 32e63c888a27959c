"""The value stored for one host, as a typed record (see :mod:`discovery.wire` for the format)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from discovery.wire import (
    DEFAULT_PREFIX,
    DRAINING,
    MAX_SLOTS,
    READY,
    STATES,
    MalformedRecord,
    check_addr,
    check_name,
    check_slots,
    drop_case_duplicates,
    host_key,
    hosts_prefix,
    parse_value,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DRAINING",
    "MAX_SLOTS",
    "READY",
    "STATES",
    "HostRecord",
    "MalformedRecord",
    "check_addr",
    "check_name",
    "check_slots",
    "drop_case_duplicates",
    "host_key",
    "hosts_prefix",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRecord:
    """One host's membership entry, stored as JSON under ``<prefix>/<job>/hosts/<host>``."""

    host: str
    """Host name as horovodrun will use it (also the last part of the key)."""
    slots: int
    """Worker processes this host can run (GPUs, or 1 on a CPU host)."""
    addr: str
    """Address of the host, for operators."""
    state: str = READY
    """``ready``: discovery lists it; ``draining``: discovery skips it so Horovod removes it gracefully."""
    pid: int = 0
    """Pid of the agent that registered it."""
    registered_at: float = 0.0
    """Unix time of registration."""

    def __post_init__(self) -> None:
        check_name("host", self.host)
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")
        check_slots(self.slots)
        check_addr(self.addr)
        if not 0 <= self.registered_at < 1e11:
            raise ValueError(f"registered_at must be a finite Unix time >= 0, got {self.registered_at!r}")

    def with_state(self, state: str) -> HostRecord:
        return replace(self, state=state)

    def to_json(self) -> bytes:
        data = asdict(self)
        del data["host"]  # the key names the host
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, host: str, raw: bytes | str) -> HostRecord:
        """Parse a stored value; raise :class:`MalformedRecord` saying what is wrong."""
        return cls(**parse_value(host, raw))
