"""A watch stream's lines as typed events, as apimachinery's ``StreamWatcher`` is for client-go:
the reflector decides on events and never reads bytes. Pods decode straight into
:class:`PodSnapshot`; a line that cannot be used is counted, logged and skipped; a connection
lost mid-stream raises ``Unavailable``.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec

from service.domain import PodSnapshot
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import TRANSIENT_ERRORS, WireStatus, unanswered
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)


class LineReader(Protocol):
    async def readline(self) -> bytes:
        """The next line, with its newline; ``b""`` at the end of the stream."""
        ...


class Stream(Protocol):
    """An open watch response (``aiohttp.ClientResponse``)."""

    @property
    def content(self) -> LineReader: ...

    def close(self) -> None: ...


class PodChange(msgspec.Struct, frozen=True):
    """An ADDED or MODIFIED event (``deleted`` false), or a DELETED one."""

    pod: PodSnapshot
    deleted: bool


class Unreadable(msgspec.Struct, frozen=True):
    """A line that cannot be used; ``key`` is the ``namespace/name`` of the pod it changes, when
    those read."""

    key: str | None


class Bookmark(msgspec.Struct, frozen=True):
    """A BOOKMARK: the stream's position, and whether it ends a streaming list's initial
    events (``k8s.io/initial-events-end``) rather than being a periodic one."""

    resource_version: str
    initial_events_end: bool


class ErrorStatus(msgspec.Struct, frozen=True):
    """An ERROR event: the ``Status`` it carries (``code`` 500 when it has none)."""

    code: int
    message: str


SKIPPED = Unreadable(None)
WatchEvent = PodChange | Unreadable | Bookmark | ErrorStatus


class _WireEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str = ""
    annotations: dict[str, str] | None = None


class _WireBookmark(msgspec.Struct):
    metadata: _BookmarkMeta = msgspec.field(default_factory=_BookmarkMeta)


_event_decoder = msgspec.json.Decoder(_WireEvent)
_bookmark_decoder = msgspec.json.Decoder(_WireBookmark)
_status_decoder = msgspec.json.Decoder(WireStatus)
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)

_INITIAL_EVENTS_END = "k8s.io/initial-events-end"
_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")


class WatchDecoder:
    """Decodes watch lines with ``decoder``; counts events by type and the lines skipped."""

    def __init__(self, decoder: PodDecoder, metrics: KubeMetrics) -> None:
        self._decoder = decoder
        self._counters = {t: metrics.watch_events.labels(type=t) for t in _TYPES}
        self._errors = metrics.decode_errors.labels(source="watch")

    def decode(self, line: bytes) -> WatchEvent:
        """The event of one line; :data:`SKIPPED` for a line skipped (counted and logged)."""
        try:
            event = _event_decoder.decode(line)
        except _DECODE_ERRORS as exc:
            self._skip("malformed watch event: %s", exc)
            return SKIPPED
        kind = event.type
        counter = self._counters.get(kind)
        if counter is not None:
            counter.inc()
        match kind:
            case "ADDED" | "MODIFIED" | "DELETED":
                try:
                    return PodChange(self._decoder.decode(event.object), kind == "DELETED")
                except PodDecodeError as exc:
                    self._skip("skipped malformed pod in a %s event: %s", exc, kind)
                    return Unreadable(_key_of(event.object))
            case "BOOKMARK":
                try:
                    meta = _bookmark_decoder.decode(event.object).metadata
                except _DECODE_ERRORS as exc:
                    self._skip("malformed bookmark: %s", exc)
                    return SKIPPED
                end = (meta.annotations or {}).get(_INITIAL_EVENTS_END) == "true"
                return Bookmark(meta.resourceVersion, end)
            case "ERROR":
                try:
                    status = _status_decoder.decode(event.object)
                except _DECODE_ERRORS:
                    status = WireStatus(message="undecodable ERROR event", code=500)
                return ErrorStatus(status.code or 500, status.message or status.reason)
            case _:
                self._skip("unknown watch event type %r", kind)
                return SKIPPED

    def _skip(self, message: str, *args: object) -> None:
        self._errors.inc()
        logger.warning(message, *args)


class EventStream:
    """The events of an open watch ``response``; ``what`` names it in an ``Unavailable``."""

    __slots__ = ("_decode", "_readline", "_response", "_what")

    def __init__(self, response: Stream, decoder: WatchDecoder, what: str) -> None:
        self._response = response
        self._readline = response.content.readline
        self._decode = decoder.decode
        self._what = what

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> WatchEvent:
        while True:
            try:
                line = await self._readline()
            except TRANSIENT_ERRORS as exc:
                raise unanswered(self._what, exc) from exc
            if not line:
                raise StopAsyncIteration
            if line.strip():
                return self._decode(line)

    def close(self) -> None:
        self._response.close()


def _key_of(raw: msgspec.Raw) -> str | None:
    try:
        meta = msgspec.json.decode(raw).get("metadata", {})
        namespace, name = meta.get("namespace"), meta.get("name")
    except (msgspec.DecodeError, AttributeError):
        return None
    return f"{namespace}/{name}" if isinstance(namespace, str) and isinstance(name, str) else None
