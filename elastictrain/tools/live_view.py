"""The launcher's live view of a run: one status line on a terminal, a JSON line every N seconds elsewhere.

Workers' own progress bars never reach the terminal under horovodrun (it pipes their output), so the
launcher, which owns the terminal, shows the run's progress from ``events.jsonl``:

- :class:`LiveState` folds events one at a time (:meth:`LiveState.update`, pure) and :func:`view` turns a
  state and the time into the status dict (world size, epoch/step, samples/s, loss, ETA, the last reset and
  its recovery time); :func:`status_line` renders that dict as one line. ``view(fold(events), now)`` is a
  pure function of the events and the clock.
- :class:`EventTail` reads only the bytes appended since its last poll; a partial last line waits for
  its end, a file that appears late is picked up, and a truncated or replaced file is read from the start.
- :class:`LiveView` ties them to an output: call :meth:`LiveView.tick` from the supervision loop; on a
  TTY it rewrites one line in place (``\\r``) at most every ``refresh_seconds``; on any other output it
  writes a JSON object per line every ``every_seconds``. ``every_seconds`` 0 turns the view off.

Import-light: the launcher imports it (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from elastictrain.rundir.events import (
    Done,
    EpochEnd,
    Event,
    Lifecycle,
    Metrics,
    Reset,
    Shares,
    Start,
    Stopped,
    Straggler,
    lifecycle,
    parse_events,
)

STATUS_KIND = "launch_status"
"""The ``kind`` of every JSON status line."""


@dataclass(frozen=True, slots=True)
class LastReset:
    ts: float
    old_size: int | None
    new_size: int
    reason: str | None
    recovery_seconds: float | None


@dataclass(frozen=True, slots=True)
class LiveState:
    """What the view needs from the events so far; :meth:`update` returns the state after one more event."""

    state: Lifecycle = Lifecycle.NOT_STARTED
    step: int | None = None
    epoch: int | None = None
    world_size: int | None = None
    samples_per_sec: float | None = None
    loss: float | None = None
    rate_from: tuple[float, int] | None = None
    """(ts, step) of the first ``metrics`` since the last start or reset: the rate is measured from there."""
    rate_to: tuple[float, int] | None = None
    """(ts, step) of the last ``metrics``."""
    step_seconds: float | None = None
    last_epoch_end: tuple[int, int] | None = None
    """(epoch, step) of the last ``epoch_end``."""
    steps_per_epoch: int | None = None
    last_reset: LastReset | None = None
    slowest: tuple[str, float] | None = None
    """(host, ratio) of the last ``metrics`` that judged one (see :mod:`elastictrain.engine.health.stragglers`)."""
    stragglers: tuple[str, ...] = ()
    """Hosts named slow by ``straggler`` events and not cleared since."""
    shares: tuple[tuple[str, int], ...] = ()
    """(host, samples per step) of the last ``shares`` event (``elastic.stragglers: balance``); empty: equal."""

    def update(self, e: Event) -> LiveState:
        """The state after ``e`` (events arrive in file order)."""
        state = self.state
        if isinstance(e, Start) or state is Lifecycle.NOT_STARTED:
            state = Lifecycle.RUNNING
        if isinstance(e, Done | Stopped):
            state = lifecycle([e])
        s = dataclasses.replace(self, state=state, step=e.step, epoch=e.epoch, world_size=e.world_size)
        if isinstance(e, Start | Reset):  # a new size or a rollback: measure the rate afresh
            s = dataclasses.replace(s, rate_from=None, rate_to=None)
        if isinstance(e, Reset):
            size = e.world_size if e.new_size is None else e.new_size
            s = dataclasses.replace(s, last_reset=LastReset(e.ts, e.old_size, size, e.reason, e.recovery_seconds))
        elif isinstance(e, Metrics):
            here = (e.ts, e.step)
            s = dataclasses.replace(
                s,
                samples_per_sec=e.samples_per_sec,
                loss=e.loss,
                step_seconds=e.step_seconds,
                rate_from=s.rate_from or here,
                rate_to=here,
                slowest=(e.slowest_host, e.slowest_ratio) if e.slowest_host and e.slowest_ratio else s.slowest,
            )
        elif isinstance(e, Shares) and e.shares:
            s = dataclasses.replace(s, shares=tuple(sorted(e.shares.items())))
        elif isinstance(e, Straggler) and e.host:
            named = tuple(h for h in s.stragglers if h != e.host) + ((e.host,) if e.slow else ())
            s = dataclasses.replace(s, stragglers=named)
        elif isinstance(e, EpochEnd):
            spe = s.steps_per_epoch
            if s.last_epoch_end is not None and s.last_epoch_end[0] == e.epoch - 1:
                spe = e.step - s.last_epoch_end[1]
            elif e.epoch == 0:
                spe = e.step
            s = dataclasses.replace(s, last_epoch_end=(e.epoch, e.step), steps_per_epoch=spe or s.steps_per_epoch)
        return s


def fold(events: Iterable[Event], state: LiveState | None = None) -> LiveState:
    """The state after ``events`` (from ``state``, or from nothing)."""
    s = state or LiveState()
    for e in events:
        s = s.update(e)
    return s


def total_steps(s: LiveState, epochs: int | None, max_steps: int | None) -> int | None:
    """The run's length in steps when it can be told: ``max_steps`` and/or ``epochs`` times the steps an
    epoch took (known after the first ``epoch_end``)."""
    by_epochs = epochs * s.steps_per_epoch if epochs and s.steps_per_epoch else None
    known = [n for n in (by_epochs, max_steps) if n]
    return min(known) if known else None


def steps_per_second(s: LiveState) -> float | None:
    """Over the metrics since the last start or reset; from one interval's ``step_seconds`` before that."""
    if s.rate_from and s.rate_to and s.rate_to[0] > s.rate_from[0] and s.rate_to[1] > s.rate_from[1]:
        return (s.rate_to[1] - s.rate_from[1]) / (s.rate_to[0] - s.rate_from[0])
    if s.step_seconds:
        return 1.0 / s.step_seconds
    return None


