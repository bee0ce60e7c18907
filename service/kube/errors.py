"""The Kubernetes adapter's error edge: what counts as no answer, and reading failed answers.

Every request of the adapter fails in one of two typed ways (``service.kit.errors``):

- :data:`TRANSIENT_ERRORS` — what aiohttp and the socket layer raise when no answer arrives
  (refused, reset, dropped, timed out) — becomes :class:`~service.kit.errors.Unavailable` through
  :func:`unavailable`, the original chained as ``__cause__``;
- an answer with an unexpected status becomes :class:`KubeApiError` (an ``ApiError``: status,
  the ``Status`` body's message, ``Retry-After``), which :func:`gone`, :func:`too_large` and
  :func:`rejected` (of its status) classify, as client-go's ``apierrors.IsGone`` and its kin.

Answers a caller always expects (a 404 on GET, a 409 on DELETE) are values of that caller.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, cast

import aiohttp
import msgspec

from service.kit.errors import ApiError, Unavailable

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    TimeoutError,  # asyncio.TimeoutError is TimeoutError (an OSError) since Python 3.11
    OSError,
)
"""No answer from the API server: connection refused, reset or dropped, a response cut short,
or a timeout (``aiohttp.ClientTimeout`` raises ``asyncio.TimeoutError``)."""


def unavailable(what: str, exc: BaseException) -> Unavailable:
    """The kit's :class:`~service.kit.errors.Unavailable` for one of :data:`TRANSIENT_ERRORS`,
    with ``exc`` as its ``__cause__`` (raise it: ``raise unavailable("GET pod", exc) from exc``)."""
    error = Unavailable(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


async def raw_response(call: Awaitable[Any]) -> aiohttp.ClientResponse:
    """The aiohttp response of a generated API call made with ``_preload_content=False``
    (the generated methods are typed as returning models, which they do not then)."""
    return cast(aiohttp.ClientResponse, await call)


async def read_whole(call: Awaitable[Any]) -> tuple[aiohttp.ClientResponse, bytes]:
    """Make a ``_preload_content=False`` call and read its whole body; the connection goes back
    to the pool either way (status and headers stay readable on the response)."""
    response = await raw_response(call)
    try:
        return response, await response.read()
    finally:
        response.release()


class KubeApiError(ApiError):
    """A Kubernetes API call answered, but not as expected (``status`` is the HTTP status)."""


def gone(exc: ApiError) -> bool:
    """410 Gone: the resourceVersion or continue token asked for is no longer served."""
    return exc.status == 410


def too_large(exc: ApiError) -> bool:
    """A resourceVersion newer than the server's cache has seen (a server behind the others)."""
    return exc.status == 504 and "Too large resource version" in exc.message


def rejected(status: int) -> bool:
    """A 4xx other than 429: the server refuses the request itself, retrying it is useless."""
    return 400 <= status < 500 and status != 429


class WireStatus(msgspec.Struct):
    """The parts of a ``Status`` object we read."""

    message: str = ""
    reason: str = ""
    code: int = 0


_status_decoder = msgspec.json.Decoder(WireStatus)


def status_message(raw: bytes) -> str:
    """The ``message`` of a Status body, or a short excerpt of whatever came instead."""
    try:
        parsed = _status_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return raw[:200].decode("utf-8", "replace")
    return parsed.message or parsed.reason


def parse_retry_after(raw: str | None) -> float | None:
    """``Retry-After`` in seconds (only the delta-seconds form the API server sends)."""
    if not raw:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if value >= 0 else None
