"""What a freshly built registry exports: every family's name, type, help text and label sets,
line for line as in ``metrics_exposition.txt``. The alert rules, the dashboard and the deploy
tests read these names, labels and help texts; a deliberate change to a metric changes that file
in the same commit."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from service.kube.store import PodStore
from service.metrics import Metrics
from tests.kubefixtures import RecordingHandler

EXPECTED = Path(__file__).with_name("metrics_exposition.txt")
NAMESPACES = ("sandboxes-a", "sandboxes-b")


def exposition(registry: CollectorRegistry) -> list[str]:
    """The exposition's lines sorted, a ``_created`` sample without its value (a timestamp)."""
    lines = []
    for line in generate_latest(registry).decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if not line.startswith("#") and name.endswith("_created"):
            line = line.rsplit(" ", 1)[0]
        lines.append(line)
    return sorted(lines)


def test_a_fresh_registry_exports_exactly_the_recorded_families_labels_and_help() -> None:
    metrics = Metrics(CollectorRegistry())
    metrics.engine.bind_namespaces(NAMESPACES)
    for namespace in NAMESPACES:  # as each namespace's informer makes its cache
        PodStore(metrics.kube, RecordingHandler(), namespace=namespace)
    assert exposition(metrics.registry) == EXPECTED.read_text().splitlines()


def test_each_group_builds_only_its_own_families_on_the_registry_it_is_given() -> None:
    metrics = Metrics(CollectorRegistry())
    groups = (metrics.kube, metrics.pg, metrics.queue, metrics.engine, metrics.kept)
    names = [
        {family.name for family in type(group)(CollectorRegistry()).registry.collect()}
        for group in (*groups, metrics.service)
    ]
    assert all(group.registry is metrics.registry for group in (*groups, metrics.service))
    assert sum(len(n) for n in names) == len(set().union(*names))
    assert set().union(*names) == {family.name for family in metrics.registry.collect()}
