"""``elastictrain agent``: register this host in etcd, keep its lease alive, drain on SIGTERM.

The daemon is a loop ``while not stopping: observe; decide; apply; wait``. :func:`decide` is a pure
function of the config, the agent's bookkeeping and one :class:`Observation` (with its time), so
tests drive it with chosen times. Signal handlers only set flags; the lease is revoked in ``finally``
when the agent leaves for any reason other than losing etcd.

Behaviour:
- registers ``<prefix>/<job>/hosts/<host>`` as ``ready`` under a lease of ``--ttl`` seconds
  (create-if-absent: it waits for a stale key of a previous agent to expire instead of taking it);
- refreshes the lease every ``--heartbeat`` seconds; registers again under a new lease when etcd
  lost the lease (restart on an empty data dir, an outage longer than the TTL);
- keeps the state an operator set (``elastictrain hosts drain``) when it registers again;
- readmits an evicted host: when an evictor (rank 0, :func:`discovery.registry.evict`) drained it with a
  cool-down, the agent marks it ``ready`` again (``drain_reason`` and ``drain_until`` cleared, ``evictions``
  kept) in its first cycle at or after the wall-clock time ``drain_until``, unless the agent is draining on a
  signal or the node is cordoned (then an uncordon comes first); registering again under a new lease keeps
  the eviction and its count, so the cool-down still applies;
- SIGTERM or SIGINT: marks the host ``draining`` at once (discovery drops it, Horovod removes it
  gracefully), revokes the lease after ``--drain-grace`` seconds and exits 0; a second signal
  skips the rest of the grace period;
- with ``--drain-when-cordoned NODE`` (Kubernetes): reads the node each cycle (``discovery/nodewatch.py``);
  while it is cordoned (``kubectl drain`` cordons, then skips DaemonSet pods, so no SIGTERM comes) the host
  is kept ``draining`` and keeps its lease; when the node is schedulable again the agent marks it ``ready``
  if the cordon was what drained it (an operator's ``undrain`` in between already did). A node that cannot
  be read keeps the last answer, logged once per new error;
- with ``--preemption-notice {auto,aws,gcp,azure}``: watches the instance's metadata service
  (``discovery/noticewatch.py``, in threads of its own); a notice marks the host ``draining`` at once, with the
  notice and the time the cloud ends the instance in its record (``notice``, ``notice_time``), keeps its lease
  (the record stays until the machine is gone) and holds the drain for the agent's life (an operator's ``undrain``
  is undone at the next cycle, an uncordon or an eviction's cool-down readmits nothing);
- exits 0 when an operator removed its key (``elastictrain hosts remove``) while its lease lived;
- exits 1 with one line when etcd stays unreachable longer than ``--retry-deadline`` (also at
  start-up), and 2 with one line for bad flags.

Size: the daemon's loop, its pure decision and its options; what it watches (nodewatch, notice) is elsewhere.
"""

from __future__ import annotations

import argparse
import enum
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from discovery import endpoints
from discovery import noticewatch as notices
from discovery.nodewatch import NodeReader, NodeWatchError, in_cluster
from discovery.notice import Notice
from discovery.record import (
    DEFAULT_PREFIX,
    DRAINING,
    READY,
    HostRecord,
    MalformedRecord,
    check_addr,
    check_name,
    check_slots,
)
from discovery.registry import (
    EtcdRegistry,
    HostRegistry,
    LeaseLost,
    RegistryError,
)
from elastictrain import envnames
from elastictrain.cliutil import OneLineParser, number
from elastictrain.commands import zygote_command
from elastictrain.logconf import configure_logging, get_logger

