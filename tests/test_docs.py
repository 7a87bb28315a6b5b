"""The documentation is self-contained: every relative Markdown link in README.md and docs/*.md
resolves to a file of the repository (and its #anchor to a heading of that file, by GitHub's slug
rule), no tracked text file points outside the repository, and the README stays short."""
from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
# What a file inside the repository must not name: the checkout's surroundings.
OUTSIDE = ("SPEC.md", "../shared", "/work/")

_LINK = re.compile(r"(?<!\\)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _strip_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than '-' and
    '_' removed, each space a '-' (so "`python -m x`" gives "python--m-x")."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def _anchors(path: Path) -> frozenset[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for h in _HEADING.findall(text):
        slug = github_slug(h)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _links(path: Path) -> list[str]:
    return _LINK.findall(_strip_code(path.read_text(encoding="utf-8")))


def _broken_links(path: Path) -> list[str]:
    bad = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        try:
            dest.relative_to(ROOT)
        except ValueError:
            bad.append(f"{target} (outside the repository)")
            continue
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading with anchor #{anchor})")
    return bad


def test_slug_rule():
    assert github_slug("Check your installation (GPU users: run this first)") == \
        "check-your-installation-gpu-users-run-this-first"
    assert github_slug("The demo: `python -m fusedopt demo`") == "the-demo-python--m-fusedopt-demo"
    assert github_slug("Result of the default run (seeds 0–3)") == "result-of-the-default-run-seeds-03"


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    bad = _broken_links(path)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_link_checker_sees_links():
    # guard against a regex that silently matches nothing
    assert "docs/math.md" in _links(ROOT / "README.md")


def _tracked_text_files() -> list[Path]:
    """Tracked and new (not ignored) text files, this file excepted (it names the patterns)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    files = []
    for name in out.stdout.decode().split("\0"):
        p = ROOT / name
        if not name or not p.is_file() or p == Path(__file__).resolve():
            continue  # deleted in the working tree
        data = p.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images)
        files.append(p)
    return files


def test_no_reference_outside_the_repository():
    """The repository is self-contained: the math contract is docs/math.md, nothing names a path
    beside or above the checkout."""
    hits = []
    for p in _tracked_text_files():
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for word in OUTSIDE:
                if word in line:
                    hits.append(f"{p.relative_to(ROOT)}:{n}: {word}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_docs_paths_named_in_tracked_files_exist():
    """A `docs/NAME.md` named in code, tests or docs names a file that exists."""
    hits = []
    for p in _tracked_text_files():
        for m in re.finditer(r"(?<![\w/.])docs/([\w.-]+\.md)", p.read_text(encoding="utf-8", errors="replace")):
            if not (ROOT / "docs" / m.group(1)).exists():
                hits.append(f"{p.relative_to(ROOT)}: docs/{m.group(1)}")
    assert not hits, "missing docs files:\n" + "\n".join(hits)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"
