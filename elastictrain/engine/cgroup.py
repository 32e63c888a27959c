"""The CPU cgroups of a thread (v1 ``cpu`` controller or v2 ``cpu.max``) and the time their quota held it back.

- :func:`cpu_hierarchies` (pure): where the v1 ``cpu`` controller and the v2 unified hierarchy are mounted, from
  ``/proc/self/mountinfo``; :func:`cgroup_paths` (pure): a thread's group in each, from ``/proc/thread-self/cgroup``;
  :func:`stat_files` (pure): ``cpu.stat`` of that group and of every ancestor (a quota may sit on any of them).
- :func:`throttled_seconds` (pure): a ``cpu.stat``'s throttled time (v1 ``throttled_time`` ns, v2
  ``throttled_usec``), None when it has none; input is untrusted, bounded to :data:`MAX_STAT_BYTES`.
- :class:`ThrottleClock`: the calling thread's groups' throttled seconds, summed (monotonic while the thread stays
  in its groups); :meth:`ThrottleClock.refresh` looks the groups up again (a process may be moved at run time).
Everything answers 0 / nothing where Linux has no cgroups; nothing here raises on a missing or odd file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"
THREAD_CGROUP = "/proc/thread-self/cgroup"
MAX_STAT_BYTES = 4096
"""A ``cpu.stat`` is about 200 bytes; more is not a cpu.stat."""
MAX_DEPTH = 16
"""Ancestors read at most (a real hierarchy is a few levels deep)."""


@dataclass(frozen=True, slots=True)
class Hierarchies:
    """Mount points of the CPU controller's hierarchies (None: not mounted)."""

    v1_cpu: str | None
    v2: str | None


def cpu_hierarchies(mountinfo: str) -> Hierarchies:
    """The v1 mount whose super options name the ``cpu`` controller, and the cgroup2 mount, from mountinfo text."""
    v1 = v2 = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        if tail[0] == "cgroup" and "cpu" in tail[2].split(",") and v1 is None:
            v1 = point
        elif tail[0] == "cgroup2" and v2 is None:
            v2 = point
    return Hierarchies(v1, v2)


def cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """``(v1 cpu group, v2 group)`` of a ``/proc/<pid>/cgroup`` text (paths from the hierarchy's root)."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


def _chain(mount: str, path: str) -> list[str]:
    """``cpu.stat`` of the group at ``path`` under ``mount`` and of its ancestors up to the mount's root."""
    out = []
    parts = [p for p in path.split("/") if p and p not in (".", "..")][:MAX_DEPTH]
    for depth in range(len(parts), -1, -1):
        out.append(os.path.join(mount, *parts[:depth], "cpu.stat"))
    return out


def stat_files(h: Hierarchies, proc_cgroup: str) -> list[str]:
    """Every ``cpu.stat`` whose quota can hold the thread back: its group's and its ancestors', in each hierarchy."""
    v1, v2 = cgroup_paths(proc_cgroup)
    files: list[str] = []
    if h.v1_cpu and v1 is not None:
        files += _chain(h.v1_cpu, v1)
    if h.v2 and v2 is not None:
        files += _chain(h.v2, v2)
    return files


def throttled_seconds(text: bytes | str) -> float | None:
    """Throttled time in a ``cpu.stat`` (v2 ``throttled_usec``, v1 ``throttled_time`` in ns); None if absent/bad."""
    if isinstance(text, bytes):
        text = text[:MAX_STAT_BYTES].decode("ascii", "replace")
    for line in text[:MAX_STAT_BYTES].splitlines():
        key, _, value = line.partition(" ")
        if key in ("throttled_usec", "throttled_time"):
            try:
                n = int(value)
            except ValueError:
                return None
            if n < 0:
                return None
            return n / 1e6 if key == "throttled_usec" else n / 1e9
    return None


class ThrottleClock:
    """Seconds the calling thread's CPU groups have been throttled (summed over the group and its ancestors).

    Call :meth:`seconds` from the thread measured; differences between two calls are what counts (each group's
    counter is cumulative; a sum over levels may count one throttled instant twice, so callers cap it).
    :meth:`refresh` re-reads the thread's groups, e.g. at a commit, since a process can be moved at any time.
    """

    def __init__(self, mountinfo: str = MOUNTINFO, thread_cgroup: str = THREAD_CGROUP) -> None:
        self._mountinfo_path = mountinfo
        self._cgroup_path = thread_cgroup
        self._hierarchies: Hierarchies | None = None
        self._fds: list[int] | None = None
        self._base = 0.0
        """Sum of the counters at :meth:`refresh` before it, so the clock stays monotonic across a move."""
        self._last = 0.0

    @staticmethod
    def _read(path: str) -> str:
        try:
            with open(path, "rb") as f:
                return f.read(1 << 16).decode("utf-8", "replace")
        except OSError:
            return ""

    def _open(self) -> list[int]:
        if self._hierarchies is None:
            self._hierarchies = cpu_hierarchies(self._read(self._mountinfo_path))
        fds = []
        for path in stat_files(self._hierarchies, self._read(self._cgroup_path)):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            if _pread_seconds(fd) is None:  # a cpu.stat without throttling (v2 without the cpu controller)
                os.close(fd)
            else:
                fds.append(fd)
        return fds

    def seconds(self) -> float:
        """Throttled seconds so far (0.0 where there is no CPU cgroup with a quota's counters)."""
        if self._fds is None:
            self._fds = self._open()
            self._base = self._last
            self._base -= self._sum(self._fds)
        self._last = max(self._last, self._base + self._sum(self._fds))
        return self._last

    @staticmethod
    def _sum(fds: Sequence[int]) -> float:
        return sum(_pread_seconds(fd) or 0.0 for fd in fds)

    def refresh(self) -> None:
        """Look the thread's groups up again at the next :meth:`seconds` (the reading stays monotonic)."""
        self.close()

    def close(self) -> None:
        for fd in self._fds or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = None


def _pread_seconds(fd: int) -> float | None:
    try:
        return throttled_seconds(os.pread(fd, MAX_STAT_BYTES, 0))
    except OSError:
        return None