PROG = "elastictrain agent"


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Settings of one agent. Timing rules are checked in ``__post_init__``."""

    job: str
    """Job name; keys live under ``<prefix>/<job>/hosts/``."""
    host: str
    """Host name horovodrun will use for this machine."""
    slots: int
    """Worker slots to advertise."""
    addr: str
    """Address recorded for operators."""
    prefix: str = DEFAULT_PREFIX
    """etcd key prefix."""
    ttl_seconds: int = 10
    """Lease TTL: a dead agent's host disappears at most this long after its last heartbeat."""
    heartbeat_seconds: float = 3.0
    """Interval between lease refreshes (and decisions)."""
    request_timeout_seconds: float = 1.0
    """Deadline of each etcd request."""
    drain_grace_seconds: float = 30.0
    """Time between marking the host draining (SIGTERM) and revoking the lease."""
    retry_deadline_seconds: float = 60.0
    """How long etcd may stay unreachable (or a stale key block registration) before the agent gives up."""
    drain_when_cordoned: str | None = None
    """Kubernetes node whose cordon drains this host (``--drain-when-cordoned``); None: no node watch."""
    preemption_notice: str = "none"
    """Which cloud's preemption notice drains this host (``--preemption-notice``): none, auto, aws, gcp, azure."""
    notice_poll_seconds: float = 1.0
    """Interval between two reads of the metadata service (AWS, Azure; GCP's reads wait for a change)."""

    def __post_init__(self) -> None:
        check_name("job", self.job)
        check_name("host", self.host)
        check_addr(self.addr)
        try:
            check_slots(self.slots)
        except ValueError as e:
            raise ValueError(f"--{e}") from None
        if self.ttl_seconds < 2:
            raise ValueError(f"--ttl must be >= 2 seconds (etcd's minimum lease TTL), got {self.ttl_seconds}")
        if not 0 < self.heartbeat_seconds <= self.ttl_seconds / 3:
            raise ValueError(
                f"--heartbeat must be > 0 and <= ttl/3 = {self.ttl_seconds / 3:g}s so that two missed "
                f"heartbeats do not expire the lease, got {self.heartbeat_seconds:g}"
            )
        if not self.request_timeout_seconds > 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout_seconds:g}")
        if self.heartbeat_seconds + 2 * self.request_timeout_seconds > self.ttl_seconds:
            raise ValueError(
                f"heartbeat + 2*request_timeout = {self.heartbeat_seconds + 2 * self.request_timeout_seconds:g}s "
                f"must be <= ttl = {self.ttl_seconds}s (lower --heartbeat or --request-timeout, or raise --ttl)"
            )
        if self.drain_when_cordoned is not None:
            check_name("--drain-when-cordoned node", self.drain_when_cordoned)
            cycle = self.heartbeat_seconds + 3 * self.request_timeout_seconds
            if cycle > self.ttl_seconds:
                raise ValueError(
                    f"with --drain-when-cordoned a cycle reads the node too: heartbeat + 3*request_timeout = "
                    f"{cycle:g}s must be <= ttl = {self.ttl_seconds}s (lower --heartbeat or --request-timeout)"
                )
        if self.preemption_notice not in notices.CHOICES:
            raise ValueError(
                f"--preemption-notice must be one of {', '.join(notices.CHOICES)}, got {self.preemption_notice!r}"
            )
        if not 0.1 <= self.notice_poll_seconds <= 60:
            raise ValueError(f"--notice-poll must be in [0.1, 60] seconds, got {self.notice_poll_seconds:g}")
        if self.drain_grace_seconds < 0:
            raise ValueError(f"--drain-grace must be >= 0, got {self.drain_grace_seconds:g}")
        if self.retry_deadline_seconds < self.ttl_seconds:
            raise ValueError(
                f"--retry-deadline must be >= ttl = {self.ttl_seconds}s (a stale key of a previous agent "
                f"takes up to one TTL to expire), got {self.retry_deadline_seconds:g}"
            )


class Action(enum.Enum):
    REGISTER = "register"
    MARK_DRAINING = "mark_draining"
    DRAIN_CORDONED = "drain_cordoned"
    READY_UNCORDONED = "ready_uncordoned"
    DRAIN_NOTICE = "drain_notice"
    """The cloud gave notice that the instance ends: mark the host draining with the notice in its record."""
    READMIT = "readmit"
    """An eviction's cool-down is over: mark the host ready (``drain_until`` reached on the wall clock)."""
    HEARTBEAT = "heartbeat"
    WAIT = "wait"
    REVOKE_AND_EXIT = "revoke_and_exit"
    EXIT = "exit"


@dataclass(frozen=True, slots=True)
class AgentDecision:
    """What a cycle decided, as an action and the sentence that is logged."""

    action: Action
    reason: str
    exit_code: int | None = None

    def __str__(self) -> str:
        return self.reason


