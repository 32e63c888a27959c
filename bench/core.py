"""The benchmark harness: goals, alternating contenders, statistics, the machine description, result files.

Pure code with no process or Horovod in it, so that ``tests/unit/test_bench.py`` checks it with fakes.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

from elastictrain.commands import usable_cores
from elastictrain.errors import ToolError
from elastictrain.fileio import write_atomic

T = TypeVar("T")

SCHEMA = "elastictrain-bench/1"


class BenchError(ToolError, RuntimeError):
    """A benchmark could not run as planned (too few hosts, a short run, a contender failed). One line for the user.

    Failures of the job harness itself (a wait timed out, a job ended early) are
    :class:`~chaos.procs.HarnessError`.
    """


@dataclass(frozen=True, slots=True)
class Goal:
    """A performance goal: ``value op target`` (``>=`` or ``<=``)."""

    op: Literal[">=", "<="]
    target: float

    def met(self, value: float | None) -> bool | None:
        """Whether ``value`` meets the goal; None when there is no value (the measurement failed)."""
        if value is None or math.isnan(value):
            return None
        return value >= self.target if self.op == ">=" else value <= self.target

    def ratio(self, value: float | None) -> float | None:
        """``value / target``: at least 1 meets a ``>=`` goal, at most 1 meets a ``<=`` goal."""
        if value is None or math.isnan(value) or self.target == 0:
            return None
        return value / self.target

    def __str__(self) -> str:
        return f"{self.op} {self.target:g}"


@dataclass(slots=True)
class Metric:
    """One reported number, with its goal when it has one (``scaling`` only reports)."""

    name: str
    value: float | None
    unit: str
    goal: Goal | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": _clean(self.value),
            "unit": self.unit,
            "goal": str(self.goal) if self.goal else None,
            "ratio_to_goal": _clean(self.goal.ratio(self.value)) if self.goal else None,
            "met": self.goal.met(self.value) if self.goal else None,
            "note": self.note,
        }


@dataclass(slots=True)
class Result:
    """What one measurement found: metrics (with goals), per-contender statistics, and raw detail."""

    name: str
    metrics: list[Metric] = field(default_factory=list)
    contenders: dict[str, dict[str, Any]] = field(default_factory=dict)
    """contender -> statistics (``median``, ``p95``, ``values``, ``unit``, ...), as from :func:`summary`."""
    detail: dict[str, Any] = field(default_factory=dict)
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "error": self.error,
            "seconds": round(self.seconds, 2),
            "metrics": [m.to_dict() for m in self.metrics],
            "contenders": _clean(self.contenders),
            "detail": _clean(self.detail),
        }


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN and infinities become None, tuples become lists, floats are shortened (4 decimals
    from 1 up, so that unix timestamps keep their sub-second part; 6 significant digits below)."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None
        return round(obj, 4) if abs(obj) >= 1 else float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def summary(values: Sequence[float], unit: str = "") -> dict[str, Any]:
    """Median, p95, min, max and the values themselves (in measurement order)."""
    if not values:
        return {"n": 0, "median": None, "p95": None, "min": None, "max": None, "values": [], "unit": unit}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p95": percentile(values, 95),
        "min": min(values),
        "max": max(values),
        "values": list(values),
        "unit": unit,
    }


def alternate(
    contenders: Sequence[tuple[str, Callable[[int], T]]],
    repeats: int,
    progress: Callable[[str], None] = lambda _msg: None,
) -> dict[str, list[T]]:
    """Run each contender ``repeats`` times, interleaved in one run (A B, B A, A B, ...); returns results per
    contender.

    The callable gets the repeat index. Interleaving spreads slow drifts of the machine (other load, a
    warming cache) over all contenders instead of charging them to whichever ran last; reversing the order
    every other repeat gives each contender the first and the second place equally often (what a run leaves
    behind, such as exiting processes or a warm page cache, then falls on both sides).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = [name for name, _ in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must be distinct, got {names}")
    out: dict[str, list[T]] = {name: [] for name in names}
    for r in range(repeats):
        for name, fn in contenders if r % 2 == 0 else reversed(contenders):
            progress(f"{name} {r + 1}/{repeats}")
            out[name].append(fn(r))
    return out


class Progress:
    """Progress lines on stderr: ``[bench +12.3s] name: message``."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.t0 = clock()
        self.scope = ""

    def __call__(self, message: str) -> None:
        prefix = f"{self.scope}: " if self.scope else ""
        self.stream.write(f"[bench +{self.clock() - self.t0:6.1f}s] {prefix}{message}\n")
        self.stream.flush()


@dataclass
class BenchContext:
    """What a measurement receives: the mode, a scratch folder, progress output, and results shared
    between measurements (``cache``: e.g. the elastictrain runs that ``commit`` and ``scaling`` reuse)."""

    quick: bool
    workdir: Path
    progress: Callable[[str], None]
    cache: dict[str, Any] = field(default_factory=dict)

    def scratch(self, name: str) -> Path:
        """A fresh folder under the work dir (removed with it at the end of the run)."""
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.workdir))


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """OMP threads per worker when ``workers`` share this machine, as ``elastictrain launch`` sets them."""
    return max(1, (cores or usable_cores()) // max(1, workers))


def cpu_model(cpuinfo: str) -> str | None:
    """The ``model name`` of ``/proc/cpuinfo`` text (None when absent)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return None


def describe_machine(
    *,
    cpuinfo: Callable[[], str] | None = None,
    memory_bytes: Callable[[], int] | None = None,
    versions: Callable[[], dict[str, str | None]] | None = None,
    gpus: Callable[[], list[str]] | None = None,
) -> dict[str, Any]:
    """Cores, memory, CPU model, OS, Python, torch, Horovod and GPUs. Each probe can be replaced (tests)."""

    def read_cpuinfo() -> str:
        try:
            return Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""

    def total_memory() -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    mem = (memory_bytes or total_memory)()
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model((cpuinfo or read_cpuinfo)()) or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": round(mem / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        **(versions or library_versions)(),
        "gpus": (gpus or gpu_names)(),
    }


