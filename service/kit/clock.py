"""Time: the running event loop's clock, the one source of time (docs/architecture.md, "Time").

Everything that reads time, sleeps, times out or schedules does it on the running asyncio loop:
:func:`now` is ``loop.time()``, and anyio's waits and ``loop.call_at`` read that same clock. No
part keeps a timer heap of its own; a test that needs fake time runs the code on a virtual-time
loop (``tests/virtualtime.py``). :func:`sleep_until` and :func:`wait_until` wait for an absolute
deadline (one cancel scope, without the rounding of ``sleep(deadline - now())``).
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
    """Wait for ``event`` but not past ``deadline``; True when the event is set."""
    if event.is_set():
        return True
    with anyio.CancelScope(deadline=deadline):
        await event.wait()
    return event.is_set()