@dataclass(slots=True)
class AgentState:
    """What the agent remembers between cycles (updated only by :class:`Agent`)."""

    lease_id: int | None = None
    wanted_state: str = READY
    """State to register with: ``ready``, or what an operator, an evictor or SIGTERM set."""
    drain_reason: str = ""
    """The eviction's reason in our key (followed with ``wanted_state``), to register with again."""
    drain_until: float = 0.0
    """The eviction's end (wall clock) in our key (followed with ``wanted_state``), to register with again."""
    evictions: int = 0
    """The eviction count in our key, to register with again."""
    registered: bool = False
    """The key was written under ``lease_id`` (so its absence later means someone deleted it)."""
    drain_requested_at: float | None = None
    force_stop: bool = False
    unreachable_since: float | None = None
    blocked_since: float | None = None
    """When a key of another lease first blocked registration."""
    cordon: str | None = None
    """Last known reason the node is being emptied (``--drain-when-cordoned``); None: schedulable or unknown."""
    cordon_drained: bool = False
    """The agent marked the host draining because of a cordon (so an uncordon makes it ready again)."""
    cordon_error: str = ""
    """Last error reading the node (logged once per new error)."""
    notice: Notice | None = None
    """The cloud's preemption notice, once read (``--preemption-notice``); kept for the agent's life."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One cycle's view of etcd, taken at ``now`` (monotonic seconds) and ``wall_time`` (Unix time)."""

    now: float
    wall_time: float = 0.0
    """Unix time of the observation: what an eviction's ``drain_until`` is compared with."""
    reachable: bool = True
    lease_alive: bool = False
    """Our lease exists and was just refreshed (False when we hold none)."""
    lease_lost: bool = False
    """The lease we held is gone (expired, or etcd lost it)."""
    key_state: str | None = None
    """State in our host's key, or None when there is no key."""
    key_lease: int = 0
    key_pid: int = 0
    key_drain_reason: str = ""
    key_drain_until: float = 0.0
    """Unix time at which an evicted host is to be ready again (0: not an eviction)."""
    key_evictions: int = 0
    error: str = ""
    cordon: str | None = None
    """Why the node is being emptied (the last answer read), or None when it is schedulable or not watched."""
    notice: Notice | None = None
    """The cloud's preemption notice read so far, or None."""
    key_notice: str = ""
    key_notice_time: float = 0.0


