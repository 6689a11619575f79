#!/usr/bin/env python3
"""Checks the relative links of the project's Markdown: README.md, ARCHITECTURE.md and every
docs/**/*.md (or the files given as arguments).

A link `[text](target)`, an image `![alt](target)` or a reference `[name]: target` whose
target is not a URL must name a file or folder that exists, relative to the Markdown file
that holds it; a `#anchor` (alone, or after a Markdown file) must be a heading of that file,
as GitHub spells heading anchors. Links inside code (fenced blocks and `code spans`) are not
links and are skipped. Prints every broken link with its file and line, and exits 1 if there
is one.

    python3 scripts/check-doc-links.py [FILE.md...]
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def prose_lines(text, blank_code_spans=True):
    """(line number, line) of every line outside fenced code, code spans blanked out unless
    told otherwise (a heading's code spans are part of its anchor)."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield n, re.sub(r"`+[^`]*`+", "", line) if blank_code_spans else line


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path):
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    seen = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8"), blank_code_spans=False):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def targets(text):
    for n, line in prose_lines(text):
        for m in INLINE.finditer(line):
            yield n, m.group(1)
        m = REFERENCE.match(line)
        if m:
            yield n, m.group(1)


def check(md):
    errors = []
    for n, target in targets(md.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        where = f"{md.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            errors.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
            errors.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return errors


def main():
    if len(sys.argv) > 1:
        files = [Path(a).resolve() for a in sys.argv[1:]]
    else:
        files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
        files += sorted((ROOT / "docs").rglob("*.md"))
    errors = [e for f in files for e in check(f)]
    for e in errors:
        print(e)
    print(f"{len(files)} files, {len(errors)} broken links", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
