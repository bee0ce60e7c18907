"""The operations and architecture docs stay true to the code and the manifests."""

from __future__ import annotations

import re

from service.domain import Outcome, SkipReason, Verdict, Waiting
from service.metrics import EVENT_RESULTS
from tests.deploy.support import BASE, DEPLOY, MONITORING, OVERLAYS, ROOT

OPERATIONS = ROOT / "docs" / "operations.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


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
    assert table_first_cells(text, "## Why was this pod deleted?") == set(EVENT_RESULTS)


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
