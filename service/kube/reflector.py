"""The pod informer's loop: sync the store, follow the watch, and decide what comes next.

As client-go's reflector, it is the one writer of the :class:`PodStore` and the one place that
reads what the server answered and decides what to ask next; its requests are made by a
:class:`ListerWatcher` (``service/kube/listwatch.py``), which only asks. A sync fills the store
(a streaming list that then goes on as the watch, or a list, page by page, followed by a watch
from its resourceVersion), and :class:`SyncRequest` is how the next sync asks and how that falls
back: streaming list → list from the watch cache → quorum list (docs/architecture.md, "How the
cache is filled"). A list whose continue token expired is started over. A stream that ends is
watched again from the last resourceVersion seen (events and bookmarks advance it); a 410 means
that history is gone, and the store is synced again (the cache goes cold, the difference is
reported). A stream that stays silent (no event, no bookmark) for ``WATCH_SILENCE_SECONDS``, from
a server known to send bookmarks, is taken for a dead connection: closed and watched again at
once, from the same version (docs/architecture.md, "A silent watch"). A failure of the outside
world (``ExternalError``: no answer, a 5xx, a 429 with its Retry-After as the least delay) is
retried after a jittered exponential backoff (kit ``Attempts``) from where the loop was; a 4xx
other than 429 means the request itself is refused, so the next attempt syncs. Anything else
raised is a bug: it ends the loop, and with it the process.

Watch events are decoded from raw JSON lines straight into :class:`PodSnapshot` (client models
are never built); malformed lines and objects are skipped, counted and logged.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Protocol, assert_never

import anyio
import msgspec

from service.config import KubeSettings
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ApiError, ExternalError
from service.kit.memory import trim_heap
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import TRANSIENT_ERRORS, KubeApiError, WireStatus, unavailable
from service.kube.listwatch import Failed, Page
from service.kube.store import PodStore, SyncState
from service.metrics import Metrics

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


class ListerWatcher(Protocol):
    """The requests the loop makes (:class:`service.kube.listwatch.ListWatch`): each answers a
    value (a page, an open stream, or :class:`Failed`) and raises only a kit error, when no
    answer came or a page does not decode."""

    async def list(
        self,
        *,
        resource_version: str = "",
        match: str = "",
        token: str | None = None,
        limit: int | None = None,
    ) -> Page | Failed: ...

    async def stream(self, known: str | None) -> Stream | Failed: ...

    async def watch(self, rv: str) -> Stream | Failed: ...


_CONTINUE_RESTARTS = 3
"""How often a list whose continue token expired (compaction) is started over."""


class ListMode(enum.StrEnum):
    """How the cache is filled (the ``LIST_MODE`` setting)."""

    AUTO = "auto"
    """Stream; on a server that rejects or does not honour it, list from then on."""
    STREAM = "stream"
    LIST = "list"


class SyncMode(enum.StrEnum):
    """How the last sync actually filled the cache."""

    STREAM = "stream"
    """A streaming list (``sendInitialEvents``): no list request at all."""
    LIST_CACHE = "list_cache"
    """A list served from the API server's watch cache."""
    LIST_QUORUM = "list_quorum"
    """A quorum list from etcd, in pages: the last resort."""


class SyncRequest(enum.Enum):
    """How the next sync reads the server's state; the methods are the fallback between them."""

    STREAM = "stream"
    """A streaming list not older than the version last seen (the newest, before any)."""
    STREAM_NEWEST = "stream_newest"
    """A streaming list of the newest state: the version last seen is no longer served."""
    LIST = "list"
    """A list from the watch cache: ``NotOlderThan`` the version last seen, or ``0``."""
    LIST_QUORUM = "list_quorum"
    """A quorum list: the watch cache cannot serve the version last seen."""

    @classmethod
    def first(cls, mode: ListMode) -> SyncRequest:
        return cls.LIST if mode is ListMode.LIST else cls.STREAM

    def version_gone(self) -> SyncRequest:
        """The version this sync asked for is gone (410, or too large): read the newest."""
        streams = self in (SyncRequest.STREAM, SyncRequest.STREAM_NEWEST)
        return SyncRequest.STREAM_NEWEST if streams else SyncRequest.LIST_QUORUM

    def synced(self) -> SyncRequest:
        """A sync completed: the next one asks from the version it ended at again."""
        streams = self in (SyncRequest.STREAM, SyncRequest.STREAM_NEWEST)
        return SyncRequest.STREAM if streams else SyncRequest.LIST

    def unsupported(self, mode: ListMode) -> SyncRequest | None:
        """The server does not honour streaming lists: list from now on (``AUTO``), keeping
        whether the version last seen is gone; ``None`` in ``STREAM`` mode, which insists."""
        if mode is ListMode.STREAM:
            return None
        return SyncRequest.LIST_QUORUM if self is SyncRequest.STREAM_NEWEST else SyncRequest.LIST