def decide(cfg: AgentConfig, st: AgentState, obs: Observation) -> AgentDecision:
    """The agent's decision for one cycle: pure, no I/O, times taken from ``obs.now``."""
    if st.drain_requested_at is not None:
        elapsed = obs.now - st.drain_requested_at
        if st.force_stop or elapsed >= cfg.drain_grace_seconds:
            why = (
                "second signal"
                if st.force_stop and elapsed < cfg.drain_grace_seconds
                else (f"drain grace of {cfg.drain_grace_seconds:g}s over")
            )
            if st.lease_id is not None and obs.reachable:
                return AgentDecision(Action.REVOKE_AND_EXIT, f"{why}; revoking lease {st.lease_id:x} and exiting", 0)
            return AgentDecision(Action.EXIT, f"{why}; etcd unreachable, exiting (the lease expires by itself)", 0)
    if not obs.reachable:
        down = obs.now - (st.unreachable_since if st.unreachable_since is not None else obs.now)
        if down > cfg.retry_deadline_seconds:
            return AgentDecision(
                Action.EXIT,
                f"etcd unreachable for {down:.0f}s, past the retry deadline of {cfg.retry_deadline_seconds:g}s "
                f"({obs.error}); giving up",
                1,
            )
        return AgentDecision(Action.WAIT, f"etcd unreachable for {down:.0f}s ({obs.error}); retrying")
    ours = st.lease_id is not None and obs.key_lease == st.lease_id
    if obs.key_state is None:
        if obs.lease_alive and st.registered:
            return AgentDecision(
                Action.REVOKE_AND_EXIT, f"host key removed by an operator while lease {st.lease_id:x} lived; exiting", 0
            )
        how = "lease lost; " if obs.lease_lost else ""
        state = st.wanted_state
        if obs.notice is not None:
            how, state = f"{how}{obs.notice.describe()}; ", DRAINING
        elif obs.cordon is not None and state == READY and st.drain_requested_at is None:
            how, state = f"{how}{obs.cordon}; ", DRAINING
        if kept_eviction(st):
            state = f"{state} ({_eviction(st.drain_reason, st.drain_until)})"
        return AgentDecision(
            Action.REGISTER,
            f"{how}registering {cfg.host} ({cfg.slots} slots) as {state} under a new {cfg.ttl_seconds}s lease",
        )
    if not ours:
        since = st.blocked_since if st.blocked_since is not None else obs.now
        if obs.now - since > cfg.retry_deadline_seconds:
            return AgentDecision(
                Action.EXIT,
                f"host key still held by lease {obs.key_lease:x} of pid {obs.key_pid} after "
                f"{obs.now - since:.0f}s; another agent runs as {cfg.host}? giving up",
                1,
            )
        return AgentDecision(
            Action.WAIT,
            f"host key held by lease {obs.key_lease:x} of pid {obs.key_pid} (a previous or duplicate "
            "agent); waiting for it to expire",
        )
    if not obs.lease_alive:
        return AgentDecision(Action.WAIT, f"lease {st.lease_id:x} lost but its key is still listed; waiting")
    if obs.notice is not None and (
        obs.key_state != DRAINING or (obs.key_notice, obs.key_notice_time) != (obs.notice.token, obs.notice.time)
    ):
        return AgentDecision(Action.DRAIN_NOTICE, f"{obs.notice.describe()}; marking host draining with the notice")
    if st.drain_requested_at is not None and obs.key_state != DRAINING:
        left = cfg.drain_grace_seconds - (obs.now - st.drain_requested_at)
        return AgentDecision(
            Action.MARK_DRAINING, f"drain requested; marking host draining, lease revoked in {left:.0f}s"
        )
    if st.drain_requested_at is None and obs.notice is None:
        if obs.cordon is not None and not st.cordon_drained and obs.key_state == READY:
            return AgentDecision(Action.DRAIN_CORDONED, f"{obs.cordon}; marking host draining until it is uncordoned")
        if obs.cordon is None and st.cordon_drained:
            return AgentDecision(Action.READY_UNCORDONED, "node is schedulable again; marking host ready")
        if (
            obs.cordon is None
            and obs.key_state == DRAINING
            and obs.key_drain_until > 0
            and obs.wall_time >= obs.key_drain_until
        ):
            why = f"the {obs.key_drain_reason} eviction" if obs.key_drain_reason else "an eviction"
            return AgentDecision(
                Action.READMIT,
                f"cool-down of {why} over; marking host ready (evictions: {obs.key_evictions})",
            )
    host = obs.key_state
    if obs.key_state == DRAINING and obs.key_drain_until > 0:
        host = f"{host} ({_eviction(obs.key_drain_reason, obs.key_drain_until)})"
    elif obs.key_state == DRAINING and obs.key_notice:
        host = f"{host} ({obs.key_notice})"
    return AgentDecision(Action.HEARTBEAT, f"lease {st.lease_id:x} refreshed; host {host}")


def kept_eviction(st: AgentState) -> bool:
    """Whether registering again writes the eviction our key carried (not when a signal or a notice drains the
    host)."""
    return st.drain_requested_at is None and st.notice is None and st.wanted_state == DRAINING and st.drain_until > 0


def _eviction(reason: str, until: float) -> str:
    return f"{reason or 'an'} eviction until {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(until))}"


class Signals:
    """Flags set by SIGTERM/SIGINT handlers (the handlers do nothing else)."""

    def __init__(self) -> None:
        self.count = 0

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.handler)
        signal.signal(signal.SIGINT, self.handler)


