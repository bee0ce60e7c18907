"""Bursts: workers take many keys at once and start their clocks with one row query per batch
(``Reconciler.observe``); a key that is due goes on to ``Reconciler.act``, every
verification step included."""

from __future__ import annotations

import math

import anyio
import pytest

from service.domain import ExecutionChange, ExecutionState, Outcome, PodPhase, Verdict
from service.engine.controller import MIN_BATCH
from service.engine.gates import DEPENDENCY_BACKOFF_MAX_S
from service.engine.held import HELD_RECHECK_S
from service.kit import clock
from service.kit.errors import Unavailable
from tests.fakes import EngineRig, clock_of, make_pod, make_rig, make_row, make_settings
from tests.virtualtime import settle

BURST = 2_000
WORKERS = 8


def _retire_all(rig: EngineRig, n: int) -> list[str]:
    """``n`` terminal pods whose rows are retired, cached; a notification for each (a burst)."""
    pods = [make_pod(f"s{i:05}") for i in range(n)]
    for pod in pods:
        rig.add(pod, make_row(pod), event=False)
    for pod in pods:
        rig.controller.executions_changed(
            [ExecutionChange(pod.namespace, pod.name, active=False, state=ExecutionState.SUSPENDED)]
        )
    return [pod.key for pod in pods]


@pytest.mark.anyio
async def test_a_burst_starts_every_clock_with_one_row_query_per_batch() -> None:
    rig = make_rig(make_settings(dry_run=True))
    async with rig.workers(WORKERS):
        _retire_all(rig, BURST)
        await settle()
        assert len(rig.clocks) == BURST
        assert rig.queue.delayed == BURST and rig.queue.processing == frozenset()
        assert rig.store.fresh_reads == 0
        assert 1 < rig.store.lookups <= math.ceil(BURST / MIN_BATCH)
        assert rig.outcome(Outcome.TOO_YOUNG) == BURST
        assert rig.sample("retired_pod_gc_reconcile_duration_seconds_count") == BURST
        assert rig.sample("retired_pod_gc_tracked_clocks") == BURST
        assert rig.pods.gets == [] and rig.pods.deletes == []
        await rig.advance(299.9)
        assert len(rig.queue) == 0 and rig.queue.delayed == BURST
        await rig.advance(0.1)  # every key was requeued for its clock's expiry: due now
        assert rig.outcome(Verdict.TERMINAL_RETIRED) == BURST


@pytest.mark.anyio
async def test_due_keys_of_a_batch_are_verified_one_by_one_before_any_delete() -> None:
    rig = make_rig(make_settings(deletes_per_minute=6000))
    async with rig.workers(WORKERS):
        keys = _retire_all(rig, 300)
        await settle()
        # Two rows are re-activated, and the batched reads lag (a replica, say): only the final
        # re-read sees it.
        rig.store.batched_rows = dict(rig.store.rows)
        for key in keys[:2]:
            pod = rig.cache.get(key)
            assert pod is not None
            rig.store.put(make_row(pod, active=True, state=ExecutionState.ACTIVE))
        lookups = rig.store.lookups
        await rig.advance(300)  # every key is due at once: the timer hands out one burst
    assert sorted(rig.pods.deleted_keys) == sorted(keys[2:])
    assert rig.store.fresh_reads == 300  # each due key re-read on its own
    # The due keys' batches are observed (a query each), then straight to verification.
    assert rig.store.lookups - lookups <= math.ceil(300 / MIN_BATCH)
    # Each reconcile counted once: 300 in the first burst, then 300 single (not the due batch).
    assert rig.sample("retired_pod_gc_reconcile_duration_seconds_count") == 600
    assert all(d.uid and d.resource_version for d in rig.pods.deletes)
    assert rig.outcome(Verdict.TERMINAL_RETIRED) == 298
    assert rig.outcome(Outcome.CHANGED) == 2


