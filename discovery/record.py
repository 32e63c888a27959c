"""The value stored for one host, as a typed record (see :mod:`discovery.wire` for the format)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from discovery.wire import (
    DEFAULT_PREFIX,
    DRAINING,
    MAX_EVICTIONS,
    MAX_SLOTS,
    READY,
    STATES,
    MalformedRecord,
    check_addr,
    check_drain_reason,
    check_evictions,
    check_name,
    check_notice,
    check_slots,
    check_time,
    drop_case_duplicates,
    host_key,
    hosts_prefix,
    parse_value,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DRAINING",
    "MAX_EVICTIONS",
    "MAX_SLOTS",
    "READY",
    "STATES",
    "HostRecord",
    "MalformedRecord",
    "check_addr",
    "check_drain_reason",
    "check_evictions",
    "check_name",
    "check_notice",
    "check_slots",
    "check_time",
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
    drain_reason: str = ""
    """Why an evictor drained the host (a short token: ``straggler``, ``hung``); ``""`` for any other drain
    (an operator's ``hosts drain``, SIGTERM, a cordon) and for a ready host."""
    drain_until: float = 0.0
    """Unix time at which the host's agent marks the evicted host ``ready`` again; 0: no automatic readmission."""
    evictions: int = 0
    """How many times the host was evicted (an evictor lengthens the next cool-down by it); kept when the host is
    readmitted or undrained."""
    notice: str = ""
    """The cloud's preemption notice that drained the host (``aws-spot-terminate``, ``gcp-preempted``,
    ``azure-preempt``, ...: :mod:`discovery.notice`), written by its agent; ``""``: none. Kept by every state
    change: the machine is going away whatever an operator sets."""
    notice_time: float = 0.0
    """Unix time at which the cloud ends the instance, as its notice says (or as the cloud documents when the notice
    carries no time); 0: no notice."""

    def __post_init__(self) -> None:
        check_name("host", self.host)
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")
        check_slots(self.slots)
        check_addr(self.addr)
        check_time("registered_at", self.registered_at)
        check_drain_reason(self.drain_reason)
        check_time("drain_until", self.drain_until)
        check_evictions(self.evictions)
        check_notice(self.notice)
        check_time("notice_time", self.notice_time)

    @property
    def evicted(self) -> bool:
        """Draining with a cool-down, so its agent makes it ready again at ``drain_until``."""
        return self.state == DRAINING and self.drain_until > 0

    def with_state(self, state: str) -> HostRecord:
        """This record in ``state``, as an operator, a signal or a cordon sets it: not an eviction, so with no
        ``drain_reason`` and no ``drain_until`` (``evictions`` is kept)."""
        return replace(self, state=state, drain_reason="", drain_until=0.0)

    def with_notice(self, notice: str, notice_time: float) -> HostRecord:
        """This record drained by a preemption notice: ``draining`` (not an eviction) with the notice recorded."""
        return replace(self.with_state(DRAINING), notice=notice, notice_time=notice_time)

    def evicted_until(self, reason: str, drain_until: float) -> HostRecord:
        """This record drained by an evictor for ``reason`` until ``drain_until``, one more eviction counted."""
        evictions = min(self.evictions + 1, MAX_EVICTIONS - 1)
        return replace(self, state=DRAINING, drain_reason=reason, drain_until=drain_until, evictions=evictions)

    def to_json(self) -> bytes:
        """The stored value: compact JSON of every field but ``host``, keys sorted."""
        data = asdict(self)
        del data["host"]  # the key names the host
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, host: str, raw: bytes | str) -> HostRecord:
        """Parse a stored value; raise :class:`MalformedRecord` saying what is wrong."""
        return cls(**parse_value(host, raw))
