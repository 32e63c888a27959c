"""What the workers of one job tell each other: heartbeats, the collective-failure marker, the hung verdict.

:class:`WorkerSignals` is the one interface the detectors (:mod:`~elastictrain.engine.health.hang`,
:mod:`~elastictrain.engine.health.watchdog`) speak. Two transports: :class:`FileSignals` keeps them in
``run_dir/.elastic/`` (:mod:`elastictrain.rundir.layout`) on storage the workers share;
:class:`~elastictrain.engine.health.etcd_signals.EtcdSignals` keeps them in etcd under the job's prefix (no shared
disk). :func:`~elastictrain.engine.health.transport.open_signals` picks one by ``elastic.signals``. Writes are best
effort (a signal that cannot be written never fails a worker); what is read is untrusted and checked
(:meth:`Beat.parse`, :func:`parse_failure`, :func:`parse_verdict`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from discovery.wire import check_name
from elastictrain.fileio import write_atomic
from elastictrain.rundir import layout

LOCAL, WAITING, IDLE = "local", "waiting", "idle"
STARTUP, RENDEZVOUS, SYNC, PROLOGUE = "startup", "rendezvous", "sync", "prologue"
RESET_PHASES = (STARTUP, RENDEZVOUS, SYNC, PROLOGUE)
"""The phases of a (re)start, in order (see :mod:`~elastictrain.engine.health.hang`)."""
PHASES = (LOCAL, WAITING, IDLE, *RESET_PHASES)
MAX_BEAT_BYTES = 4096
MAX_BEAT_FILES = 4096
"""Heartbeat files read at most when a rendezvous judges the whole folder (the run_dir is untrusted)."""
MAX_MARK_BYTES = 400
"""Most bytes of a failure marker or a hung verdict that are read (``ts`` then one line of at most 300 characters)."""
MAX_VERDICT_CHARS = 300



@dataclass(frozen=True, slots=True)
class Member:
    """One rank of the current ring, as gathered after the rendezvous."""

    rank: int
    host: str
    slot: int
    pid: int


@dataclass(frozen=True, slots=True)
class Beat:
    """One worker's heartbeat."""

    pid: int
    host: str
    slot: int
    boot_id: str
    created: float
    """The process's start time (with ``boot_id`` and ``pid``: the same process, not a reused pid)."""
    ts: float
    phase: str
    since: float
    """When the current phase began."""
    steps: int
    """Steps completed since its ring formed."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, raw: bytes) -> Beat | None:
        """A heartbeat read from the run_dir (untrusted), or None when it is not a valid one."""
        if len(raw) > MAX_BEAT_BYTES:
            return None
        try:
            d = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(d, dict):
            return None
        ints, floats = ("pid", "slot", "steps"), ("created", "ts", "since")
        if any(isinstance(d.get(k), bool) or not isinstance(d.get(k), int) or d[k] < 0 for k in ints):
            return None
        if any(not isinstance(d.get(k), int | float) or not math.isfinite(d[k]) for k in floats):
            return None
        if d.get("phase") not in PHASES or not isinstance(d.get("boot_id"), str) or not isinstance(d.get("host"), str):
            return None
        try:
            return cls(**{k: d[k] for k in cls.__slots__})
        except (KeyError, TypeError):
            return None


class WorkerSignals(Protocol):
    """The signals workers exchange. Every write replaces the writer's last one; none raises for the transport."""

    def write_beat(self, beat: Beat) -> None:
        """This worker's heartbeat (about once a second, and at once when a phase begins)."""

    def read_beats(self, members: Sequence[Member]) -> dict[tuple[str, int], Beat]:
        """The ring members' heartbeats by (host, slot): a missing, invalid or misnamed one is left out."""

    def all_beats(self) -> list[Beat]:
        """Every valid heartbeat of the job (at most :data:`MAX_BEAT_FILES`): a rendezvous judges them all."""

    def remove_beat(self, host: str, slot: int, pid: int) -> None:
        """When this worker closes: drop ``host``/``slot``'s heartbeat if it is still ``pid``'s."""

    def record_failure(self, host: str) -> None:
        """A collective of this worker (on ``host``) failed now: tells the others their ring is broken."""

    def last_failure(self) -> float | None:
        """When the newest collective failure was recorded by any worker, or None."""

    def record_verdict(self, why: str, at: float | None = None) -> None:
        """A hung peer was found (``why``: one line, who and what was done) at ``at`` (Unix time; default now)."""

    def verdict_since(self, ts: float) -> str | None:
        """The newest verdict's reason when it was recorded at or after ``ts``, else None."""