@pytest.mark.anyio
async def test_a_notification_during_the_batch_lookup_keeps_that_clock_stopped() -> None:
    rig = make_rig(make_settings(deletes_per_minute=6000))  # a pacer burst of 600: no wait
    gate = anyio.Event()
    rig.store.lookup_gate = gate
    async with rig.workers(1):
        keys = _retire_all(rig, 100)
        await settle()
        assert rig.store.lookups == 1  # the batch is reading
        flipped = rig.cache.get(keys[7])
        assert flipped is not None
        # Active and back to retired while the query was in flight: the query may have read
        # either state, so its answer must not start this clock.
        for active, state in ((True, ExecutionState.ACTIVE), (False, ExecutionState.SUSPENDED)):
            rig.controller.executions_changed(
                [ExecutionChange(flipped.namespace, flipped.name, active=active, state=state)]
            )
        again = anyio.Event()  # holds the re-read of the flipped key
        rig.store.lookup_gate = again
        gate.set()
        await settle()
        assert rig.outcome(Outcome.CHANGED) == 1
        assert rig.outcome(Outcome.TOO_YOUNG) == 99
        assert clock_of(rig.clocks, flipped.uid) is None and len(rig.clocks) == 99
        await rig.advance(4)  # the re-read held, within its statement timeout (5 s)
        rig.store.lookup_gate = None
        again.set()
        await settle()
        obs = clock_of(rig.clocks, flipped.uid)
        assert obs is not None and obs.since_s == clock.now()  # from the second read
        await rig.advance(296)
        assert len(rig.pods.deletes) == 99 and flipped.key not in rig.pods.deleted_keys
        await rig.advance(4)
    assert len(rig.pods.deletes) == 100


@pytest.mark.anyio
async def test_a_failed_batch_lookup_clears_every_clock_and_holds_every_key_together() -> None:
    rig = make_rig(make_settings(deletes_per_minute=6000))
    async with rig.workers(WORKERS):
        keys = _retire_all(rig, 200)
        await settle()
        await rig.advance(100)
        rig.store.lookup_error = Unavailable("db down")
        lookups = rig.store.lookups
        for key in keys:  # a resync while the database is down
            rig.queue.add(key)
        await settle()
        assert len(rig.clocks) == 0
        assert rig.outcome(Outcome.LOOKUP_FAILED) >= 200
        # One lookup found the database down; every other key was held, none sent its own.
        assert rig.store.lookups == lookups + 1
        assert rig.sample("retired_pod_gc_dependency_backoff", {"dependency": "database"}) == 1
        assert rig.sample("retired_pod_gc_queue_retries_total") == 0
        # Down for a minute: one probe a backoff step (capped), not one lookup a key a step.
        await rig.advance(60)
        probes = rig.store.lookups - lookups - 1
        assert 60 / DEPENDENCY_BACKOFF_MAX_S <= probes <= 60 / (0.8 * DEPENDENCY_BACKOFF_MAX_S) + 6
        assert (
            rig.sample(
                "retired_pod_gc_dependency_probes_total",
                {"dependency": "database", "result": "failed"},
            )
            == probes
        )
        # And the workers are not kept busy either: one held key (the driver) comes back each
        # step; the others once in HELD_RECHECK_S at most.
        assert rig.outcome(Outcome.LOOKUP_FAILED) <= 200 * (1 + 60 / HELD_RECHECK_S) + probes
        rig.store.lookup_error = None
        # Back: the next probe answers within the cap, and releases every held key at once.
        await rig.advance(DEPENDENCY_BACKOFF_MAX_S)
        assert len(rig.clocks) == 200
        assert rig.sample("retired_pod_gc_dependency_backoff", {"dependency": "database"}) == 0
        await rig.advance(300 - DEPENDENCY_BACKOFF_MAX_S - 1)
        assert rig.pods.deletes == []  # the gap restarted every clock
        await rig.advance(10)
    assert len(rig.pods.deletes) == 200


