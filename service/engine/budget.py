"""The delete budget: at most ``deletes_per_minute`` DELETEs in any rolling 60 s window.

Two stages, each with its own job:

1. **Pacing** (aiolimiter, real clock only). ``AsyncLimiter(N, 60)`` is a leaky bucket that
   starts empty: it admits a burst of N and then drains at N/60 per second, so up to ~2N in the
   first minute. A leaky bucket of capacity C and rate r admits at most ``C + r*60`` in any
   window, so we size it ``C = max(1, N // 10)``, ``r = (N - C) / 60``: a small burst, then an
   even spread, at most N per window, and a backlog runs at ``N - C`` per window (90 % of the
   cap). aiolimiter reads the event loop's clock, which a fake clock cannot drive, so pacing is
   off (``pace=False``) in fake-clock tests.
2. **The exact guard** (always on, injected clock). A record of the last N grant times: a grant
   is allowed only when fewer than N grants lie in ``(now - 60, now]``; otherwise the caller
   waits until the oldest one leaves the window. This alone enforces the invariant exactly
   (``grant[i + N] - grant[i] >= 60`` for every i) and lets a backlog reach the cap, and it is
   what the fake-clock tests check window by window. Waiters are served first come, first
   served (an ``anyio.Lock`` is fair).

The bound is on grant times. The reconciler takes a token only for a candidate that is already
past its threshold, then re-verifies (fresh GET and row re-read) before deleting; a candidate
that fails re-verification wastes its token, which only ever errs towards deleting less.
"""

from __future__ import annotations

from collections import deque

import anyio
from aiolimiter import AsyncLimiter

from service.engine.clock import SchedulingClock, sleep_until


def pacer_shape(deletes_per_window: int, window_s: float = 60.0) -> tuple[int, float] | None:
    """``(capacity, rate_per_s)`` of a leaky bucket that never exceeds the cap in a window.

    ``None`` when no such bucket exists with a positive rate (a cap of 1 per window): the exact
    guard then does all the work.
    """
    capacity = max(1, deletes_per_window // 10)
    if deletes_per_window - capacity <= 0:
        return None
    return capacity, (deletes_per_window - capacity) / window_s


class DeleteBudget:
    """``await acquire()`` before each DELETE; returns the grant time (monotonic seconds)."""

    def __init__(
        self,
        deletes_per_minute: int,
        *,
        clock: SchedulingClock,
        window_s: float = 60.0,
        pace: bool = True,
    ) -> None:
        if deletes_per_minute < 1:
            raise ValueError("deletes_per_minute must be at least 1")
        self._cap = deletes_per_minute
        self._window_s = window_s
        self._clock = clock
        self._grants: deque[float] = deque(maxlen=deletes_per_minute)
        self._lock = anyio.Lock()
        shape = pacer_shape(deletes_per_minute, window_s) if pace else None
        self._pacer: AsyncLimiter | None = None
        if shape is not None:
            capacity, rate_per_s = shape
            # AsyncLimiter(max_rate, time_period) is a bucket of capacity max_rate draining
            # at max_rate / time_period per second.
            self._pacer = AsyncLimiter(capacity, capacity / rate_per_s)

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def window_s(self) -> float:
        return self._window_s

    @property
    def paced(self) -> bool:
        return self._pacer is not None

    async def acquire(self) -> float:
        """Wait for a delete token; cancellation before the grant consumes nothing."""
        if self._pacer is not None:
            await self._pacer.acquire()
        async with self._lock:
            while True:
                now = self._clock.monotonic()
                if len(self._grants) < self._cap:
                    break
                # One expression for the test and the wake-up time: ``now - oldest >= window``
                # can stay false at the very deadline (rounding), and the loop would spin.
                free_at = self._grants[0] + self._window_s
                if now >= free_at:
                    break
                await sleep_until(self._clock, free_at)
            self._grants.append(now)  # maxlen drops the oldest: only the last N matter
            return now

    def retry_after_s(self) -> float:
        """How long until the exact guard would grant again (0 when it would now)."""
        if len(self._grants) < self._cap:
            return 0.0
        return max(0.0, self._grants[0] + self._window_s - self._clock.monotonic())

    def granted_in_window(self) -> int:
        now = self._clock.monotonic()
        return sum(1 for t in self._grants if now - t < self._window_s)
