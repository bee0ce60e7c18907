"""The transport's decisions that need no server: watches, time budgets, throttling, stalls.

A 429, or a 503 with ``Retry-After``, is sent again after its ``Retry-After``, at most
:data:`MAX_THROTTLE_RETRIES` times and never past the request's own timeout, as client-go's rest
client does. A DELETE's goes back to the reconciler instead: nothing may delay a DELETE after its
final check (docs/architecture.md, invariant 1).
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
import anyio

from service.kit import clock

MAX_THROTTLE_RETRIES = 10
"""Most times one request is sent again after a 429 (client-go's rest client: 10)."""
DEFAULT_RETRY_AFTER_S = 1.0
"""The wait after a 429 that carries no ``Retry-After``."""
STALL_FRACTION = 0.9
"""A request its caller cancelled after this fraction of its timeout counts as timed out (the
caller's bound and aiohttp's are the same timeout, and either may fire first)."""


def is_watch(query: Mapping[str, object] | None) -> bool:
    """Whether a request is a watch (or a streaming list): ``watch=true`` in its query."""
    return query is not None and str(query.get("watch")).lower() == "true"


def budget_s(timeout: aiohttp.ClientTimeout) -> float | None:
    """How long one request may take, retries included: its total timeout, or for a stream the
    time to connect."""
    return timeout.total if timeout.total is not None else timeout.connect


def within(timeout: aiohttp.ClientTimeout, deadline: float | None) -> aiohttp.ClientTimeout:
    """``timeout`` with its total cut to what is left before ``deadline``."""
    if deadline is None or timeout.total is None:
        return timeout
    return aiohttp.ClientTimeout(
        total=max(0.001, deadline - clock.now()),
        connect=timeout.connect,
        sock_read=timeout.sock_read,
        sock_connect=timeout.sock_connect,
        ceil_threshold=timeout.ceil_threshold,
    )


def is_throttled(status: int, retry_after_s: float | None) -> bool:
    """The server did not process the request and says when to come back (client-go's
    ``checkWait`` waits on these)."""
    return status == 429 or (status == 503 and retry_after_s is not None)


def throttle_wait(
    retry_after_s: float | None, *, delete: bool, retries: int, now: float, deadline: float | None
) -> float | None:
    """How long to wait before sending a throttled request again, after ``retries`` retries;
    ``None`` when its answer goes back to the caller instead (see the module docstring)."""
    wait_s = DEFAULT_RETRY_AFTER_S if retry_after_s is None else retry_after_s
    if delete or retries >= MAX_THROTTLE_RETRIES:
        return None
    if deadline is not None and now + wait_s >= deadline:
        return None
    return wait_s


def _given_up(exc: BaseException, waited_s: float, bound_s: float | None) -> bool:
    """Whether ``exc`` is a cancellation by a caller that waited most of ``bound_s``."""
    cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
    return cancelled and bound_s is not None and waited_s >= STALL_FRACTION * bound_s


def stalled(exc: BaseException, waited_s: float, timeout_s: float | None) -> bool:
    """Whether a request had no answer for (about) its whole timeout: its pool is suspect."""
    return isinstance(exc, TimeoutError) or _given_up(exc, waited_s, timeout_s)


def unanswered(exc: BaseException, waited_s: float, bound_s: float | None) -> bool:
    """Whether a request ended without an answer from the server: timed out, refused, reset, or
    given up by its caller after most of its budget (an earlier cancellation is the caller's
    business, e.g. a shutdown)."""
    if isinstance(exc, TimeoutError | aiohttp.ClientConnectionError | OSError):
        return True
    return _given_up(exc, waited_s, bound_s)
