"""``KeyHistogram`` exports exactly what ``prometheus_client``'s ``Histogram`` exports for the
same observations."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.metrics import KeyHistogram


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("buckets", [(0.001, 0.01, 0.5, 1, 10), (0.25, 2.5, 30)])
@pytest.mark.parametrize(
    "amounts",
    [[], [0.0], [0.001], [0.0009, 0.3, 7.5], [1e9, -1.0, 1.0, 10], [0.02] * 1000],
)
def test_key_histogram_exports_what_histogram_exports(
    buckets: tuple[float, ...], amounts: list[float]
) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("h_seconds", "help", buckets=buckets, registry=theirs)
    key_histogram = KeyHistogram("h_seconds", "help", buckets=buckets, registry=ours)
    for amount in amounts:
        histogram.observe(amount)
        key_histogram.observe(amount)
    assert _samples(ours) == pytest.approx(_samples(theirs))
    exported = [
        line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line
    ]
    assert generate_latest(ours).decode().splitlines() == exported


@pytest.mark.parametrize("amount", [0.0, 0.001, 0.3, 1e9, -1.0])
@pytest.mark.parametrize("count", [0, 1, 3, 10_000])
def test_key_histogram_observing_a_count_is_observing_that_many_times(
    amount: float, count: int
) -> None:
    once, each = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 0.5, 1, 10)
    together = KeyHistogram("h", "h", buckets=buckets, registry=once)
    one_by_one = KeyHistogram("h", "h", buckets=buckets, registry=each)
    together.observe(0.02)  # something there already
    one_by_one.observe(0.02)
    together.observe(amount, count)
    for _ in range(count):
        one_by_one.observe(amount)
    assert _samples(once) == pytest.approx(_samples(each))
