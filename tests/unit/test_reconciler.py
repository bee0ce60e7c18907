"""One key's reconcile, called directly, on in-memory fakes and virtual time.

Each safety test names the invariant (docs/architecture.md) it guards and fails when the
enforcing code goes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import anyio
import pytest
from msgspec import structs

from service.domain import (
    DeleteOutcome,
    DeleteResult,
    ExecutionChange,
    ExecutionState,
    Outcome,
    PodPhase,
    PodSnapshot,
    Verdict,
)
from service.engine.gates import DEPENDENCY_BACKOFF_INITIAL_S
from service.engine.results import Action
from service.kit import clock
from service.kit.errors import Unavailable
from service.kube.decode import PodDecodeError
from service.kube.errors import KubeApiError
from tests.fakes import (
    NAMESPACE,
    EngineRig,
    FakePodClient,
    clock_of,
    make_pending_pod,
    make_pod,
    make_rig,
    make_row,
    make_settings,
)
from tests.virtualtime import settle

T0 = 1000.0


def _rig(pods: FakePodClient | None = None, **settings: object) -> tuple[EngineRig, PodSnapshot]:
    rig = make_rig(make_settings(**settings), pods=pods)  # type: ignore[arg-type]
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    return rig, pod


async def _expire(rig: EngineRig, pod: PodSnapshot) -> None:
    """Observe ``pod`` once and let exactly the threshold pass."""
    first = await rig.reconcile(pod.key)
    assert first.outcome == Outcome.TOO_YOUNG
    await rig.advance(rig.settings.threshold_s)


# ------------------------------------------------------------- threshold


@pytest.mark.anyio
async def test_too_young_requeues_for_exactly_the_remaining_time_then_deletes() -> None:
    rig, pod = _rig()
    result = await rig.reconcile(pod.key)
    assert (result.action, result.outcome) == (Action.REQUEUE_AFTER, Outcome.TOO_YOUNG)
    assert result.requeue_after_s == 300.0
    await rig.advance(120)
    again = await rig.reconcile(pod.key)
    assert again.requeue_after_s == 180.0  # the clock kept running: same UID, same shape
    await rig.advance(179.5)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    assert rig.pods.deletes == []
    await rig.advance(0.5)
    done = await rig.reconcile(pod.key)
    assert (done.action, done.outcome) == (Action.DONE, Verdict.TERMINAL_RETIRED)
    assert [(d.uid, d.at_s) for d in rig.pods.deletes] == [(pod.uid, T0 + 300)]
    assert rig.outcome(Verdict.TERMINAL_RETIRED) == 1
    assert rig.outcome(Outcome.TOO_YOUNG) == 3
    assert len(rig.clocks) == 0  # a deleted pod's clock is dropped


@pytest.mark.anyio
async def test_invariant7_delete_preconditions_come_from_the_fresh_get() -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    await rig.reconcile(pod.key)
    [call] = rig.pods.deletes
    assert (call.namespace, call.name) == (pod.namespace, pod.name)
    assert (call.uid, call.resource_version) == (pod.uid, pod.resource_version)
    assert rig.pods.gets == [pod.key]
    assert (
        rig.sample(
            "retired_pod_gc_deletes_total", {"sandbox_namespace": NAMESPACE, "result": "deleted"}
        )
        == 1
    )


@pytest.mark.anyio
async def test_a_server_version_ahead_of_the_cache_waits_for_the_watch() -> None:
    rig, pod = _rig()
    # The server moved on (writes the watch has not delivered): what happened in between is
    # unknown, so nothing is sent until the cache has seen that version.
    ahead = structs.replace(pod, resource_version="105")
    rig.pods.pods[pod.key] = ahead
    await _expire(rig, pod)
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.CHANGED
    assert rig.pods.deletes == []
    rig.add(ahead)  # the MODIFIED event arrives, still reapable: the clock keeps running
    result = await rig.reconcile(pod.key)
    [call] = rig.pods.deletes
    assert (call.uid, call.resource_version) == (pod.uid, "105")


@pytest.mark.anyio
async def test_replaced_never_started_pod_is_reaped_with_its_own_verdict() -> None:
    rig = make_rig(make_settings())
    pod = make_pending_pod()
    rig.add(pod, make_row(pod, state=ExecutionState.REPLACED), event=False)
    await _expire(rig, pod)
    result = await rig.reconcile(pod.key)
    assert result.outcome == Verdict.REPLACED_NEVER_STARTED
    assert rig.outcome(Verdict.REPLACED_NEVER_STARTED) == 1
    assert rig.pods.deleted_keys == [pod.key]


# ------------------------------------------------------ invariants 1 and 2


@pytest.mark.anyio
@pytest.mark.parametrize("fresh", ["active", "no_row", "unknown_state", "inactive_active_state"])
async def test_invariant1_no_delete_when_the_final_re_read_is_not_retired(fresh: str) -> None:
    rig, pod = _rig()
    retired = make_row(pod)
    rig.store.batched_rows = {pod.key: retired}  # the batched lookup still says retired
    if fresh == "active":
        rig.store.put(make_row(pod, active=True, state=ExecutionState.ACTIVE))
    elif fresh == "no_row":
        del rig.store.rows[pod.key]
    elif fresh == "unknown_state":
        rig.store.put(make_row(pod, state=ExecutionState.UNKNOWN))
    else:
        rig.store.put(make_row(pod, state=ExecutionState.ACTIVE))
    await _expire(rig, pod)
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.CHANGED
    assert rig.pods.deletes == []
    assert clock_of(rig.clocks, pod.uid) is None
    assert rig.store.fresh_reads == 1


@pytest.mark.anyio
@pytest.mark.parametrize("change", ["running", "terminating", "recreated", "pending_with_ip"])
async def test_invariant2_no_delete_when_the_fresh_get_shows_a_live_or_other_pod(
    change: str,
) -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    server = {
        "running": structs.replace(pod, phase=PodPhase.RUNNING, all_containers_terminated=False),
        "terminating": structs.replace(pod, terminating=True),
        "recreated": structs.replace(pod, uid="uid-new", resource_version="900"),
        "pending_with_ip": structs.replace(
            pod, phase=PodPhase.PENDING, pod_ip="10.0.0.9", all_containers_terminated=False
        ),
    }[change]
    rig.pods.pods[pod.key] = server
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.CHANGED
    assert rig.pods.deletes == []
    assert rig.pods.pods[pod.key] == server  # the pod on the server survives


class _RecreatingPodClient(FakePodClient):
    """The pod is deleted and recreated under its name right after our fresh GET."""

    async def get_pod(self, namespace: str, name: str) -> PodSnapshot | None:
        pod = await super().get_pod(namespace, name)
        if pod is not None:
            self.pods[pod.key] = structs.replace(pod, uid="uid-new", resource_version="1")
        return pod


@pytest.mark.anyio
async def test_invariant2_uid_precondition_protects_a_pod_recreated_after_the_fresh_get() -> None:
    recreating = _RecreatingPodClient()  # the fake stands in for the API server
    rig, pod = _rig(recreating)
    await _expire(rig, pod)
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.CONFLICT
    assert result.action is Action.REQUEUE_AFTER
    [call] = recreating.deletes
    assert call.uid == pod.uid  # the observed UID, not the new pod's
    assert recreating.pods[pod.key].uid == "uid-new"  # the new pod survives
    assert rig.outcome(Outcome.CONFLICT) == 1
    assert (
        rig.sample(
            "retired_pod_gc_deletes_total", {"sandbox_namespace": NAMESPACE, "result": "conflict"}
        )
        == 1
    )


@pytest.mark.anyio
async def test_a_pod_recreated_under_the_same_name_starts_its_own_clock() -> None:
    rig, pod = _rig()
    await rig.reconcile(pod.key)
    await rig.advance(250)
    new = structs.replace(pod, uid="uid-new", resource_version="7")
    rig.add(new, event=False)  # the cache already shows the new pod (no event needed)
    await rig.advance(100)  # 350 s after the old UID was first seen
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.TOO_YOUNG
    assert result.requeue_after_s == 300.0
    assert clock_of(rig.clocks, pod.uid) is None
    assert rig.pods.deletes == []


# ------------------------------------------------------------ invariant 3


@pytest.mark.anyio
async def test_a_pod_that_stops_classifying_restarts_its_clock() -> None:
    rig, pod = _rig()
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    await rig.advance(100)
    rig.store.put(make_row(pod, active=True, state=ExecutionState.ACTIVE))  # no notification
    assert (await rig.reconcile(pod.key)).outcome == Outcome.SKIPPED
    rig.store.put(make_row(pod))  # retired again
    await rig.advance(100)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    await rig.advance(150)  # 350 s after first seen: beyond the original threshold
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.TOO_YOUNG
    assert result.requeue_after_s == 150.0  # restarted at 200 s, not 0 s
    assert rig.pods.deletes == []
    assert rig.sample("retired_pod_gc_skips_total", {"reason": "row_active"}) == 1


@pytest.mark.anyio
async def test_a_pod_that_fails_the_prefilter_restarts_its_clock_without_a_db_query() -> None:
    rig, pod = _rig()
    await rig.reconcile(pod.key)
    queries = rig.store.queries
    await rig.advance(200)
    rig.cache.put(structs.replace(pod, phase=PodPhase.RUNNING))
    assert (await rig.reconcile(pod.key)).outcome == Outcome.SKIPPED
    assert rig.store.queries == queries  # the prefilter decides without the database
    assert rig.sample("retired_pod_gc_skips_total", {"reason": "pod_running"}) == 1
    rig.cache.put(pod)
    await rig.advance(200)
    assert (await rig.reconcile(pod.key)).requeue_after_s == 300.0


@pytest.mark.anyio
async def test_a_changed_reapable_shape_restarts_the_clock() -> None:
    rig = make_rig(make_settings())
    pending = make_pending_pod()
    rig.add(pending, make_row(pending, state=ExecutionState.REPLACED), event=False)
    await rig.reconcile(pending.key)
    await rig.advance(200)
    failed = structs.replace(
        pending, phase=PodPhase.FAILED, all_containers_terminated=True, resource_version="2"
    )
    rig.add(failed, event=False)
    result = await rig.reconcile(pending.key)
    assert result.requeue_after_s == 300.0


@pytest.mark.anyio
async def test_a_failed_lookup_restarts_the_clock_and_holds_the_key_for_the_database() -> None:
    rig, pod = _rig()
    await rig.reconcile(pod.key)
    await rig.advance(200)
    rig.store.lookup_error = Unavailable("db down")
    failed = await rig.reconcile(pod.key)
    assert (failed.action, failed.outcome) == (
        Action.REQUEUE_AFTER,
        Outcome.LOOKUP_FAILED,
    )
    assert failed.held_by == "database"
    assert 0 < failed.requeue_after_s <= DEPENDENCY_BACKOFF_INITIAL_S
    assert clock_of(rig.clocks, pod.uid) is None
    # Held: until its next attempt time no lookup goes out, and the clock stays cleared.
    lookups = rig.store.lookups
    again = await rig.reconcile(pod.key)
    assert (again.outcome, again.held_by) == (Outcome.LOOKUP_FAILED, "database")
    assert rig.store.lookups == lookups
    assert clock_of(rig.clocks, pod.uid) is None
    rig.store.lookup_error = None
    await rig.advance(150)
    assert (await rig.reconcile(pod.key)).requeue_after_s == 300.0
    assert rig.outcome(Outcome.LOOKUP_FAILED) == 2


@pytest.mark.anyio
async def test_a_failed_fresh_re_read_restarts_the_clock_and_sends_nothing() -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    rig.store.fresh_error = Unavailable("statement timeout")
    result = await rig.reconcile(pod.key)
    assert (result.outcome, result.held_by) == (Outcome.LOOKUP_FAILED, "database")
    assert clock_of(rig.clocks, pod.uid) is None
    assert rig.pods.deletes == []


@pytest.mark.anyio
async def test_a_clearing_event_during_the_lookup_keeps_the_clock_from_starting() -> None:
    rig, pod = _rig()
    gate = anyio.Event()
    rig.store.lookup_gate = gate
    results = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            results.append(await rig.reconcile(pod.key))

        tg.start_soon(run)
        await settle()
        assert rig.store.lookups == 1  # the lookup is in flight
        # The row flips active (notification) while the lookup (old snapshot) is in flight.
        rig.controller.executions_changed(
            [ExecutionChange(pod.namespace, pod.name, active=True, state=ExecutionState.ACTIVE)]
        )
        gate.set()
    assert results[0].outcome == Outcome.CHANGED
    assert len(rig.clocks) == 0


@pytest.mark.anyio
async def test_a_clock_cleared_while_waiting_for_a_delete_token_prevents_the_delete() -> None:
    rig = make_rig(
        make_settings(deletes_per_minute=1),
        budget_window_s=10.0,  # a token wait within the reconciler's 15 s for a turn
    )
    first, second = make_pod("a"), make_pod("b")
    for p in (first, second):
        rig.add(p, make_row(p), event=False)
        await rig.reconcile(p.key)
    await rig.advance(300)
    assert (await rig.reconcile(first.key)).outcome == Verdict.TERMINAL_RETIRED
    results = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            results.append(await rig.reconcile(second.key))

        tg.start_soon(run)
        await settle()  # waiting for the budget (1 per 10 s)
        # The row flips active and back while we wait: the notification clears the clock.
        rig.controller.executions_changed(
            [
                ExecutionChange(
                    second.namespace, second.name, active=True, state=ExecutionState.ACTIVE
                )
            ]
        )
        await rig.advance(10)
    assert results[0].outcome == Outcome.CHANGED
    assert rig.pods.deleted_keys == [first.key]


# ------------------------------------------------------- delete outcomes


@pytest.mark.anyio
async def test_404_on_delete_is_benign_and_counted() -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    rig.pods.delete_script.append(DeleteOutcome(DeleteResult.GONE, 404, "not found"))
    result = await rig.reconcile(pod.key)
    assert (result.action, result.outcome) == (Action.DONE, Outcome.GONE)
    assert rig.outcome(Outcome.GONE) == 1
    assert rig.outcome(Verdict.TERMINAL_RETIRED) == 0
    assert (
        rig.sample(
            "retired_pod_gc_deletes_total", {"sandbox_namespace": NAMESPACE, "result": "gone"}
        )
        == 1
    )
    assert clock_of(rig.clocks, pod.uid) is None


@pytest.mark.anyio
async def test_409_on_delete_is_benign_counted_and_looked_at_again() -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    # A status update lands between our GET and our DELETE: the resourceVersion precondition fails.
    rig.pods.delete_script.append(DeleteOutcome(DeleteResult.CONFLICT, 409, "precondition"))
    result = await rig.reconcile(pod.key)
    assert (result.action, result.outcome) == (Action.REQUEUE_AFTER, Outcome.CONFLICT)
    assert result.requeue_after_s == 1.0
    assert rig.outcome(Outcome.CONFLICT) == 1
    assert clock_of(rig.clocks, pod.uid) is not None  # still the same pod, still reapable
    retry = await rig.reconcile(pod.key)
    assert retry.outcome == Verdict.TERMINAL_RETIRED
    assert len(rig.pods.deletes) == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    "failure", ["status_500", "status_429", "status_503_retry_after", "status_401", "unavailable"]
)
async def test_a_failed_delete_is_retried_with_its_clock_kept_and_verified_again(
    failure: str,
) -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    rig.pods.delete_script.append(
        {
            "status_500": KubeApiError(500, "boom"),
            "status_429": KubeApiError(429, "slow down", retry_after_s=7.0),
            "status_503_retry_after": KubeApiError(503, "shutting down", retry_after_s=2.0),
            "status_401": KubeApiError(401, "Unauthorized"),
            "unavailable": Unavailable("reset"),
        }[failure]
    )
    result = await rig.reconcile(pod.key)
    if failure == "status_429":
        # Throttled: after the Retry-After, not a failure of the reconcile.
        expected = (Action.REQUEUE_AFTER, Outcome.THROTTLED, 7.0)
    elif failure == "status_503_retry_after":
        expected = (Action.REQUEUE_AFTER, Outcome.THROTTLED, 2.0)
    elif failure == "status_401":
        # The credentials were read again by the API client: verified again at once.
        expected = (Action.REQUEUE_AFTER, Outcome.ERROR, 0.0)
    elif failure == "unavailable":
        # No answer: held for the API server with every other key, to its next attempt time.
        assert result.held_by == "api_server"
        assert 0 < result.requeue_after_s <= DEPENDENCY_BACKOFF_INITIAL_S
        expected = (Action.REQUEUE_AFTER, Outcome.ERROR, result.requeue_after_s)
    else:
        expected = (Action.BACKOFF, Outcome.ERROR, 0.0)
    assert (result.action, result.outcome, result.requeue_after_s) == expected
    throttled = failure in {"status_429", "status_503_retry_after"}
    assert result.failed is not throttled
    for label in ("error", "throttled"):
        assert rig.sample(
            "retired_pod_gc_deletes_total", {"sandbox_namespace": NAMESPACE, "result": label}
        ) == (1 if (label == "throttled") is throttled else 0)
    # The key is not lost: its clock runs on, and the retry verifies again before its DELETE.
    assert clock_of(rig.clocks, pod.uid) is not None
    await rig.advance(result.requeue_after_s if result.held_by else 0.0)
    gets = len(rig.pods.gets)
    retry = await rig.reconcile(pod.key)
    assert retry.outcome == Verdict.TERMINAL_RETIRED
    assert len(rig.pods.gets) == gets + 1
    assert len(rig.pods.deletes) == 2


@pytest.mark.anyio
async def test_a_failed_fresh_get_backs_off_and_sends_nothing() -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    rig.pods.get_error = Unavailable("connection reset")
    result = await rig.reconcile(pod.key)
    assert (result.outcome, result.held_by) == (Outcome.ERROR, "api_server")
    assert rig.pods.deletes == []
    assert clock_of(rig.clocks, pod.uid) is not None  # no answer says nothing about the pod
    rig.pods.get_error = None
    await rig.advance(result.requeue_after_s)
    assert (await rig.reconcile(pod.key)).outcome == Verdict.TERMINAL_RETIRED


@pytest.mark.anyio
async def test_an_undecodable_fresh_get_clears_the_clock_is_retried_and_never_deletes() -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    rig.pods.get_error = PodDecodeError("undecodable pod object: labels")
    result = await rig.reconcile(pod.key)
    assert (result.action, result.outcome) == (Action.BACKOFF, Outcome.ERROR)
    assert rig.pods.deletes == []
    assert rig.sample("retired_pod_gc_reconcile_bugs_total") == 0  # expected, not a bug
    # A gap in what is known of the pod: its continuous observation starts over.
    assert clock_of(rig.clocks, pod.uid) is None
    rig.pods.get_error = None
    again = await rig.reconcile(pod.key)
    assert (again.outcome, again.requeue_after_s) == (Outcome.TOO_YOUNG, 300.0)
    assert rig.pods.deletes == []


@pytest.mark.anyio
async def test_a_pod_gone_from_the_server_is_gone() -> None:
    rig, pod = _rig()
    await _expire(rig, pod)
    del rig.pods.pods[pod.key]
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.GONE
    assert rig.pods.deletes == []


# ----------------------------------------------------------- dry run, disabled


@pytest.mark.anyio
async def test_dry_run_verifies_but_never_deletes_and_reports_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="service.engine")  # the per-report line is debug
    rig, pod = _rig(dry_run=True, deletes_per_minute=1)
    await _expire(rig, pod)
    first = await rig.reconcile(pod.key)
    assert first.outcome == Verdict.TERMINAL_RETIRED
    assert rig.pods.gets == [pod.key] and rig.store.fresh_reads == 1  # it verified
    second = await rig.reconcile(pod.key)
    assert second.outcome == Outcome.ALREADY_REPORTED
    await rig.advance(3600)
    third = await rig.reconcile(pod.key)
    assert third.outcome == Outcome.ALREADY_REPORTED
    assert rig.pods.deletes == []
    assert rig.outcome(Verdict.TERMINAL_RETIRED, "dry_run") == 1
    assert rig.outcome(Outcome.ALREADY_REPORTED, "dry_run") == 2
    assert rig.outcome(Verdict.TERMINAL_RETIRED, "live") == 0
    reports = [r for r in caplog.records if "would reap" in r.getMessage()]
    assert len(reports) == 1
    assert rig.pods.gets == [pod.key]  # a reported UID costs no more API calls
    assert rig.budget.retry_after_s() == 0.0  # dry run spends no delete token (cap 1)


@pytest.mark.anyio
async def test_dry_run_reports_a_recreated_pod_again_as_a_new_uid() -> None:
    rig, pod = _rig(dry_run=True)
    await _expire(rig, pod)
    await rig.reconcile(pod.key)
    new = structs.replace(pod, uid="uid-2")
    rig.add(new, event=True)
    await _expire(rig, new)
    assert (await rig.reconcile(pod.key)).outcome == Verdict.TERMINAL_RETIRED
    assert rig.outcome(Verdict.TERMINAL_RETIRED, "dry_run") == 2


@pytest.mark.anyio
@pytest.mark.parametrize("dry_run", [False, True])
async def test_disabled_sends_nothing_and_reports_nothing(dry_run: bool) -> None:
    rig, pod = _rig(enabled=False, dry_run=dry_run)
    for _ in range(3):
        result = await rig.reconcile(pod.key)
        assert result.outcome is Outcome.INACTIVE
        await rig.advance(400)
    assert rig.pods.deletes == [] and rig.pods.gets == []
    assert rig.store.queries == 0
    for mode in ("live", "dry_run"):
        for verdict in Verdict:
            assert rig.outcome(verdict, mode) == 0


@pytest.mark.anyio
async def test_leadership_lost_during_the_token_wait_sends_nothing() -> None:
    rig = make_rig(
        make_settings(deletes_per_minute=1),
        budget_window_s=10.0,  # a token wait within the reconciler's 15 s for a turn
    )
    first, second = make_pod("a"), make_pod("b")
    for p in (first, second):
        rig.add(p, make_row(p), event=False)
        await rig.reconcile(p.key)
    await rig.advance(300)
    await rig.reconcile(first.key)
    results = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            results.append(await rig.reconcile(second.key))

        tg.start_soon(run)
        await settle()
        rig.controller.set_leader(False)
        await rig.advance(10)
    assert results[0].outcome in (Outcome.INACTIVE, Outcome.CHANGED)
    assert rig.pods.deleted_keys == [first.key]


@pytest.mark.anyio
async def test_a_lapsed_lease_stops_the_delete_even_before_the_leadership_callback() -> None:
    leading = [True]
    rig = make_rig(
        make_settings(deletes_per_minute=1),
        budget_window_s=10.0,  # a token wait within the reconciler's 15 s for a turn
        leader_check=lambda: leading[0],
    )
    first, second = make_pod("a"), make_pod("b")
    for p in (first, second):
        rig.add(p, make_row(p), event=False)
        await rig.reconcile(p.key)
    await rig.advance(300)
    await rig.reconcile(first.key)
    results = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            results.append(await rig.reconcile(second.key))

        tg.start_soon(run)
        await settle()
        leading[0] = False  # the renew deadline passed; on_change(False) has not run yet
        await rig.advance(10)
    assert results[0].outcome is Outcome.INACTIVE
    assert rig.pods.deleted_keys == [first.key]
    assert len(rig.clocks) == 2 - 1  # clocks untouched: only the live check stopped it


@pytest.mark.anyio
async def test_an_exhausted_budget_throttles_and_requeues_for_when_a_token_frees() -> None:
    rig = make_rig(make_settings(deletes_per_minute=1))
    first, second = make_pod("a"), make_pod("b")
    for p in (first, second):
        rig.add(p, make_row(p), event=False)
        await rig.reconcile(p.key)
    await rig.advance(300)
    await rig.reconcile(first.key)
    await rig.advance(20)
    # The token frees 60 s after the first grant; the reconciler waits for a turn a third of
    # its 45 s timeout (15 s), gives up, and asks to come back when the token frees.
    result = await rig.reconcile(second.key)
    assert (result.action, result.outcome) == (Action.REQUEUE_AFTER, Outcome.THROTTLED)
    assert clock.now() == rig.pods.deletes[0].at_s + 20 + 15
    assert result.requeue_after_s == 60.0 - 20 - 15
    assert rig.pods.deleted_keys == [first.key]


# ----------------------------------------------------------- odd inputs


@pytest.mark.anyio
@pytest.mark.parametrize("key", ["no-slash", "a/b/c", "/x", "ns/", ""])
async def test_a_malformed_key_is_dropped_without_raising(key: str) -> None:
    rig, _ = _rig()
    result = await rig.reconcile(key)
    assert (result.action, result.outcome) == (Action.DONE, Outcome.ERROR)


@pytest.mark.anyio
async def test_a_pod_missing_from_the_cache_is_gone_and_its_clock_cleared() -> None:
    rig, pod = _rig()
    await rig.reconcile(pod.key)
    rig.cache.remove(pod.key)
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.GONE
    assert len(rig.clocks) == 0


@pytest.mark.anyio
async def test_every_log_line_of_one_reconcile_carries_its_reconcile_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    rig, pod = _rig()
    rig.store.fresh_read_log = "store: re-read of %s"  # a line logged by another module
    await _expire(rig, pod)
    first = [r for r in caplog.records if r.name.startswith(("service.", "tests."))]
    caplog.clear()
    result = await rig.reconcile(pod.key)
    assert result.outcome == Verdict.TERMINAL_RETIRED
    records = [r for r in caplog.records if r.name.startswith(("service.", "tests."))]
    assert {r.name for r in records} >= {"service.engine.reconciler", "tests.fakes"}
    ids = {getattr(r, "reconcile_id", None) for r in records}
    assert len(ids) == 1 and None not in ids  # one id on every line, whichever module logs
    assert ids.isdisjoint(getattr(r, "reconcile_id", None) for r in first)  # a new one
    caplog.clear()
    logging.getLogger("service.test").info("outside any reconcile")
    assert not hasattr(caplog.records[0], "reconcile_id")


@pytest.mark.anyio
async def test_each_key_of_a_batch_has_one_reconcile_id_from_observation_to_delete(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    rig = make_rig(make_settings())
    pods = [make_pod("sbx1"), make_pod("sbx2")]
    for pod in pods:
        rig.add(pod, make_row(pod), event=False)
    rig.store.fresh_read_log = "store: re-read of %s"  # a line logged by another module
    keys = [pod.key for pod in pods]
    first = await rig.reconcile_batch(keys)
    assert {r.outcome for r in first.values()} == {Outcome.TOO_YOUNG}
    await rig.advance(rig.settings.threshold_s)
    caplog.clear()
    results = await rig.reconcile_batch(keys)
    assert [results[key].outcome for key in keys] == [Verdict.TERMINAL_RETIRED] * 2
    ids: dict[str, set[str | None]] = {}
    batches: set[str | None] = set()
    for key in keys:
        lines = [
            r
            for r in caplog.records
            if getattr(r, "key", None) == key or (r.name == "tests.fakes" and key in r.getMessage())
        ]
        messages = [r.getMessage() for r in lines]
        assert any(m.startswith("reapable") for m in messages), messages  # observation
        assert any(m.startswith("store: re-read") for m in messages), messages  # verification
        assert any(m.startswith("deleted ") for m in messages), messages  # the DELETE
        ids[key] = {getattr(r, "reconcile_id", None) for r in lines}
        batches |= {getattr(r, "batch_id", None) for r in lines}
        assert len(ids[key]) == 1 and None not in ids[key], ids  # one id, on every line
    assert ids[keys[0]].isdisjoint(ids[keys[1]])  # two keys of one batch: two ids
    assert len(batches) == 1 and None not in batches  # the batch id travels beside them


# ------------------------------------------------------- notification barrier


class _Barrier:
    """A notification barrier whose sync can fail, or deliver a late notification first."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False
        self.deliver: Callable[[], None] | None = None

    async def sync(self) -> None:
        self.calls += 1
        if self.deliver is not None:
            self.deliver()
        if self.fail:
            raise Unavailable("listener stalled")


