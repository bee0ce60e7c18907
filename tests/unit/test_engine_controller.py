"""The event side and the worker loop: events in, reconciles out, on fakes and virtual time."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

import anyio
import pytest
from msgspec import structs

from service import config
from service.domain import (
    ExecutionChange,
    ExecutionRow,
    ExecutionState,
    Outcome,
    PodPhase,
    PodSnapshot,
    Verdict,
    Waiting,
)
from service.engine.observation import ObservationClocks
from service.engine.results import Action
from service.kit import clock
from service.pg.errors import DatabaseError
from tests.fakes import (
    NAMESPACE,
    EngineRig,
    FakePodCache,
    clock_of,
    make_pod,
    make_rig,
    make_row,
    make_settings,
    take_ready,
)
from tests.virtualtime import settle

T0 = 1000.0


def _retired(rig: EngineRig, pods: Iterable[PodSnapshot]) -> None:
    for pod in pods:
        rig.add(pod, make_row(pod))


def _change(pod: PodSnapshot, *, active: bool, state: ExecutionState) -> ExecutionChange:
    return ExecutionChange(pod.namespace, pod.name, active=active, state=state)


async def _observed_for_100s(rig: EngineRig, pod: PodSnapshot, row: ExecutionRow) -> None:
    """``pod`` and its ``row`` reconciled once (the clock starts), then 100 s pass."""
    rig.add(pod, row, event=False)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    await rig.advance(100)


async def _assert_clock_restarted(rig: EngineRig, pod: PodSnapshot) -> None:
    """300 s after the first observation the reconcile still waits a whole threshold."""
    await rig.advance(200)
    result = await rig.reconcile(pod.key)
    assert (result.outcome, result.requeue_after_s) == (Outcome.TOO_YOUNG, 300.0)
    assert rig.pods.deletes == []


# ------------------------------------------------------------------ threshold


@pytest.mark.anyio
async def test_deletes_only_after_the_threshold_with_uid_and_rv_preconditions() -> None:
    rig = make_rig(make_settings(threshold_s=300))
    pod = make_pod()
    async with rig.workers():
        rig.add(pod, make_row(pod))  # the watch event enqueues it at once
        await settle()
        assert rig.outcome(Outcome.TOO_YOUNG) == 1
        assert rig.queue.delayed == 1  # requeued: the delete below comes at exactly the expiry
        rig.add(structs.replace(pod, resource_version="131"))  # a reapable-shape status write
        await rig.advance(299.5)
        assert rig.pods.deletes == []
        await rig.advance(0.5)
        assert len(rig.pods.deletes) == 1
        call = rig.pods.deletes[0]
        assert call.at_s == T0 + 300  # the moment the clock expired, not on a tick
        assert (call.uid, call.resource_version) == (pod.uid, "131")
        queries = rig.store.queries
        await rig.advance(10_000)  # idle: no polling, no row queries
        assert rig.store.queries == queries
    assert rig.outcome(Verdict.TERMINAL_RETIRED) == 1
    assert rig.outcome(Outcome.TOO_YOUNG) == 2  # the add, and the status write


@pytest.mark.anyio
async def test_pods_failing_the_prefilter_are_not_enqueued_but_clear_their_clock() -> None:
    rig = make_rig()
    pod = make_pod()
    rig.add(pod, make_row(pod))
    assert len(rig.queue) == 1
    assert await take_ready(rig.queue) == [pod.key]
    await rig.reconcile(pod.key)
    assert clock_of(rig.clocks, pod.uid) is not None
    running_pod = structs.replace(pod, phase=PodPhase.RUNNING, resource_version="2")
    rig.add(running_pod)
    assert clock_of(rig.clocks, pod.uid) is None
    assert len(rig.queue) == 0


# ------------------------------------------------------------ invariant 3


@pytest.mark.anyio
@pytest.mark.parametrize(
    "flip",
    [
        _change(make_pod(), active=True, state=ExecutionState.ACTIVE),
        _change(make_pod(), active=False, state=ExecutionState.UNKNOWN),
        ExecutionChange("sandboxes", make_pod().name, active=None, state=None, deleted=True),
    ],
    ids=["reactivated", "unknown_state", "row_deleted"],
)
async def test_a_row_flipping_and_back_between_two_reconciles_restarts_the_clock(
    flip: ExecutionChange,
) -> None:
    rig = make_rig()
    pod = make_pod()
    await _observed_for_100s(rig, pod, make_row(pod))
    # Between two reconciles the row flips and flips back; only notifications see it.
    rig.controller.executions_changed([flip])
    rig.controller.executions_changed([_change(pod, active=False, state=ExecutionState.SUSPENDED)])
    await _assert_clock_restarted(rig, pod)


@pytest.mark.anyio
async def test_a_pod_leaving_the_shape_and_back_between_two_reconciles_restarts_the_clock() -> None:
    rig = make_rig()
    pod = make_pod()
    await _observed_for_100s(rig, pod, make_row(pod))
    terminating = structs.replace(pod, terminating=True, resource_version="2")
    rig.controller.pod_changed(pod, terminating)
    rig.controller.pod_changed(terminating, pod)  # (an impossible flip back, for the test)
    await _assert_clock_restarted(rig, pod)


@pytest.mark.anyio
async def test_a_pod_state_not_reapable_only_with_its_row_restarts_the_clock() -> None:
    # Chaos seed 53: Succeeded (reapable with a `suspended` row) → Pending with no IP and the
    # condition False (passes the pod-only prefilter, but with `suspended` it is no reap) →
    # Succeeded again, all before the next reconcile, which sees only the last state.
    rig = make_rig()
    pod = make_pod()
    await _observed_for_100s(rig, pod, make_row(pod))
    pending = make_pod(
        uid=pod.uid,
        phase=PodPhase.PENDING,
        resource_version="2",
        container_count=0,
        all_containers_terminated=False,
    )
    rig.controller.pod_changed(pod, pending)
    rig.add(structs.replace(pod, resource_version="3"))
    await _assert_clock_restarted(rig, pod)


@pytest.mark.anyio
async def test_a_status_write_that_changes_nothing_classification_reads_keeps_the_clock() -> None:
    rig = make_rig()
    pod = make_pod()
    await _observed_for_100s(rig, pod, make_row(pod))
    rig.add(structs.replace(pod, resource_version="2"))
    assert rig.clocks.elapsed(pod.uid, clock.now()) == 100


@pytest.mark.anyio
async def test_a_row_moving_between_retired_states_restarts_the_clock() -> None:
    # A Pending never-started pod is reapable only while its row is retired as `replaced`:
    # `replaced` → `suspended` → `replaced` between two reconciles must not go unseen.
    rig = make_rig()
    pod = make_pod(phase=PodPhase.PENDING, container_count=0, all_containers_terminated=False)
    await _observed_for_100s(rig, pod, make_row(pod, state=ExecutionState.REPLACED))
    rig.controller.executions_changed([_change(pod, active=False, state=ExecutionState.SUSPENDED)])
    rig.controller.executions_changed([_change(pod, active=False, state=ExecutionState.REPLACED)])
    await _assert_clock_restarted(rig, pod)


@pytest.mark.anyio
async def test_a_new_uid_event_clears_the_old_clock() -> None:
    rig = make_rig()
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    await rig.reconcile(pod.key)
    new = structs.replace(pod, uid="uid-new")
    rig.controller.pod_changed(pod, new)
    assert len(rig.clocks) == 0


@pytest.mark.anyio
async def test_an_add_event_for_a_new_uid_clears_the_clock_of_the_old_one() -> None:
    # After a relist the delete of the old pod may never have been seen: only an ADD arrives.
    rig = make_rig()
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    await rig.reconcile(pod.key)
    rig.controller.pod_changed(None, structs.replace(pod, uid="uid-new"))
    assert len(rig.clocks) == 0


@pytest.mark.parametrize("event", ["cache_cold", "notifications_missed", "leader_again"])
@pytest.mark.anyio
async def test_cold_cache_listener_reconnect_and_new_leadership_restart_clocks(event: str) -> None:
    rig = make_rig()
    pods = [make_pod(f"s{i}") for i in range(3)]
    for pod in pods:
        rig.add(pod, make_row(pod), event=False)
        await rig.reconcile(pod.key)
    assert len(rig.clocks) == 3
    await rig.advance(200)
    if event == "cache_cold":
        rig.controller.cache_cold(NAMESPACE)
    elif event == "notifications_missed":
        rig.controller.notifications_missed()
    else:
        rig.controller.set_leader(False)
        rig.controller.set_leader(True)
    assert len(rig.clocks) == 0
    assert rig.sample("retired_pod_gc_tracked_clocks") == 0
    await rig.advance(200)  # 400 s after the first observation
    for pod in pods:
        assert (await rig.reconcile(pod.key)).requeue_after_s == 300.0
    assert rig.pods.deletes == []


@pytest.mark.anyio
async def test_no_clock_starts_from_the_stale_snapshot_of_a_relisting_cache() -> None:
    # The watch expired; while the cache relists, the server's pod went Pending (not reapable
    # with a `suspended` row) and back to Succeeded. The relist shows only the final state, at
    # a newer version: a clock started from the old snapshot meanwhile would cover the Pending.
    rig = make_rig()
    pod = make_pod(resource_version="29")
    rig.add(pod, make_row(pod), event=False)
    rig.controller.cache_cold(NAMESPACE)
    rig.cache.synced = False
    rig.pods.pods[pod.key] = structs.replace(pod, resource_version="46")
    stale = await rig.reconcile(pod.key)
    assert stale.outcome == Outcome.CACHE_COLD
    assert len(rig.clocks) == 0
    await rig.advance(100)
    # The relist delivers the final state (only its version differs), then the cache is synced.
    rig.add(structs.replace(pod, resource_version="46"))
    rig.cache.synced = True
    rig.controller.cache_synced(NAMESPACE)
    first = await rig.reconcile(pod.key)
    assert (first.outcome, first.requeue_after_s) == (Outcome.TOO_YOUNG, 300.0)
    await rig.advance(299)
    assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    assert rig.pods.deletes == []


@pytest.mark.anyio
async def test_a_restart_starts_with_no_clocks() -> None:
    before = make_rig()
    pod = make_pod()
    before.add(pod, make_row(pod))
    await before.reconcile(pod.key)
    assert len(before.clocks) == 1
    after = make_rig()  # a new process: nothing carried over
    await after.advance(400)
    after.add(pod, make_row(pod))
    assert len(after.clocks) == 0
    assert (await after.reconcile(pod.key)).requeue_after_s == 300.0


@pytest.mark.anyio
async def test_clocks_never_outlive_their_pods() -> None:
    rig = make_rig(make_settings(dry_run=True))
    pods = [make_pod(f"s{i}") for i in range(4)]
    for pod in pods:
        rig.add(pod, make_row(pod), event=False)
        await rig.reconcile(pod.key)
    await rig.advance(300)
    await rig.reconcile(pods[0].key)  # reported in dry run
    assert rig.clocks.reported_count == 1
    for pod in pods:
        rig.cache.remove(pod.key)
        rig.controller.pod_changed(pod, None)
    assert len(rig.clocks) == 0
    assert rig.clocks.reported_count == 0


@pytest.mark.anyio
async def test_cache_synced_enqueues_candidates_and_prunes_reports_of_vanished_pods() -> None:
    rig = make_rig(make_settings(dry_run=True))
    kept, vanished = make_pod("keep"), make_pod("gone")
    running_pod = make_pod("run", phase=PodPhase.RUNNING)
    for pod in (kept, vanished):
        rig.add(pod, make_row(pod), event=False)
        await rig.reconcile(pod.key)
    await rig.advance(300)
    for pod in (kept, vanished):
        await rig.reconcile(pod.key)
    assert rig.clocks.reported_count == 2
    await take_ready(rig.queue)  # the requeues of those reconciles: not what is asserted below
    rig.controller.cache_cold(NAMESPACE)
    rig.cache.remove(vanished.key)  # deleted while the watch was down: no event
    rig.add(running_pod, event=False)
    rig.controller.cache_synced(NAMESPACE)
    assert rig.clocks.reported_count == 1
    assert rig.clocks.was_reported(kept.uid)
    assert await take_ready(rig.queue) == [kept.key]  # only candidates; not the Running pod


# ------------------------------------------------------------ notifications


@pytest.mark.anyio
async def test_a_retirement_notification_enqueues_and_records_its_latency() -> None:
    rig = make_rig()
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    change = structs.replace(
        _change(pod, active=False, state=ExecutionState.REPLACED),
        received_at_s=clock.now() - 0.004,
    )
    rig.controller.executions_changed([change])
    assert await take_ready(rig.queue) == [pod.key]
    assert rig.sample("retired_pod_gc_retirement_to_enqueue_seconds_count") == 1
    assert rig.sample("retired_pod_gc_retirement_to_enqueue_seconds_sum") == pytest.approx(0.004)


@pytest.mark.anyio
async def test_a_batch_clears_exactly_its_keys_clocks_at_once_and_enqueues_them_as_one_burst() -> (
    None
):
    rig = make_rig()
    pods = [make_pod(f"b{i}") for i in range(6)]
    for pod in pods:
        rig.add(pod, make_row(pod), event=False)
        assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    assert len(rig.clocks) == 6
    await take_ready(rig.queue)
    in_batch, outside = pods[:4], pods[4:]
    batch = [
        _change(in_batch[0], active=True, state=ExecutionState.ACTIVE),  # a re-activation
        _change(in_batch[1], active=False, state=ExecutionState.REPLACED),
        _change(in_batch[2], active=False, state=ExecutionState.SUSPENDED),
        ExecutionChange(in_batch[3].namespace, in_batch[3].name, None, None, deleted=True),
    ]
    received_at_s = clock.now() - 0.004
    batch = [structs.replace(c, received_at_s=received_at_s) for c in batch]
    rig.controller.executions_changed(batch)
    # Every clock of the batch is gone the moment it is handed over; the others run on.
    assert [rig.clocks.uid_for(p.key) for p in in_batch] == [None] * 4
    assert [rig.clocks.uid_for(p.key) for p in outside] == [p.uid for p in outside]
    assert rig.sample("retired_pod_gc_queue_adds_total") >= 4
    keys = await rig.queue.get_batch(100)
    assert keys == [p.key for p in in_batch]
    # One latency sample for the notification (it carries retirements), not one per row.
    assert rig.sample("retired_pod_gc_retirement_to_enqueue_seconds_count") == 1
    assert rig.sample("retired_pod_gc_retirement_to_enqueue_seconds_sum") == pytest.approx(0.004)


@pytest.mark.anyio
async def test_a_change_of_a_pod_name_not_cached_clears_its_clock_and_enqueues_nothing() -> None:
    # A change names a pod name in every watched namespace; where no pod of that name is
    # cached there is nothing to reconcile (a pod that appears later is enqueued by its event).
    rig = make_rig()
    pod, elsewhere = make_pod("held"), make_pod("not-held")
    rig.add(pod, make_row(pod), event=False)
    rig.clocks.observe(elsewhere.uid, elsewhere.key, Verdict.TERMINAL_RETIRED, clock.now())
    rig.controller.executions_changed(
        [
            _change(pod, active=False, state=ExecutionState.REPLACED),
            _change(elsewhere, active=True, state=ExecutionState.ACTIVE),
        ]
    )
    assert rig.clocks.uid_for(elsewhere.key) is None
    assert await take_ready(rig.queue) == [pod.key]


@pytest.mark.anyio
async def test_an_inactive_controller_clears_a_batch_but_enqueues_nothing() -> None:
    rig = make_rig(leader=False)
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    rig.clocks.observe(pod.uid, pod.key, Verdict.TERMINAL_RETIRED, clock.now())
    rig.controller.executions_changed([_change(pod, active=True, state=ExecutionState.ACTIVE)])
    assert rig.clocks.uid_for(pod.key) is None
    assert len(rig.queue) == 0


@pytest.mark.anyio
async def test_reconciles_done_counts_what_the_duration_histogram_counts() -> None:
    """The watchdog's progress count: one a counted reconcile, none while inactive."""
    rig = make_rig()
    pods = [make_pod(f"p{i}") for i in range(3)]
    for pod in pods:
        rig.add(pod, make_row(pod))
    await rig.reconcile_batch([pod.key for pod in pods])
    await rig.reconcile(pods[0].key)
    assert rig.controller.reconciles_done == 4
    assert rig.sample("retired_pod_gc_reconcile_duration_seconds_count") == 4
    idle = make_rig(leader=False)
    idle.add(pods[0], make_row(pods[0]))
    await idle.reconcile(pods[0].key)
    assert idle.controller.reconciles_done == 0


