"""Invariant 1's bound: no DELETE (or dry-run report) on a final row re-read older than
``FINAL_CHECK_MAX_AGE_S``, whatever aged it — a slow re-read, the notification sync, the wait for
a delete token, or a starved event loop — and the clock is looked at once more right before.

Every test runs on virtual time: the delays are stalls of the virtual-time loop (time moves on
while no other task runs, as on a starved machine), and the age of each DELETE is judged from the
fakes' own records (when each re-read began, when each DELETE was sent).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import anyio
import pytest

from service.domain import ExecutionChange, ExecutionState, Outcome, PodSnapshot, Verdict
from service.engine.results import ReconcileResult
from service.engine.verify import FINAL_CHECK_MAX_AGE_S, MAX_AGE_REVERIFICATIONS
from tests.fakes import EngineRig, make_pod, make_rig, make_row, make_settings
from tests.virtualtime import running_loop, settle

OVER = FINAL_CHECK_MAX_AGE_S + 0.05
"""A delay just past the bound."""


class SlowBarrier:
    """A notification sync that takes ``delays`` seconds of virtual time, one per call (a stall
    of the loop: no other task runs meanwhile)."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def sync(self) -> None:
        if self.delays:
            running_loop().stall(self.delays.pop(0))


def _ages(rig: EngineRig) -> list[float]:
    """For every DELETE sent: how long before it the latest row re-read began."""
    starts = rig.store.fresh_read_times
    ages = []
    for call in rig.pods.deletes:
        i = bisect.bisect_right(starts, call.at_s) - 1
        assert i >= 0, f"DELETE of {call.name} with no re-read before it"
        ages.append(call.at_s - starts[i])
    return ages


async def _reconcile_after_threshold(rig: EngineRig, *pods: PodSnapshot) -> None:
    for pod in pods:
        rig.add(pod, make_row(pod), event=False)
        first = await rig.reconcile(pod.key)
        assert first.outcome == Outcome.TOO_YOUNG
    await rig.advance(rig.settings.threshold_s)


async def _concurrently(rig: EngineRig, keys: list[str]) -> list[ReconcileResult]:
    """Reconcile ``keys`` concurrently, advancing virtual time until every one has finished."""
    results: list[ReconcileResult] = []

    async def one(key: str) -> None:
        results.append(await rig.reconcile(key))

    async with anyio.create_task_group() as tg:
        for key in keys:
            tg.start_soon(one, key)
        while len(results) < len(keys):
            await rig.advance(1.0)
    return results


def _delay_rereads(rig: EngineRig, barrier: SlowBarrier) -> None:
    rig.store.fresh_read_delays.append(OVER)


def _delay_sync(rig: EngineRig, barrier: SlowBarrier) -> None:
    barrier.delays.append(OVER)


DELAYS: dict[str, Callable[[EngineRig, SlowBarrier], None]] = {
    "slow re-read": _delay_rereads,
    "slow notification sync": _delay_sync,
}


@pytest.mark.anyio
@pytest.mark.parametrize("where", list(DELAYS))
async def test_a_final_check_aged_past_the_bound_is_redone_before_the_delete(where: str) -> None:
    barrier = SlowBarrier()
    rig = make_rig(make_settings(), barrier=barrier)
    pod = make_pod()
    await _reconcile_after_threshold(rig, pod)
    DELAYS[where](rig, barrier)

    result = await rig.reconcile(pod.key)

    assert result.outcome == Verdict.TERMINAL_RETIRED
    assert rig.pods.deleted_keys == [pod.key]
    assert all(age <= FINAL_CHECK_MAX_AGE_S for age in _ages(rig)), _ages(rig)
    assert rig.sample("retired_pod_gc_final_check_reverifications_total") == 1
    assert rig.store.fresh_reads == 2


