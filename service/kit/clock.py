"""Time, injected one way: a real monotonic clock, a fake one for tests and the demo, and sleeping.

Every part that reads or waits for time takes one :class:`SchedulingClock` (``clock=``). Reading
is ``monotonic()``; the work queue's delayed adds, the delete budget's window, backoff sleeps and
the graceful drain all wait until a deadline. They do so through one
primitive, ``call_at(deadline, callback)``, instead of ``anyio.sleep``: a real clock maps it onto
the event loop's timers, and :class:`FakeClock` keeps its own timer heap that ``advance()`` fires
synchronously, in deadline order, with ``monotonic()`` reading exactly each timer's deadline while
it runs. So a fake-clock test never sleeps for real: it advances the clock and lets the woken
tasks run (``await anyio.wait_all_tasks_blocked()``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.lowlevel


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, never going backwards."""
        ...


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class SchedulingClock(Clock, Protocol):
    """A monotonic clock that can also call back at a deadline (on the event loop thread)."""

    def call_at(self, deadline: float, callback: Callable[[], object]) -> Cancellable:
        """Call ``callback()`` once ``monotonic() >= deadline``; ``cancel()`` prevents it."""
        ...


class MonotonicClock:
    """The production clock: ``time.monotonic`` and the running asyncio loop's timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    def call_at(self, deadline: float, callback: Callable[[], object]) -> Cancellable:
        loop = asyncio.get_running_loop()
        # call_later rather than call_at: the loop's clock need not be time.monotonic.
        return loop.call_later(max(0.0, deadline - time.monotonic()), callback)


class _FakeTimer:
    __slots__ = ("callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], object]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Virtual time. Nothing moves until :meth:`advance`; timers fire inside ``advance``."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self._now = start_s
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def call_at(self, deadline: float, callback: Callable[[], object]) -> Cancellable:
        # A deadline already reached fires on the next advance (even advance(0)), never
        # re-entrantly from inside call_at.
        timer = _FakeTimer(deadline, callback)
        heapq.heappush(self._timers, (deadline, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, firing every due timer at its own deadline, in order."""
        if seconds < 0:
            raise ValueError("a monotonic clock never goes backwards")
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            deadline, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, deadline)
            timer.callback()
        self._now = target

    @property
    def next_deadline(self) -> float | None:
        """The earliest pending (not cancelled) timer, or ``None``."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None


async def sleep_until(clock: SchedulingClock, deadline: float) -> None:
    """Sleep until ``clock.monotonic() >= deadline`` (a checkpoint even when already there)."""
    if deadline <= clock.monotonic():
        await anyio.lowlevel.checkpoint()
        return
    event = anyio.Event()
    handle = clock.call_at(deadline, event.set)
    try:
        await event.wait()
    finally:
        handle.cancel()


async def wait_until(event: anyio.Event, clock: SchedulingClock, deadline: float) -> bool:
    """Wait for ``event`` but not past ``deadline`` on ``clock``; True when the event is set.

    One cancel scope around the wait, cancelled by the clock's timer at the deadline (no task
    of its own): a cancellation from outside propagates as ever, and the answer is whether the
    event is set when the wait ends, whichever ended it."""
    if event.is_set():
        return True
    if deadline <= clock.monotonic():
        return False
    with anyio.CancelScope() as scope:
        handle = clock.call_at(deadline, scope.cancel)
        try:
            await event.wait()
        finally:
            handle.cancel()
    return event.is_set()
