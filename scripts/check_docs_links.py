#!/usr/bin/env python3
"""Check that every relative link and #anchor in README.md and docs/src/**/*.md resolves.

A link resolves when the file it names exists (relative to the page, inside the repository) and,
if it has a #fragment into a Markdown file, that file has a heading with that id under mdBook's
rules: the heading text lowercased, whitespace turned into '-', every character that is not
alphanumeric, '-' or '_' dropped, repeated ids numbered -1, -2, ...; an explicit `{#id}` wins.
External links (http:, https:, mailto:) are not fetched. Links inside code spans and fenced code
blocks are ignored. Exits 1 naming each broken link, 0 when all resolve. Standard library only.

Usage: python3 scripts/check_docs_links.py [ROOT]   (ROOT defaults to the repository root)
"""

import html
import os
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve()

INLINE_LINK = re.compile(r"(!?)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"\s*\{#([^}\s]+)[^}]*\}\s*$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def strip_code(lines):
    """The lines with fenced blocks blanked and code spans removed (their text is not Markdown)."""
    out, fence = [], None
    for line in lines:
        m = FENCE.match(line)
        if fence:
            if m and line.strip().startswith(fence):
                fence = None
            out.append("")
            continue
        if m:
            fence = m.group(1)
            out.append("")
            continue
        out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return out


def heading_text(raw):
    """The text of a heading as rendered: inline markup and HTML tags gone, entities decoded."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # links keep their text
    # Code spans are literal (`<name>` stays text); outside them, tags go and markup is dropped.
    parts = re.split(r"(`+)(.+?)\1", text)
    out = []
    for i, part in enumerate(parts):
        kind = i % 3
        if kind == 1:
            continue
        if kind == 2:
            out.append(part)
            continue
        part = re.sub(r"<[^>]+>", "", part).replace("*", "")
        part = re.sub(r"(?<!\w)_+|_+(?!\w)", "", part)  # emphasis underscores, not snake_case
        out.append(html.unescape(part))
    return "".join(out)


def mdbook_id(text):
    out = []
    for ch in text:
        if ch.isalnum() or ch in "-_":
            out.append(ch.lower())
        elif ch.isspace():
            out.append("-")
    return "".join(out)


_anchor_cache = {}


def anchors(path):
    """The heading ids of a Markdown file."""
    if path in _anchor_cache:
        return _anchor_cache[path]
    ids, seen = set(), {}
    fence = None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if fence:
            if m and line.strip().startswith(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        h = HEADING.match(line)
        if not h:
            continue
        raw = h.group(2)
        explicit = EXPLICIT_ID.search(raw)
        if explicit:
            ids.add(explicit.group(1))
            continue
        base = mdbook_id(heading_text(raw))
        n = seen.get(base, 0)
        ids.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    _anchor_cache[path] = ids
    return ids


def links(path):
    """(line number, target) of every link and image in a Markdown file."""
    lines = strip_code(path.read_text(encoding="utf-8").splitlines())
    for i, line in enumerate(lines, 1):
        for m in INLINE_LINK.finditer(line):
            yield i, m.group(2)
        r = REF_DEF.match(line)
        if r:
            yield i, r.group(1)


def check(page):
    broken = []
    for line, target in links(page):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
            continue
        target_path, _, fragment = target.partition("#")
        dest = page if not target_path else (page.parent / target_path)
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        try:
            dest.resolve().relative_to(ROOT)
        except ValueError:
            broken.append(f"{where} (outside the repository)")
            continue
        if not dest.exists():
            broken.append(f"{where} (no such file)")
            continue
        if fragment:
            if dest.is_dir() or dest.suffix != ".md":
                broken.append(f"{where} (an anchor into a file that is not Markdown)")
            elif fragment not in anchors(dest):
                broken.append(f"{where} (no heading with id '{fragment}' in {dest.resolve().relative_to(ROOT)})")
    return broken


def main():
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs" / "src").rglob("*.md"))
    broken = []
    for page in pages:
        if page.exists():
            broken.extend(check(page))
    if broken:
        print(f"{len(broken)} broken link(s):", file=sys.stderr)
        for b in broken:
            print(f"  {b}", file=sys.stderr)
        return 1
    print(f"checked {len(pages)} pages: every relative link and anchor resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
