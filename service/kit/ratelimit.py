"""Rate limiting with aiolimiter, shaped so that a cap per window holds.

``AsyncLimiter(C, C / r)`` admits ``C`` at once and then ``r`` per second: up to ``C + r * W`` in
a window of ``W`` seconds. :func:`capped_shape` sizes it so that this is the cap;
:func:`limiter` is a plain burst-and-rate bucket. aiolimiter reads the event loop's clock.
"""

from __future__ import annotations

from aiolimiter import AsyncLimiter

__all__ = ["AsyncLimiter", "capped_shape", "limiter"]


def capped_shape(cap: int, window_s: float = 60.0) -> tuple[int, float] | None:
    """``(capacity, rate_per_s)`` of a bucket that never admits more than ``cap`` in any window of
    ``window_s``: ``capacity = max(1, cap // 10)``, the rest spread evenly (``None``: cap 1)."""
    capacity = max(1, cap // 10)
    if cap - capacity <= 0:
        return None
    return capacity, (cap - capacity) / window_s


def limiter(*, burst: int, per_second: float) -> AsyncLimiter:
    """A bucket that admits ``burst`` at once, then ``per_second``."""
    if burst < 1 or per_second <= 0:
        raise ValueError("need burst >= 1 and per_second > 0")
    return AsyncLimiter(burst, burst / per_second)
