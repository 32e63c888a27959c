"""The sample ledger (``run_dir/ledger/``): rank 0's record of which sample ids every committed step used.

Written by :class:`SampleLedger` in the worker (``audit.sample_ledger: true``), read back by
:func:`read_ledger` for ``elastictrain audit``, the chaos invariants and the tests. Standard library
only, so reading a ledger never imports torch.

Format: one file per process that held rank 0, ``tenure-<sequence>-<name>.jsonl``, one JSON object a
line:

- ``{"kind": "meta", "num_samples": N, "drop_last": B}``: first line of each file; the training set's
  length and ``data.drop_last`` (both fixed for a run: a resume may not change them);
- ``{"kind": "step", "step": S, "epoch": E, "ids": [...]}``: the ids of committed step ``S``, written
  *before* the in-memory commit;
- ``{"kind": "restore", "step": S}``: training resumed from committed step ``S`` (after a reset, or a
  resume from a checkpoint); every step after ``S`` recorded so far was rolled back.

Replay reads the files in :func:`ledger_files` order and applies each line in turn. The ledger lives in a
shared, writable folder, so :func:`read_ledger` validates every line and raises :class:`LedgerError`
(one line naming the file and line) on anything it cannot trust. The one exception is the final line of
a file that has no newline and does not parse: the torn write of a killed rank 0, which is skipped.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from elastictrain.errors import InputError
from elastictrain.rundir import layout

LEDGER_PREFIX = "tenure-"
"""Ledger files are ``tenure-<sequence>-<name>.jsonl``; the sequence orders them (see :func:`ledger_files`)."""
_TENURE = re.compile(r"^tenure-(\d+)-")


class LedgerError(InputError):
    """A ledger that cannot be read or trusted; the message is one line naming the file (and line)."""


def ledger_files(ledger_dir: str | Path) -> list[Path]:
    """The ledger files of a run in replay order: the order in which processes held rank 0.

    That order is the sequence number each file took when it was created (one more than the highest in
    the folder: a logical clock, so skewed host clocks cannot reorder it). Files of an older format
    (``<creation ns>-<pid>.jsonl``, named by a wall clock) come first, in name order.
    """

    def key(path: Path) -> tuple[int, str]:
        return (tenure_seq(path.name) if _TENURE.match(path.name) else -1, path.name)

    return sorted(Path(ledger_dir).glob("*.jsonl"), key=key)


def tenure_name(seq: int, name: str) -> str:
    """The file name of the ``seq``-th rank-0 tenure of process ``name``."""
    return f"{LEDGER_PREFIX}{seq:06d}-{name}.jsonl"


def tenure_seq(file_name: str) -> int:
    """The tenure number in a ledger file name; 0 for a name of the older format."""
    m = _TENURE.match(file_name)
    return int(m.group(1)) if m else 0


def next_tenure_seq(ledger_dir: str | Path, taken: Iterable[str] = ()) -> int:
    """One more than the highest tenure number in ``ledger_dir`` and among the file names ``taken``."""
    names = [p.name for p in Path(ledger_dir).glob("*.jsonl")] + [Path(t).name for t in taken]
    return 1 + max((tenure_seq(n) for n in names), default=0)


_OPENINGS = itertools.count(1)
"""Openings of a ledger in this process: each is a tenure of rank 0."""


class RecordSink(Protocol):
    """Where a ledger's lines go instead of a file: the worker's :class:`~elastictrain.rundir.outbox.Outbox`."""

    def append(self, stream: str, data: bytes) -> None: ...


class SampleLedger:
    """Rank 0's writer: one file per process that holds rank 0 (``name`` makes it unique, e.g. the pid).

    ``num_samples`` and ``drop_last``, when given, go into the file's ``meta`` line, so the ledger can be
    audited without the config. ``record`` lines are written *before* the state is committed, and a
    ``restore`` line whenever training resumes from a committed step.
    """

    def __init__(
        self,
        root: str | Path,
        name: str,
        *,
        num_samples: int | None = None,
        drop_last: bool | None = None,
        outbox: RecordSink | None = None,
    ) -> None:
        self.dir = Path(root)
        self._outbox = outbox
        self._f: IO[str] | None = None
        if outbox is not None:  # the launcher's collector numbers the tenure (:mod:`elastictrain.rundir.outbox`)
            self.stream = f"{layout.LEDGER}/{name}@{next(_OPENINGS)}.jsonl"  # a second tenure of a process is its own
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.path = self.dir / tenure_name(next_tenure_seq(self.dir), name)
            self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if num_samples is not None:
            self._write({"kind": "meta", "num_samples": num_samples, "drop_last": bool(drop_last)})

    def _write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        if self._outbox is not None:
            self._outbox.append(self.stream, line.encode())
        elif self._f is not None:
            self._f.write(line)

    def record(self, step: int, epoch: int, ids: list[int]) -> None:
        self._write({"kind": "step", "step": step, "epoch": epoch, "ids": ids})

    def restore(self, step: int) -> None:
        self._write({"kind": "restore", "step": step})

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


@dataclass(slots=True)
class Ledger:
    """A replayed ledger."""

    committed: dict[int, list[int]] = field(default_factory=dict)
    """epoch -> sample ids of every committed step, in step order."""
    num_samples: int | None = None
    """From the ``meta`` lines; None when no file has one (a ledger written before they existed)."""
    drop_last: bool | None = None
    files: int = 0
    steps: int = 0
    """Committed steps after replay."""
    torn_lines: int = 0
    """Unparseable final lines skipped (a writer killed mid-line)."""


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry: Any) -> str | None:
    """Why a parsed line is not a valid ledger entry, or None."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    kind = entry.get("kind")
    if kind == "step":
        if not _nonneg_int(entry.get("step")) or not _nonneg_int(entry.get("epoch")):
            return "step and epoch must be non-negative integers"
        ids = entry.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return "ids must be a list of integers"
        return None
    if kind == "restore":
        return None if _nonneg_int(entry.get("step")) else "restore step must be a non-negative integer"
    if kind == "meta":
        n, drop = entry.get("num_samples"), entry.get("drop_last")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(drop, bool):
            return "meta needs num_samples >= 1 and a boolean drop_last"
        return None
    return f"unknown kind {ascii(kind)[:40]}"


