"""``elastictrain audit --run-dir D``: check a run's sample ledger, every sample exactly once per epoch.

:func:`audit_samples` is the check itself, a pure function of the replayed ledger
(:func:`elastictrain.rundir.ledger.read_ledger`); the chaos invariants use it too. :func:`audit_run_dir` decides
which epochs a run dir must have completed and audits them:

- every epoch before the newest one in the ledger is complete (training moved past it), and so is every
  epoch of ``training.epochs`` (from ``D/config.yaml``) when ``events.jsonl``'s last lifecycle event is
  ``done`` and ``training.max_steps`` is unset; a complete epoch must hold every id of the training set
  exactly once;
- otherwise the newest epoch is partial (the run stopped or is still going): no id twice;
- ids in an epoch at or past ``training.epochs`` (an epoch that should never have started) and ids
  outside ``range(num_samples)`` are violations.

With ``data.drop_last`` an epoch's final short step is skipped by design, so missing ids are reported as
dropped, not as a violation. The dataset length comes from the ledger's ``meta`` lines; a ledger written
before they existed needs ``--num-samples``.

Exit codes: 0 pass, 1 a violation, 2 bad flags or a run dir that cannot be read or trusted (one line).
Standard library and PyYAML only: no torch import.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastictrain.cliutil import OneLineParser
from elastictrain.errors import ToolError
from elastictrain.rundir import layout
from elastictrain.rundir.events import Lifecycle, lifecycle, read_events
from elastictrain.rundir.ledger import LedgerError, read_ledger

EXAMPLES = 5
"""Ids shown per kind of violation and epoch."""


class AuditError(ToolError):
    """The run dir cannot be audited; the message is one line for the user."""


@dataclass(slots=True)
class EpochAudit:
    epoch: int
    kind: str
    """``complete``, ``partial`` or ``extra`` (an epoch at or past ``training.epochs``)."""
    expected: int | None
    """Ids a complete epoch must hold (the dataset length); None for partial and extra epochs."""
    seen: int = 0
    duplicated: int = 0
    """Ids seen more than once, counted once per extra sighting; for an ``extra`` epoch, every id."""
    lost: int = 0
    """Ids of a complete epoch never seen (0 with ``drop_last``: see ``dropped``)."""
    dropped: int = 0
    """Ids of a complete epoch never seen, with ``drop_last`` (not a violation)."""
    out_of_range: int = 0
    duplicate_examples: list[int] = field(default_factory=list)
    missing_examples: list[int] = field(default_factory=list)
    out_of_range_examples: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.duplicated == 0 and self.lost == 0 and self.out_of_range == 0


@dataclass(slots=True)
class SampleAudit:
    epochs: list[EpochAudit] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return sum(e.lost for e in self.epochs)

    @property
    def duplicated(self) -> int:
        """Duplicates, ids of extra epochs and ids out of range: every sighting that should not be."""
        return sum(e.duplicated + e.out_of_range for e in self.epochs)

    @property
    def epochs_checked(self) -> int:
        return sum(1 for e in self.epochs if e.kind != "extra")

    @property
    def per_epoch(self) -> dict[int, tuple[int, int]]:
        """epoch -> (lost, duplicated)."""
        return {e.epoch: (e.lost, e.duplicated + e.out_of_range) for e in self.epochs}

    @property
    def ok(self) -> bool:
        return self.epochs_checked > 0 and all(e.ok for e in self.epochs)


def audit_samples(
    committed: Mapping[int, Sequence[int]],
    num_samples: int,
    epochs: int,
    *,
    last_partial: bool = False,
    drop_last: bool = False,
) -> SampleAudit:
    """Epochs ``0 .. epochs-1`` of ``committed`` (epoch -> ids of its committed steps) must each hold every id
    of ``range(num_samples)`` exactly once; with ``last_partial`` the last of them may lack ids (no id twice).
    With ``drop_last`` missing ids count as dropped, not lost. Ids of any other epoch count as duplicates."""
    audit = SampleAudit()
    for epoch in range(epochs):
        partial = last_partial and epoch == epochs - 1
        ids = committed.get(epoch, ())
        e = EpochAudit(epoch, "partial" if partial else "complete", None if partial else num_samples, seen=len(ids))
        counts = Counter(ids)
        for i, c in sorted(counts.items()):
            if not 0 <= i < num_samples:
                e.out_of_range += c
                if len(e.out_of_range_examples) < EXAMPLES:
                    e.out_of_range_examples.append(i)
            elif c > 1:
                e.duplicated += c - 1
                if len(e.duplicate_examples) < EXAMPLES:
                    e.duplicate_examples.append(i)
        if not partial:
            missing = [i for i in range(num_samples) if counts[i] == 0]
            if drop_last:
                e.dropped = len(missing)
            else:
                e.lost = len(missing)
                e.missing_examples = missing[:EXAMPLES]
        audit.epochs.append(e)
    for epoch in sorted(committed):
        if not 0 <= epoch < epochs:  # training ran into an epoch it should never have started
            ids = committed[epoch]
            e = EpochAudit(epoch, "extra", None, seen=len(ids), duplicated=len(ids))
            e.duplicate_examples = sorted(set(ids))[:EXAMPLES]
            audit.epochs.append(e)
    return audit


# ---------------------------------------------------------------------------------------------- run dir
@dataclass(slots=True)
class RunAudit:
    run_dir: Path
    audit: SampleAudit
    num_samples: int
    drop_last: bool
    files: int
    steps: int
    torn_lines: int
    training_epochs: int
    state: str
    """The run's last lifecycle event (``done``, ``stopped``, ``running``) or ``not_started``."""


