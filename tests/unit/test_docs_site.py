"""The docs site builds with ``mkdocs build --strict`` (a broken link or anchor, or a page outside the nav, fails),
and the README stays a short front door whose links all resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def build_site(config_file: Path, site_dir: Path) -> None:
    build(load_config(config_file=str(config_file), strict=True, site_dir=str(site_dir)))


def test_the_site_builds_strict_with_every_page_of_the_nav(tmp_path: Path) -> None:
    build_site(ROOT / "mkdocs.yml", tmp_path / "site")
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")} | {"index"}
    assert pages <= built, f"pages not built: {sorted(pages - built)}"


def test_a_broken_anchor_fails_the_strict_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-section)\n")
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text().split("\nnav:")[0] + "\n")
    with pytest.raises(Abort):
        build_site(tmp_path / "mkdocs.yml", tmp_path / "site")


def test_the_readme_is_at_most_300_lines_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
