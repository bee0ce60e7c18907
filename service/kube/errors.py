"""The Kubernetes adapter's error edge: a request fails as ``Unavailable`` (no answer;
:class:`RequestTimeout` for a timeout) or as :class:`KubeApiError` (an unexpected status), which
:func:`gone`, :func:`too_large` and :func:`rejected` classify, as client-go's ``apierrors.IsGone``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import msgspec

from service.kit.errors import ApiError, Unavailable

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, OSError)
"""No answer from the API server: connection refused, reset or dropped, a response cut short,
or a timeout (``asyncio.TimeoutError`` is ``TimeoutError``, an ``OSError``)."""


class RequestTimeout(Unavailable):
    """No answer within the request's timeout (or no request slot within it)."""


def unanswered(what: str, exc: BaseException) -> Unavailable:
    """``exc``, one of :data:`TRANSIENT_ERRORS`, as the ``Unavailable`` it means (a timeout as
    :class:`RequestTimeout`); the caller raises it from ``exc``."""
    kind = RequestTimeout if isinstance(exc, TimeoutError) else Unavailable
    return kind(f"{what}: {type(exc).__name__}: {exc}")


@contextmanager
def answering(what: str) -> Iterator[None]:
    """:data:`TRANSIENT_ERRORS` as ``Unavailable`` (:func:`unanswered`), the original chained as
    ``__cause__``: the request path's one catch. The watch stream's lines catch them inline
    (a context manager a line costs the stream's reader a tenth of its CPU)."""
    try:
        yield
    except TRANSIENT_ERRORS as exc:
        raise unanswered(what, exc) from exc


class KubeApiError(ApiError):
    """A Kubernetes API call answered, but not as expected: its status, the ``Status`` body's
    message, ``Retry-After``."""


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
