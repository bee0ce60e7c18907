"""The delete budget: at most ``deletes_per_minute`` DELETEs in any rolling 60 s window.

Two stages, each with its own job:

1. **Pacing** (aiolimiter). ``AsyncLimiter(N, 60)`` is a leaky bucket that
   starts empty: it admits a burst of N and then drains at N/60 per second, so up to ~2N in the
   first minute. A leaky bucket of capacity C and rate r admits at most ``C + r*60`` in any
   window, so we size it ``C = max(1, N // 10)``, ``r = (N - C) / 60``: a small burst, then an
   even spread, at most N per window, and a backlog runs at ``N - C`` per window (90 % of the
   cap). A cap of 1 has no such bucket: the exact guard alone paces it.
2. **The exact guard** (always on). A record of the last N grant times: a grant
   is allowed only when fewer than N grants lie in ``(now - 60, now]``; otherwise the caller
   waits until the oldest one leaves the window. This alone enforces the invariant exactly
   (``grant[i + N] - grant[i] >= 60`` for every i) and lets a backlog reach the cap, and it is
   what the virtual-time tests check window by window.

Both stages read the event loop's clock (``service/kit/clock.py``), as every wait here does.

**The token is taken last.** A caller first waits for its :class:`Turn`: first come, first
served (an ``anyio.Lock`` is fair), until both stages would grant *now*; nothing is consumed yet.
Holding the turn, it makes its final checks (the reconciler re-verifies a check that aged while
it waited), and only then takes the token with :meth:`Turn.take`, which never suspends, and hands
the DELETE to the API client at once. So the grant times the two stages bound are the times the
DELETEs are sent — however long the wait, the re-verification or a starved event loop took — and
a candidate that fails its final checks gives its turn to the next caller without spending a
token. Only one caller holds the turn; capacity only grows while it does.
"""

from __future__ import annotations

from collections import deque

import anyio

from service.kit import clock
from service.kit.ratelimit import AsyncLimiter, capped_limiter, capped_shape

PACER_POLL_MAX_S = 0.05
"""How often the head of the line looks at the pacer while it waits (aiolimiter can wait only by
consuming): at most this, and at most a tenth of a token's drain time."""


class Turn:
    """The head of the budget's line, with a grant available now. Ends with :meth:`take` or
    :meth:`release` (both idempotent; ``release`` after ``take`` does nothing)."""

    __slots__ = ("_budget", "_held")

    def __init__(self, budget: DeleteBudget) -> None:
        self._budget = budget
        self._held = True

    async def take(self) -> float:
        """Spend the token now and give up the turn; returns the grant time.

        Never suspends: the pacer had capacity when the turn began, only the turn's holder
        consumes it, and a leaky bucket only drains while it is held, so aiolimiter's
        ``acquire`` returns without waiting (``test_taking_a_turn_never_yields_to_the_loop``).
        """
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

    def __init__(
        self,
        deletes_per_minute: int,
        *,
        window_s: float = 60.0,
    ) -> None:
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
            self._pacer = capped_limiter(deletes_per_minute, window_s)
            self._pacer_poll_s = min(PACER_POLL_MAX_S, 0.1 / shape[1])

    async def turn(self) -> Turn:
        """Wait for the head of the line with a grant available now; consumes nothing.

        Cancellation while waiting holds nothing. The caller must end the turn (``take`` or
        ``release``); while it holds it, every other caller waits.
        """
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
