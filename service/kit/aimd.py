"""An adaptive concurrency limit: additive increase, multiplicative decrease (AIMD).

:class:`AimdLimit` is a fair (first come, first served) semaphore whose size follows the answers
it gets, as TCP's congestion window does: ``limit`` answers in a row add one slot, at most one
per ``increase_interval_s``; a throttle signal (an HTTP 429) halves it, within ``floor`` and
``ceiling``, once per round (a signal from a request granted before the last decrease was sent
under the old limit). Requests running when the limit drops finish; no new one starts until
fewer run than the new limit. Time is the kit's clock; nothing here sleeps.
"""

from __future__ import annotations

from collections import deque

import anyio

from service.kit import clock

INCREASE_INTERVAL_S = 1.0
"""Least time between two increases of the limit (and after a decrease)."""


class _Waiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False


class AimdLimit:
    """``started_at = await limit.acquire()``, the request, ``limit.release()``; between them
    :meth:`succeeded` or :meth:`throttled` (with ``started_at``) as the answer says."""

    def __init__(
        self, *, ceiling: int, floor: int = 1, increase_interval_s: float = INCREASE_INTERVAL_S
    ) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError("need 1 <= floor <= ceiling")
        self.floor = floor
        self.ceiling = ceiling
        self.increase_interval_s = increase_interval_s
        self._changed_at = float("-inf")
        self.limit = ceiling
        """How many may run at once now."""
        self._answers = 0
        """Answers since the limit last changed."""
        self.in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self._decreased_at = float("-inf")

    @property
    def slots(self) -> int:
        return self.limit

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> float:
        """Wait for a slot (in arrival order); returns the time it was granted, which
        :meth:`throttled` takes. A cancelled wait takes no slot."""
        if self.in_flight < self.slots and not self._waiters:
            self.in_flight += 1
            return clock.now()
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()
            else:
                self._waiters.remove(waiter)
            raise
        return clock.now()

    def release(self) -> None:
        """Give a slot back (the longest waiter gets it when the limit allows)."""
        self.in_flight -= 1
        self._grant()

    def succeeded(self) -> None:
        """An answer that was not a throttle signal: the ``limit``-th in a row adds a slot, when
        ``increase_interval_s`` has passed since the limit last changed."""
        if self.limit >= self.ceiling:
            return
        self._answers += 1
        if self._answers < self.limit:
            return
        now = clock.now()
        if now - self._changed_at < self.increase_interval_s:
            return
        self._answers = 0
        self._changed_at = now
        self.limit += 1
        self._grant()

    def throttled(self, started_at: float) -> bool:
        """A throttle signal for a request granted at ``started_at``: the limit halves, unless
        it already did after that request began. True when it halved."""
        if started_at <= self._decreased_at:
            return False
        self._decreased_at = self._changed_at = clock.now()
        self._answers = 0
        self.limit = max(self.floor, self.limit // 2)
        return True

    def _grant(self) -> None:
        while self._waiters and self.in_flight < self.slots:
            waiter = self._waiters.popleft()
            waiter.granted = True
            self.in_flight += 1
            waiter.event.set()