@pytest.mark.anyio
@pytest.mark.parametrize("dry_run", [False, True])
async def test_no_delete_or_report_when_notifications_cannot_be_synced(dry_run: bool) -> None:
    barrier = _Barrier()
    barrier.fail = True
    rig = make_rig(make_settings(dry_run=dry_run), barrier=barrier)
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    await _expire(rig, pod)
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.LOOKUP_FAILED
    assert barrier.calls == 1
    assert rig.pods.deletes == []
    assert rig.outcome(Verdict.TERMINAL_RETIRED) == 0
    assert clock_of(rig.clocks, pod.uid) is None  # a gap in what we know restarts the clock


@pytest.mark.anyio
async def test_a_flip_still_in_flight_at_the_final_check_stops_the_delete() -> None:
    barrier = _Barrier()
    rig = make_rig(make_settings(), barrier=barrier)
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    await _expire(rig, pod)
    # The row was re-activated and retired again; the re-read already shows "retired" but the
    # re-activation's notification is only handed over by the sync.
    barrier.deliver = lambda: rig.controller.executions_changed(
        [
            ExecutionChange(
                namespace=pod.namespace, pod_name=pod.name, active=True, state=ExecutionState.ACTIVE
            )
        ]
    )
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.CHANGED
    assert rig.pods.deletes == []


