"""Every cross-reference resolves: the links and anchors of the docs, and the docs code cites.

Two kinds are checked. A Markdown link in ``README.md``, ``docs/*.md`` or ``benchmarks/*.md``
whose target is in the repository must name a file that exists and, with ``#anchor``, a heading
of that file whose GitHub slug is the anchor. A citation of a doc in a comment or docstring of
``service/``, ``devtools/``, ``tests/`` or ``benchmarks/`` (or in a doc), written
``docs/x.md, "Section"``, ``docs/x.md ("Section")`` or ``docs/x.md#anchor``, must name a file
that exists and a heading of it (the quoted text is the heading's text, without its backticks;
the anchor is its slug); ``benchmarks/RESULTS.md, run `name``` must name a results file that
exists and that RESULTS.md renders.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
)
CODE_DIRS = ("service", "devtools", "tests", "benchmarks")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
DOC = r"((?:docs/[\w.-]+|benchmarks/[A-Z]+|README)\.md)`?"
CITED_SECTION = re.compile(DOC + r"(?:,\s*|\s+\(\s*)\"([^\"]+)\"")
CITED_ANCHOR = re.compile(DOC + r"#([\w-]+)")
CITED_RUN = re.compile(r"benchmarks/RESULTS\.md`?,\s*runs?\s+`([\w.-]+)`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    return [h.replace("`", "").strip() for h in HEADING.findall(text)]


def names_a_heading(section: str, names: list[str]) -> bool:
    """The heading's text, or its text before a parenthesised qualifier ("Name (`path/`)")."""
    wanted = section.replace("`", "").strip()
    return any(name == wanted or name.startswith(wanted + " (") for name in names)


def anchors(doc: Path) -> set[str]:
    """Every anchor GitHub makes for the headings of ``doc`` (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    made = set()
    for heading in headings(doc):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        made.add(base if n == 0 else f"{base}-{n}")
    return made


def broken_links(doc: Path) -> Iterator[str]:
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    text = INLINE_CODE.sub("", text)
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            yield f"{doc.relative_to(ROOT)}: link to a missing file: {target}"
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            yield f"{doc.relative_to(ROOT)}: link to a missing anchor: {target}"


def flattened(path: Path) -> str:
    """The file's text with line breaks, indentation and comment markers joined to one space."""
    return re.sub(r"\s*\n\s*(?:#+\s*)?", " ", path.read_text(encoding="utf-8"))


def broken_citations(path: Path) -> Iterator[str]:
    text = flattened(path)
    where = path.relative_to(ROOT)
    for doc_name, section in CITED_SECTION.findall(text):
        doc = ROOT / doc_name
        if not doc.exists():
            yield f"{where}: cites a missing file: {doc_name}"
        elif not names_a_heading(section, headings(doc)):
            yield f"{where}: cites a missing section: {doc_name}, {section!r}"
    for doc_name, anchor in CITED_ANCHOR.findall(text):
        doc = ROOT / doc_name
        if not doc.exists():
            yield f"{where}: cites a missing file: {doc_name}"
        elif anchor not in anchors(doc):
            yield f"{where}: cites a missing anchor: {doc_name}#{anchor}"
    results = ROOT / "benchmarks" / "RESULTS.md"
    for run in CITED_RUN.findall(text):
        if not (ROOT / "benchmarks" / "results" / f"{run}.json").exists():
            yield f"{where}: cites a run with no results file: {run}"
        elif f"`{run}`" not in results.read_text(encoding="utf-8"):
            yield f"{where}: cites a run RESULTS.md does not show: {run}"


def citing_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")]
    files += [p for p in (ROOT / "deploy").rglob("*") if p.suffix in (".yaml", ".json")]
    here = Path(__file__).resolve()  # its docstring shows the forms, with made-up names
    return sorted(p for p in [*files, *DOCS, ROOT / "Makefile"] if p != here)


def test_slugs_are_githubs() -> None:
    assert slug("Deterministic simulation (`tests/sim/`)") == "deterministic-simulation-testssim"
    assert slug("What is about to happen: the live view") == "what-is-about-to-happen-the-live-view"
    assert slug("B1 cold start, 100,000 pods") == "b1-cold-start-100000-pods"


def test_every_link_and_anchor_of_the_docs_resolves() -> None:
    assert len(DOCS) >= 6
    broken = [b for doc in DOCS for b in broken_links(doc)]
    assert broken == []


def test_every_doc_the_code_and_the_docs_cite_has_the_cited_section() -> None:
    files = citing_files()
    cited = sum(len(CITED_SECTION.findall(flattened(p))) for p in files)
    assert cited >= 10  # the pattern still finds the citations it is meant to check
    broken = [b for path in files for b in broken_citations(path)]
    assert broken == []
