"""Exponential backoff with jitter: one policy, for per-key retries and for reconnect loops.

:class:`Backoff` is the policy: after ``failures`` failures in a row, ``min(max_s, initial_s *
2**failures)``, less up to ``jitter`` of it at random, so that replicas or keys cut off by one
outage do not retry in lockstep. :class:`Attempts` counts the failures of one loop.
"""

from __future__ import annotations

import random

_MAX_EXPONENT = 64
"""2**64 * initial overflows nothing in Python but is absurd: the exponent is capped first."""


class Backoff:
    """The policy; it draws its jitter from ``rng`` (by default a random source of its own)."""

    __slots__ = ("initial_s", "jitter", "max_s", "rng")

    def __init__(
        self,
        *,
        initial_s: float,
        max_s: float,
        jitter: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError("need 0 < initial_s <= max_s")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError("jitter must be within [0, 1]")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        """Fraction taken off at random: a delay is uniform in ``[(1 - jitter) d, d]``."""
        self.rng = rng if rng is not None else random.Random()

    def delay_s(self, failures: int) -> float:
        """The delay before the next try after ``failures`` (>= 0) failures in a row."""
        base = min(self.max_s, self.initial_s * 2.0 ** min(max(failures, 0), _MAX_EXPONENT))
        if self.jitter > 0:
            base *= 1.0 - self.jitter * self.rng.random()
        return base


class Attempts:
    """Consecutive failures of one loop, and the delay each one earns."""

    __slots__ = ("_failures", "backoff")

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self._failures = 0

    @property
    def failures(self) -> int:
        return self._failures

    def next_delay(self, floor_s: float | None = None) -> float:
        """Count one more failure; the delay before the next try (at least ``floor_s``, the
        server's Retry-After when it sent one)."""
        delay = self.backoff.delay_s(self._failures)
        self._failures += 1
        return max(delay, floor_s) if floor_s is not None else delay

    def reset(self) -> None:
        self._failures = 0
