"""The Event writer against the emulator over HTTP: what an Event says, that the real server's
validation accepts it, the rate limit, the bounded buffer, failures counted and logged once per
change of kind (and once when a write works again), and the bounded flush at shutdown; the
``RetiredPodKept`` Events of retired-but-kept pods written by the same writer, retried alike,
after the delete Events, and counted apart."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from prometheus_client import CollectorRegistry

from devtools.emulator import RunningEmulator
from service.domain import ExecutionState, Verdict
from service.kit.backoff import Backoff
from service.kube.events import REASON_DELETED, REASON_KEPT, REASON_WOULD_DELETE, KubeEventRecorder
from service.kube.transport import ApiTransport
from service.metrics import EventResult, KubeMetrics
from service.ports import KeptReport, ReapReport
from tests.fakes import make_pod
from tests.kubefixtures import SANDBOX_NAMESPACE, eventually
from tests.pgfixtures import metric

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
EVENTS_PATH = f"/apis/events.k8s.io/v1/namespaces/{NS}/events"


def report(i: int = 0, *, dry_run: bool = False) -> ReapReport:
    return ReapReport(
        pod=make_pod(f"e{i:04d}", uid=f"uid-{i}", resource_version=str(500 + i)),
        verdict=Verdict.TERMINAL_RETIRED,
        rule="terminal pod of a retired execution",
        reapable_for_s=312.4,
        row_state=ExecutionState.SUSPENDED,
        dry_run=dry_run,
    )


def kept_report(i: int = 0) -> KeptReport:
    return KeptReport(
        pod=make_pod(f"k{i:04d}", uid=f"kept-{i}", resource_version=str(700 + i)),
        reason="pod_running",
        rule="Running pods may hold a live VM",
        row_state=ExecutionState.SUSPENDED,
        since_s=1_796_000_000.0,
        since_source="retired_at",
        kept_for_s=1900.0,
    )


FAST_RETRIES = Backoff(initial_s=0.01, max_s=0.05)


def results(metrics: KubeMetrics, name: str = "retired_pod_gc_events_total") -> dict[str, int]:
    counts = {r: int(metric(metrics.registry, name, result=r)) for r in EventResult}
    return {r: n for r, n in counts.items() if n}


def kept_results(metrics: KubeMetrics) -> dict[str, int]:
    return results(metrics, "retired_pod_gc_kept_events_total")


@asynccontextmanager
async def draining(recorder: KubeEventRecorder) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()


def make_recorder(api: ApiTransport, **options: object) -> tuple[KubeEventRecorder, KubeMetrics]:
    metrics = KubeMetrics(CollectorRegistry())
    values: dict[str, object] = {
        "instance": "gc-replica-1",
        "metrics": metrics,
        "timeout_s": 5.0,
    }
    values.update(options)
    return KubeEventRecorder(api, **values), metrics  # type: ignore[arg-type]


async def test_a_delete_and_a_dry_run_report_become_valid_events_regarding_the_pod(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    recorder, metrics = make_recorder(kube_api, wall_clock=lambda: 1_796_000_000.25)
    async with draining(recorder):
        recorder.record(report(1))
        recorder.record(report(2, dry_run=True))
        await eventually(lambda: results(metrics) == {"created": 2})
    stored = {e["regarding"]["uid"]: e for e in emulator.emulator.events.events(NS)}
    assert set(stored) == {"uid-1", "uid-2"}
    deleted, reported = stored["uid-1"], stored["uid-2"]
    assert deleted["regarding"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": NS,
        "name": "space-sbx-e0001-g1",
        "uid": "uid-1",
        "resourceVersion": "501",
    }
    assert (deleted["reason"], reported["reason"]) == (REASON_DELETED, REASON_WOULD_DELETE)
    for event in (deleted, reported):
        assert (event["type"], event["action"]) == ("Normal", "Delete")
        assert event["reportingInstance"] == "gc-replica-1"
        assert event["eventTime"] == "2026-11-30T00:53:20.250000Z"
        assert event["metadata"]["name"].startswith(event["regarding"]["name"] + ".")
        assert "terminal_retired" in event["note"]
        assert "312s" in event["note"]
        assert "suspended" in event["note"]
    assert "uid=uid-1 resourceVersion=501" in deleted["note"]
    assert deleted["note"].startswith("Deleted")
    assert reported["note"].startswith("Would delete (dry run)")


async def test_dry_run_reports_are_paced_and_those_beyond_the_bound_summarised(
    emulator: RunningEmulator, kube_api: ApiTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """The real limiter on the real loop, at a small rate: it admits ``burst`` reports at once,
    then ``per_second``, so the k-th Event cannot reach the server sooner than
    ``(k - burst) / per_second`` after the drain started (load can only delay it further). The
    reports beyond the bound are counted and named in one summary line, none silently lost."""
    emu = emulator.emulator
    burst, per_second, bound, n = 3, 20.0, 12, 30
    recorder, metrics = make_recorder(
        kube_api, burst=burst, per_second=per_second, report_bound=bound
    )
    caplog.set_level(logging.WARNING, logger="service.kube.events")
    for i in range(n):
        recorder.record(report(i, dry_run=True))
    assert recorder.pending == bound
    started_s = time.time()  # the emulator stamps requests with time.time() too
    async with draining(recorder):
        await eventually(lambda: recorder.pending == 0 and recorder.summarized == 0)
    assert results(metrics) == {"created": bound, "summarized": n - bound}
    arrivals = sorted(e.time_s for e in emu.audit_log(method="POST", path_contains=EVENTS_PATH))
    assert len(arrivals) == bound
    for k, arrived_s in enumerate(arrivals, start=1):
        assert arrived_s - started_s >= (k - burst) / per_second, (k, arrived_s - started_s)
    [summary] = [r.getMessage() for r in caplog.records if "more would-delete" in r.getMessage()]
    assert summary.startswith(f"dry run: {n - bound} more would-delete reports")


async def test_delete_events_are_not_paced_again_the_delete_budget_is_their_pace(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    """At a pace of one report a minute, fifty deletes recorded at once are still all written
    (paced, the last would wait most of an hour); none is summarised or dropped."""
    n = 50
    recorder, metrics = make_recorder(kube_api, burst=1, per_second=1 / 60)
    for i in range(n):
        recorder.record(report(i))
    async with draining(recorder):
        await eventually(lambda: results(metrics) == {"created": n})
    assert {e["regarding"]["uid"] for e in emulator.emulator.events.events(NS)} == {
        f"uid-{i}" for i in range(n)
    }


async def test_the_buffer_and_the_report_pace_follow_the_delete_budget(
    kube_api: ApiTransport,
) -> None:
    small, _ = make_recorder(kube_api)
    assert (small.buffer_size, small.reports_per_second) == (1000, 2.0)
    big, _ = make_recorder(kube_api, deletes_per_minute=6000)
    # two minutes of deletes at the cap wait; reports go at the pace deletes would
    assert (big.buffer_size, big.reports_per_second, big.report_bound) == (12000, 100.0, 1000)


async def test_a_full_buffer_drops_and_counts_what_does_not_fit(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    emu.add_latency(60.0, method="POST", path_contains=EVENTS_PATH)
    recorder, metrics = make_recorder(kube_api, buffer_size=5, timeout_s=60.0)
    async with draining(recorder):
        for i in range(12):
            recorder.record(report(i))
        assert recorder.pending == 5
        assert results(metrics) == {"dropped_buffer_full": 7}
        await recorder.flush(timeout_s=0.1)
    assert results(metrics) == {"dropped_buffer_full": 7, "dropped_shutdown": 5}


async def test_refusals_are_dropped_at_once_and_logged_once_per_kind(
    emulator: RunningEmulator, kube_api: ApiTransport, caplog: pytest.LogCaptureFixture
) -> None:
    emu = emulator.emulator
    emu.fail_next(2, code=403, method="POST", path_contains=EVENTS_PATH)
    emu.fail_next(2, code=422, method="POST", path_contains=EVENTS_PATH)
    recorder, metrics = make_recorder(kube_api, retry_backoff=FAST_RETRIES)
    caplog.set_level(logging.DEBUG, logger="service.kube.events")
    async with draining(recorder):
        for i in range(5):
            recorder.record(report(i))
        await eventually(lambda: sum(results(metrics).values()) == 5)
    assert results(metrics) == {"forbidden": 2, "rejected": 2, "created": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert sum("403" in w for w in warnings) == 1
    assert sum("422" in w for w in warnings) == 1
    # The write that worked says so, with the failures before it.
    [recovered] = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert recovered == "Event writes fail: works again after 4 failures"
    assert len(emu.events.events(NS)) == 1
    # Nothing was sent twice.
    assert sum(r.method == "POST" for r in emu.requests) == 5


async def test_transient_failures_are_retried_until_every_event_is_written(
    emulator: RunningEmulator, kube_api: ApiTransport, caplog: pytest.LogCaptureFixture
) -> None:
    emu = emulator.emulator
    emu.add_latency(60.0, method="POST", path_contains=EVENTS_PATH, count=1)
    emu.fail_next(2, code=500, method="POST", path_contains=EVENTS_PATH)
    emu.fail_next(1, code=503, method="POST", path_contains=EVENTS_PATH)
    recorder, metrics = make_recorder(kube_api, timeout_s=0.3, retry_backoff=FAST_RETRIES)
    caplog.set_level(logging.DEBUG, logger="service.kube.events")
    async with draining(recorder):
        for i in range(4):
            recorder.record(report(i))
        await eventually(lambda: results(metrics).get("created") == 4)
    # The first write waits out the latency, then the three failures come in turn, each
    # retried: every Event is written once, in the order of the deletes.
    assert results(metrics) == {"timeout": 1, "server_error": 3, "created": 4}
    written = [e["regarding"]["name"] for e in emu.events.events(NS)]
    assert written == [report(i).pod.name for i in range(4)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("timed out" in w for w in warnings) == 1
    assert sum("answered 50" in w for w in warnings) == 1


async def test_an_event_failing_past_its_age_bound_is_dropped_and_counted(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    emu.fail_next(1000, code=500, method="POST", path_contains=EVENTS_PATH)
    recorder, metrics = make_recorder(kube_api, retry_backoff=FAST_RETRIES, max_age_s=0.5)
    async with draining(recorder):
        recorder.record(report(0))
        await eventually(lambda: results(metrics).get("expired") == 1)
        assert recorder.pending == 0
    assert results(metrics)["server_error"] >= 2
    assert "created" not in results(metrics)


async def test_flush_at_shutdown_is_bounded_and_counts_what_it_leaves(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    recorder, metrics = make_recorder(kube_api, timeout_s=60.0)
    async with draining(recorder):
        recorder.record(report(0))
        await eventually(lambda: results(metrics) == {"created": 1})
        emu.add_latency(60.0, method="POST", path_contains=EVENTS_PATH)
        for i in range(1, 4):
            recorder.record(report(i))
        # The second write reached the server and hangs there.
        await eventually(lambda: sum(r.method == "POST" for r in emu.requests) == 2)
        dropped = await recorder.flush(timeout_s=0.2)
        recorder.record(report(4))
    assert recorder.pending == 0
    assert dropped == 3
    assert results(metrics) == {"created": 1, "dropped_shutdown": 4}
    assert len(emu.events.events(NS)) == 1


async def test_the_unwritten_events_are_exported_and_logged_with_their_count_at_shutdown(
    emulator: RunningEmulator, kube_api: ApiTransport, caplog: pytest.LogCaptureFixture
) -> None:
    emu = emulator.emulator
    recorder, metrics = make_recorder(kube_api, timeout_s=60.0)

    def unwritten() -> float:
        return metrics.registry.get_sample_value("retired_pod_gc_events_unwritten") or 0.0

    async with draining(recorder):
        assert unwritten() == 0
        emu.add_latency(60.0, method="POST", path_contains=EVENTS_PATH)
        for i in range(3):
            recorder.record(report(i))
        # One write hangs at the server, two wait behind it: what a SIGKILL would lose now.
        await eventually(lambda: sum(r.method == "POST" for r in emu.requests) == 1)
        assert unwritten() == 3
        with caplog.at_level(logging.INFO, logger="service.kube.events"):
            await recorder.flush(timeout_s=0.2)
    assert unwritten() == 0
    assert results(metrics) == {"dropped_shutdown": 3}
    lines = [r.getMessage() for r in caplog.records if "shutting down" in r.getMessage()]
    assert lines == [
        "shutting down: 3 of 3 unwritten Events not written within 0.2s (counted as "
        "dropped_shutdown)"
    ]


async def test_a_bug_writing_one_event_is_logged_counted_and_the_next_is_still_written(
    emulator: RunningEmulator, kube_api: ApiTransport, caplog: pytest.LogCaptureFixture
) -> None:
    # A NaN wall clock makes the Event's name unbuildable (int(nan) raises ValueError): a bug of
    # the recorder's own, not a failure of the API server.
    times = iter([float("nan"), 1_796_000_001.0])
    recorder, metrics = make_recorder(kube_api, wall_clock=lambda: next(times))
    async with draining(recorder):
        recorder.record(report(1))
        recorder.record(report(2))
        await eventually(lambda: results(metrics) == {"bug": 1, "created": 1})
    [bug] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert bug.exc_info is not None and isinstance(bug.exc_info[1], ValueError)
    assert len(emulator.emulator.events.events(NS)) == 1


# ------------------------------------------------------------------ RetiredPodKept


async def test_a_kept_event_answered_500_is_retried_and_written(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    """A kept pod's Warning Event gets the delete Events' retries: a 500 is an attempt, counted
    in the kept Events' own metric, and the same Event is written after it."""
    emu = emulator.emulator
    emu.fail_next(1, code=500, method="POST", path_contains=EVENTS_PATH)
    recorder, metrics = make_recorder(kube_api, retry_backoff=FAST_RETRIES)
    async with draining(recorder):
        recorder.record_kept(kept_report(1))
        await eventually(lambda: kept_results(metrics).get("created") == 1)
    assert kept_results(metrics) == {"server_error": 1, "created": 1}
    assert results(metrics) == {}  # the delete Events' metric is not theirs
    [event] = emu.events.events(NS)
    assert (event["type"], event["reason"], event["action"]) == ("Warning", REASON_KEPT, "Keep")
    assert event["regarding"]["uid"] == "kept-1"
    assert "pod_running" in event["note"]
    posts = emu.audit_log(method="POST", path_contains=EVENTS_PATH)
    assert [p.status for p in posts] == [500, 201]


async def test_kept_events_wait_until_no_delete_event_does_and_have_their_own_bound(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    """Kept Events recorded first are still written after the delete Events recorded behind
    them, so a burst of kept pods never delays a delete's Event; beyond their own buffer they
    are dropped and counted apart, and the delete Events' buffer is untouched."""
    recorder, metrics = make_recorder(kube_api, kept_buffer_size=3)
    for i in range(5):
        recorder.record_kept(kept_report(i))
    for i in range(2):
        recorder.record(report(i))
    assert recorder.pending == 5
    async with draining(recorder):
        await eventually(lambda: recorder.pending == 0)
    assert results(metrics) == {"created": 2}
    assert kept_results(metrics) == {"created": 3, "dropped_buffer_full": 2}
    written = [e["regarding"]["uid"] for e in emulator.emulator.events.events(NS)]
    assert written == ["uid-0", "uid-1", "kept-0", "kept-1", "kept-2"]
