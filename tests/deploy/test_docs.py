"""The operations and architecture docs stay true to the code and the manifests."""

from __future__ import annotations

import re
from pathlib import Path

from service.domain import Outcome, SkipReason, Verdict, Waiting
from service.metrics import EventResult
from tests.deploy.support import BASE, DEPLOY, MONITORING, OVERLAYS, ROOT

OPERATIONS = ROOT / "docs" / "operations.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
COMMIT_LIKE = re.compile(r"(?<![0-9A-Za-z])(?:[0-9a-f]{7,12}|[0-9a-f]{40})(?![0-9A-Za-z])")
"""A commit id as git abbreviates it (7 to 12 hex digits) or writes it whole (40)."""


def table_first_cells(text: str, heading: str) -> set[str]:
    """First-column backticked values of the first table under ``heading``."""
    section = text.split(heading, 1)[1]
    cells = set()
    started = False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            if match := re.match(r"\|\s*`([^`]+)`\s*\|", line):
                cells.add(match.group(1))
        elif started:
            break
    return cells


def test_operations_explains_exactly_every_outcome_label() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    documented = table_first_cells(text, "## Reading the outcome metrics")
    assert documented == {str(v) for v in Verdict} | {
        str(o) for o in Outcome if o is not Outcome.INACTIVE
    }


def test_operations_explains_exactly_every_skip_reason() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    assert table_first_cells(text, "### Skip reasons") == {str(r) for r in SkipReason}


def test_operations_explains_exactly_every_wait_of_the_live_view() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    assert table_first_cells(text, "## What is about to happen") == {str(w) for w in Waiting}


def test_operations_explains_exactly_every_event_result() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    assert table_first_cells(text, "## Why was this pod deleted?") == set(EventResult)


def test_architecture_lists_the_seven_invariants() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    rows = re.findall(r"^\| ([1-9]) \|", text, flags=re.MULTILINE)
    assert rows == [str(i) for i in range(1, 8)]
    for layer in ("service/engine/", "service/classifier.py", "service/kube/", "service/pg/"):
        assert layer in text


def test_every_path_the_docs_name_exists() -> None:
    for doc in (OPERATIONS, ARCHITECTURE):
        text = doc.read_text(encoding="utf-8")
        paths = set(
            re.findall(r"`((?:service|devtools|deploy|tests|docs)/[A-Za-z0-9_./-]+)`", text)
        )
        assert paths, doc
        missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
        assert missing == [], f"{doc.name} names missing paths: {missing}"


def commit_like(text: str) -> list[str]:
    """The tokens of ``text`` that read as a commit id: 7 to 12 or 40 hex digits standing alone,
    with at least one digit and one letter (``1000000`` is a number, ``defaced`` a word). The
    simulator's trace hashes (16 hex digits) and image digests (64) are other lengths, so they
    stay reference values; a commit belongs in the commit log or benchmarks/NOTES.md."""
    return [
        token
        for token in COMMIT_LIKE.findall(text)
        if any(c.isdigit() for c in token) and any(c.isalpha() for c in token)
    ]


def test_the_commit_rule_tells_a_commit_from_a_reference_value() -> None:
    assert commit_like("at 1e515ce, and c038d47, before the refactor") == ["1e515ce", "c038d47"]
    assert commit_like("a defaced word, 2026-12-03, 1000000 seeds, 4402.7 s") == []
    assert commit_like("full 1e515ce" + "0" * 33) == ["1e515ce" + "0" * 33]
    assert commit_like("hashes `ad0e8c598ccc5150`, sha256:" + "ab" * 32) == []


def test_no_doc_names_a_commit() -> None:
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        found = commit_like(doc.read_text(encoding="utf-8"))
        assert found == [], f"{doc.relative_to(ROOT)} names commits {found}"


def test_operations_documents_the_secret_the_base_references() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    deployment = (DEPLOY / "base" / "deployment.yaml").read_text(encoding="utf-8")
    secret = re.search(r"secretName: (\S+)", deployment)
    assert secret is not None
    assert f"generic {secret.group(1)}" in text


def _comment_figures(manifest: str) -> set[str]:
    comments = " ".join(
        line.split("#", 1)[1] for line in manifest.splitlines() if line.lstrip().startswith("#")
    )
    return set(re.findall(r"(\d[\d,]*(?:\u2013\d[\d,]*)? MiB)", re.sub(r"\s+", " ", comments)))


def test_the_manifests_memory_figures_are_the_docs() -> None:
    # The Deployment's sizing comment repeats the measured figures: each is the one
    # docs/operations.md ("Capacity and sizing") gives, so the two cannot drift apart.
    sizing = OPERATIONS.read_text(encoding="utf-8").split("## Capacity and sizing", 1)[1]
    sizing = re.sub(r"\s+", " ", sizing.split("\n## ", 1)[0])
    for manifest in sorted(DEPLOY.rglob("*.yaml")):
        figures = _comment_figures(manifest.read_text(encoding="utf-8"))
        missing = sorted(f for f in figures if f not in sizing)
        assert missing == [], f"{manifest.relative_to(ROOT)}: {missing} not in the sizing section"
    deployment = (DEPLOY / "base" / "deployment.yaml").read_text(encoding="utf-8")
    assert _comment_figures(deployment) >= {"84 MiB", "205 MiB", "601 MiB", "689\u2013692 MiB"}


def test_every_kustomization_the_docs_apply_is_one_the_tests_render() -> None:
    # `kubectl apply -k` / `delete -k` need a cluster; what they send is what `kubectl kustomize`
    # renders, and tests/deploy renders and validates exactly these directories.
    rendered = {BASE, MONITORING, DEPLOY / "migrate", *OVERLAYS.values()}
    named = set()
    for doc in (OPERATIONS, ROOT / "README.md"):
        named |= set(re.findall(r"kubectl (?:apply|delete) -k (\S+?)[`\s;]", doc.read_text()))
    assert named, "no kubectl apply -k in the docs"
    assert {ROOT / p for p in named} <= rendered, sorted(named)


def heading_anchors(doc: Path) -> set[str]:
    """The anchors a renderer gives ``doc``'s headings: lower case, punctuation dropped, spaces
    as hyphens, a repeated one suffixed ``-1``, ``-2``, ...; headings inside code fences are
    none."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (heading := re.match(r"#{1,6} (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_link_between_the_docs_reaches_its_file_and_heading() -> None:
    docs = [
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "README.md",
        *sorted((ROOT / "benchmarks").glob("*.md")),
        *sorted(DEPLOY.rglob("*.md")),
    ]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists() or (
                anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked)
            ):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []
