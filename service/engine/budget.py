"""The delete budget: at most ``deletes_per_minute`` DELETEs in any rolling 60 s window.

Two stages, on the event loop's clock:

1. **Pacing** (aiolimiter): a leaky bucket of capacity ``C = max(1, N // 10)`` draining at
   ``(N - C) / 60`` per second admits at most ``C + r*60 = N`` in any window: a small burst, then
   an even spread; a backlog runs at 90 % of the cap. A cap of 1 has no bucket.
2. **The exact guard**: the last N grant times; a grant is allowed only when fewer than N lie in
   ``(now - 60, now]``. This alone enforces ``grant[i + N] - grant[i] >= 60`` for every i, and is
   what the virtual-time tests check window by window.

**The token is taken last.** A caller first waits for its :class:`Turn` (first come, first
served: an ``anyio.Lock`` is fair) until both stages would grant *now*, consuming nothing; holding
it, it makes its final checks, then takes the token (:meth:`Turn.take`) and hands the DELETE to
the API client at once: the grant times bounded are the times the DELETEs are sent, and a
candidate that fails its final checks spends no token.
"""

from __future__ import annotations

from collections import deque

import anyio

from service.kit import clock
from service.kit.ratelimit import AsyncLimiter, capped_shape, limiter

PACER_POLL_MAX_S = 0.05
"""How often, at most, the head of the line looks at the pacer while it waits (aiolimiter can
wait only by consuming); at most a tenth of a token's drain time too."""


class Turn:
    """The head of the budget's line, with a grant available now. Ends with :meth:`take` or
    :meth:`release` (both idempotent; ``release`` after ``take`` does nothing)."""

    __slots__ = ("_budget", "_held")

    def __init__(self, budget: DeleteBudget) -> None:
        self._budget = budget
        self._held = True

    async def take(self) -> float:
        """Spend the token now and give up the turn; returns the grant time. Never suspends: the
        pacer had capacity when the turn began and only its holder consumes it
        (``test_taking_a_turn_never_yields_to_the_loop``)."""
        if not self._held:
            raise RuntimeError("this turn has ended")
        budget = self._budget
        if budget._pacer is not None:
            await budget._pacer.acquire()
        now = clock.now()
        budget._grants.append(now)  # maxlen drops the oldest: only the last N matter
        self.release()
        return now

    def release(self) -> None:
        """Give up the turn without a grant (the next caller gets it)."""
        if self._held:
            self._held = False
            self._budget._lock.release()


class DeleteBudget:
    """``turn = await budget.turn()``, final checks, ``await turn.take()``, then the DELETE."""

    def __init__(self, deletes_per_minute: int, *, window_s: float = 60.0) -> None:
        if deletes_per_minute < 1:
            raise ValueError("deletes_per_minute must be at least 1")
        self._cap = deletes_per_minute
        self._window_s = window_s
        self._grants: deque[float] = deque(maxlen=deletes_per_minute)
        self._lock = anyio.Lock()
        shape = capped_shape(deletes_per_minute, window_s)
        self._pacer: AsyncLimiter | None = None
        self._pacer_poll_s = PACER_POLL_MAX_S
        if shape is not None:
            self._pacer = limiter(burst=shape[0], per_second=shape[1])
            self._pacer_poll_s = min(PACER_POLL_MAX_S, 0.1 / shape[1])

    async def turn(self) -> Turn:
        """Wait for the head of the line with a grant available now; consumes nothing (nor does a
        cancelled wait). The caller must end the turn; while it holds it, every other waits."""
        await self._lock.acquire()
        try:
            while True:
                if len(self._grants) == self._cap:
                    # One expression for the test and the wake-up time: ``now - oldest >=
                    # window`` can stay false at the very deadline (rounding), and spin.
                    free_at = self._grants[0] + self._window_s
                    if clock.now() < free_at:
                        await clock.sleep_until(free_at)
                        continue
                if self._pacer is not None and not self._pacer.has_capacity():
                    await anyio.sleep(self._pacer_poll_s)
                    continue
                return Turn(self)
        except BaseException:
            self._lock.release()
            raise

    def retry_after_s(self) -> float:
        """How long until the exact guard would grant again (0 when it would now)."""
        if len(self._grants) < self._cap:
            return 0.0
        return max(0.0, self._grants[0] + self._window_s - clock.now())