@dataclass
class Agent:
    """Runs the cycle against a registry. Collaborators are passed in so tests can use fakes."""

    cfg: AgentConfig
    registry: HostRegistry
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    signals: Signals = field(default_factory=Signals)
    sleep: Callable[[float], None] = time.sleep
    log: Any = None
    node_watch: NodeReader | None = None
    """Reads the Kubernetes node each cycle (``--drain-when-cordoned``); None: not watched."""
    notice_watch: notices.NoticeReader | None = None
    """The cloud's preemption notice, read each cycle and while waiting (``--preemption-notice``); None: not
    watched."""
    state: AgentState = field(default_factory=AgentState)
    exit_code: int | None = None
    last_decision: AgentDecision | None = None

    def observe(self) -> Observation:
        st = self.state
        now, wall_time = self.clock(), self.wall_clock()
        if self.signals.count and st.drain_requested_at is None:
            st.drain_requested_at = now
        if self.signals.count > 1:
            st.force_stop = True
        self._read_node()
        if self.notice_watch is not None and st.notice is None:
            st.notice = self.notice_watch.notice()
        lease_alive = lease_lost = False
        try:
            if st.lease_id is not None:
                try:
                    self.registry.keep_alive(st.lease_id)
                    lease_alive = True
                except LeaseLost:
                    st.lease_id, st.registered, lease_lost = None, False, True
            try:
                entry = self.registry.get(self.cfg.host)
                key = (entry.record, entry.lease_id) if entry else None
            except MalformedRecord as e:  # garbage under our key: treat it as a foreign key
                key = (HostRecord(host=self.cfg.host, slots=self.cfg.slots, addr=self.cfg.addr), -1)
                self._log().warning("malformed value under our key", error=str(e))
        except RegistryError as e:
            if st.unreachable_since is None:
                st.unreachable_since = now
            return Observation(now=now, reachable=False, error=str(e), cordon=st.cordon, notice=st.notice)
        st.unreachable_since = None
        if key is None:
            st.blocked_since = None
            return Observation(
                now=now,
                wall_time=wall_time,
                lease_alive=lease_alive,
                lease_lost=lease_lost,
                cordon=st.cordon,
                notice=st.notice,
            )
        record, key_lease = key
        if st.lease_id is not None and key_lease == st.lease_id:
            st.blocked_since = None
            if st.drain_requested_at is None:
                # follow an operator's drain / undrain, an eviction and its readmission
                st.wanted_state, st.drain_reason, st.drain_until = record.state, record.drain_reason, record.drain_until
                if record.state == READY:
                    st.cordon_drained = False  # an operator undrained it: an uncordon has nothing to undo
            st.evictions = record.evictions
        elif st.blocked_since is None:
            st.blocked_since = now
        return Observation(
            now=now,
            wall_time=wall_time,
            lease_alive=lease_alive,
            lease_lost=lease_lost,
            key_state=record.state,
            key_lease=key_lease,
            key_pid=record.pid,
            key_drain_reason=record.drain_reason,
            key_drain_until=record.drain_until,
            key_evictions=record.evictions,
            cordon=st.cordon,
            notice=st.notice,
            key_notice=record.notice,
            key_notice_time=record.notice_time,
        )

    def _read_node(self) -> None:
        """Update ``state.cordon`` from the node; on a failure keep the last answer and log the error once."""
        if self.node_watch is None:
            return
        st = self.state
        try:
            st.cordon = self.node_watch.drain_reason()
            st.cordon_error = ""
        except NodeWatchError as e:
            if str(e) != st.cordon_error:
                self._log().warning("cannot read the node; keeping the last answer", error=str(e), cordon=st.cordon)
            st.cordon_error = str(e)

    def apply(self, decision: AgentDecision) -> None:
        st = self.state
        try:
            if decision.action is Action.REGISTER:
                self._register()
            elif decision.action is Action.MARK_DRAINING:
                entry = self.registry.get(self.cfg.host)
                if entry is not None and entry.lease_id == st.lease_id:
                    self.registry.compare_and_set(entry, entry.record.with_state(DRAINING))
                st.wanted_state = DRAINING
            elif decision.action in (Action.DRAIN_CORDONED, Action.READY_UNCORDONED):
                cordoned = decision.action is Action.DRAIN_CORDONED
                old, new = (READY, DRAINING) if cordoned else (DRAINING, READY)
                entry = self.registry.get(self.cfg.host)
                ours = entry if entry is not None and entry.lease_id == st.lease_id else None
                if (
                    ours
                    and ours.record.state == old
                    and self.registry.compare_and_set(ours, ours.record.with_state(new))
                ):
                    st.wanted_state, st.cordon_drained = new, cordoned
                elif not cordoned:  # already ready (an operator undrained it): nothing left to undo
                    st.cordon_drained = False
            elif decision.action is Action.DRAIN_NOTICE:
                entry = self.registry.get(self.cfg.host)
                if entry is not None and entry.lease_id == st.lease_id and st.notice is not None:
                    self.registry.compare_and_set(entry, entry.record.with_notice(st.notice.token, st.notice.time))
                st.wanted_state, st.drain_reason, st.drain_until = DRAINING, "", 0.0
            elif decision.action is Action.READMIT:
                self._readmit()
            elif decision.action is Action.REVOKE_AND_EXIT:
                if st.lease_id is not None:
                    self.registry.revoke_lease(st.lease_id)
                st.lease_id, st.registered = None, False
        except (RegistryError, MalformedRecord) as e:
            self._log().warning(
                "action failed; the next cycle decides again", action=decision.action.value, error=str(e)
            )
        if decision.exit_code is not None:
            self.exit_code = decision.exit_code

    def _readmit(self) -> None:
        """Mark our evicted host ready if its cool-down is still over when read again (compare-and-set: an
        operator's drain or a new eviction written in between wins, and the next cycle decides again)."""
        st = self.state
        entry = self.registry.get(self.cfg.host)
        if (
            entry is not None
            and entry.lease_id == st.lease_id
            and entry.record.evicted
            and self.wall_clock() >= entry.record.drain_until
            and self.registry.compare_and_set(entry, entry.record.with_state(READY))
        ):
            st.wanted_state, st.drain_reason, st.drain_until = READY, "", 0.0

    def _register(self) -> None:
        st = self.state
        evicted = kept_eviction(st)
        if st.drain_requested_at is not None or st.notice is not None:
            st.wanted_state = DRAINING
        elif st.cordon is not None and st.wanted_state == READY:
            st.wanted_state, st.cordon_drained = DRAINING, True
        lease_id = self.registry.grant_lease(self.cfg.ttl_seconds)
        record = HostRecord(
            host=self.cfg.host,
            slots=self.cfg.slots,
            addr=self.cfg.addr,
            state=st.wanted_state,
            pid=os.getpid(),
            registered_at=self.wall_clock(),
            drain_reason=st.drain_reason if evicted else "",
            drain_until=st.drain_until if evicted else 0.0,
            evictions=st.evictions,
            notice=st.notice.token if st.notice else "",
            notice_time=st.notice.time if st.notice else 0.0,
        )
        try:
            created = self.registry.register(record, lease_id)
        except BaseException:
            self.registry.revoke_lease(lease_id)
            raise
        if created:
            st.lease_id, st.registered = lease_id, True
        else:  # someone else's key appeared in between: drop our lease, the next cycle waits
            self.registry.revoke_lease(lease_id)

    def run_cycle(self) -> AgentDecision:
        decision = decide(self.cfg, self.state, self.observe())
        self.apply(decision)
        return decision

    def next_wait(self) -> float:
        st = self.state
        wait = self.cfg.heartbeat_seconds
        if st.drain_requested_at is not None:
            left = st.drain_requested_at + self.cfg.drain_grace_seconds - self.clock()
            wait = min(wait, max(0.0, left))
        return wait

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``, returning early when a signal arrived or a preemption notice was read (in slices of
        0.1 s)."""
        seen = self.signals.count
        deadline = self.clock() + seconds
        while self.signals.count == seen and not self._notice_unseen():
            left = deadline - self.clock()
            if left <= 0:
                return
            self.sleep(min(0.1, left))

    def run(self) -> int:
        """The daemon loop. Returns the exit code; the lease is revoked in ``finally`` unless done."""
        log = self._log()
        last = ""
        try:
            while self.exit_code is None:
                decision = self.last_decision = self.run_cycle()
                if decision.action is not Action.HEARTBEAT or decision.reason != last:
                    log.info(decision.reason, action=decision.action.value)
                else:
                    log.debug(decision.reason, action=decision.action.value)
                last = decision.reason
                if self.exit_code is None:
                    self.wait(self.next_wait())
            return self.exit_code
        finally:
            if self.state.lease_id is not None:
                try:
                    self.registry.revoke_lease(self.state.lease_id)
                    log.info("lease revoked on shutdown", lease=f"{self.state.lease_id:x}")
                except RegistryError as e:
                    log.warning("could not revoke lease on shutdown; it expires by itself", error=str(e))
            self.registry.close()

    def _notice_unseen(self) -> bool:
        """The watch holds a notice that no cycle has read yet."""
        return self.state.notice is None and self.notice_watch is not None and self.notice_watch.notice() is not None

    def _log(self) -> Any:
        if self.log is None:
            self.log = get_logger("agent")
        return self.log


# --------------------------------------------------------------------------------------------------
# CLI


def detect_gpus(timeout_seconds: float = 5.0) -> int:
    """Number of GPUs ``nvidia-smi -L`` lists; 0 when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_seconds, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _slots(value: str) -> int:
    if value == "auto":
        return max(1, detect_gpus())
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Register this host in etcd for a job; drain on SIGTERM.")
    p.add_argument("--etcd", required=True, metavar="URL", help="etcd endpoint(s), http(s)://HOST:PORT[,...]")
    p.add_argument("--job", required=True, help="job name")
    p.add_argument("--host", default=None, help="host name to register (default: this machine's hostname)")
    p.add_argument("--addr", default=None, help="address to record (default: resolved from --host)")
    p.add_argument("--slots", type=_slots, default="auto", help="worker slots, or 'auto' (GPU count, else 1)")
    p.add_argument("--ttl", type=number(int), default=10, metavar="SECONDS", help="lease TTL (default 10)")
    p.add_argument(
        "--heartbeat",
        type=number(float),
        default=None,
        metavar="SECONDS",
        help="lease refresh interval (default ttl/3)",
    )
    p.add_argument(
        "--request-timeout",
        type=number(float),
        default=None,
        metavar="SECONDS",
        help="deadline of each etcd request (default min(2, ttl/6))",
    )
    p.add_argument(
        "--drain-grace",
        type=number(float),
        default=30.0,
        metavar="SECONDS",
        help="seconds between SIGTERM (draining) and revoking the lease (default 30)",
    )
    p.add_argument(
        "--retry-deadline",
        type=number(float),
        default=None,
        metavar="SECONDS",
        help="give up when etcd stays unreachable this long (default max(60, ttl))",
    )
    p.add_argument(
        "--prefix",
        default=os.environ.get(envnames.ETCD_PREFIX) or DEFAULT_PREFIX,
        help="etcd key prefix (default $ELASTICTRAIN_ETCD_PREFIX or /elastictrain)",
    )
    p.add_argument(
        "--drain-when-cordoned",
        default=None,
        metavar="NODE",
        help="Kubernetes: drain this host while node NODE is cordoned (reads the node from the API server "
        "with the pod's service account each cycle); ready again when it is uncordoned",
    )
    p.add_argument(
        "--preemption-notice",
        choices=notices.CHOICES,
        default="none",
        help="drain this host when the cloud gives notice that the instance ends, read from the instance's "
        "metadata service: aws (spot interruption), gcp (preemption, terminating maintenance), azure (Scheduled "
        "Events: Preempt, Terminate); auto probes the three and keeps the one that answers (default none)",
    )
    p.add_argument(
        "--notice-poll",
        type=number(float),
        default=1.0,
        metavar="SECONDS",
        help="interval between two reads of the metadata service (default 1; GCP's reads wait for a change)",
    )
    p.add_argument(
        "--warm-config",
        default=None,
        metavar="CONFIG",
        help="hot join: keep a warm worker process (elastictrain zygote) for this job's config, and register "
        "the host only once it is warm",
    )
    p.add_argument("--warm-set", action="append", default=[], metavar="K=V", help="a --set for the warm config")
    p.add_argument(
        "--warm-timeout",
        type=number(float),
        default=300.0,
        metavar="SECONDS",
        help="register anyway (workers then start cold) if the warm process is not ready by then (default 300)",
    )
    endpoints.add_arguments(p)
    return p