def _training_length(path: Path) -> tuple[int, int | None]:
    """``training.epochs`` and ``training.max_steps`` from the run dir's resolved config."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise AuditError(f"{path}: not found (rank 0 writes it when it starts; is this a run_dir?)") from None
    except OSError as e:
        raise AuditError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise AuditError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    training = raw.get("training") if isinstance(raw, dict) else None
    if not isinstance(training, dict):
        raise AuditError(f"{path}: no training section")
    epochs, max_steps = training.get("epochs"), training.get("max_steps")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise AuditError(f"{path}: training.epochs must be an integer >= 1, got {ascii(epochs)[:40]}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise AuditError(f"{path}: training.max_steps must be null or an integer >= 1, got {ascii(max_steps)[:40]}")
    return epochs, max_steps


def audit_run_dir(
    run_dir: str | Path, *, num_samples: int | None = None, on_skip: Callable[[int, str], None] | None = None
) -> RunAudit:
    """Audit ``run_dir`` (rules in the module docstring). Raises :class:`AuditError` when it cannot be
    audited. ``num_samples`` overrides the ledger's; ``on_skip`` hears of unusable events.jsonl lines."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AuditError(f"--run-dir {run_dir}: not a directory")
    ledger_dir = run_dir / layout.LEDGER
    if not ledger_dir.is_dir() or not any(ledger_dir.glob("*.jsonl")):
        raise AuditError(f"{ledger_dir}: no ledger files (the run needs audit.sample_ledger: true)")
    try:
        ledger = read_ledger(ledger_dir)
    except LedgerError as e:
        raise AuditError(str(e)) from None
    n = num_samples if num_samples is not None else ledger.num_samples
    if n is None:
        raise AuditError(f"{ledger_dir}: the ledger does not record the dataset length; pass --num-samples N")
    if not ledger.committed:
        raise AuditError(f"{ledger_dir}: no committed step yet; nothing to audit")
    epochs, max_steps = _training_length(run_dir / layout.CONFIG)
    try:
        events = read_events(run_dir / layout.EVENTS, on_skip)
    except FileNotFoundError:
        events = []
    except OSError as e:
        raise AuditError(f"{run_dir / layout.EVENTS}: cannot read ({e.strerror})") from None
    state = lifecycle(events)
    newest = max(ledger.committed)
    if (state is Lifecycle.DONE and max_steps is None) or newest >= epochs:
        audit = audit_samples(ledger.committed, n, epochs, drop_last=bool(ledger.drop_last))
    else:  # stopped, running or cut short by max_steps: the newest epoch may be incomplete
        audit = audit_samples(ledger.committed, n, newest + 1, last_partial=True, drop_last=bool(ledger.drop_last))
    return RunAudit(
        run_dir, audit, n, bool(ledger.drop_last), ledger.files, ledger.steps, ledger.torn_lines, epochs, state.value
    )


def _ids(values: list[int], total: int) -> str:
    if not values:
        return ""
    more = ", ..." if total > len(values) else ""
    return f" (e.g. {', '.join(map(str, values))}{more})"


def format_audit(r: RunAudit) -> str:
    """One line per epoch, then the verdict line."""
    a = r.audit
    lines = [
        f"ledger   {r.run_dir / layout.LEDGER}: {r.files} file(s), {r.steps} committed steps, dataset {r.num_samples} "
        f"samples{', drop_last' if r.drop_last else ''}; run {r.state}, training.epochs {r.training_epochs}"
    ]
    if r.torn_lines:
        lines.append(f"note     {r.torn_lines} torn final line(s) of killed writers skipped")
    for e in a.epochs:
        parts = [
            f"epoch {e.epoch}",
            e.kind if e.kind != "extra" else f"extra (past training.epochs {r.training_epochs})",
        ]
        if e.expected is not None:
            parts.append(f"expected {e.expected}")
        parts.append(f"seen {e.seen}")
        parts.append(f"duplicates {e.duplicated}{_ids(e.duplicate_examples, e.duplicated)}")
        if e.kind == "complete":
            parts.append(f"missing {e.lost}{_ids(e.missing_examples, e.lost)}")
            if e.dropped:
                parts.append(f"dropped {e.dropped} (drop_last)")
        if e.out_of_range:
            parts.append(f"out of range {e.out_of_range}{_ids(e.out_of_range_examples, e.out_of_range)}")
        lines.append("  ".join(parts))
    complete = sum(1 for e in a.epochs if e.kind == "complete")
    partial = sum(1 for e in a.epochs if e.kind == "partial")
    expected = sum(e.expected or 0 for e in a.epochs)
    seen = sum(e.seen for e in a.epochs)
    verdict = "PASS" if a.ok else "FAIL"
    lines.append(
        f"verdict  {verdict}: {a.epochs_checked} epochs audited ({complete} complete, {partial} partial); "
        f"samples expected {expected}, seen {seen}; duplicates {a.duplicated}, missing {a.lost}"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="elastictrain audit", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--run-dir", required=True, help="the job's run_dir (holds ledger/, config.yaml, events.jsonl)")
    p.add_argument(
        "--num-samples",
        type=int,
        help="the training set's length, for a ledger written before it was recorded there",
    )
    args = p.parse_args(argv)
    if args.num_samples is not None and args.num_samples < 1:
        sys.stderr.write(f"elastictrain audit: --num-samples must be >= 1, got {args.num_samples}\n")
        return 2

    def skipped(line: int, reason: str) -> None:
        sys.stderr.write(f"elastictrain audit: warning: {layout.EVENTS} line {line}: {reason}; skipped\n")

    try:
        result = audit_run_dir(args.run_dir, num_samples=args.num_samples, on_skip=skipped)
    except AuditError as e:
        sys.stderr.write(f"elastictrain audit: {e}\n")
        return 2
    sys.stdout.write(format_audit(result))
    return 0 if result.audit.ok else 1
