"""The documentation holds together: README.md is the front page (at most 300 lines, the test command CI
runs), every relative link of README.md, docs/*.md and the examples' READMEs reaches an existing file and
heading, and the package table lives only in docs/architecture.md (where tests/test_architecture.py checks it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*/README.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 300


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def anchors(path: Path) -> set[str]:
    """The heading anchors GitHub gives a markdown file: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = re.fullmatch(r"#{1,6} (.+)", line)
        if fenced or not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "").strip().lower()
        slug = base = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = 0
        while slug in found:
            n += 1
            slug = f"{base}-{n}"
        found.add(slug)
    return found


def test_every_relative_link_reaches_a_file_and_heading() -> None:
    broken = []
    for page in PAGES:
        for number, line in prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                path = (page.parent / file_part).resolve() if file_part else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not path.exists():
                    broken.append(f"{where}: no such file")
                elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
                    broken.append(f"{where}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_a_broken_file_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A `b` c?\n\n## A b c\n\n```\n[x](skipped.md)\n```\n[ok](#a-b-c-1) [bad](#nope) [gone](gone.md)\n"
    )
    assert anchors(page) == {"a-b-c", "a-b-c-1"}
    links = [target for _, line in prose(page) for target in LINK.findall(line)]
    assert links == ["#a-b-c-1", "#nope", "gone.md"]


def test_readme_is_the_front_page_with_the_ci_test_command() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail to docs/"
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1] == "```bash" and lines[marker + 3] == "```", ".ci/run needs one bash line after the marker"


def test_the_package_table_is_only_in_the_architecture_page() -> None:
    row = re.compile(r"\| `megatron_rl/[a-z_]+(/|\.py)?`")
    copies = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in PAGES
        if page != ROOT / "docs" / "architecture.md"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if row.match(line)
    ]
    assert not copies, f"package table rows outside docs/architecture.md: {copies}"
