"""Whether the API server answers (``service/kube/reachability.py``), on virtual time."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client import CollectorRegistry

from service.kit import clock
from service.kube.reachability import Reachability
from service.metrics import KubeMetrics

pytestmark = pytest.mark.anyio


def gauges(metrics: KubeMetrics) -> tuple[float | None, float | None]:
    registry = metrics.registry
    return (
        registry.get_sample_value("retired_pod_gc_api_reachable"),
        registry.get_sample_value("retired_pod_gc_api_last_answer_age_seconds"),
    )


async def test_unreachable_once_a_request_ends_unanswered_with_no_answer_since_it_was_sent() -> (
    None
):
    metrics = KubeMetrics(CollectorRegistry())
    reach = Reachability(metrics)
    assert (reach.problem, gauges(metrics)) == (None, (1, 0))
    sent = clock.now()
    await anyio.sleep(10)
    reach.unanswered(sent, "TimeoutError GET /api/v1/namespaces/ns/pods/p")
    assert reach.problem is not None  # unreachable
    assert reach.problem == "no answer for 10s: TimeoutError GET /api/v1/namespaces/ns/pods/p"
    assert gauges(metrics) == (0, 10)
    await anyio.sleep(5)
    assert reach.problem == "no answer for 15s: TimeoutError GET /api/v1/namespaces/ns/pods/p"
    reach.answered()
    assert (reach.problem, gauges(metrics)) == (None, (1, 0))


async def test_a_request_unanswered_while_others_are_answered_is_its_connections_failure() -> None:
    metrics = KubeMetrics(CollectorRegistry())
    reach = Reachability(metrics)
    sent = clock.now()  # on a dead pooled connection ...
    await anyio.sleep(3)
    reach.answered()  # ... while a Lease renewal on another is answered
    await anyio.sleep(7)
    reach.unanswered(sent, "TimeoutError GET /x")
    assert reach.problem is None
    assert metrics.registry.get_sample_value("retired_pod_gc_api_reachable") == 1


async def test_a_waiter_is_woken_by_the_first_answer_after_its_time() -> None:
    reach = Reachability()
    since = clock.now()
    woken: list[float] = []

    async def wait() -> None:
        woken.append(float(await reach.answered_after(since, 30)))
        woken.append(clock.now() - since)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(4)
        reach.answered()
    assert woken == [1.0, 4.0]
    # An answer after ``since`` already: at once; none within the timeout: False after it.
    assert await reach.answered_after(since, 30)
    later = clock.now()
    assert not await reach.answered_after(later, 30)
    assert clock.now() - later == 30
