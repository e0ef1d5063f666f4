"""The design documents in ``docs/`` hold what the code cites, and the user-facing Markdown links resolve.

- Every citation of a design document in the source (``<name>.md``, optionally followed by section numbers such
  as ``§4.1``, ``§1-3``, ``§4-§5``, ``§3, §7.6`` or ``§3 and §7``, or by a quoted heading name) names a file in
  ``docs/`` and, for each section, a heading of that file that starts with the number.
- Every relative link in ``README.md``, ``docs/*.md`` and ``benchmarks/README.md`` points to an existing file, and
  every ``#anchor`` to a heading of its target (GitHub's slug rule).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED = ("draftkit", "callbacks", "benchmarks", "tests")
LINKED = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]

# Documents the code cites as design references; any other ``*.md`` name (README.md, MADE_BY.md) is not one.
DESIGN_DOCS = ("eagle3-format", "layer-analysis", "dual-precision", "architecture", "head-training")

_NUMBER = r"[0-9]+(?:\.[0-9]+)*[a-z]?"
CITATION = re.compile(
    r"\b(?P<doc>" + "|".join(re.escape(d) for d in DESIGN_DOCS) + r")\.md"
    r"(?:\s*(?P<sections>§" + _NUMBER + r"(?:\s*(?:-|–|,|and|/)\s*§?" + _NUMBER + r")*)"
    r"|\s+\"(?P<title>[^\"]+)\")?"
)
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*$", re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def section_numbers(sections: str) -> list[str]:
    """The section numbers one citation names, ranges of whole sections expanded.

    ``"§1-3"`` -> ``["1", "2", "3"]``; ``"§6.1-6.2"`` -> ``["6.1", "6.2"]``; ``"§5.2a"`` -> ``["5.2"]`` (a
    route inside §5.2); ``"§4."`` -> ``["4"]``.
    """
    out: list[str] = []
    parts = re.findall(r"(-|–)?\s*§?(" + _NUMBER + r")", sections)
    for dash, number in parts:
        number = re.sub(r"[a-z]$", "", number).rstrip(".")
        if dash and out and out[-1].isdigit() and number.isdigit():
            out += [str(n) for n in range(int(out[-1]) + 1, int(number) + 1)]
        else:
            out.append(number)
    return out


def matches(pattern: re.Pattern):
    """(file relative to ROOT, line, match) of ``pattern`` in every Python source of SCANNED but this file."""
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            text = path.read_text(encoding="utf-8")
            for m in pattern.finditer(text):
                yield str(path.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m


def citations() -> list[tuple[str, int, str, list[str], str | None]]:
    """(file, line, document, section numbers, quoted title) for every design-document citation in SCANNED."""
    return [(where, line, m["doc"], section_numbers(m["sections"]) if m["sections"] else [], m["title"])
            for where, line, m in matches(CITATION)]


def headings(path: Path) -> list[str]:
    return [m["text"] for m in HEADING.finditer(path.read_text(encoding="utf-8"))]


def heading_number(text: str) -> str | None:
    m = re.match(r"([0-9]+(?:\.[0-9]+)*)\.?\s", text)
    return m.group(1) if m else None


def slug(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


CITED = citations()


def test_citation_parser_on_the_forms_the_code_uses():
    text = ("(eagle3-format.md §3, §7.6) (dual-precision.md §1-3) (layer-analysis.md §4-§5) "
            "(dual-precision.md §3 and §7) (layer-analysis.md §3, §5.2a, §6.1) (eagle3-format.md §4.1/§4.3) "
            "(dual-precision.md §6.1-6.2) (architecture.md \"Floors\") (see layer-analysis.md.) README.md §2")
    got = [(m["doc"], section_numbers(m["sections"]) if m["sections"] else [], m["title"])
           for m in CITATION.finditer(text)]
    assert got == [
        ("eagle3-format", ["3", "7.6"], None),
        ("dual-precision", ["1", "2", "3"], None),
        ("layer-analysis", ["4", "5"], None),
        ("dual-precision", ["3", "7"], None),
        ("layer-analysis", ["3", "5.2", "6.1"], None),
        ("eagle3-format", ["4.1", "4.3"], None),
        ("dual-precision", ["6.1", "6.2"], None),
        ("architecture", [], "Floors"),
        ("layer-analysis", [], None),
    ]


def test_the_source_cites_the_design_documents():
    docs = {doc for _, _, doc, _, _ in CITED}
    assert {"eagle3-format", "layer-analysis", "dual-precision", "architecture"} <= docs
    assert sum(len(numbers) for _, _, _, numbers, _ in CITED) > 70


def test_no_source_points_outside_the_repository():
    """A citation names the repository's own file (docs/X.md), never the design team's shared/ folder, which a
    user does not have."""
    outside = [f"{where}:{line}" for where, line, _ in matches(re.compile(r"shared/(reference|cases|seeds)/"))]
    assert outside == []


@pytest.mark.parametrize("where,line,doc,numbers,title", CITED, ids=[f"{c[0]}:{c[1]}" for c in CITED])
def test_citation_resolves_to_a_heading(where, line, doc, numbers, title):
    path = DOCS / f"{doc}.md"
    assert path.is_file(), f"{where}:{line} cites {doc}.md, which is not in docs/: add it or drop the citation"
    texts = headings(path)
    have = {heading_number(t) for t in texts} - {None}
    missing = [n for n in numbers if n not in have]
    assert not missing, f"{where}:{line} cites {doc}.md §{', §'.join(missing)}: no such heading in docs/{doc}.md"
    if title:
        assert any(title.lower() in t.lower() for t in texts), f"{where}:{line}: no heading '{title}' in docs/{doc}.md"


def test_every_design_document_has_unique_numbered_sections():
    for path in sorted(DOCS.glob("*.md")):
        numbers = [heading_number(t) for t in headings(path) if heading_number(t)]
        assert numbers, f"{path.name} has no numbered sections"
        assert len(numbers) == len(set(numbers)), f"{path.name} repeats a section number"


LINKS = [(md, m["target"]) for md in LINKED for m in LINK.finditer(md.read_text(encoding="utf-8"))
         if not re.match(r"[a-z]+:", m["target"])]


def test_the_markdown_files_have_relative_links():
    assert len(LINKS) >= 10


@pytest.mark.parametrize("md,target", LINKS, ids=[f"{m.relative_to(ROOT)}->{t}" for m, t in LINKS])
def test_relative_link_resolves(md, target):
    file_part, _, anchor = target.partition("#")
    dest = (md.parent / file_part).resolve() if file_part else md
    assert dest.exists(), f"{md.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        anchors = {slug(t) for t in headings(dest)}
        assert anchor in anchors, f"{md.relative_to(ROOT)} links to #{anchor}, no such heading in {dest.name}"