def view(s: LiveState, now: float, *, epochs: int | None = None, max_steps: int | None = None) -> dict[str, Any]:
    """The status dict (the JSON line's content) of state ``s`` at time ``now``."""
    total = total_steps(s, epochs, max_steps)
    rate = steps_per_second(s)
    eta = None
    if s.state is Lifecycle.DONE:
        eta = 0.0
    elif total is not None and rate and s.step is not None and s.state is Lifecycle.RUNNING:
        eta = max(0.0, (total - s.step) / rate)
    last = None
    if s.last_reset is not None:
        r = s.last_reset
        last = {
            "ts": r.ts,
            "age_seconds": round(max(0.0, now - r.ts), 1),
            "old_size": r.old_size,
            "new_size": r.new_size,
            "reason": r.reason,
            "recovery_seconds": r.recovery_seconds,
        }
    return {
        "kind": STATUS_KIND,
        "ts": round(now, 3),
        "state": s.state.value,
        "step": s.step,
        "total_steps": total,
        "epoch": s.epoch,
        "world_size": s.world_size,
        "samples_per_sec": s.samples_per_sec,
        "loss": s.loss,
        "eta_seconds": None if eta is None else round(eta, 1),
        "last_reset": last,
        "slowest_host": None if s.slowest is None else {"host": s.slowest[0], "ratio": s.slowest[1]},
        "stragglers": list(s.stragglers),
        "shares": dict(s.shares) or None,
    }


