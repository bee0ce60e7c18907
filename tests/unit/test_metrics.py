"""``observe_many`` records exactly what as many ``observe`` calls would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from service.metrics import observe_many


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("amount", [0.0, 0.0009, 0.001, 0.3, 7.5, 1e9, -1.0])
@pytest.mark.parametrize("count", [0, 1, 2, 10_000])
def test_observe_many_is_count_observes(amount: float, count: int) -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 0.5, 1, 10)
    h_one = Histogram("h", "h", buckets=buckets, registry=one)
    h_many = Histogram("h", "h", buckets=buckets, registry=many)
    h_one.observe(0.02)  # something there already
    h_many.observe(0.02)
    for _ in range(count):
        h_one.observe(amount)
    observe_many(h_many, amount, count)
    assert _samples(many) == pytest.approx(_samples(one))
