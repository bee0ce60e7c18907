"""service.kit.timeouts.fail_after behaves as anyio.fail_after, scenario by scenario; and
service.kit.clock.wait_until ends on the event, on the deadline or on a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from service.kit import clock
from service.kit.timeouts import fail_after
from tests.virtualtime import advance, pending_timers, settle

pytestmark = pytest.mark.anyio

Bound = Callable[[float], Any]
"""anyio.fail_after or the kit's: a context manager factory yielding a cancel scope."""


async def completes(bound: Bound) -> list[object]:
    with bound(30) as scope:
        await anyio.sleep(0)
    return ["after", scope.cancel_called, scope.cancelled_caught]


async def expires(bound: Bound) -> list[object]:
    with bound(0.01) as scope:
        await anyio.sleep(30)
    return ["after", scope.cancelled_caught]


async def expires_without_a_checkpoint(bound: Bound) -> list[object]:
    with bound(0) as scope:
        pass  # cancelled at once, but nothing awaited: no cancellation was caught
    return ["after", scope.cancel_called, scope.cancelled_caught]


async def cancelled_from_outside(bound: Bound) -> list[object]:
    seen: list[object] = []
    with anyio.CancelScope() as outer:
        with bound(30) as scope:
            outer.cancel()
            await anyio.sleep(30)
        seen.append("after inner")
    return [*seen, outer.cancelled_caught, scope.cancel_called, scope.cancelled_caught]


async def cancelled_by_its_own_scope(bound: Bound) -> list[object]:
    with bound(30) as scope:
        scope.cancel()
        await anyio.sleep(30)
    return ["after", scope.cancel_called, scope.cancelled_caught]


async def body_raises(bound: Bound) -> list[object]:
    with bound(30):
        await anyio.sleep(0)
        raise ValueError("the body's own")


async def deadline_moved_later(bound: Bound) -> list[object]:
    with bound(0.01) as scope:
        scope.deadline = anyio.current_time() + 30
        await anyio.sleep(0.05)
    return ["after", scope.cancel_called]


async def deadline_moved_earlier(bound: Bound) -> list[object]:
    with bound(30) as scope:
        scope.deadline = anyio.current_time() - 1
        await anyio.sleep(30)
    return ["after"]


async def inner_expires_outer_does_not(bound: Bound) -> list[object]:
    seen: list[object] = []
    with bound(30) as outer:
        try:
            with bound(0.01):
                await anyio.sleep(30)
        except TimeoutError:
            seen.append("inner timed out")
        await anyio.sleep(0)
    return [*seen, outer.cancel_called]


async def outer_expires_through_inner(bound: Bound) -> list[object]:
    inner_caught: list[bool] = []
    try:
        with bound(0.01):
            try:
                with bound(30) as inner:
                    await anyio.sleep(30)
            finally:
                inner_caught.append(inner.cancelled_caught)
    except TimeoutError as exc:
        return ["outer timed out", *inner_caught, type(exc.__context__).__name__]
    return ["no timeout"]


SCENARIOS: dict[Callable[[Bound], Awaitable[list[object]]], object] = {
    completes: ["after", False, False],
    expires: TimeoutError,
    expires_without_a_checkpoint: ["after", True, False],
    cancelled_from_outside: [True, False, False],
    cancelled_by_its_own_scope: ["after", True, True],
    body_raises: ValueError,
    deadline_moved_later: ["after", False],
    deadline_moved_earlier: TimeoutError,
    inner_expires_outer_does_not: ["inner timed out", False],
    outer_expires_through_inner: ["outer timed out", False, "CancelledError"],
}


async def _outcome(scenario: Callable[[Bound], Awaitable[list[object]]], bound: Bound) -> object:
    try:
        return await scenario(bound)
    except (TimeoutError, ValueError) as exc:
        return type(exc)


@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=lambda s: s.__name__)
async def test_fail_after_behaves_as_anyios(
    scenario: Callable[[Bound], Awaitable[list[object]]],
) -> None:
    expected = SCENARIOS[scenario]
    assert await _outcome(scenario, anyio.fail_after) == expected
    assert await _outcome(scenario, fail_after) == expected


async def test_fail_after_timeout_carries_the_cancellation_as_context() -> None:
    for bound in (anyio.fail_after, fail_after):
        with pytest.raises(TimeoutError) as info, bound(0.01):
            await anyio.sleep(30)
        assert isinstance(info.value.__context__, anyio.get_cancelled_exc_class())


# -- wait_until ------------------------------------------------------------------------------


async def test_wait_until_ends_when_the_event_is_set() -> None:
    event = anyio.Event()
    out: list[object] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            out.append(await clock.wait_until(event, clock.now() + 10))

        tg.start_soon(wait)
        await settle()
        assert out == []
        event.set()
    assert out == [True]
    assert pending_timers() == 0  # its timer was cancelled


async def test_wait_until_ends_at_the_deadline_with_false() -> None:
    event = anyio.Event()
    out: list[object] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            out.append(await clock.wait_until(event, clock.now() + 10))

        tg.start_soon(wait)
        await settle()
        await advance(9.9)
        await settle()
        assert out == []
        await advance(0.1)
    assert out == [False]


async def test_wait_until_answers_true_when_the_event_and_the_deadline_come_together() -> None:
    event = anyio.Event()
    out: list[object] = []
    # Set at the deadline's very instant, by a timer that fires just before the wait's own.
    asyncio.get_running_loop().call_at(clock.now() + 10, event.set)
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            out.append(await clock.wait_until(event, clock.now() + 10))

        tg.start_soon(wait)
        await settle()
        await advance(10)
    assert out == [True]


async def test_wait_until_does_not_wait_when_already_decided() -> None:
    event = anyio.Event()
    assert await clock.wait_until(event, clock.now()) is False
    event.set()
    assert await clock.wait_until(event, clock.now() + 10) is True
    assert pending_timers() == 0


async def test_wait_until_lets_a_cancellation_from_outside_through() -> None:
    event = anyio.Event()
    out: list[object] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            try:
                out.append(await clock.wait_until(event, clock.now() + 10))
            except anyio.get_cancelled_exc_class():
                out.append("cancelled")
                raise

        tg.start_soon(wait)
        await settle()
        tg.cancel_scope.cancel()
    assert out == ["cancelled"]
    assert pending_timers() == 0
