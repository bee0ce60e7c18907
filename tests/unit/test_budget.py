"""The delete budget: never more than N grants in any rolling window; a backlog reaches N."""

from __future__ import annotations

import asyncio
import time

import anyio
import anyio.lowlevel
import pytest

from service.engine.budget import DeleteBudget
from service.kit.clock import FakeClock, MonotonicClock
from service.kit.ratelimit import capped_shape


async def _acquire(budget: DeleteBudget) -> float:
    """A turn taken at once (a caller with no final checks); the grant time."""
    return await (await budget.turn()).take()


def _max_in_any_window(times: list[float], window_s: float) -> int:
    """The most grants in any half-open window [t, t + window) (windows starting at a grant)."""
    times = sorted(times)
    best = 0
    j = 0
    for i, start in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < start + window_s:
            j += 1
        best = max(best, j - i)
    return best


def test_pacer_shape_never_exceeds_the_cap_in_a_window_and_keeps_most_of_it() -> None:
    for cap in range(1, 6001):
        shape = capped_shape(cap)
        if shape is None:
            assert cap == 1
            continue
        capacity, rate_per_s = shape
        assert capacity >= 1 and rate_per_s > 0
        # A leaky bucket admits at most capacity + rate * window in any window.
        assert capacity + rate_per_s * 60.0 <= cap + 1e-9
        if cap >= 10:
            assert rate_per_s * 60.0 >= 0.9 * cap - 1  # a backlog still nears the cap


def test_a_plain_aiolimiter_bucket_would_break_the_cap() -> None:
    # Why the sizing matters: AsyncLimiter(N, 60) starts empty and admits N + N in the first
    # minute; the sized bucket admits at most N.
    cap = 120
    naive_first_minute = cap + cap / 60.0 * 60.0
    capacity, rate_per_s = capped_shape(cap) or (0, 0.0)
    assert naive_first_minute > cap
    assert capacity + rate_per_s * 60.0 <= cap


@pytest.mark.anyio
async def test_the_exact_guard_caps_every_rolling_window_and_a_backlog_reaches_the_cap() -> None:
    clock = FakeClock()
    cap = 5
    budget = DeleteBudget(cap, clock=clock, pace=False)
    start = clock.monotonic()
    grants: list[float] = []
    async with anyio.create_task_group() as tg:
        for _ in range(23):

            async def take() -> None:
                grants.append(await _acquire(budget))

            tg.start_soon(take)
        await anyio.wait_all_tasks_blocked()
        for _ in range(300):  # 300 s in 1 s steps (timers fire at their exact deadlines)
            clock.advance(1)
            await anyio.wait_all_tasks_blocked()
    assert len(grants) == 23
    assert _max_in_any_window(grants, 60.0) <= cap
    for i in range(len(grants) - cap):
        assert grants[i + cap] - grants[i] >= 60.0
    # Under a backlog every minute is used to the cap: 5 at 0 s, 5 at 60 s, ...
    per_minute = [
        sum(1 for g in grants if start + 60 * m <= g < start + 60 * (m + 1)) for m in range(5)
    ]
    assert per_minute == [5, 5, 5, 5, 3]


@pytest.mark.anyio
async def test_a_cancelled_acquire_consumes_nothing() -> None:
    clock = FakeClock()
    budget = DeleteBudget(1, clock=clock, pace=False)
    await _acquire(budget)
    assert budget.retry_after_s() == 60.0
    with anyio.move_on_after(0.01):
        await _acquire(budget)  # blocks on the fake clock; cancelled by a real 10 ms timeout
    clock.advance(60)
    assert budget.retry_after_s() == 0.0
    with anyio.fail_after(1):
        granted = await _acquire(budget)
    assert granted == clock.monotonic()
    assert budget.retry_after_s() == 60.0  # one grant (the cap), now


@pytest.mark.anyio
async def test_paced_budget_on_the_real_clock_spreads_grants_and_caps_windows() -> None:
    # A scaled-down window (0.5 s) so the real aiolimiter pacing runs in well under a second.
    window_s = 0.5
    cap = 10
    budget = DeleteBudget(cap, clock=MonotonicClock(), window_s=window_s, pace=True)
    grants: list[float] = []
    started = time.monotonic()
    with anyio.fail_after(10):
        for _ in range(15):
            grants.append(await _acquire(budget))
    took_s = time.monotonic() - started
    assert _max_in_any_window(grants, window_s) <= cap
    # 15 grants with at most 10 per 0.5 s cannot finish within one window.
    assert took_s >= window_s * 0.9
    # Pacing: the burst is the small capacity (1), not the whole cap.
    assert sum(1 for g in grants if g < started + 0.05) <= 2


@pytest.mark.anyio
async def test_taking_a_turn_never_yields_to_the_loop() -> None:
    # The reconciler checks the clock, takes the token and hands the DELETE over with nothing
    # else running in between: take() must not suspend, on the real, paced budget.
    budget = DeleteBudget(20, clock=MonotonicClock(), window_s=1.0, pace=True)
    ran_between: list[int] = []
    for i in range(12):  # past the pacer's burst (2): later turns waited for the bucket
        turn = await budget.turn()
        asyncio.get_running_loop().call_soon(ran_between.append, i)
        await turn.take()
        assert ran_between == [], f"take() #{i} let another callback run"
        await anyio.lowlevel.checkpoint()
        assert ran_between == [i]
        ran_between.clear()


@pytest.mark.anyio
async def test_a_released_turn_spends_nothing_and_goes_to_the_next_caller() -> None:
    clock = FakeClock()
    budget = DeleteBudget(1, clock=clock, pace=False)
    first = await budget.turn()
    order: list[str] = []

    async def second() -> None:
        turn = await budget.turn()
        order.append("second has the turn")
        await turn.take()

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        assert order == []  # first come, first served: the line is held
        first.release()
    assert order == ["second has the turn"]
    assert budget.retry_after_s() == 60.0  # one grant (the cap): the released turn spent none
    with pytest.raises(RuntimeError):
        await first.take()


@pytest.mark.anyio
async def test_paced_take_times_keep_the_envelope_however_long_each_holder_checks() -> None:
    # Each holder spends a different time on its final checks before taking (as a
    # re-verification does). The grant happens inside take(), so the leaky bucket's envelope
    # (at most C + r·t grants in any span t) holds for the take calls themselves. Judged with
    # each take's own bracket [before, after]: no tolerance.
    window_s = 1.0
    cap = 20
    budget = DeleteBudget(cap, clock=MonotonicClock(), window_s=window_s, pace=True)
    capacity, rate_per_s = capped_shape(cap, window_s) or (0, 0.0)
    checks_s = [0.0, 0.12, 0.0, 0.0, 0.09, 0.0, 0.15, 0.0, 0.0, 0.05] * 2
    taken: list[tuple[float, float]] = []

    async def candidate(check_s: float) -> None:
        turn = await budget.turn()
        await anyio.sleep(check_s)
        before = time.monotonic()
        await turn.take()
        taken.append((before, time.monotonic()))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for check_s in checks_s:
                tg.start_soon(candidate, check_s)
    assert len(taken) == len(checks_s)
    for i in range(len(taken)):
        for j in range(i + 1, len(taken)):
            longest_span = taken[j][1] - taken[i][0]
            assert j - i + 1 <= capacity + rate_per_s * longest_span, (i, j, longest_span)
