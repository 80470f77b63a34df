"""The manual holds together: every relative link in README.md and docs/*.md resolves (the file exists; a
`#anchor` into a markdown page names one of its headings, by GitHub's slug rules), and every repository
path the pages name in backticks exists. Plain text only: no Ray, no torch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
# A path the pages name as code: under a top-level folder of the repository, ending in a file suffix.
NAMED_PATH = re.compile(r"`((?:distrain|jobs|conf|tests|examples|docs)/[\w./-]*\.(?:py|yaml|md|svg))`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup and punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks); a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(match[1])
            seen[base] = seen.get(base, -1) + 1
            seen.setdefault(f"{base}-{seen[base]}" if seen[base] else base, 0)
    return set(seen)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading '#{anchor}' in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_path_named_in_backticks_exists(page: Path):
    named = set(NAMED_PATH.findall(page.read_text()))
    assert sorted(p for p in named if not (REPO / p).exists()) == []


def test_the_checker_finds_a_broken_link_and_a_missing_heading(tmp_path: Path):
    """The test above is only as good as `broken_links`: a wrong file and a wrong anchor are both caught."""
    (tmp_path / "b.md").write_text("# Which strategy should I use?\n\n```\n# not a heading\n```\n## Run `a.py` now\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#which-strategy-should-i-use) [ok](b.md#run-apy-now) [ok](#top) [web](https://x.org/#y)\n"
        "[gone](c.md) [bad](b.md#not-a-heading) [self](#nowhere)\n\n# Top\n"
    )
    assert broken_links(page) == [
        "c.md: no such file",
        "b.md#not-a-heading: no heading '#not-a-heading' in b.md",
        "#nowhere: no heading '#nowhere' in a.md",
    ]
