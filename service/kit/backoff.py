"""Exponential backoff with jitter: one policy, for per-key retries and for reconnect loops.

:class:`Backoff` is the policy: after ``failures`` failures in a row, ``min(max_s, initial_s *
2**failures)``, less up to ``jitter`` of it at random, so that replicas or keys cut off by one
outage do not retry in lockstep. :class:`Attempts` counts the failures of one loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_MAX_EXPONENT = 64
"""2**64 * initial overflows nothing in Python but is absurd: the exponent is capped first."""


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float
    """The delay after the first failure (before jitter)."""
    max_s: float
    """The cap of every delay."""
    jitter: float = 0.0
    """Fraction of a delay taken off at random: the delay is uniform in ``[(1 - jitter) d, d]``."""
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.max_s < self.initial_s:
            raise ValueError("need 0 < initial_s <= max_s")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be within [0, 1]")

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
