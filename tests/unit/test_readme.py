"""README.md is the front page: short, and every link it makes into the docs site lands on a
page (and a heading) that exists, so cutting or renaming a docs page cannot strand it."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
LINK = re.compile(r"\]\((?P<path>[^)#\s]*)(?:#(?P<anchor>[^)\s]+))?\)")


def anchors(page: Path) -> set[str]:
    """The heading ids of a Markdown page, as mkdocs' toc extension makes them."""
    text = page.read_text(encoding="utf-8")
    return {slugify(h, "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_links_land_on_docs_pages_and_headings():
    links = LINK.findall(README.read_text(encoding="utf-8"))
    assert any(path.startswith("docs/guides/") for path, _ in links)
    for path, anchor in links:
        if path.startswith(("http://", "https://")):
            continue
        target = REPO / path if path else README
        assert target.is_file(), f"README.md links to {path}, which is not a file"
        if anchor:
            assert anchor in anchors(target), f"README.md links to {path}#{anchor}: no such heading"