def start_zygote(
    cmd: list[str], timeout: float, signals: Signals, log: Any, job: str = ""
) -> subprocess.Popen[bytes] | None:
    """Start the warm worker process (in its own session: the agent's terminal signals are not its workers')
    and wait until it says it is ready, it exits, a signal arrives, or ``timeout``; a zygote that never gets
    ready costs only the hot join (workers start cold). Its environment names ``job`` (``ELASTICTRAIN_JOB``), as a
    cold worker's does: the workers it forks show that environment, by which a survivor tells a worker of the job
    (:func:`elastictrain.engine.health.hang.job_worker_runs`)."""
    import threading

    env = {**os.environ, envnames.JOB: job} if job else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True, env=env)
    ready, ended = threading.Event(), threading.Event()

    def pump() -> None:  # reads every line for the process's life, so it never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"zygote ready"):
                ready.set()
        ended.set()

    threading.Thread(target=pump, name="zygote-stdout", daemon=True).start()
    deadline, seen = time.monotonic() + timeout, signals.count
    while signals.count == seen and time.monotonic() < deadline and not ended.is_set():
        if ready.wait(0.2):
            log.info("warm worker process ready", pid=proc.pid)
            return proc
    if ended.is_set() and not ready.is_set():
        log.warning("warm worker process exited before it was ready; workers start cold", code=proc.wait())
        return None
    log.warning("warm worker process not ready; workers start cold until it is", pid=proc.pid)
    return proc


