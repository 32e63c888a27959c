"""docs/events.md lists exactly the events and fields of elastictrain/rundir/events.py (its table is generated)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from elastictrain.rundir.events import EVENT_TYPES, markdown_table

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "events.md"


def test_the_checked_in_event_table_is_the_one_the_module_generates() -> None:
    text = DOC.read_text()
    assert markdown_table() in text, "docs/events.md is out of date: run python scripts/gen_events_doc.py"
    result = subprocess.run(
        [sys.executable, "scripts/gen_events_doc.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_the_doc_names_every_event_and_no_other() -> None:
    rows = re.findall(r"^\| `([a-z_]+)` \|", DOC.read_text(), flags=re.M)
    assert rows == [kind.value for kind in EVENT_TYPES]
