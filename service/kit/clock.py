"""Time: the running event loop's clock, the one source of time (docs/architecture.md, "Time").

Everything that reads time, sleeps, times out or schedules does it on the running asyncio loop:
:func:`now` is ``loop.time()`` (anyio's ``current_time()`` on the asyncio backend, the only one
the service runs on), and waits are anyio's (``sleep``, ``move_on_after``, ``fail_after``, a
:class:`~anyio.CancelScope` deadline) or ``loop.call_at``/``call_later``, all of which read that
same clock. No part keeps a timer heap of its own. A test that needs fake time runs the code on
a virtual-time loop (``tests/virtualtime.py``): nothing else changes.

:func:`sleep_until` and :func:`wait_until` wait until an absolute deadline on that clock (one
cancel scope with the deadline, so a deadline read from :func:`now` is met exactly, without the
rounding of ``sleep(deadline - now())``).
"""

from __future__ import annotations

import asyncio

import anyio


def now() -> float:
    """Seconds on the running event loop's clock (monotonic, arbitrary origin)."""
    return asyncio.get_running_loop().time()


async def sleep_until(deadline: float) -> None:
    """Sleep until :func:`now` reaches ``deadline`` (a checkpoint even when already there)."""
    with anyio.CancelScope(deadline=deadline):
        await anyio.sleep_forever()


async def wait_until(event: anyio.Event, deadline: float) -> bool:
    """Wait for ``event`` but not past ``deadline``; True when the event is set.

    One cancel scope around the wait: a cancellation from outside propagates as ever, and the
    answer is whether the event is set when the wait ends, whichever ended it."""
    if event.is_set():
        return True
    with anyio.CancelScope(deadline=deadline):
        await event.wait()
    return event.is_set()