# ------------------------------------------------------------ invariant 4


@pytest.mark.anyio
async def test_rate_limit_caps_deletes_per_rolling_minute() -> None:
    cap = 5
    rig = make_rig(make_settings(deletes_per_minute=cap, threshold_s=60))
    pods = [make_pod(f"s{i:02}") for i in range(23)]
    async with rig.workers(4):
        _retired(rig, pods)
        await settle()
        await rig.advance(60)  # every pod is past the threshold now
        for _ in range(400):
            await rig.advance(1)
    times = sorted(d.at_s for d in rig.pods.deletes)
    assert len(times) == 23 and len(set(rig.pods.deleted_keys)) == 23
    for i in range(len(times) - cap):  # no rolling 60 s window holds more than the cap
        assert times[i + cap] - times[i] >= 60.0
    start = T0 + 60
    per_minute = [
        sum(1 for t in times if start + 60 * m <= t < start + 60 * (m + 1)) for m in range(5)
    ]
    # and a backlog runs at the pacer's rate, cap - capacity a minute (capacity 1 for a cap of 5)
    assert per_minute == [cap - 1] * 5


# ------------------------------------------------------------ invariants 5, 6


@pytest.mark.anyio
async def test_dry_run_with_workers_reports_each_uid_once_across_many_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="service.engine")  # the per-report line is debug
    rig = make_rig(make_settings(dry_run=True))
    pod = make_pod()
    async with rig.workers():
        rig.add(pod, make_row(pod))
        await rig.advance(300)
        for i in range(5):  # status updates keep coming
            rig.add(structs.replace(pod, resource_version=str(200 + i)))
            await rig.advance(10)
    assert rig.pods.deletes == []
    assert rig.outcome(Verdict.TERMINAL_RETIRED, "dry_run") == 1
    assert rig.outcome(Outcome.ALREADY_REPORTED, "dry_run") == 5
    assert sum("would reap" in r.getMessage() for r in caplog.records) == 1
    assert rig.controller.reaped.unsummarised == 1  # and one in the info summary


