"""A generated table inside a checked-in Markdown page: the part between two marker lines is rewritten from the code.

Used by scripts/gen_events_doc.py and scripts/gen_config_doc.py: ``main(argv, ...)`` rewrites the page in place, or
with ``--check`` exits 1 when the checked-in table differs from the one the code generates.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def render(text: str, doc: Path, begin: str, end: str, table: str) -> str:
    """``text`` (``doc``'s) with the part between the markers replaced by ``table``."""
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise SystemExit(f"{doc}: the table markers are missing")
    return head + begin + table + end + tail


def main(argv: list[str], *, doc: Path, begin: str, end: str, table: Callable[[], str], script: str) -> int:
    """Rewrite ``doc``'s table, or with ``--check`` say (exit 1) that it is out of date; ``script`` regenerates it."""
    text = doc.read_text()
    new = render(text, doc, begin, end, table())
    if "--check" in argv:
        if new != text:
            sys.stderr.write(f"{doc} is out of date: run python {script}\n")
            return 1
        return 0
    doc.write_text(new)
    return 0