@pytest.mark.anyio
async def test_a_batch_skips_what_is_not_reapable_and_queries_only_candidates() -> None:
    rig = make_rig()
    running_pods = [make_pod(f"r{i}", phase=PodPhase.RUNNING) for i in range(50)]
    active = [make_pod(f"a{i}") for i in range(50)]
    no_row = [make_pod(f"n{i}") for i in range(50)]
    for pod in running_pods:
        rig.add(pod, make_row(pod), event=False)
    for pod in active:
        rig.add(pod, make_row(pod, active=True, state=ExecutionState.ACTIVE), event=False)
    for pod in no_row:
        rig.add(pod, None, event=False)
    queried: list[str] = []
    lookup_many = rig.store.lookup_many

    async def recording(names: list[str]) -> dict[str, object]:
        queried.extend(names)
        return await lookup_many(names)  # type: ignore[return-value]

    rig.store.lookup_many = recording  # type: ignore[assignment, method-assign]
    async with rig.workers(1):
        for pod in [*running_pods, *active, *no_row]:
            rig.queue.add(pod.key)
        await settle()
    assert sorted(queried) == sorted(p.key for p in [*active, *no_row])
    assert rig.outcome(Outcome.SKIPPED) == 150
    assert len(rig.clocks) == 0 and rig.queue.delayed == 0


@pytest.mark.anyio
async def test_an_inactive_replica_drops_a_batch_unread() -> None:
    rig = make_rig(make_settings(enabled=False))
    async with rig.workers(WORKERS):
        for i in range(500):
            rig.queue.add(f"sandboxes/p{i}")
        await settle()
    assert rig.store.queries == 0 and len(rig.clocks) == 0


@pytest.mark.anyio
async def test_stop_ends_a_batch_after_its_read_without_starting_its_due_keys() -> None:
    rig = make_rig(make_settings(deletes_per_minute=6000))
    drained: list[bool] = []
    async with anyio.create_task_group() as tg:
        await tg.start(rig.controller.run_workers, 1)
        _retire_all(rig, 50)
        await settle()
        gate = anyio.Event()
        rig.store.lookup_gate = gate
        await rig.advance(300)  # all 50 due: one batch, reading
        assert len(rig.queue.processing) == 50

        async def stop() -> None:
            drained.append(await rig.controller.stop(timeout_s=20))

        tg.start_soon(stop)
        await settle()
        assert drained == []
        gate.set()
    assert drained == [True]
    assert rig.queue.processing == frozenset()
    assert rig.store.fresh_reads == 0 and rig.pods.gets == [] and rig.pods.deletes == []


@pytest.mark.anyio
async def test_a_batch_from_a_relisting_cache_starts_no_clock() -> None:
    rig = make_rig()
    pods = [make_pod(f"s{i:05}") for i in range(50)]
    for pod in pods:
        rig.add(pod, make_row(pod), event=False)
    rig.cache.synced = False
    observed = await rig.reconciler.observe([pod.key for pod in pods])
    assert observed.due == []
    assert len(observed.results) == len(pods)
    assert {r.outcome for r in observed.results.values()} == {Outcome.CACHE_COLD}
    assert rig.outcome(Outcome.CACHE_COLD) == 0  # observe counts nothing itself
    results = await rig.reconcile_batch([pod.key for pod in pods])
    assert {r.outcome for r in results.values()} == {Outcome.CACHE_COLD}
    assert len(rig.clocks) == 0
    assert rig.store.lookups == 0
    assert rig.outcome(Outcome.CACHE_COLD) == len(pods)


@pytest.mark.anyio
async def test_when_the_key_that_drives_the_probe_is_gone_another_held_key_drives_it() -> None:
    rig = make_rig(make_settings(deletes_per_minute=6000))
    async with rig.workers(1):
        rig.store.lookup_error = Unavailable("db down")
        keys = _retire_all(rig, 3)  # one batch: the first key held drives the probes
        await settle()
        assert rig.outcome(Outcome.LOOKUP_FAILED) == 3
        # The driver and the next one go away while the database is down (no event: the cache
        # alone forgets them, as after a missed delete).
        for key in keys[:2]:
            rig.cache.remove(key)
        await rig.advance(20)
        rig.store.lookup_error = None
        # The one left drives the probes now: it is back within a backoff step of the restore,
        # not at its own recheck (HELD_RECHECK_S).
        await rig.advance(DEPENDENCY_BACKOFF_MAX_S)
        assert len(rig.clocks) == 1
        assert DEPENDENCY_BACKOFF_MAX_S + 20 < HELD_RECHECK_S
