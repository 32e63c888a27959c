"""The writer of the peer benchmark's common per-step log: every contender's script writes it the same way.

Standard library only, and nothing from ``elastictrain``: the contenders' scripts import it from their own
environments (``.peers-venv`` for torchrun and TorchFT, the product's for elastictrain and stock Horovod). The
bench reads the logs and applies the one rule every contender is measured by
(``bench.peers``: ``replay``, ``goodput``, ``survival``, ``first_step_after``, ``pause``, ``audit``).

Format: a folder of ``<writer>.jsonl`` files, one per training process (``writer``: logical host and pid), one
JSON object a line, written when a step ends:

    {"step": S, "epoch": E, "t0": T0, "t1": T1, "world": W, "committed": true, "ids": [...]}

- ``step`` is the contender's own step counter after the step (elastictrain and Horovod: the elastic state's
  counter; torchrun: the counter restored from its checkpoint; TorchFT: ``Manager.current_step()``);
- ``t0`` (unix seconds) is taken just before the step's ``zero_grad``/forward, ``t1`` just after the optimizer
  step returned; data loading, commits, checkpoints and logging between steps are outside ``[t0, t1]``;
- ``world``: the number of workers (TorchFT: replica groups) that took part in the step;
- ``committed``: the contender's own commit outcome for the step: false when it threw the step away as it ended
  (TorchFT: the ``commit_result`` of its ``should_commit``, read from its commit log, never from its step counter,
  which a healing group moves to its peers' step even when the commit fails);
- ``ids``: the sample indices this process trained on in the step.

Before a step, a process also writes a begin line, ``{"begin": T0, "epoch": E, "ids": [...]}`` (``T0`` is the
step line's ``t0``): the audit reads the ids of a process that took part in a kept step but was killed before
its step line.

The rule (``replay``), the same for every contender, reads each process's own counter: committed lines of one
step that overlap in time (a collective joins them) are one completion of that step. A line whose step is one
more than its process's previous committed line continues that process's state; any other line (a process's
first, or its counter moved back to a restored commit or checkpoint, or forward to a peer's state it healed
from, as a TorchFT replica group does) began from the latest completion of the step before it that had ended.
So the completions form a tree, and the job's final state is one leaf of it: the leaf whose processes are still
at it (a process that wrote only uncommitted lines since still holds its state; one that went on elsewhere, or
fell silent while other steps began, abandoned it), the highest step among such leaves (replicas that meet heal
to the highest step). The kept lines are those of the completions on the path to that leaf; every other committed
line is redone (its work was lost: rolled back, restarted from an older checkpoint or from scratch, or a
replica's own steps before it healed from a peer). Then:

- goodput (``goodput``): compute in kept steps ÷ the window: each kept step's span (inside the window, less its
  overlap with the previous kept step) capped at the contender's steady step time (the median span), so waits
  inside a kept step (a quorum, a timeout) earn nothing; a redone or thrown-away step earns nothing;
- survival (``survival``): after a kill, the spared processes wrote committed lines under the same writer (pid)
  at a smaller world before the killed one's return;
- recovery (``first_step_after``): a fault's time to the end of the first committed step begun after it;
- scale-up pause (``pause``): the longest gap between the job's step completions from a host's listing to
  the first step at the new size, less the median gap before the listing;
- exactly once (``audit``): per completed epoch, the sample ids of the kept lines against ``range(N)``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["StepLogWriter"]


class StepLogWriter:
    """A training process's writer: call :meth:`started` just before a step, :meth:`ended` just after it."""

    def __init__(self, folder: str | os.PathLike[str], writer: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"{writer}.jsonl"
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - one line per step, closed by the process's end
        self.t0: float | None = None

    def started(self, ids: Sequence[int] | None = None, epoch: int | None = None) -> None:
        """Mark the step's start (only the first call per step counts, so a loss called per micro-batch may). With
        ``ids``, first write a begin line, ``{"begin": T0, "epoch": E, "ids": [...]}``: a process killed after its
        gradients were summed and before its step line still leaves the ids it trained on."""
        if self.t0 is None:
            self.t0 = time.time()
        if ids is not None:
            begin = {"begin": self.t0, "epoch": epoch, "ids": [int(i) for i in ids]}
            self._f.write(json.dumps(begin, separators=(",", ":")) + "\n")

    def ended(self, *, step: int, epoch: int, world: int, ids: Sequence[int], committed: bool = True) -> None:
        t1 = time.time()
        t0 = self.t0 if self.t0 is not None else t1
        self.t0 = None
        line = {"step": step, "epoch": epoch, "t0": t0, "t1": t1, "world": world, "committed": committed}
        self._f.write(json.dumps({**line, "ids": [int(i) for i in ids]}, separators=(",", ":")) + "\n")