@pytest.mark.anyio
async def test_a_long_wait_for_a_delete_token_is_followed_by_a_fresh_check() -> None:
    # One DELETE per 10 s: the second candidate waits 10 s for its token, far past the bound
    # and within the reconciler's wait for a turn (a third of the reconcile timeout, 15 s).
    rig = make_rig(make_settings(deletes_per_minute=1), budget_window_s=10.0)
    first, second = make_pod("a"), make_pod("b")
    await _reconcile_after_threshold(rig, first, second)

    results = await _concurrently(rig, [first.key, second.key])

    assert sorted(r.outcome for r in results) == [Verdict.TERMINAL_RETIRED] * 2
    assert rig.pods.deletes[1].at_s - rig.pods.deletes[0].at_s >= 10  # the second one waited
    assert all(age <= FINAL_CHECK_MAX_AGE_S for age in _ages(rig)), _ages(rig)
    assert rig.sample("retired_pod_gc_final_check_reverifications_total") == 1


@pytest.mark.anyio
@pytest.mark.parametrize("dry_run", [False, True])
async def test_a_loop_starved_past_the_bound_at_every_try_gives_up_without_acting(
    dry_run: bool,
) -> None:
    rig = make_rig(make_settings(dry_run=dry_run))
    pod = make_pod()
    await _reconcile_after_threshold(rig, pod)
    # The loop is starved past the bound during every re-read: each check is too old when the
    # reconciler next reads the clock.
    rig.store.fresh_read_delays.extend([OVER] * (2 + MAX_AGE_REVERIFICATIONS))

    result = await rig.reconcile(pod.key)

    assert result.outcome == Outcome.STALE
    assert result.requeue_after_s > 0
    assert rig.pods.deletes == []
    assert not rig.clocks.was_reported(pod.uid)
    assert rig.store.fresh_reads == 1 + MAX_AGE_REVERIFICATIONS
    assert rig.outcome(Outcome.STALE) == 1


@pytest.mark.anyio
async def test_a_clearing_event_during_a_short_token_wait_stops_the_delete() -> None:
    # Tokens come back after 0.1 s: the second pod's wait is shorter than the bound, so its
    # verification is not redone; the clock is still looked at right before the DELETE.
    rig = make_rig(make_settings(deletes_per_minute=1), budget_window_s=0.1)
    first, second = make_pod("a"), make_pod("b")
    await _reconcile_after_threshold(rig, first, second)
    results: list[ReconcileResult] = []

    async def one(key: str) -> None:
        results.append(await rig.reconcile(key))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, first.key)
        tg.start_soon(one, second.key)
        await settle()  # the second waits for the token
        rig.controller.executions_changed(
            [
                ExecutionChange(
                    second.namespace, second.name, active=True, state=ExecutionState.ACTIVE
                )
            ]
        )
        await rig.advance(0.1)

    assert rig.sample("retired_pod_gc_final_check_reverifications_total") == 0
    assert sorted(r.outcome for r in results) == sorted([Verdict.TERMINAL_RETIRED, Outcome.CHANGED])
    assert rig.pods.deleted_keys == [first.key]


@pytest.mark.anyio
async def test_a_candidate_that_fails_its_final_check_passes_the_turn_on_unspent() -> None:
    # One DELETE per 10 s (a wait within the reconciler's 15 s for a turn). The second
    # candidate waits for the turn; while it waits, its row becomes active again (no
    # notification: only the re-read after the long wait shows it). It gives the turn up
    # without spending a token, so the third candidate deletes at once.
    rig = make_rig(make_settings(deletes_per_minute=1), budget_window_s=10.0)
    first, second, third = make_pod("a"), make_pod("b"), make_pod("c")
    await _reconcile_after_threshold(rig, first, second, third)
    results: list[ReconcileResult] = []

    async def one(key: str) -> None:
        results.append(await rig.reconcile(key))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, first.key)
        await settle()
        tg.start_soon(one, second.key)
        await settle()  # the second holds the line, waiting for a token
        rig.store.put(make_row(second, active=True, state=ExecutionState.ACTIVE))
        await rig.advance(10.0)
    assert [r.outcome for r in results] == [Verdict.TERMINAL_RETIRED, Outcome.CHANGED]
    assert rig.budget.retry_after_s() == 0.0  # the first grant left the window; none since

    third_result = await rig.reconcile(third.key)  # no virtual time passes

    assert third_result.outcome == Verdict.TERMINAL_RETIRED
    assert rig.pods.deleted_keys == [first.key, third.key]
    assert rig.pods.deletes[1].at_s - rig.pods.deletes[0].at_s == 10.0
