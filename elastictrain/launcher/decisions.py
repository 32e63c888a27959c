"""What the launcher does after a horovodrun ends: pure functions of what it observed, tested without processes.

:func:`decide_after_exit` turns one horovodrun's exit code, the run log and what the registry showed
(:class:`HostWatch`) into a :class:`RelaunchDecision`: completed, relaunch, failed, relaunch limit or stopped,
with the sentence the launcher prints and its exit code. The exit codes are ``launch``'s contract
(README "Run a job").
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from discovery.record import READY
from elastictrain.cliutil import EXIT_STOPPED

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_HOSTS_TIMEOUT = 3
EXIT_RELAUNCH_LIMIT = 4
EXIT_INTERRUPTED = 130


class Outcome(enum.Enum):
    COMPLETED = "completed"
    RELAUNCH = "relaunch"
    FAILED = "failed"
    RELAUNCH_LIMIT = "relaunch_limit"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RelaunchDecision:
    """What the launcher decided after horovodrun ended, as an outcome and the sentence it prints."""

    outcome: Outcome
    reason: str
    exit_code: int | None = None

    def __str__(self) -> str:
        return self.reason


def decide_after_exit(
    *,
    returncode: int,
    completed: bool,
    hosts_lost: Sequence[str],
    min_ready_slots: int,
    min_np: int,
    relaunches: int,
    max_relaunches: int,
    stop_signal: int | None = None,
    stalled: str | None = None,
) -> RelaunchDecision:
    """Decide what follows one horovodrun: pure, from its exit code, events.jsonl and what the registry showed."""
    if stop_signal is not None:
        code = EXIT_INTERRUPTED if stop_signal == signal.SIGINT else EXIT_STOPPED
        return RelaunchDecision(Outcome.STOPPED, f"stopped by {signal.Signals(stop_signal).name}", code)
    if returncode == 0 and completed:
        return RelaunchDecision(Outcome.COMPLETED, "training completed", EXIT_COMPLETED)
    if returncode == 0:
        return RelaunchDecision(
            Outcome.FAILED, "horovodrun exited 0 but events.jsonl does not end with 'done'", EXIT_FAILED
        )
    why = []
    if hosts_lost:
        why.append(f"hosts lost: {', '.join(hosts_lost)}")
    if min_ready_slots < min_np:
        why.append(f"ready slots fell to {min_ready_slots} < --min-np {min_np}")
    if stalled:
        why.append(stalled)
    if not why:
        return RelaunchDecision(
            Outcome.FAILED,
            f"horovodrun exited {returncode} while every host stayed registered (a failure, not a preemption)",
            EXIT_FAILED,
        )
    if relaunches >= max_relaunches:
        return RelaunchDecision(
            Outcome.RELAUNCH_LIMIT,
            f"horovodrun exited {returncode} ({'; '.join(why)}) after {relaunches} relaunches "
            f"(--max-relaunches {max_relaunches}); giving up",
            EXIT_RELAUNCH_LIMIT,
        )
    return RelaunchDecision(
        Outcome.RELAUNCH,
        f"horovodrun exited {returncode} ({'; '.join(why)}); relaunch {relaunches + 1} when hosts return",
    )


@dataclass(slots=True)
class HostWatch:
    """What the registry showed during one attempt: hosts lost (vanished or registered anew, not drained)."""

    baseline: dict[str, tuple[int, float]] = field(default_factory=dict)
    """host -> (agent pid, registered_at) of the ready hosts when the attempt started."""
    drained: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    min_ready_slots: int | None = None
    ready_slots: int = 0
    stalled: str | None = None
    """Set when the launcher ended a horovodrun that kept no worker alive while enough hosts were ready."""

    def observe(self, entries: Iterable[Any]) -> None:
        """Feed one listing (``Listing.entries``)."""
        now: dict[str, tuple[int, float]] = {}
        ready = 0
        for e in entries:
            r = e.record
            if r.state == READY:
                ready += r.slots
            else:
                self.drained.add(r.host)
            now[r.host] = (r.pid, r.registered_at)
        if not self.baseline and self.min_ready_slots is None:
            self.baseline = {h: ident for h, ident in now.items() if h not in self.drained}
        for host, ident in self.baseline.items():
            if host not in self.drained and now.get(host) != ident:
                self.lost.add(host)
        self.ready_slots = ready
        self.min_ready_slots = ready if self.min_ready_slots is None else min(self.min_ready_slots, ready)
