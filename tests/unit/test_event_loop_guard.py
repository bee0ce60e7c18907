"""The test-wide event-loop guard (tests/conftest.py) fails a test whose task raises unobserved.

The guard itself runs in teardown, so these tests drive its fixture function directly: each
makes the loop report something and checks that the guard turns it into a failure.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.loopguard import under_guard


@pytest.mark.anyio
async def test_the_guard_fails_a_test_whose_task_raised_and_was_never_awaited() -> None:
    async def body() -> None:
        async def boom() -> None:
            raise ConnectionError("unexpected connection_lost() call")

        task = asyncio.get_running_loop().create_task(boom())
        await asyncio.sleep(0)
        assert task.done()
        del task  # dropped without anyone looking at its exception

    message = await under_guard(body)
    assert message is not None
    assert "never retrieved" in message
    assert "unexpected connection_lost() call" in message


@pytest.mark.anyio
async def test_the_guard_fails_a_test_whose_callback_raised() -> None:
    async def body() -> None:
        def callback() -> None:
            raise ValueError("raised in a callback")

        asyncio.get_running_loop().call_soon(callback)
        await asyncio.sleep(0)

    message = await under_guard(body)
    assert message is not None
    assert "raised in a callback" in message


@pytest.mark.anyio
async def test_the_guard_passes_a_test_whose_task_exception_was_retrieved() -> None:
    async def body() -> None:
        async def boom() -> None:
            raise ConnectionError("observed")

        task = asyncio.get_running_loop().create_task(boom())
        with pytest.raises(ConnectionError):
            await task

    assert await under_guard(body) is None