def read_ledger(ledger_dir: str | Path) -> Ledger:
    """Replay ``ledger_dir`` (see the module docstring). Raises :class:`LedgerError` when the folder or a
    file cannot be read, a line is not a valid entry, or the files disagree on ``meta``."""
    folder = Path(ledger_dir)
    if not folder.is_dir():
        raise LedgerError(f"{folder}: no ledger folder")
    out = Ledger()
    steps: dict[int, tuple[int, list[int]]] = {}
    for path in ledger_files(folder):
        out.files += 1
        try:
            data = path.read_bytes()
        except OSError as e:
            raise LedgerError(f"{path}: cannot read ({e.strerror})") from None
        lines = data.split(b"\n")
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                if i == len(lines) - 1:  # no newline after it: a write cut short by a kill
                    out.torn_lines += 1
                    continue
                raise LedgerError(f"{path} line {i + 1}: not JSON") from None
            problem = _entry_problem(entry)
            if problem is not None:
                raise LedgerError(f"{path} line {i + 1}: {problem}")
            if entry["kind"] == "restore":
                steps = {s: v for s, v in steps.items() if s <= entry["step"]}
            elif entry["kind"] == "step":
                steps[entry["step"]] = (entry["epoch"], entry["ids"])
            else:
                meta = (entry["num_samples"], entry["drop_last"])
                if out.num_samples is not None and meta != (out.num_samples, out.drop_last):
                    raise LedgerError(
                        f"{path} line {i + 1}: meta num_samples={meta[0]} drop_last={meta[1]} differs from "
                        f"num_samples={out.num_samples} drop_last={out.drop_last} in an earlier file"
                    )
                out.num_samples, out.drop_last = meta
    for step in sorted(steps):
        epoch, ids = steps[step]
        out.committed.setdefault(epoch, []).extend(ids)
    out.steps = len(steps)
    return out


def committed_samples(ledger_dir: str | Path) -> dict[int, list[int]]:
    """epoch -> sample ids of every committed step (:func:`read_ledger`'s ``committed``)."""
    return read_ledger(ledger_dir).committed