class End(enum.StrEnum):
    """Why a watch stream ended (or was not opened), when the protocol says so."""

    CLOSED = "closed"
    """The server ended the stream (its ``timeoutSeconds``) or closed it cleanly: resume."""
    EMPTY = "empty"
    """Closed at once without a single line: a misbehaving server (back off)."""
    EXPIRED = "expired"
    """410 Gone (an answer or an ``ERROR`` event), or a version too large: relist."""
    UNSUPPORTED = "unsupported"
    """A streaming list the server rejected (a 4xx) or did not honour (a plain bookmark
    first, or silence before the initial-events-end bookmark)."""
    ERROR = "error"
    """An ``ERROR`` event with a status other than 410."""
    BROKEN = "broken"
    """A stream that broke the protocol: an initial-events-end bookmark without a version, or
    a streaming list that ended before its initial events did."""
    SILENT = "silent"
    """No event and no bookmark for the silence bound, from a server that sends bookmarks: the
    connection is taken for dead (resume at once)."""


@dataclass(frozen=True, slots=True)
class WatchEnd:
    """How a watch stream ended: the reason, and the server's status and message if any."""

    why: End
    status: int = 0
    message: str = ""

    def __str__(self) -> str:
        status = f" {self.status}" if self.status else ""
        return f"watch {self.why}{status}: {self.message}" if self.message else f"watch {self.why}"


def _too_large(status: int, message: str) -> bool:
    return status == 504 and "Too large resource version" in message


def rejected(status: int) -> bool:
    """A 4xx other than 429: the server refuses the request itself, retrying it is useless."""
    return 400 <= status < 500 and status != 429


class _WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str = ""
    annotations: dict[str, str] | None = None


class _Bookmark(msgspec.Struct):
    metadata: _BookmarkMeta = msgspec.field(default_factory=_BookmarkMeta)


class _KeyMeta(msgspec.Struct):
    name: object = None
    namespace: object = None


class _KeyOnly(msgspec.Struct):
    metadata: _KeyMeta = msgspec.field(default_factory=_KeyMeta)


_event_decoder = msgspec.json.Decoder(_WatchEvent)
_key_decoder = msgspec.json.Decoder(_KeyOnly)
_bookmark_decoder = msgspec.json.Decoder(_Bookmark)
_status_decoder = msgspec.json.Decoder(WireStatus)

_INITIAL_EVENTS_END = "k8s.io/initial-events-end"
_CHANGES = ("ADDED", "MODIFIED", "DELETED")
_SYNCED = SyncState.SYNCED
_CLOSED = WatchEnd(End.CLOSED)
_NOT_HONOURED = WatchEnd(
    End.UNSUPPORTED, message="a bookmark came before the initial-events-end bookmark"
)


def _error_event(raw: msgspec.Raw) -> WatchEnd:
    try:
        status = _status_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        status = WireStatus(message="undecodable ERROR event", code=500)
    if status.code == 410:
        return WatchEnd(End.EXPIRED, 410, status.message)
    return WatchEnd(End.ERROR, status.code or 500, status.message or status.reason)


def _opened(answer: Stream | Failed, *, streaming: bool) -> Stream | WatchEnd:
    """The stream a watch request opened, or why it ended before it began: a 410 (or a version
    too large) is :attr:`End.EXPIRED`, a rejected streaming list :attr:`End.UNSUPPORTED`; any
    other answer raises :class:`KubeApiError`."""
    if not isinstance(answer, Failed):
        return answer
    status, message = answer.status, answer.message
    if status == 410 or _too_large(status, message):
        return WatchEnd(End.EXPIRED, status, message)
    if streaming and rejected(status):
        return WatchEnd(End.UNSUPPORTED, status, message)
    raise KubeApiError(status, message, retry_after_s=answer.retry_after_s)


