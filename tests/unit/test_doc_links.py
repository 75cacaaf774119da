"""Every relative link in README.md, docs/ and bench/'s pages reaches a file, and every #anchor a
heading of the page it names (GitHub's rule for heading ids), so the docs tree cannot rot by a
page being moved or renamed."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted({ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
                *(ROOT / "bench").rglob("*.md")})
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(INLINE_CODE.sub("", line))
    return "\n".join(kept)


def slug(heading: str) -> str:
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    targets = LINK.findall(prose(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/flags.md", "bench/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_docs_index_reaches_every_page() -> None:
    index = ROOT / "docs" / "README.md"
    reached = {(index.parent / t.partition("#")[0]).resolve() for t in relative_links(index)}
    for page in (ROOT / "docs").glob("*.md"):
        assert page == index or page.resolve() in reached, f"docs/README.md misses {page.name}"
    # The readme's own index reaches the docs index.
    assert "docs/README.md" in relative_links(ROOT / "README.md")


def test_the_checker_catches_a_broken_link_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title here\n\n## Two, words (§3.1)\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#two-words-31) [bad](a.md#nope) [gone](c.md) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n[web](https://example.com)\n")
    assert relative_links(page) == ["a.md#two-words-31", "a.md#nope", "c.md"]
    assert anchors(tmp_path / "a.md") == {"title-here", "two-words-31"}
