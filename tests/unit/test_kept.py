"""Retired but kept (service/engine/kept/): which retired pods are kept, why and since when, fed
by notifications, the cache and the sweep; on fakes and virtual time."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import anyio
import pytest
from msgspec import structs

from service.app.pending import kept_lines, kept_section
from service.domain import (
    ConditionStatus,
    ExecutionChange,
    ExecutionRow,
    ExecutionState,
    PodPhase,
    PodSnapshot,
    SkipReason,
    split_key,
)
from service.engine.activation import Activation
from service.engine.kept.events import EVENT_INTERVAL_S
from service.engine.kept.model import Since
from service.engine.kept.view import KeptPods
from service.kit import clock
from service.kit.errors import Unavailable
from service.kube.events import event_body
from service.metrics import KEPT_REASONS, KeptMetrics
from service.ports import KeptReport, RetiredRow
from tests.fakes import NAMESPACE, FakePodCache, make_pod, make_row
from tests.virtualtime import advance, settle

pytestmark = pytest.mark.anyio

WALL = 1.8e9
"""The fake wall clock's reading at the loop's START_S."""


class FakeRetiredRows:
    """``ports.RetiredRowSource`` as the SQL answers: only inactive rows of the namespace."""

    def __init__(self) -> None:
        self.rows: dict[str, RetiredRow] = {}
        self.queries: list[tuple[str, str, int]] = []
        """(kind, namespace, how many names) of each query."""
        self.gate: anyio.Event | None = None
        self.error: Exception | None = None

    def put(self, row: ExecutionRow, retired_at_s: float | None = None) -> None:
        self.rows[row.key] = RetiredRow(row, retired_at_s)

    async def retired_rows(
        self, namespace: str, names: Sequence[str], *, kind: str
    ) -> dict[str, RetiredRow]:
        self.queries.append((kind, namespace, len(names)))
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        out = {}
        for name in names:
            found = self.rows.get(f"{namespace}/{name}")
            if found is not None and not found.row.active:
                out[found.row.key] = found
        return out


class Recorder:
    def __init__(self) -> None:
        self.reports: list[KeptReport] = []

    def record_kept(self, report: KeptReport) -> None:
        self.reports.append(report)


def running(sandbox_id: str = "sbx1", **kw: object) -> PodSnapshot:
    return structs.replace(
        make_pod(sandbox_id, phase=PodPhase.RUNNING, all_containers_terminated=False), **kw
    )


class Rig:
    def __init__(self, *pods: PodSnapshot, bound_s: float = 60.0, period_s: float = 600.0):
        self.cache = FakePodCache(pods)
        self.rows = FakeRetiredRows()
        self.metrics = KeptMetrics()
        self.activation = Activation(enabled=True)
        self.activation.set_leader(True)
        self.recorder = Recorder()
        self.kept = KeptPods(
            cache=self.cache,
            rows=self.rows,
            namespaces=(NAMESPACE,),
            activation=self.activation,
            metrics=self.metrics,
            period_s=period_s,
            bound_s=bound_s,
            recorder=self.recorder,
            wall_clock=lambda: WALL + clock.now(),
        )

    def gauge(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "retired_pod_gc_retired_kept_pods", {"reason": reason}
        )
        assert value is not None
        return value

    def oldest(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "retired_pod_gc_retired_kept_oldest_seconds", {"reason": reason}
        )
        assert value is not None
        return value

    def notify(self, pod: PodSnapshot, *, active: bool | None, deleted: bool = False) -> None:
        state = ExecutionState.ACTIVE if active else ExecutionState.SUSPENDED
        self.kept.executions_changed(
            [
                ExecutionChange(
                    pod.namespace,
                    pod.name,
                    active=active,
                    state=state,
                    deleted=deleted,
                    received_at_s=clock.now(),
                )
            ]
        )

    def change(self, new: PodSnapshot) -> None:
        old = self.cache.put(new)
        self.kept.pod_changed(old, new)


def retire(rig: Rig, pod: PodSnapshot, *, state: ExecutionState = ExecutionState.SUSPENDED) -> None:
    rig.rows.put(make_row(pod, state=state))


async def test_every_reason_label_set_is_at_zero_before_anything() -> None:
    rig = Rig()
    for reason in KEPT_REASONS:
        assert rig.gauge(reason) == 0
        assert rig.oldest(reason) == 0
    assert "no_row" not in KEPT_REASONS and "row_active" not in KEPT_REASONS


async def test_a_retirement_notification_reports_a_running_pod_after_one_query() -> None:
    pod = running()
    rig = Rig(pod)
    retire(rig, pod)
    notified_at = clock.now()
    rig.notify(pod, active=False)
    assert await rig.kept.confirm()
    assert len(rig.rows.queries) == 1
    kept = rig.kept.get(pod.key)
    assert kept is not None
    assert kept.reason is SkipReason.POD_RUNNING
    assert kept.severity == "warning"
    assert kept.row_state is ExecutionState.SUSPENDED
    assert (kept.since_s, kept.source) == (notified_at, Since.NOTIFICATION)
    assert rig.gauge("pod_running") == 1


async def test_a_reactivation_notification_removes_the_pod_at_once_without_a_query() -> None:
    pod = running()
    rig = Rig(pod)
    retire(rig, pod)
    rig.notify(pod, active=False)
    await rig.kept.confirm()
    assert rig.gauge("pod_running") == 1
    rig.notify(pod, active=True)
    assert rig.kept.get(pod.key) is None
    assert rig.gauge("pod_running") == 0
    assert len(rig.rows.queries) == 1


async def test_a_notification_for_a_row_the_query_finds_active_reports_nothing() -> None:
    pod = running()
    rig = Rig(pod)
    rig.rows.put(make_row(pod, active=True, state=ExecutionState.ACTIVE))
    rig.notify(pod, active=False)  # the notification says inactive; the row says otherwise
    await rig.kept.confirm()
    assert len(rig.kept) == 0


async def test_the_sweep_finds_a_retirement_whose_notification_was_lost() -> None:
    pods = [running(f"s{i}") for i in range(1000)]
    rig = Rig(*pods)
    lost = pods[7]
    rig.rows.put(make_row(lost), retired_at_s=WALL + clock.now() - 120)
    active = pods[8]
    rig.rows.put(make_row(active, active=True, state=ExecutionState.ACTIVE))
    assert await rig.kept.sweep(NAMESPACE)
    assert rig.rows.queries == [("kept_sweep", NAMESPACE, 1000)]  # one query, whatever the cache
    kept = rig.kept.get(lost.key)
    assert kept is not None and kept.source is Since.RETIRED_AT
    assert kept.since_s == pytest.approx(clock.now() - 120)
    assert [k.key for k in rig.kept.kept()] == [lost.key]
    await rig.kept.tick()
    assert rig.oldest("pod_running") == pytest.approx(120)


async def test_the_sweep_forgets_a_row_reactivated_without_a_notification() -> None:
    pod = running()
    rig = Rig(pod)
    retire(rig, pod)
    await rig.kept.sweep(NAMESPACE)
    assert rig.gauge("pod_running") == 1
    rig.rows.put(make_row(pod, active=True, state=ExecutionState.ACTIVE))
    await rig.kept.sweep(NAMESPACE)
    assert rig.gauge("pod_running") == 0 and len(rig.kept) == 0


async def test_the_classifier_decides_the_reason_and_a_reapable_pod_is_not_kept() -> None:
    terminal = make_pod("term")  # Succeeded, every container terminated: reapable, not kept
    with_ip = make_pod(
        "ip", phase=PodPhase.PENDING, pod_ip="10.0.0.1", all_containers_terminated=False
    )
    half_stopped = make_pod("half", phase=PodPhase.FAILED, all_containers_terminated=False)
    kept_one = structs.replace(running("keep"), keep=True)
    rig = Rig(terminal, with_ip, half_stopped, kept_one)
    for pod in (terminal, with_ip, half_stopped, kept_one):
        retire(rig, pod, state=ExecutionState.REPLACED)
    await rig.kept.sweep(NAMESPACE)
    reasons = {k.key: (k.reason, k.severity) for k in rig.kept.kept()}
    assert reasons == {
        with_ip.key: (SkipReason.PENDING_WITH_IP, "warning"),
        half_stopped.key: (SkipReason.TERMINAL_CONTAINER_NOT_TERMINATED, "warning"),
        kept_one.key: (SkipReason.KEEP_ANNOTATION, "info"),
    }
    assert rig.gauge("keep_annotation") == 1


async def test_a_pod_change_reclassifies_without_a_query() -> None:
    pod = running()
    rig = Rig(pod)
    retire(rig, pod)
    await rig.kept.sweep(NAMESPACE)
    queries = len(rig.rows.queries)
    rig.change(
        structs.replace(pod, phase=PodPhase.SUCCEEDED, all_containers_terminated=True)
    )  # now reapable: the controller's, not a leak
    assert len(rig.kept) == 0 and rig.gauge("pod_running") == 0
    rig.change(structs.replace(pod, phase=PodPhase.FAILED, all_containers_terminated=False))
    kept = rig.kept.get(pod.key)
    assert kept is not None and kept.reason is SkipReason.TERMINAL_CONTAINER_NOT_TERMINATED
    rig.cache.remove(pod.key)
    rig.kept.pod_changed(pod, None)
    assert len(rig.kept) == 0
    assert len(rig.rows.queries) == queries


async def test_a_reactivation_while_a_sweep_is_in_flight_wins() -> None:
    pod = running()
    rig = Rig(pod)
    retire(rig, pod)
    rig.rows.gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.kept.sweep, NAMESPACE)
        await settle()
        rig.notify(pod, active=True)  # committed after the sweep's snapshot
        rig.rows.gate.set()
    assert len(rig.kept) == 0


async def test_a_pending_pod_without_the_condition_is_kept_with_the_classifiers_reason() -> None:
    pod = make_pod(
        "p",
        phase=PodPhase.PENDING,
        ready_to_start=ConditionStatus.ABSENT,
        all_containers_terminated=False,
    )
    rig = Rig(pod)
    retire(rig, pod, state=ExecutionState.REPLACED)
    await rig.kept.sweep(NAMESPACE)
    kept = rig.kept.get(pod.key)
    assert kept is not None and kept.reason is SkipReason.PENDING_WITHOUT_CONDITION
    assert kept.severity == "none"


async def test_one_event_after_the_bound_then_none_for_a_day() -> None:
    pod = running()
    rig = Rig(pod, bound_s=60)
    retire(rig, pod)
    rig.notify(pod, active=False)
    await rig.kept.confirm()
    await rig.kept.tick()
    assert rig.recorder.reports == []  # not kept for the bound yet
    await anyio.sleep(61)
    await rig.kept.tick()
    assert len(rig.recorder.reports) == 1
    report = rig.recorder.reports[0]
    assert (report.reason, report.row_state, report.since_source) == (
        "pod_running",
        ExecutionState.SUSPENDED,
        "notification",
    )
    assert report.kept_for_s >= 60
    for _ in range(10):
        await anyio.sleep(600)
        await rig.kept.tick()
    assert len(rig.recorder.reports) == 1
    await anyio.sleep(EVENT_INTERVAL_S)
    await rig.kept.tick()
    assert len(rig.recorder.reports) == 2


async def test_no_event_for_a_row_found_active_when_read_again() -> None:
    pod = running()
    rig = Rig(pod, bound_s=60)
    retire(rig, pod)
    await rig.kept.sweep(NAMESPACE)
    rig.rows.put(make_row(pod, active=True, state=ExecutionState.ACTIVE))  # notification lost
    await anyio.sleep(61)
    await rig.kept.tick()
    assert rig.recorder.reports == []
    assert len(rig.kept) == 0


async def test_a_failed_query_changes_nothing_and_the_suspect_waits() -> None:
    pod = running()
    rig = Rig(pod)
    retire(rig, pod)
    rig.rows.error = Unavailable("down")
    rig.notify(pod, active=False)
    assert not await rig.kept.confirm()
    assert not await rig.kept.sweep(NAMESPACE)
    assert len(rig.kept) == 0
    rig.rows.error = None
    assert await rig.kept.confirm()
    assert rig.kept.get(pod.key) is not None


async def test_a_replica_that_is_not_the_leader_reports_nothing_and_one_that_loses_clears() -> None:
    pod = running()
    rig = Rig(pod)
    retire(rig, pod)
    await rig.kept.sweep(NAMESPACE)
    await rig.kept.tick()
    assert rig.gauge("pod_running") == 1
    rig.activation.set_leader(False)
    await rig.kept.tick()
    assert rig.gauge("pod_running") == 0 and len(rig.kept) == 0
    rig.notify(pod, active=False)
    assert await rig.kept.confirm()
    assert len(rig.kept) == 0


async def test_run_sweeps_once_a_period_a_namespace_and_confirms_notifications() -> None:
    pods = [running(f"s{i}") for i in range(50)]
    rig = Rig(*pods, period_s=60)
    async with anyio.create_task_group() as tg:
        await tg.start(rig.kept.run)
        await advance(1)
        assert [q[0] for q in rig.rows.queries] == ["kept_sweep"]  # once the cache is synced
        retire(rig, pods[3])
        rig.notify(pods[3], active=False)
        await advance(1)
        assert rig.kept.get(pods[3].key) is not None
        assert [q[0] for q in rig.rows.queries] == ["kept_sweep", "kept_confirm"]
        await advance(600)
        kinds = [q[0] for q in rig.rows.queries]
        assert kinds.count("kept_sweep") == 1 + 10  # one a period, whatever the cache size
        assert kinds.count("kept_event") == 1  # the re-read before its one Event
        assert len(rig.recorder.reports) == 1
        tg.cancel_scope.cancel()
    assert {split_key(k.key)[1] for k in rig.kept.kept()} == {pods[3].name}


async def test_two_queries_in_flight_finishing_out_of_order_each_see_their_notifications() -> None:
    # (found by the simulator: the queries' sets of notified keys were told apart by value)
    first, second = running("a"), running("b")
    rig = Rig(first, second)
    retire(rig, first)
    retire(rig, second)
    gates = [anyio.Event(), anyio.Event()]
    calls = 0
    answer = rig.rows.retired_rows

    async def gated(namespace: str, names: Sequence[str], *, kind: str) -> dict[str, RetiredRow]:
        nonlocal calls
        gate = gates[calls]
        calls += 1
        await gate.wait()
        return await answer(namespace, names, kind=kind)

    rig.rows.retired_rows = gated  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.kept.sweep, NAMESPACE)
        await settle()
        tg.start_soon(rig.kept.sweep, NAMESPACE)
        await settle()
        gates[1].set()  # the second query answers first
        await settle()
        rig.notify(first, active=True)  # while the first is still in flight
        gates[0].set()
    assert [k.key for k in rig.kept.kept()] == [second.key]


async def test_the_pending_section_lists_the_longest_kept_first_and_the_table_shows_it() -> None:
    older, newer, active = running("old"), running("new"), running("act")
    rig = Rig(older, newer, active)
    rig.rows.put(make_row(older), retired_at_s=WALL + clock.now() - 600)
    rig.rows.put(make_row(newer), retired_at_s=WALL + clock.now() - 60)
    rig.rows.put(make_row(active, active=True, state=ExecutionState.ACTIVE))
    await rig.kept.sweep(NAMESPACE)
    section = kept_section(rig.kept, now_s=clock.now(), wall_offset_s=WALL)
    assert section["count"] == 2 and section["by_reason"] == {"pod_running": 2}
    assert [p["key"] for p in section["pods"]] == [older.key, newer.key]
    first = section["pods"][0]
    assert (first["reason"], first["severity"], first["row_state"]) == (
        "pod_running",
        "warning",
        "suspended",
    )
    assert first["since_source"] == "retired_at" and first["kept_for_s"] == pytest.approx(600)
    assert datetime.fromisoformat(first["since"]).timestamp() == pytest.approx(
        WALL + clock.now() - 600
    )
    one = kept_section(rig.kept, now_s=clock.now(), wall_offset_s=WALL, key=newer.key)
    assert [p["key"] for p in one["pods"]] == [newer.key]
    assert kept_section(rig.kept, now_s=0, wall_offset_s=0, key=active.key)["pods"] == []
    lines = kept_lines(section)
    assert lines[0].startswith("retired but kept: 2 pods")
    assert lines[1].split()[:3] == ["KEY", "REASON", "SEVERITY"]
    assert lines[2].split()[:3] == [older.key, "pod_running", "warning"]
    assert kept_lines(None) == []


def test_the_event_is_a_warning_naming_the_reason_the_state_and_since_when() -> None:
    pod = running()
    report = KeptReport(
        pod=pod,
        reason="pod_running",
        rule="Running pods may hold a live VM",
        row_state=ExecutionState.SUSPENDED,
        since_s=1.8e9,
        since_source="retired_at",
        kept_for_s=1900.0,
    )
    body = event_body(report, instance="gc-0", at_s=1.8e9 + 1900)
    assert (body["type"], body["reason"], body["action"]) == ("Warning", "RetiredPodKept", "Keep")
    assert body["regarding"]["uid"] == pod.uid and body["regarding"]["name"] == pod.name
    note = body["note"]
    assert "pod_running" in note and "(suspended, inactive)" in note
    assert "since 2027-01-15T08:00:00.000000Z (retired_at)" in note
    assert "Kept for 1900s" in note
