"""Errors of the Kubernetes adapter, and reading ``Status`` bodies of failed responses.

``KubeApiError`` (status, message, retry_after_s) is raised by the pod client's ``get_pod`` on
anything but 200/404, and used inside the informer to decide between relist (410) and backoff
(everything else). ``status == 0`` means no HTTP answer (timeout, refused connection).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, cast

import aiohttp
import msgspec

from service.kit.errors import ApiError


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
    """A Kubernetes API call that did not give the expected answer."""


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
