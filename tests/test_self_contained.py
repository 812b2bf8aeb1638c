"""The repository is self-contained: a user has only the repository, so nothing in it may point
outside it, and the documentation's relative links must resolve.

1. No tracked text file names design notes that live outside the repository (``../shared``,
   ALGORITHMS.md, DESIGN.md, BUILD-NOTES.md, STYLE.md; a file of that exact name inside the
   repository would be fine) or an issue tracker's numbers ("issue 12", "issue #3", "issues 5.3").
   The documentation lives in docs/: point there, or state the fact.
2. Every relative link in README.md and docs/*.md names a file that exists inside the repository,
   and every ``#anchor`` into a markdown file names one of its headings.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # necessarily holds the patterns

OUTSIDE_NAMES = ("ALGORITHMS.md", "DESIGN.md", "BUILD-NOTES.md", "STYLE.md")
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:  # e.g. an sdist without .git
        pytest.skip(f"not a git checkout ({e})")
    return [p for p in out.decode().split("\0") if p]


def _text(rel: str) -> str | None:
    """The file's text, or None for a binary (NUL byte or not UTF-8) or a tracked file that is gone."""
    try:
        data = (ROOT / rel).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _outside_patterns(tracked: list[str]) -> list[tuple[str, re.Pattern[str]]]:
    inside = {Path(p).name for p in tracked}
    pats = [("../shared", re.compile(r"\.\./shared\b"))]
    for name in OUTSIDE_NAMES:
        if name in inside:  # the repository has such a file: naming it points inside
            continue
        stem = re.escape(name[: -len(".md")])
        # exact upper-case name, alone (docs/algorithms.md is fine); BUILD-NOTES also without ".md"
        tail = r"(?:\.md)?" if name == "BUILD-NOTES.md" else r"\.md"
        pats.append((name, re.compile(rf"(?<![\w.-]){stem}{tail}(?![\w-])")))
    pats.append(("issue number", ISSUE))
    return pats


def test_nothing_points_outside_the_repository():
    tracked = _tracked_files()
    pats = _outside_patterns(tracked)
    hits = []
    for rel in tracked:
        if rel == THIS:
            continue
        text = _text(rel)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for what, pat in pats:
                m = pat.search(line)
                if m:
                    hits.append(f"{rel}:{lineno}: {m.group(0)!r} ({what}): {line.strip()[:100]}")
    assert not hits, ("these files point outside the repository; point to docs/ or state the fact:\n"
                      + "\n".join(hits))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation and symbols removed
    (letters, digits, marks, spaces, '-' and '_' kept), spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _strip_fences(md.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = _slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _strip_fences(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def _strip_code(text: str) -> str:
    """Fenced code blocks and inline code spans hold examples, not links."""
    return re.sub(r"`[^`\n]*`", "", _strip_fences(text))


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_doc_files_exist():
    assert (ROOT / "README.md").is_file()
    assert {"algorithms.md", "design.md", "results.md"} <= {p.name for p in (ROOT / "docs").glob("*.md")}


@pytest.mark.parametrize("md", _doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(md: Path):
    broken = []
    for target in LINK.findall(_strip_code(md.read_text(encoding="utf-8"))):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (md.parent / path_part).resolve() if path_part else md.resolve()
        if ROOT.resolve() not in (dest, *dest.parents):
            broken.append(f"{target}: outside the repository")
            continue
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{md.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)
