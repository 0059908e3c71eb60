#!/usr/bin/env python3
"""Fail if a relative link in the Markdown docs points nowhere.

Checks every link, image and reference definition in ``*.md`` at the repository root and under
``docs/`` (or in the files given as arguments): the target file or directory must exist, and a
``#fragment`` must name a heading (GitHub's anchor rules) or an explicit ``id``/``name`` in the
target Markdown file. Links with a scheme (``https:``, ``mailto:``) are not fetched. Code blocks
and code spans are ignored. Standard library only.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+).+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)"
)
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=[\"']([^\"']+)[\"']", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<[^>]+\b(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Lines outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(path):
        line = CODE_SPAN.sub("", line)
        for pattern in (INLINE_LINK, REFERENCE_DEFINITION, HTML_LINK):
            for target in pattern.findall(line):
                yield number, target.strip("<>")


def problem(source: Path, target: str) -> str | None:
    if SCHEME.match(target):
        return None
    location, _, fragment = target.partition("#")
    location = unquote(location)
    if location.startswith("/"):  # GitHub resolves these from the repository root
        resolved = ROOT / location.lstrip("/")
    else:
        resolved = (source.parent / location) if location else source
    if not resolved.exists():
        return f"{target}: {location} does not exist"
    if fragment and resolved.suffix == ".md" and unquote(fragment) not in anchors(resolved):
        return f"{target}: no heading or anchor #{fragment} in {resolved.relative_to(ROOT)}"
    return None


def default_files() -> list[Path]:
    return sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("**/*.md"))


def main(argv: list[str]) -> int:
    files = [Path(arg).resolve() for arg in argv] or default_files()
    broken = 0
    checked = 0
    for path in files:
        for number, target in links(path):
            checked += 1
            message = problem(path, target)
            if message:
                broken += 1
                print(f"{path.relative_to(ROOT)}:{number}: broken link {message}")
    summary = f"checked {checked} links in {len(files)} files"
    if broken:
        print(f"{summary}: {broken} broken", file=sys.stderr)
        return 1
    print(f"{summary}: all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
