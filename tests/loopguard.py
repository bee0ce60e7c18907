"""Drive the test-wide event-loop guard (``tests/conftest.py``) by hand, to test what it catches."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from tests import conftest


async def under_guard(body: Callable[[], Awaitable[None]]) -> str | None:
    """Run ``body`` inside the guard; the guard's failure message, or None when it passed."""
    guard = conftest.event_loop_guard.__wrapped__()  # type: ignore[attr-defined]
    await guard.__anext__()
    await body()
    try:
        await guard.__anext__()
    except StopAsyncIteration:
        return None
    except pytest.fail.Exception as failure:
        return str(failure)
    raise AssertionError("the guard yielded twice")
