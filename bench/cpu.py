"""CPU time of a process tree and the machine's steal, sampled in the background while a benchmark runs."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path


def read_steal() -> tuple[float, float]:
    """(steal, total) CPU time of the whole machine from ``/proc/stat`` in clock ticks; (0, 0) where unreadable.

    Steal is time a virtual machine's CPUs were runnable but the hypervisor ran someone else: on a shared
    VM it explains run-to-run noise that no process here caused.
    """
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        values = [float(v) for v in fields[:8]]
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0
    return (values[7] if len(values) > 7 else 0.0), sum(values)


class TreeCpuMonitor:
    """Samples, every ``interval`` seconds, the CPU seconds used so far by a process tree and the machine's steal.

    Each process seen keeps its last reading after it exits, so the sum only grows. :meth:`between` gives the
    CPU seconds and the steal fraction in a window of unix times (from the samples nearest inside it).
    """

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, float, float, float]] = []
        """(unix time, tree CPU seconds, steal ticks, total ticks)."""
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-monitor", daemon=True)

    def start(self) -> TreeCpuMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                self._seen[p.pid] = t.user + t.system
        steal, total = read_steal()
        self.samples.append((time.time(), sum(self._seen.values()), steal, total))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                return

    def between(self, t0: float, t1: float) -> dict[str, float] | None:
        """CPU seconds of the tree and the machine's steal fraction between the samples nearest inside [t0, t1]."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (a, cpu_a, steal_a, total_a), (b, cpu_b, steal_b, total_b) = inside[0], inside[-1]
        ticks = total_b - total_a
        return {
            "seconds": b - a,
            "cpu_seconds": cpu_b - cpu_a,
            "steal_fraction": (steal_b - steal_a) / ticks if ticks > 0 else 0.0,
        }