@pytest.mark.anyio
async def test_delete_tokens_are_spent_on_verified_candidates_only() -> None:
    rig, pod = _rig(deletes_per_minute=1)
    await _expire(rig, pod)
    # The server already has the pod Running again (the watch has not delivered it yet).
    rig.pods.pods[pod.key] = structs.replace(pod, phase=PodPhase.RUNNING, resource_version="7")
    result = await rig.reconcile(pod.key)
    assert result.outcome == Outcome.CHANGED
    assert rig.pods.deletes == []
    assert rig.budget.retry_after_s() == 0.0  # the one token of the window is unspent


class _SlotRecordingPodClient(FakePodClient):
    """Records whether the API client's request slot is held at each GET and at the DELETE."""

    def __init__(self, pods: list[PodSnapshot]) -> None:
        super().__init__(pods)
        self.held = False
        self.entered = 0
        self.held_at: list[tuple[str, bool]] = []

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        self.entered += 1
        self.held = True
        try:
            yield
        finally:
            self.held = False

    def delete_slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._slot()

    async def get_pod(self, namespace: str, name: str) -> PodSnapshot | None:
        self.held_at.append(("GET", self.held))
        return await super().get_pod(namespace, name)

    async def delete_pod(
        self, namespace: str, name: str, *, uid: str, resource_version: str
    ) -> DeleteOutcome:
        self.held_at.append(("DELETE", self.held))
        return await super().delete_pod(namespace, name, uid=uid, resource_version=resource_version)


@pytest.mark.anyio
async def test_the_request_slot_is_held_from_the_final_check_through_the_delete() -> None:
    recording = _SlotRecordingPodClient([])  # the fake stands in for the API server
    rig, pod = _rig(recording)
    await _expire(rig, pod)
    result = await rig.reconcile(pod.key)
    assert result.outcome == Verdict.TERMINAL_RETIRED
    # The verification's GET takes a slot of its own (not held); the DELETE is sent in the
    # slot taken before the final check, once.
    assert recording.held_at == [("GET", False), ("DELETE", True)]
    assert recording.entered == 1
    assert not recording.held
