"""The delete budget: never more than N grants in any rolling window; a backlog reaches N."""

from __future__ import annotations

import asyncio

import anyio
import anyio.lowlevel
import pytest

from service.engine.budget import DeleteBudget
from service.kit import clock
from service.kit.ratelimit import capped_shape
from tests.virtualtime import advance, settle

# Every test here runs on virtual time (tests/unit/conftest.py): both stages, the aiolimiter
# pacer included, read the event loop's clock, so time moves only when every caller waits.


async def _grant(budget: DeleteBudget) -> float:
    """A caller with no final checks: its turn, taken at once; the grant time."""
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
        assert capacity + rate_per_s * 60.0 <= cap
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
async def test_the_exact_guard_alone_caps_every_rolling_window_and_a_backlog_reaches_the_cap() -> (
    None
):
    # A cap of 1 has no pacer (no bucket with a positive rate fits): the exact guard alone
    # decides, and a backlog gets one grant every window, to the second.
    assert capped_shape(1) is None
    budget = DeleteBudget(1)
    start = clock.now()
    grants: list[float] = []
    async with anyio.create_task_group() as tg:
        for _ in range(5):

            async def take() -> None:
                grants.append(await _grant(budget))

            tg.start_soon(take)
        await advance(300)
    assert grants == [start + 60.0 * m for m in range(5)]


@pytest.mark.anyio
async def test_a_backlog_never_exceeds_the_cap_in_a_window_and_runs_at_the_pacers_rate() -> None:
    cap = 5
    capacity, rate_per_s = capped_shape(cap) or (0, 0.0)
    budget = DeleteBudget(cap)
    start = clock.now()
    grants: list[float] = []
    async with anyio.create_task_group() as tg:
        for _ in range(23):

            async def take() -> None:
                grants.append(await _grant(budget))

            tg.start_soon(take)
        await advance(400)
    assert len(grants) == 23
    assert _max_in_any_window(grants, 60.0) <= cap
    for i in range(len(grants) - cap):
        assert grants[i + cap] - grants[i] >= 60.0
    # The leaky bucket's envelope holds for every span of grants, and a backlog runs at
    # N - C per window (here 4 of 5: capacity 1, then one every 15 s).
    for i in range(len(grants)):
        for j in range(i + 1, len(grants)):
            assert j - i + 1 <= capacity + rate_per_s * (grants[j] - grants[i])
    per_minute = [
        sum(1 for g in grants if start + 60 * m <= g < start + 60 * (m + 1)) for m in range(5)
    ]
    assert per_minute == [cap - capacity] * 5


@pytest.mark.anyio
async def test_the_pacer_spreads_a_burst_that_the_exact_guard_alone_would_grant_at_once() -> None:
    # Ten callers at once under a cap of 10: the exact guard alone would grant all ten at the
    # first instant; the pacer admits its capacity (1) and spreads the rest at its rate.
    cap = 10
    capacity, rate_per_s = capped_shape(cap) or (0, 0.0)
    assert capacity == 1
    budget = DeleteBudget(cap)
    start = clock.now()
    grants: list[float] = []
    async with anyio.create_task_group() as tg:
        for _ in range(cap):

            async def take() -> None:
                grants.append(await _grant(budget))

            tg.start_soon(take)
        await advance(120)
    assert len(grants) == cap
    assert sum(1 for g in grants if g == start) == capacity
    for i in range(1, cap):  # one more grant only once the bucket has drained one token's worth
        assert grants[i] - grants[0] >= i / rate_per_s


@pytest.mark.anyio
async def test_a_cancelled_wait_for_a_turn_consumes_nothing() -> None:
    budget = DeleteBudget(1)
    await _grant(budget)
    assert budget.retry_after_s() == 60.0
    with anyio.move_on_after(1) as waited:
        await _grant(budget)  # the guard holds it for 60 s; cancelled after 1
    assert waited.cancelled_caught
    await advance(59)
    assert budget.retry_after_s() == 0.0
    with anyio.fail_after(0.001):  # granted at once: the cancelled caller holds nothing
        granted = await _grant(budget)
    assert granted == clock.now()
    assert budget.retry_after_s() == 60.0


@pytest.mark.anyio
async def test_taking_a_turn_never_yields_to_the_loop() -> None:
    # The reconciler checks the clock, takes the token and hands the DELETE over with nothing
    # else running in between: take() must not suspend, with the pacer on.
    budget = DeleteBudget(20, window_s=1.0)
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
    budget = DeleteBudget(2)
    first = await budget.turn()
    order: list[str] = []

    async def second() -> None:
        turn = await budget.turn()
        order.append("second has the turn")
        await turn.take()

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await settle()
        assert order == []  # first come, first served: the line is held
        first.release()
    assert order == ["second has the turn"]
    assert budget.retry_after_s() == 0.0  # one grant of two: the released turn spent nothing
    with pytest.raises(RuntimeError):
        await first.take()


@pytest.mark.anyio
async def test_paced_take_times_keep_the_envelope_however_long_each_holder_checks() -> None:
    # Each holder spends a different time on its final checks before taking (as a
    # re-verification does). The grant happens inside take(), so the leaky bucket's envelope
    # (at most C + r·t grants in any span t) holds for the take calls themselves.
    window_s = 1.0
    cap = 20
    budget = DeleteBudget(cap, window_s=window_s)
    capacity, rate_per_s = capped_shape(cap, window_s) or (0, 0.0)
    checks_s = [0.0, 0.12, 0.0, 0.0, 0.09, 0.0, 0.15, 0.0, 0.0, 0.05] * 2
    taken: list[float] = []

    async def candidate(check_s: float) -> None:
        turn = await budget.turn()
        await anyio.sleep(check_s)
        taken.append(await turn.take())

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for check_s in checks_s:
                tg.start_soon(candidate, check_s)
    assert len(taken) == len(checks_s)
    assert taken == sorted(taken)
    for i in range(len(taken)):
        for j in range(i + 1, len(taken)):
            span = taken[j] - taken[i]
            assert j - i + 1 <= capacity + rate_per_s * span, (i, j, span)