class _Silence:
    """Ends a stream's reading (cancels ``scope``) once ``bound_s`` has passed since its last
    line. The reader sets :attr:`last` per line, an assignment: the timer checks it when due and
    sets itself again for the new deadline, so a stream costs one timer per ``bound_s`` however
    many events it carries, and a stream whose lines come less than ``bound_s`` apart is never
    cut."""

    __slots__ = ("_bound_s", "_handle", "_loop", "_scope", "last")

    def __init__(self, scope: anyio.CancelScope, bound_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._scope = scope
        self._bound_s = bound_s
        self.last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(
            self.last + bound_s, self._check
        )

    def _check(self) -> None:
        due = self.last + self._bound_s
        if self._loop.time() >= due:
            self._handle = None
            self._scope.cancel()
        else:
            self._handle = self._loop.call_at(due, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _reason(exc: ExternalError) -> str:
    """The ``watch_restarts`` reason of a failure."""
    return "timeout" if isinstance(exc.__cause__, TimeoutError) else "error"


class Reflector:
    """Keeps ``store`` in step with the server through ``lw``, until cancelled.

    A stream that ends cleanly within ``min_watch_s`` without any event counts as a failure
    (backoff), so that a misbehaving server cannot make the loop spin.
    """

    def __init__(
        self,
        lw: ListerWatcher,
        store: PodStore,
        decoder: PodDecoder,
        metrics: Metrics,
        *,
        settings: KubeSettings,
        backoff: Backoff,
        min_watch_s: float,
    ) -> None:
        self._lw = lw
        self._store = store
        self._decoder = decoder
        self._metrics = metrics
        self._namespace = store.namespace
        self._stream_sync_timeout_s = settings.stream_sync_timeout_s
        self._silence_s = settings.watch_silence_s
        self._bookmarks_sent = False
        """Whether the server is known to send periodic bookmarks (so that silence means a dead
        connection): set by any such bookmark, cleared by a stream that lived for the silence
        bound without one."""
        self._stream_bookmarks = 0
        """Periodic bookmarks received on the stream being read."""
        self._silence_log = CauseLog(f"pod watch of namespace {store.namespace}", logger)
        self._page_size = settings.list_page_size
        self._mode = ListMode(settings.list_mode)
        self._next = SyncRequest.first(self._mode)
        self._attempts = Attempts(backoff)
        # Logged once per change of cause, with a count; each retry is a debug line.
        self._failures = CauseLog(f"list/watch of namespace {self._namespace} fails", logger)
        self._min_watch_s = min_watch_s
        self.resource_version: str | None = None
        """The last resourceVersion seen (sync, event or bookmark); ``None`` before a sync."""
        self.sync_mode: SyncMode | None = None
        """How the store was last filled; ``None`` before the first sync."""
        self._event_counters = {
            t: metrics.watch_events.labels(type=t)
            for t in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
        }
        self._watch_decode_errors = metrics.decode_errors.labels(source="watch")

    async def run(self) -> None:
        """Sync, watch, resume, relist and back off until cancelled."""
        relist = True
        while True:
            try:
                end = await self._sync() if relist else await self._resume()
            except ExternalError as exc:
                retry_after_s = exc.retry_after_s if isinstance(exc, ApiError) else None
                refused = isinstance(exc, ApiError) and rejected(exc.status)
                # Refused (e.g. a resourceVersion it cannot parse, from a bad bookmark):
                # resuming would fail forever, so sync.
                relist = refused or not self._store.synced
                await self._back_off(
                    _reason(exc), f"{type(exc).__name__}: {exc}", retry_after_s, cause_of(exc)
                )
                continue
            relist = await self._after(end)

    async def _after(self, end: WatchEnd) -> bool:
        """Act on how a stream ended; whether the next attempt syncs."""
        synced = self._store.synced
        match end.why:
            case End.CLOSED:
                self._metrics.watch_restarts.labels(reason="closed").inc()
                self._failures.ok()  # a watch that lived (the backoff is left as it was)
                self._silence_log.ok()  # a stream followed to its end: the connection works
                return not synced
            case End.SILENT:
                # A dead connection, not a refusal: watch again at once, from the same version.
                self._metrics.watch_restarts.labels(reason="silent").inc()
                self._silence_log.failed(end.message)
                return not synced
            case End.EXPIRED:
                self._metrics.watch_restarts.labels(reason="expired").inc()
                if not synced:
                    # The version a sync asked for is gone too: read the newest state.
                    self._next = self._next.version_gone()
                logger.info(
                    "resourceVersion %s expired; relisting", self.resource_version or "(none)"
                )
                return True
            case End.ERROR:
                await self._back_off("error", str(end), cause=f"watch {end.why} {end.status}")
                return rejected(end.status) or not synced
            case End.EMPTY | End.UNSUPPORTED | End.BROKEN:
                await self._back_off("error", str(end), cause=f"watch {end.why} {end.status}")
                return not synced
            case _:
                assert_never(end.why)

    async def _back_off(
        self, reason: str, what: str, floor_s: float | None = None, cause: str | None = None
    ) -> None:
        """Count, log (once per change of ``cause``, by default ``what``) and wait."""
        self._metrics.watch_restarts.labels(reason=reason).inc()
        delay = self._attempts.next_delay(floor_s)
        self._failures.failed(cause or what, what)
        logger.debug("kubernetes list/watch failed (%s); retrying in %.2fs", what, delay)
        await anyio.sleep(delay)

    def _worked(self) -> None:
        """A sync completed or a watch delivered: the backoff starts over, and a failure
        logged says it works again."""
        self._attempts.reset()
        self._failures.ok()

    # ------------------------------------------------------------------ sync

    async def _sync(self) -> WatchEnd:
        """Bring the store to the server's state, then follow the watch that goes on from
        there; returns when that stream ends. The store is updated in place; every pod the sync
        did not see is reported deleted once it is complete."""
        store = self._store
        if store.begin_sync() is SyncState.RELISTING:
            self._metrics.relists.inc()
        request = self._next
        if request is SyncRequest.STREAM or request is SyncRequest.STREAM_NEWEST:
            known = None if request is SyncRequest.STREAM_NEWEST else self.resource_version
            end = await self._stream(known)
            if end.why is not End.UNSUPPORTED:
                return end
            fallback = request.unsupported(self._mode)
            if fallback is None:
                return end  # STREAM mode: back off, then stream again
            logger.warning("streaming list unavailable (%s); listing from now on", end)
            self._next = request = fallback
            store.begin_sync()
        if request is SyncRequest.LIST:
            listed = await self._list_cached()
            if not isinstance(listed, Failed):
                return await self._listed(listed, SyncMode.LIST_CACHE)
            logger.info(
                "list from the watch cache refused (%d: %s); quorum list",
                listed.status,
                listed.message,
            )
            self._next = request.version_gone()
            store.begin_sync()
        return await self._listed(await self._list_quorum(), SyncMode.LIST_QUORUM)

    async def _list_cached(self) -> str | Failed:
        """One list from the watch cache into the store (``NotOlderThan`` the version last
        seen, or ``resourceVersion=0`` before any); its resourceVersion, or the answer when the
        cache cannot serve that version (a 4xx other than 429, or a version too large)."""
        known = self.resource_version
        if known:
            return await self._list(known, "NotOlderThan", refusable=True)
        return await self._list("0", "", refusable=True)

    async def _list_quorum(self) -> str:
        """One quorum list into the store, in pages; its resourceVersion."""
        rv = await self._list("", "", refusable=False)
        assert not isinstance(rv, Failed)
        return rv

    async def _list(self, version: str, match: str, *, refusable: bool) -> str | Failed:
        """A list into the store, page by page; started over when its continue token expires
        (compaction), at most :data:`_CONTINUE_RESTARTS` times. Any other failed answer raises
        :class:`KubeApiError`, except a refusal of a ``refusable`` list, which is returned."""
        # As client-go: a list not older than a known version is not paginated, or a server
        # would take it to etcd; resourceVersion=0 ignores the limit where a watch cache serves.
        limit = None if match else self._page_size
        store = self._store
        token: str | None = None
        rv = ""
        restarts = 0
        while True:
            page = await self._lw.list(
                resource_version=version, match=match, token=token, limit=limit
            )
            if isinstance(page, Failed):
                if page.status == 410 and token is not None and restarts < _CONTINUE_RESTARTS:
                    restarts += 1
                    store.begin_sync()
                    token = None
                    continue
                if refusable and (rejected(page.status) or _too_large(page.status, page.message)):
                    return page
                raise KubeApiError(page.status, page.message, retry_after_s=page.retry_after_s)
            put = store.put
            for snap in page.pods:
                put(snap)
            if token is None:
                rv = page.resource_version
            token = page.continue_
            if not token:
                return rv

    async def _listed(self, rv: str, mode: SyncMode) -> WatchEnd:
        self._synced(rv, mode)
        self._worked()
        return await self._watch(rv)

    def _synced(self, rv: str, mode: SyncMode) -> None:
        self.resource_version = rv
        self.sync_mode = mode
        self._next = self._next.synced()
        for m in SyncMode:
            self._metrics.list_mode.labels(sandbox_namespace=self._namespace, mode=m.value).set(
                1 if m is mode else 0
            )
        self._store.finish_sync()
        trim_heap()  # the sync's garbage back to the OS: once a sync, never per event
        logger.info(
            "pod cache synced by %s: %d pods at resourceVersion %s (namespace %s)",
            mode.value,
            len(self._store),
            rv,
            self._namespace,
        )

    async def _stream(self, known: str | None) -> WatchEnd:
        """A streaming list: the state as ADDED events up to the BOOKMARK annotated
        ``k8s.io/initial-events-end``, then the same stream goes on as an ordinary watch.

        Not honoured (:attr:`End.UNSUPPORTED`) when a plain bookmark comes first or the stream
        stays silent for ``stream_sync_timeout_s`` before that bookmark; the events already
        applied are then reconciled by the list that follows."""
        started = clock.now()
        opened = _opened(await self._lw.stream(known), streaming=True)
        if isinstance(opened, WatchEnd):
            return opened
        self._stream_bookmarks = 0
        store = self._store
        apply = self._apply
        readline = opened.content.readline
        bound_s = self._stream_sync_timeout_s
        events = 0
        end: WatchEnd | None = None
        try:
            # The deadline follows the events (moved once half the bound has passed, to keep
            # timer rescheduling off the per-event path): it measures silence, not total time.
            loop_time = asyncio.get_running_loop().time
            with anyio.CancelScope(deadline=loop_time() + bound_s) as silence:
                while True:
                    try:
                        line = await readline()
                    except TRANSIENT_ERRORS as exc:
                        raise unavailable("streaming list", exc) from exc
                    if not line:
                        break
                    if not line.strip():
                        continue
                    now = loop_time()
                    if now + bound_s - silence.deadline > bound_s / 2:
                        silence.deadline = now + bound_s
                    end = apply(line)
                    events += 1
                    if end is not None or store.state is _SYNCED:
                        break  # synced: the rest of the stream is an ordinary watch
            if end is not None:
                return end
            if store.state is not _SYNCED:
                if silence.cancelled_caught:
                    return WatchEnd(
                        End.UNSUPPORTED,
                        message=f"no initial-events-end bookmark within {bound_s:g}s of silence",
                    )
                return WatchEnd(
                    End.BROKEN,
                    message="streaming list ended before its initial-events-end bookmark",
                )
            self._worked()
            return await self._follow(opened, started, events)
        finally:
            opened.close()

    # ------------------------------------------------------------------ watch

    async def _resume(self) -> WatchEnd:
        rv = self.resource_version
        assert rv is not None, "resumed before any sync"
        return await self._watch(rv)

    async def _watch(self, rv: str) -> WatchEnd:
        """One watch request from ``rv``, followed until the stream ends."""
        started = clock.now()
        opened = _opened(await self._lw.watch(rv), streaming=False)
        if isinstance(opened, WatchEnd):
            return opened
        self._stream_bookmarks = 0
        try:
            return await self._follow(opened, started, 0)
        finally:
            opened.close()

    def _silence_bound(self) -> float | None:
        """How long the stream being read may stay silent before it is taken for dead:
        ``WATCH_SILENCE_SECONDS`` once the server is known to send bookmarks; ``None`` before
        (silence is then no evidence, and only the request's read timeout ends it)."""
        return self._silence_s if self._bookmarks_sent else None

    async def _follow(self, stream: Stream, started: float, events: int) -> WatchEnd:
        """Read the watch until it ends; a silence past :meth:`_silence_bound` ends it too."""
        apply = self._apply
        readline = stream.content.readline
        loop_time = asyncio.get_running_loop().time
        silence: _Silence | None = None
        end: WatchEnd | None = None
        with anyio.CancelScope() as scope:
            try:
                while True:
                    if silence is None and self._bookmarks_sent:
                        bound_s = self._silence_bound()
                        if bound_s is not None:
                            silence = _Silence(scope, bound_s)
                    try:
                        line = await readline()
                    except TRANSIENT_ERRORS as exc:
                        raise unavailable("watch stream", exc) from exc
                    if not line:
                        break
                    if not line.strip():
                        continue
                    if silence is not None:
                        silence.last = loop_time()
                    end = apply(line)
                    if end is not None:
                        break
                    events += 1
                    if events == 1:
                        self._worked()
            finally:
                if silence is not None:
                    silence.stop()
                if not self._stream_bookmarks and clock.now() - started >= self._silence_s:
                    self._bookmarks_sent = False  # lived the bound without one: none are sent
        if scope.cancelled_caught:
            return WatchEnd(
                End.SILENT,
                message=f"no event and no bookmark for {self._silence_s:g}s: "
                "the connection is taken for dead",
            )
        if end is not None:
            return end
        if events == 0 and clock.now() - started < self._min_watch_s:
            return WatchEnd(End.EMPTY, message="watch stream closed at once without events")
        return _CLOSED

    def _apply(self, line: bytes) -> WatchEnd | None:
        """Apply one watch event line to the store; why the stream ends, if it does."""
        try:
            event = _event_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._decode_error("malformed watch event: %s", exc)
            return None
        kind = event.type
        counter = self._event_counters.get(kind)
        if counter is not None:
            counter.inc()
        if kind in _CHANGES:
            try:
                snap = self._decoder.decode(event.object)
            except PodDecodeError as exc:
                self._decode_error("skipped malformed pod in a %s event: %s", exc, kind)
                self._forget_unreadable(event.object)
                return None
            store = self._store
            if kind == "DELETED":
                store.delete(snap)
            else:
                store.put(snap)
            if store.state is _SYNCED:
                # Not during a streaming list's initial events: they are not ordered by
                # resourceVersion, so the stream's position is only known at their end.
                self.resource_version = snap.resource_version
            return None
        if kind == "BOOKMARK":
            return self._bookmark(event.object)
        if kind == "ERROR":
            return _error_event(event.object)
        self._decode_error("unknown watch event type %r", kind)
        return None

    def _bookmark(self, raw: msgspec.Raw) -> WatchEnd | None:
        try:
            meta = _bookmark_decoder.decode(raw).metadata
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._decode_error("malformed bookmark: %s", exc)
            return None
        initial_end = (meta.annotations or {}).get(_INITIAL_EVENTS_END) == "true"
        if not initial_end:
            # A periodic bookmark: the server sends them, so silence means a dead connection.
            # (Not the initial-events-end one: a server may send that one alone.)
            self._stream_bookmarks += 1
            self._bookmarks_sent = True
        if self._store.state is _SYNCED:
            if meta.resourceVersion:
                self.resource_version = meta.resourceVersion
            return None
        # The initial events of a streaming list: only their end bookmark may come now.
        if not initial_end:
            return _NOT_HONOURED
        if not meta.resourceVersion:
            return WatchEnd(
                End.BROKEN, message="initial-events-end bookmark without resourceVersion"
            )
        self._synced(meta.resourceVersion, SyncMode.STREAM)
        return None

    def _forget_unreadable(self, raw: msgspec.Raw) -> None:
        """A pod we can no longer read is a gap in its observation: fail closed by dropping it
        from the cache (its clock is cleared and it cannot be acted on) until a readable event
        or a sync brings it back."""
        try:
            meta = _key_decoder.decode(raw).metadata
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if isinstance(meta.namespace, str) and isinstance(meta.name, str):
            self._store.forget(f"{meta.namespace}/{meta.name}")

    def _decode_error(self, message: str, *args: object) -> None:
        self._watch_decode_errors.inc()
        logger.warning(message, *args)