@pytest.mark.anyio
async def test_deletes_are_logged_at_info_as_one_summary_line_an_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each delete's own line is debug; at info the worker loop's tally logs them summarised,
    by verdict and namespace, at most once an interval, and what is left on shutdown."""
    caplog.set_level(logging.INFO, logger="service")
    rig = make_rig(
        make_settings(
            deletes_per_minute=600, env={config.PREFIX + "NAMESPACES": f"{NAMESPACE},{OTHER}"}
        )
    )
    pods = [make_pod(f"n{i}", namespace=(NAMESPACE, OTHER)[i % 3 == 0]) for i in range(6)]
    async with rig.workers(2), anyio.create_task_group() as tg:
        await tg.start(rig.controller.reaped.run)  # summaries at 60, 120, ... (interval 60 s)
        await rig.advance(30)
        for pod in pods[:5]:
            rig.add(pod, make_row(pod))  # deleted at 330 (threshold 300)
        await rig.advance(331)
        rig.add(pods[5], make_row(pods[5]))
        await rig.advance(rig.settings.threshold_s + 1)
        tg.cancel_scope.cancel()
    assert len(rig.pods.deletes) == 6
    info = [r.getMessage() for r in caplog.records if r.name.startswith("service.engine")]
    assert not any("deleted " in m and " as " in m for m in info), info  # no per-pod line
    summaries = [m for m in info if m.startswith("deleted ")]
    assert summaries == [
        f"deleted 5 pods in the last 60s (terminal_retired 5; namespaces {NAMESPACE} 3, {OTHER} 2)"
    ], summaries
    assert rig.controller.reaped.unsummarised == 1
    await rig.controller.stop(1.0)  # shutdown names what no interval has summarised yet
    last = [r.getMessage() for r in caplog.records if r.name == "service.engine.reaped"][-1]
    assert last.startswith("deleted 1 pod in the last ")
    assert last.endswith(f"(terminal_retired 1; namespace {NAMESPACE} 1)")
    assert rig.controller.reaped.unsummarised == 0


@pytest.mark.anyio
async def test_disabled_sends_nothing() -> None:
    rig = make_rig(make_settings(enabled=False))
    pods = [make_pod(f"s{i}") for i in range(3)]
    async with rig.workers():
        _retired(rig, pods)
        rig.controller.executions_changed(
            [_change(pods[0], active=False, state=ExecutionState.SUSPENDED)]
        )
        rig.controller.cache_synced(NAMESPACE)
        assert rig.controller.resync() == 0
        await rig.advance(10_000)
    assert not rig.controller.active
    assert rig.pods.deletes == [] and rig.pods.gets == []
    assert rig.store.queries == 0
    assert len(rig.queue) == 0
    assert rig.sample("retired_pod_gc_queue_adds_total") == 0  # an inactive replica queues nothing


@pytest.mark.anyio
async def test_not_leader_processes_nothing_and_leadership_enqueues_every_candidate() -> None:
    rig = make_rig(leader=False)
    pods = [make_pod(f"s{i}") for i in range(3)]
    async with rig.workers():
        _retired(rig, pods)
        await rig.advance(400)
        assert rig.store.queries == 0 and len(rig.clocks) == 0
        rig.controller.set_leader(True)
        await settle()
        assert len(rig.clocks) == 3  # observed at once, starting from zero
        assert rig.pods.deletes == []
        await rig.advance(300)
    assert len(rig.pods.deletes) == 3


@pytest.mark.anyio
async def test_keys_already_queued_when_leadership_is_lost_are_dropped() -> None:
    rig = make_rig()
    pod = make_pod()
    rig.add(pod, make_row(pod))
    rig.controller.set_leader(False)
    assert await rig.queue.get_batch(10) == [pod.key]
    result = await rig.reconcile(pod.key)
    assert result.outcome == "inactive"
    assert rig.queue.processing == frozenset()
    assert rig.store.queries == 0


# ------------------------------------------------------------ worker loop


def _messages(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


class _ExplodingCache(FakePodCache):
    def get(self, key: str) -> PodSnapshot | None:
        if key.startswith(f"{NAMESPACE}/boom"):
            raise RuntimeError("a bug in a dependency")
        return super().get(key)


@pytest.mark.anyio
async def test_a_malformed_key_never_crashes_a_worker(caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig()
    exploding = _ExplodingCache()
    rig.cache = exploding
    rig.reconciler._cache = exploding
    rig.controller._cache = exploding
    pod = make_pod()
    async with rig.workers(1):
        for bad in ("no-slash", "a/b/c", "", f"{NAMESPACE}/boom"):
            rig.queue.add(bad)
        await settle()
        dropped = _messages(caplog, "malformed work-queue key")
        assert {m.rsplit(": ", 1)[1] for m in dropped} == {"'no-slash'", "'a/b/c'", "''"}
        await rig.advance(1)
        await settle()
        rig.add(pod, make_row(pod))
        await rig.advance(300)
    # The key that raises is backed off and retried; a malformed key is dropped, not retried.
    assert len(_messages(caplog, f"reconcile of '{NAMESPACE}/boom' raised")) >= 2
    assert _messages(caplog, "malformed work-queue key") == dropped
    assert rig.pods.deleted_keys == [pod.key]  # the one worker lived on
    assert rig.sample("retired_pod_gc_reconcile_errors_total") >= 2


@pytest.mark.anyio
async def test_worker_results_map_onto_the_queue_like_controller_runtime() -> None:
    rig = make_rig()  # the queue's backoff: 5 ms after the first failure, doubling
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)

    async def ready_after(delay_s: float) -> None:
        """The key comes back after ``delay_s`` (within 10 %), not before."""
        await rig.advance(delay_s * 0.9)
        assert len(rig.queue) == 0 and rig.queue.delayed == 1
        await rig.advance(delay_s * 0.2)
        assert await rig.queue.get_batch(10) == [pod.key]

    # An answer that is an error (not a dependency that is down: that holds every key together,
    # tests/unit/test_engine_batch.py) backs the key off on its own.
    answered = DatabaseError("relation does not exist", sqlstate="42P01")
    rig.store.lookup_error = answered
    rig.queue.add(pod.key)
    assert await rig.queue.get_batch(10) == [pod.key]
    for delay_s in (0.005, 0.010, 0.020):  # backoff: rate-limited requeue, one more failure each
        result = await rig.reconcile(pod.key)
        assert (result.action, result.outcome) == (Action.BACKOFF, Outcome.LOOKUP_FAILED)
        await ready_after(delay_s)
    rig.store.lookup_error = None
    result = await rig.reconcile(pod.key)  # requeue after: forget, and add after the delay
    assert (result.action, result.requeue_after_s) == (Action.REQUEUE_AFTER, 300.0)
    await ready_after(300.0)
    rig.store.lookup_error = answered
    await rig.reconcile(pod.key)
    await ready_after(0.005)  # the success forgot the failures


@pytest.mark.anyio
async def test_stop_lets_an_in_flight_reconcile_finish() -> None:
    rig = make_rig()
    pod = make_pod()
    gate = anyio.Event()
    rig.store.lookup_gate = gate
    drained: list[bool] = []
    async with anyio.create_task_group() as tg:
        await tg.start(rig.controller.run_workers, 2)
        rig.add(pod, make_row(pod))
        await settle()
        assert rig.queue.processing == frozenset({pod.key})

        async def stop() -> None:
            drained.append(await rig.controller.stop(timeout_s=20))

        tg.start_soon(stop)
        await settle()
        rig.add(make_pod("late"), make_row(make_pod("late")))  # not accepted any more
        assert drained == []
        gate.set()
    assert drained == [True]
    assert rig.outcome(Outcome.TOO_YOUNG) == 1  # the in-flight one completed
    assert rig.store.lookups == 1


@pytest.mark.anyio
async def test_stop_gives_up_after_its_timeout() -> None:
    rig = make_rig()
    pod = make_pod()
    rig.store.lookup_gate = anyio.Event()  # never set: the lookup hangs
    drained: list[bool] = []
    async with anyio.create_task_group() as tg:
        await tg.start(rig.controller.run_workers, 1)
        rig.add(pod, make_row(pod))
        await settle()

        # The lookup is bounded by the statement timeout (5 s): stop gives up before that.
        assert rig.settings.database.statement_timeout_s > 1

        async def stop() -> None:
            drained.append(await rig.controller.stop(timeout_s=1))

        tg.start_soon(stop)
        await rig.advance(1)
        assert drained == [False]
        tg.cancel_scope.cancel()  # what the caller does next: cancel the workers


@pytest.mark.anyio
async def test_resync_enqueues_every_cached_candidate_and_only_those() -> None:
    rig = make_rig()
    candidates = [make_pod(f"c{i}") for i in range(3)]
    others = [
        make_pod("run", phase=PodPhase.RUNNING),
        make_pod("term", terminating=True),
        make_pod("ip", phase=PodPhase.PENDING, pod_ip="10.1.1.1"),
    ]
    for pod in candidates + others:
        rig.add(pod, event=False)
    assert rig.controller.resync() == 3
    assert sorted(await take_ready(rig.queue)) == sorted(p.key for p in candidates)


@pytest.mark.anyio
async def test_periodic_resync_runs_on_the_clock() -> None:
    rig = make_rig()
    pod = make_pod()
    rig.add(pod, event=False)
    async with anyio.create_task_group() as tg:
        await tg.start(rig.controller.run_resync, 600.0)
        await rig.advance(599)
        assert len(rig.queue) == 0
        await rig.advance(1)
        assert len(rig.queue) == 1
        tg.cancel_scope.cancel()


def test_observation_clocks_restart_on_a_new_uid_and_index_by_key() -> None:
    clocks = ObservationClocks()
    assert clocks.observe("u1", "ns/a", Verdict.TERMINAL_RETIRED, 10.0) == 0.0
    assert clocks.observe("u1", "ns/a", Verdict.TERMINAL_RETIRED, 25.0) == 15.0
    assert clocks.observe("u2", "ns/a", Verdict.TERMINAL_RETIRED, 30.0) == 0.0
    assert clock_of(clocks, "u1") is None and clocks.uid_for("ns/a") == "u2"
    clocks.clear_key("ns/a")
    assert len(clocks) == 0 and clocks.uid_for("ns/a") is None


@pytest.mark.anyio
async def test_the_oldest_clock_gauge_is_the_age_of_the_oldest_running_clock() -> None:
    rig = make_rig()
    oldest = "retired_pod_gc_oldest_clock_seconds"
    assert rig.metrics.registry.get_sample_value(oldest) == 0.0
    first, second = make_pod("first"), make_pod("second")
    await _observed_for_100s(rig, first, make_row(first))
    await _observed_for_100s(rig, second, make_row(second))
    assert rig.metrics.registry.get_sample_value(oldest) == pytest.approx(200.0)
    rig.clocks.clear(first.uid)
    assert rig.metrics.registry.get_sample_value(oldest) == pytest.approx(100.0)
    rig.clocks.clear_all()
    assert rig.metrics.registry.get_sample_value(oldest) == 0.0


@pytest.mark.anyio
async def test_a_sync_in_progress_enqueues_nothing_but_still_clears_clocks_at_event_time() -> None:
    rig = make_rig()
    pod = make_pod()
    await _observed_for_100s(rig, pod, make_row(pod))
    assert clock_of(rig.clocks, pod.uid) is not None
    rig.cache.synced = False  # a relist is filling the cache
    rig.add(structs.replace(pod, resource_version="101", pod_ip="10.0.0.1"))  # changed
    assert clock_of(rig.clocks, pod.uid) is None  # cleared when the event arrived
    other = make_pod("other")
    rig.add(other, make_row(other))
    assert await take_ready(rig.queue) == []
    rig.cache.synced = True
    rig.controller.cache_synced(NAMESPACE)  # the end of the sync enqueues every candidate
    assert sorted(await take_ready(rig.queue)) == sorted([pod.key, other.key])


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["lookup", "fresh_get", "fresh_read"])
async def test_a_bug_in_an_adapter_is_logged_counted_and_never_deletes(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig()
    pod = make_pod()
    rig.add(pod, make_row(pod), event=False)
    bug = TypeError("an adapter's bug")
    if where == "lookup":
        rig.store.lookup_error = bug
    elif where == "fresh_get":
        rig.pods.get_error = bug
    else:
        rig.store.fresh_error = bug
    for _ in range(3):
        if where != "lookup":  # a bug of the verification: observed, due, then it raises
            assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
            await rig.advance(300)
        result = await rig.reconcile(pod.key)
        assert (result.action, result.outcome) == (Action.BACKOFF, Outcome.ERROR)
        assert clock_of(rig.clocks, pod.uid) is None  # a gap in the observation
        await rig.advance(300)
    assert rig.pods.deletes == []
    assert rig.sample("retired_pod_gc_reconcile_bugs_total") == 3
    assert rig.outcome(Outcome.LOOKUP_FAILED) == 0  # not disguised as an outage
    bugs = [r for r in caplog.records if r.levelno == logging.ERROR and "a bug" in r.getMessage()]
    assert len(bugs) == 3
    assert all(r.exc_info and r.exc_info[1] is bug for r in bugs)  # with its traceback


# ------------------------------------------------------------ several namespaces

OTHER = "tenant-b"


def _two_namespace_rig() -> EngineRig:
    return make_rig(make_settings(env={config.PREFIX + "NAMESPACES": f"{NAMESPACE},{OTHER}"}))


@pytest.mark.anyio
async def test_a_namespace_going_cold_clears_only_its_own_clocks_and_its_own_keys_wait() -> None:
    rig = _two_namespace_rig()
    ours, theirs = make_pod("a"), make_pod("b", namespace=OTHER)
    for pod in (ours, theirs):
        rig.add(pod, make_row(pod), event=False)
        await rig.reconcile(pod.key)
    assert len(rig.clocks) == 2
    await rig.advance(200)
    rig.controller.cache_cold(OTHER)
    rig.cache.cold_namespaces.add(OTHER)
    assert clock_of(rig.clocks, ours.uid) is not None and clock_of(rig.clocks, theirs.uid) is None
    # A key is judged by the cache of its own namespace: OTHER's waits, ours goes on.
    results = await rig.reconcile_batch([ours.key, theirs.key])
    assert results[theirs.key].outcome == Outcome.CACHE_COLD
    assert results[ours.key].outcome == Outcome.TOO_YOUNG
    assert results[ours.key].requeue_after_s == pytest.approx(100.0)
    await rig.advance(100)
    assert (await rig.reconcile(ours.key)).outcome == Verdict.TERMINAL_RETIRED
    assert (await rig.reconcile(theirs.key)).outcome == Outcome.CACHE_COLD
    assert rig.pods.deleted_keys == [ours.key]
    # Synced again: only then does OTHER's pod start a clock, from zero.
    rig.cache.cold_namespaces.clear()
    rig.controller.cache_synced(OTHER)
    assert theirs.key in await take_ready(rig.queue)
    assert (await rig.reconcile(theirs.key)).requeue_after_s == 300.0


@pytest.mark.anyio
async def test_a_key_of_a_namespace_not_configured_is_never_acted_on() -> None:
    rig = _two_namespace_rig()
    stray = make_pod("c", namespace="not-configured")
    # Even a cache and a store that answered for it (they do not) would not get it deleted.
    rig.add(stray, make_row(stray), event=False)
    for _ in range(3):
        result = await rig.reconcile(stray.key)
        assert result.outcome == Outcome.ERROR
        await rig.advance(400)
    assert len(rig.clocks) == 0
    assert rig.pods.deletes == [] and rig.pods.gets == [] and rig.store.queries == 0
    # Its events do not enqueue it either: that namespace has no synced cache.
    rig.controller.pod_changed(None, structs.replace(stray, resource_version="101"))
    assert await take_ready(rig.queue) == []


@pytest.mark.anyio
async def test_pods_of_every_configured_namespace_share_one_delete_budget() -> None:
    rig = make_rig(
        make_settings(
            deletes_per_minute=2, env={config.PREFIX + "NAMESPACES": f"{NAMESPACE},{OTHER}"}
        )
    )
    pods = [make_pod(f"n{i}", namespace=(NAMESPACE, OTHER)[i % 2]) for i in range(4)]
    async with rig.workers(2):
        for pod in pods:
            rig.add(pod, make_row(pod))
        await rig.advance(300)
        await rig.advance(1)
        # One budget for both namespaces: its pacer's burst (capacity 1 for a cap of 2), not
        # one burst per namespace.
        assert len(rig.pods.deletes) == 1
        await rig.advance(300)
    times = sorted(call.at_s for call in rig.pods.deletes)
    assert len(times) == 4
    assert times[:2] == [T0 + 300, T0 + 360]
    # Then the one pacer's rate (cap - capacity = 1 a minute), whichever namespace is next.
    assert all(later - earlier >= 60.0 for earlier, later in itertools.pairwise(times))
    deleted = {call.namespace for call in rig.pods.deletes}
    assert deleted <= {NAMESPACE, OTHER}
    for namespace in (NAMESPACE, OTHER):
        count = sum(1 for call in rig.pods.deletes if call.namespace == namespace)
        assert (
            rig.sample(
                "retired_pod_gc_deletes_total",
                {"sandbox_namespace": namespace, "result": "deleted"},
            )
            == count
        )


def test_clearing_a_namespace_stops_its_clocks_and_its_observations_in_flight_only() -> None:
    clocks = ObservationClocks()
    ours = make_pod("a")
    theirs = make_pod("b", namespace=OTHER)
    # A namespace that is a prefix of another's name is a different namespace.
    lookalike = make_pod("c", namespace=f"{OTHER}-2")
    for pod in (ours, theirs, lookalike):
        assert clocks.observe(pod.uid, pod.key, Verdict.TERMINAL_RETIRED, 0.0) == 0.0
    clocks.begin([ours.key, theirs.key])
    clocks.clear_namespace(OTHER)
    assert clocks.elapsed(theirs.uid, 10.0) is None and clocks.uid_for(theirs.key) is None
    assert clocks.elapsed(ours.uid, 10.0) == 10.0
    assert clocks.elapsed(lookalike.uid, 10.0) == 10.0
    # The observation of OTHER's key that was reading when the clear came starts no clock.
    assert clocks.observe(theirs.uid, theirs.key, Verdict.TERMINAL_RETIRED, 10.0) is None
    assert clocks.observe(ours.uid, ours.key, Verdict.TERMINAL_RETIRED, 10.0) == 10.0
    assert len(clocks) == 2


@pytest.mark.parametrize("clearing", ["keys", "namespace"])
def test_clearing_a_batch_or_a_namespace_forgets_what_its_clocks_waited_for(clearing: str) -> None:
    # What a clock waits for past the threshold lives only as long as the clock: clearing
    # by a notification batch or a cold namespace drops it as clearing one key does, or a
    # pod that never comes back would leave its entry behind for good.
    clocks = ObservationClocks()
    keys = [f"{NAMESPACE}/p{i}" for i in range(3)]
    for i, key in enumerate(keys):
        assert clocks.observe(f"uid-{i}", key, Verdict.TERMINAL_RETIRED, 0.0) == 0.0
        clocks.set_waiting(f"uid-{i}", Waiting.BUDGET)
    if clearing == "keys":
        for key in keys:
            clocks.clear_key(key)
    else:
        clocks.clear_namespace(NAMESPACE)
    assert clocks.running() == []
    assert clocks._waiting == {}
