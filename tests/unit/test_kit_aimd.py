"""The adaptive concurrency limit (``service/kit/aimd.py``) on virtual time: slots in arrival
order, halved once per round of throttle signals, grown back by answers, never below the floor
nor above the ceiling, and a cancelled wait takes no slot."""

from __future__ import annotations

import anyio
import pytest

from service.kit import clock
from service.kit.aimd import INCREASE_INTERVAL_S, AimdLimit
from tests.virtualtime import advance, settle

pytestmark = pytest.mark.anyio


async def test_slots_are_granted_in_arrival_order_up_to_the_limit() -> None:
    limit = AimdLimit(ceiling=2)
    order: list[int] = []

    async def request(i: int) -> None:
        await limit.acquire()
        order.append(i)
        await anyio.sleep(1.0)
        limit.release()

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(request, i)
        await settle()
        assert (order, limit.in_flight, limit.waiting) == ([0, 1], 2, 3)
        await advance(1.0)
        assert order == [0, 1, 2, 3]
    assert order == [0, 1, 2, 3, 4]
    assert limit.in_flight == 0


async def test_a_round_of_throttle_signals_halves_the_limit_once() -> None:
    limit = AimdLimit(ceiling=32)
    granted = [await limit.acquire() for _ in range(8)]
    # Eight requests of one round answered 429: one decrease, not eight.
    assert [limit.throttled(at) for at in granted] == [True] + [False] * 7
    assert limit.slots == 16
    for _ in granted:
        limit.release()
    await anyio.sleep(0.1)
    # A request granted after the decrease is of the next round: it halves again.
    later = await limit.acquire()
    assert limit.throttled(later)
    assert limit.slots == 8
    limit.release()


async def test_the_limit_never_falls_below_the_floor_and_grows_back_to_the_ceiling() -> None:
    limit = AimdLimit(ceiling=4)
    for _ in range(10):
        await anyio.sleep(0.1)
        limit.throttled(clock.now())
    assert limit.slots == 1
    # Additive increase: one slot per round of `limit` answers, at most one per interval.
    for _ in range(10):
        limit.succeeded()
    assert limit.slots == 1  # the last decrease was just now
    rounds = []
    for _ in range(3):
        await anyio.sleep(INCREASE_INTERVAL_S)
        before, answers = limit.slots, 0
        while limit.slots == before:
            limit.succeeded()
            answers += 1
        rounds.append(answers)
    # At 1 the round was counted already; then two answers at 2, three at 3.
    assert rounds == [1, 2, 3]
    for _ in range(100):
        await anyio.sleep(INCREASE_INTERVAL_S)
        limit.succeeded()
    assert limit.slots == 4


async def test_the_limit_grows_by_one_slot_an_interval_at_most() -> None:
    limit = AimdLimit(ceiling=8)
    limit.throttled(clock.now())
    await anyio.sleep(INCREASE_INTERVAL_S)
    for _ in range(4):
        limit.succeeded()
    assert limit.slots == 5
    for _ in range(100):
        limit.succeeded()
    assert limit.slots == 5  # a round's worth and more, but within the interval
    await anyio.sleep(INCREASE_INTERVAL_S)
    limit.succeeded()  # the answers of the interval count for the round
    assert limit.slots == 6


async def test_a_lower_limit_admits_no_new_request_until_fewer_run() -> None:
    limit = AimdLimit(ceiling=4)
    held = [await limit.acquire() for _ in range(4)]
    limit.throttled(held[0])
    assert limit.slots == 2
    admitted: list[int] = []

    async def request(i: int) -> None:
        await limit.acquire()
        admitted.append(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, 1)
        await settle()
        limit.release()
        limit.release()
        await settle()
        assert admitted == []  # two still run: the limit is two
        limit.release()
        await settle()
        assert admitted == [1]
    limit.release()
    limit.release()
    assert limit.in_flight == 0


async def test_growth_wakes_a_waiter_and_a_cancelled_wait_takes_no_slot() -> None:
    limit = AimdLimit(ceiling=2)
    first = await limit.acquire()
    await limit.acquire()
    limit.throttled(first)
    limit.release()
    assert (limit.slots, limit.in_flight) == (1, 1)
    with anyio.move_on_after(1.0):
        await limit.acquire()
    assert (limit.in_flight, limit.waiting) == (1, 0)
    got: list[str] = []

    async def waiter() -> None:
        await limit.acquire()
        got.append("slot")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await settle()
        assert got == []
        await anyio.sleep(INCREASE_INTERVAL_S)
        limit.succeeded()  # 1 -> 2: the waiter gets the new slot
        await settle()
        assert got == ["slot"]
    assert limit.in_flight == 2


def test_floor_and_ceiling_are_checked() -> None:
    with pytest.raises(ValueError, match="floor"):
        AimdLimit(ceiling=2, floor=3)
    with pytest.raises(ValueError, match="floor"):
        AimdLimit(ceiling=2, floor=0)