def stop_zygote(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM (it stops taking requests and exits when its workers have), then SIGKILL after ``grace``."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    host = args.host or socket.gethostname()
    ttl = int(args.ttl)
    return AgentConfig(
        job=args.job,
        host=host,
        slots=args.slots,
        addr=args.addr or _resolve(host),
        prefix=args.prefix,
        ttl_seconds=ttl,
        heartbeat_seconds=args.heartbeat if args.heartbeat is not None else ttl / 3,
        request_timeout_seconds=args.request_timeout if args.request_timeout is not None else min(2.0, ttl / 6),
        drain_grace_seconds=args.drain_grace,
        retry_deadline_seconds=args.retry_deadline if args.retry_deadline is not None else max(60.0, ttl),
        drain_when_cordoned=args.drain_when_cordoned,
        preemption_notice=args.preemption_notice,
        notice_poll_seconds=args.notice_poll,
    )


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        access = endpoints.from_args(args, os.environ).check(endpoints.parse_endpoints(args.etcd))
        cfg = config_from_args(args)
        node_watch = None
        if cfg.drain_when_cordoned is not None:
            node_watch = in_cluster(cfg.drain_when_cordoned, timeout_seconds=cfg.request_timeout_seconds)
        for cloud in notices.clouds_of(cfg.preemption_notice):
            notices.endpoint(cloud)  # a bad endpoint override is CLI misuse: exit 2 before anything starts
    except ValueError as e:
        parser.error(str(e))
    configure_logging(job=cfg.job, host=cfg.host)
    signals = Signals()
    signals.install()  # before the first request, so a SIGTERM during start-up drains too
    notice_watch = notices.build(
        cfg.preemption_notice, timeout_seconds=cfg.request_timeout_seconds, poll_seconds=cfg.notice_poll_seconds
    )
    registry = EtcdRegistry(args.etcd, cfg.job, cfg.prefix, timeout_seconds=cfg.request_timeout_seconds, access=access)
    agent = Agent(cfg, registry, signals=signals, node_watch=node_watch, notice_watch=notice_watch)
    get_logger("agent").info(
        "agent starting",
        etcd=args.etcd,
        etcd_access=access.describe(),
        slots=cfg.slots,
        ttl=cfg.ttl_seconds,
        heartbeat=cfg.heartbeat_seconds,
        drain_grace=cfg.drain_grace_seconds,
        drain_when_cordoned=cfg.drain_when_cordoned,
        preemption_notice=notice_watch.cloud if notice_watch else "none",
        pid=os.getpid(),
    )
    zygote = None
    if args.warm_config:
        zygote = start_zygote(
            zygote_command(
                args.warm_config, args.warm_set, job=cfg.job, host=cfg.host, etcd=args.etcd, prefix=cfg.prefix
            ),
            args.warm_timeout,
            signals,
            get_logger("agent"),
            job=cfg.job,
        )
    if notice_watch is not None:
        notice_watch.start()
    try:
        code = agent.run()
    finally:
        if notice_watch is not None:
            notice_watch.stop()
        if zygote is not None:
            stop_zygote(zygote, cfg.drain_grace_seconds + 10)
    if code != 0 and agent.last_decision is not None:
        print(f"{PROG}: error: {agent.last_decision.reason}", file=sys.stderr)
    return code