def _duration(seconds: float) -> str:
    whole = round(seconds)
    h, rest = divmod(whole, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


def status_line(v: dict[str, Any]) -> str:
    """One line for a terminal from :func:`view`'s dict."""
    if v["state"] == Lifecycle.NOT_STARTED:
        return "waiting for the workers' first event"
    step = f"step {v['step']}" + (f"/{v['total_steps']}" if v["total_steps"] else "")
    parts = [
        f"{v['state']}: {step}, epoch {v['epoch']}",
        f"{v['world_size']} workers",
        f"{_number(v['samples_per_sec'], '.1f')} samples/s",
        f"loss {_number(v['loss'], '.4f')}",
        f"ETA {'-' if v['eta_seconds'] is None else _duration(v['eta_seconds'])}",
    ]
    slow = v.get("slowest_host")
    if slow:
        named = " STRAGGLER" if slow["host"] in v.get("stragglers", ()) else ""
        parts.append(f"slowest {slow['host']} {slow['ratio']:.2f}x{named}")
    if v.get("shares"):
        parts.append("shares " + "/".join(f"{h} {n}" for h, n in v["shares"].items()))
    r = v["last_reset"]
    if r is None:
        parts.append("no reset")
    else:
        rec = "" if r["recovery_seconds"] is None else f", recovered in {r['recovery_seconds']:.1f}s"
        old = "?" if r["old_size"] is None else r["old_size"]
        parts.append(f"last reset {old}->{r['new_size']} ({r['reason'] or '?'}) {_duration(r['age_seconds'])} ago{rec}")
    return " | ".join(parts)


class EventTail:
    """Reads the events appended to ``path`` since the last :meth:`poll`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""
        self.skipped = 0
        """Lines that were not usable events (damaged or unknown); the view goes on without them."""

    def poll(self) -> list[Event]:
        """The complete new lines as events; [] when the file does not exist (yet) or nothing was added."""
        try:
            with self.path.open("rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:  # new, replaced or truncated
                    self._inode, self._offset, self._partial = st.st_ino, 0, b""
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return parse_events(lines, self._skip)

    def _skip(self, line: int, reason: str) -> None:
        self.skipped += 1


class LiveView:
    """The launcher's status output for one run: call :meth:`tick` often (it is cheap when nothing changed)."""

    def __init__(
        self,
        events_path: str | os.PathLike[str],
        stream: TextIO,
        *,
        every_seconds: float,
        tty: bool | None = None,
        epochs: int | None = None,
        max_steps: int | None = None,
        refresh_seconds: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tail = EventTail(events_path)
        self.stream = stream
        self.enabled = every_seconds > 0
        self.tty = stream.isatty() if tty is None else tty
        self.period = refresh_seconds if self.tty else every_seconds
        self.epochs, self.max_steps = epochs, max_steps
        self.clock = clock
        self.state = LiveState()
        self._next = clock() + (0.0 if self.tty else every_seconds)
        self._shown = ""

    def current(self) -> dict[str, Any]:
        """The status now (reads what was appended first)."""
        self.state = fold(self.tail.poll(), self.state)
        return view(self.state, self.clock(), epochs=self.epochs, max_steps=self.max_steps)

    def tick(self) -> None:
        """Write the status when it is due."""
        if not self.enabled or self.clock() < self._next:
            return
        self._next = self.clock() + self.period
        v = self.current()
        if self.tty:
            width = max(20, shutil.get_terminal_size().columns - 1)
            self._draw(status_line(v)[:width])
        else:
            self.stream.write(json.dumps(v, allow_nan=False, default=str) + "\n")
            self.stream.flush()

    def _draw(self, line: str) -> None:
        self._shown = line
        self.stream.write("\r\x1b[K" + line)
        self.stream.flush()

    def around(self, out: Callable[[str], None]) -> Callable[[str], None]:
        """``out`` that first erases the status line and then draws it again below what it printed."""

        def wrapped(line: str) -> None:
            if not (self.enabled and self.tty and self._shown):
                out(line)
                return
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            out(line)
            self._draw(self._shown)

        return wrapped

    def close(self) -> None:
        """End the terminal line (the last status stays visible); nothing to do on other outputs."""
        if self.enabled and self.tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = ""