class Heartbeats:
    """The heartbeat folder: one file per worker, ``<host>-<slot>.json``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, host: str, slot: int) -> Path:
        check_name("host", host)
        return self.folder / f"{host}-{int(slot)}.json"

    def write(self, beat: Beat) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path(beat.host, beat.slot), beat.to_json(), durable=False)

    def read(self, members: Sequence[Member]) -> dict[tuple[str, int], Beat]:
        out = {}
        for m in members:
            try:
                raw = self.path(m.host, m.slot).read_bytes()
            except (OSError, ValueError):
                continue
            beat = Beat.parse(raw)
            if beat is not None and beat.host == m.host and beat.slot == m.slot:
                out[(m.host, m.slot)] = beat
        return out

    def remove(self, host: str, slot: int, pid: int) -> None:
        """Delete ``host``/``slot``'s heartbeat when it is ``pid``'s (a newer process of the slot keeps its own)."""
        with contextlib.suppress(OSError, ValueError):
            path = self.path(host, slot)
            beat = Beat.parse(path.read_bytes())
            if beat is not None and beat.pid == pid:
                path.unlink()

    def read_all(self) -> list[Beat]:
        """Every valid heartbeat in the folder (at most :data:`MAX_BEAT_FILES` files; one whose name is not its
        own host and slot is refused)."""
        out = []
        try:
            with os.scandir(self.folder) as entries:
                names = [e.name for _, e in zip(range(MAX_BEAT_FILES), entries, strict=False)]
        except OSError:
            return []
        for name in names:
            if not name.endswith(".json"):
                continue
            try:
                with open(self.folder / name, "rb") as f:
                    raw = f.read(MAX_BEAT_BYTES + 1)
            except OSError:
                continue
            beat = Beat.parse(raw)
            if beat is not None and name == f"{beat.host}-{beat.slot}.json":
                out.append(beat)
        return out


class FailureMarker:
    """A tiny file that says "a worker saw a collective fail at time T" (``ts`` then the host, one line)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, host: str) -> None:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, failure_line(time.time(), host), durable=False)

    def last(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                return parse_failure(f.read(MAX_MARK_BYTES + 1))
        except OSError:
            return None


class HungVerdict:
    """A tiny file naming the newest hung peer found (``ts`` then the reason, one line)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, why: str, at: float | None = None) -> None:
        when = time.time() if at is None else at
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, verdict_line(when, why), durable=False)

    def since(self, ts: float) -> str | None:
        """The verdict's reason when it was recorded at or after ``ts``, else None."""
        try:
            with open(self.path, "rb") as f:
                verdict = parse_verdict(f.read(MAX_MARK_BYTES))
        except OSError:
            return None
        return verdict[1] if verdict is not None and verdict[0] >= ts else None


def failure_line(ts: float, host: str) -> str:
    """The failure marker's value: ``ts`` then the host, one line."""
    return f"{ts} {host.splitlines()[0][:MAX_VERDICT_CHARS] if host else ''}\n"


def parse_failure(raw: bytes) -> float | None:
    """When a failure marker (untrusted) says the failure was, or None when it is not a valid one."""
    if len(raw) > MAX_MARK_BYTES:
        return None
    try:
        ts = float(raw.decode().split()[0])
    except (ValueError, UnicodeDecodeError, IndexError):
        return None
    return ts if math.isfinite(ts) and ts >= 0 else None


def verdict_line(when: float, why: str) -> str:
    """The hung verdict's value: ``when`` then the first line of ``why`` (at most 300 characters)."""
    return f"{when} {(why.splitlines() or [''])[0][:MAX_VERDICT_CHARS]}\n"


def parse_verdict(raw: bytes) -> tuple[float, str] | None:
    """(when, why) of a hung verdict (untrusted; only its first :data:`MAX_MARK_BYTES` are read), or None."""
    try:
        when, _, why = raw[:MAX_MARK_BYTES].decode(errors="replace").partition(" ")
        ts = float(when)
    except ValueError:
        return None
    return (ts, why.strip()) if math.isfinite(ts) else None


@dataclass(frozen=True, slots=True)
class FileSignals:
    """:class:`WorkerSignals` as files in one folder that every worker reaches (``run_dir/.elastic``)."""

    heartbeats: Heartbeats
    failures: FailureMarker
    verdict: HungVerdict

    @classmethod
    def in_folder(cls, folder: Path) -> FileSignals:
        """The three signals under ``folder``, by :mod:`~elastictrain.rundir.layout`'s names."""
        return cls(
            Heartbeats(folder / layout.HEARTBEATS),
            FailureMarker(folder / layout.FAILURE_MARKER),
            HungVerdict(folder / layout.HUNG_VERDICT),
        )

    @classmethod
    def of_run_dir(cls, run_dir: str | os.PathLike[str]) -> FileSignals:
        return cls.in_folder(layout.RunDir.of(run_dir).signals)

    def write_beat(self, beat: Beat) -> None:
        self.heartbeats.write(beat)

    def read_beats(self, members: Sequence[Member]) -> dict[tuple[str, int], Beat]:
        return self.heartbeats.read(members)

    def all_beats(self) -> list[Beat]:
        return self.heartbeats.read_all()

    def remove_beat(self, host: str, slot: int, pid: int) -> None:
        self.heartbeats.remove(host, slot, pid)

    def record_failure(self, host: str) -> None:
        self.failures.record(host)

    def last_failure(self) -> float | None:
        return self.failures.last()

    def record_verdict(self, why: str, at: float | None = None) -> None:
        self.verdict.record(why, at)

    def verdict_since(self, ts: float) -> str | None:
        return self.verdict.since(ts)