def library_versions(dists: Sequence[str] = ("torch", "horovod", "mlflow")) -> dict[str, str | None]:
    """The installed version of each distribution in ``dists`` (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def gpu_names() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def build_report(
    results: Sequence[Result],
    *,
    machine: dict[str, Any],
    quick: bool,
    argv: Sequence[str],
    started: float,
    finished: float,
    load_before: list[float] | None,
    load_after: list[float] | None,
) -> dict[str, Any]:
    """The JSON document of one bench run (schema ``elastictrain-bench/1``)."""
    return {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "host": machine.get("hostname"),
        "mode": "quick" if quick else "full",
        "argv": list(argv),
        "wall_seconds": round(finished - started, 1),
        "machine": machine,
        "load_average": {"before": load_before, "after": load_after},
        "measurements": {r.name: r.to_dict() for r in results},
    }


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    text = str(value)
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".strip()


def markdown_table(report: dict[str, Any]) -> str:
    """The results as a markdown table (the README's Benchmarks section shows it)."""
    m = report["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "no GPU"
    load = report.get("load_average") or {}
    lines = [
        f"`python -m bench{' --quick' if report['mode'] == 'quick' else ''}` on {report['date'][:10]}, "
        f"{m.get('cpu_model') or 'unknown CPU'}, {m.get('usable_cores')} cores, {m.get('memory_gib')} GiB, {gpus}; "
        f"torch {m.get('torch')}, Horovod {m.get('horovod')}, Python {m.get('python')}; "
        f"load average {_fmt((load.get('before') or [None])[0])} before, "
        f"{_fmt((load.get('after') or [None])[0])} after; {report['wall_seconds']:.0f} s.",
        "",
        "| measurement | metric | value | goal | met | contenders (median) |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in report["measurements"].items():
        contenders = " · ".join(
            f"{c}: {_fmt(s.get('median'), s.get('unit', ''))}" for c, s in (res.get("contenders") or {}).items()
        )
        if res["status"] != "ok":
            lines.append(f"| `{name}` | error | {res['error']} | | | |")
            continue
        for i, metric in enumerate(res["metrics"]):
            met = {True: "✅", False: "❌", None: "report" if metric["goal"] is None else "—"}[metric["met"]]
            lines.append(
                f"| `{name}` | {metric['name']} | {_fmt(metric['value'], metric['unit'])} | {metric['goal'] or ''} "
                f"| {met} | {contenders if i == 0 else ''} |"
            )
    return "\n".join(lines) + "\n"


def result_stem(started: float, host: str, quick: bool) -> str:
    """``<date>-<host>`` (``-quick`` appended for a quick run, so it never replaces a full run's files)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in host) or "host"
    return f"{time.strftime('%Y-%m-%d', time.localtime(started))}-{safe}{'-quick' if quick else ''}"


def write_results(report: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out_dir`` (atomically); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / f"{stem}.json", out_dir / f"{stem}.md")
    for path, text in zip(paths, (json.dumps(report, indent=1) + "\n", markdown_table(report)), strict=True):
        write_atomic(path, text)
    return paths
