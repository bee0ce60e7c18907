"""The pod informer's loop, as client-go's reflector: the one writer of the :class:`PodStore`,
the one place that decides what to ask next (:class:`ListerWatcher` makes the requests) and the
one reader of the streams (client-go's ``handleWatch``).

A sync is a streaming list that goes on as the watch, or a paged list followed by a watch from
its resourceVersion (docs/architecture.md, "How the cache is filled"). A watch that ends is
resumed from the last resourceVersion seen; a 410 relists; a silent one is taken for dead
(docs/architecture.md, "A silent watch"). Every failure is raised (an ``ExternalError`` of a
request, a :class:`WatchEnd` of a stream) and classified in :meth:`Reflector._failed`; anything
else raised is a bug and ends the process.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from typing import Protocol, assert_never

import anyio

from service.config import KubeSettings
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ApiError, ExternalError
from service.kit.memory import trim_heap
from service.kube.errors import KubeApiError, RequestTimeout, gone, rejected, too_large
from service.kube.listwatch import Page
from service.kube.reachability import Reachability
from service.kube.store import PodStore, SyncState
from service.kube.watchstream import (
    Bookmark,
    ErrorStatus,
    EventStream,
    PodChange,
    Unreadable,
    WatchEvent,
)
from service.metrics import KubeMetrics, WatchRestart

logger = logging.getLogger(__name__)

WAKE_FLOOR_S = 1.0
"""The least wait after a failure without an answer, however soon the server answers again."""

_CONTINUE_RESTARTS = 3
"""How often a list whose continue token expired (compaction) is started over."""


class End(enum.StrEnum):
    """Why a watch stream ended (or was not opened), when the protocol says so."""

    EMPTY = "empty"
    """Closed at once without a single line: a misbehaving server (back off)."""
    EXPIRED = "expired"
    """410 Gone (an answer or an ``ERROR`` event), or a version too large: relist."""
    UNSUPPORTED = "unsupported"
    """A streaming list the server rejected (a 4xx) or did not honour."""
    ERROR = "error"
    """An ``ERROR`` event with a status other than 410."""
    BROKEN = "broken"
    """A stream that broke the protocol (e.g. an initial-events-end bookmark without a version)."""
    REFUSED = "refused"
    """A list from the watch cache the server refused: the sync lists from etcd instead."""
    SILENT = "silent"
    """Silent past its bound: the connection is taken for dead (resume at once)."""


class WatchEnd(Exception):
    """How a watch stream ended: the reason, and the server's status and message if any."""

    def __init__(self, why: End, status: int = 0, message: str = "") -> None:
        super().__init__(why, status, message)
        self.why = why
        self.status = status
        self.message = message

    def __str__(self) -> str:
        status = f" {self.status}" if self.status else ""
        return f"watch {self.why}{status}: {self.message}" if self.message else f"watch {self.why}"


def end_margin_s(settings: KubeSettings) -> float:
    """How long a watch may stay silent past its ``timeoutSeconds`` while bookmarks are not known:
    ``API_TIMEOUT_SECONDS`` (how late any answer may be), at most a quarter of the silence bound."""
    return min(settings.api_timeout_s, settings.watch_silence_s / 4)


def short_timeout_s(settings: KubeSettings) -> int:
    """The ``timeoutSeconds`` of a watch while the server is not known to send bookmarks."""
    return max(1, math.floor(settings.watch_silence_s - end_margin_s(settings)))


class _Silence:
    """Cancels ``scope`` once the stream has been silent for ``bound`` = (seconds, after), from
    its last line or ``after``, whichever is later (``None``: unbounded). The reader sets
    :attr:`last` per line (an assignment); the timer checks it when due, and sets itself again."""

    __slots__ = ("_after", "_bound_s", "_handle", "_loop", "_scope", "last")

    def __init__(self, scope: anyio.CancelScope, bound: tuple[float, float] | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._scope = scope
        self._handle: asyncio.TimerHandle | None = None
        self.last = self._loop.time()
        self.rebound(bound)

    def _due(self) -> float:
        return max(self.last, self._after) + self._bound_s

    def _check(self) -> None:
        due = self._due()
        if self._loop.time() >= due:
            self._handle = None
            self._scope.cancel()
        else:
            self._handle = self._loop.call_at(due, self._check)

    def rebound(self, bound: tuple[float, float] | None) -> None:
        """Bound the silence from now on by ``bound``, unless the stream is already dead."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if bound is not None and not self._scope.cancel_called:
            self._bound_s, self._after = bound
            self._handle = self._loop.call_at(self._due(), self._check)

    def stop(self) -> None:
        self.rebound(None)


class ListerWatcher(Protocol):
    """The requests the loop makes (:class:`service.kube.listwatch.ListWatch`)."""

    async def list(
        self, *, resource_version: str, match: str, token: str | None, limit: int | None
    ) -> Page: ...

    async def stream(self, known: str | None, *, timeout_cap: int | None) -> EventStream: ...

    async def watch(self, rv: str, *, timeout_cap: int | None) -> EventStream: ...


class SyncMode(enum.StrEnum):
    """How the last sync actually filled the cache."""

    STREAM = "stream"
    """A streaming list (``sendInitialEvents``): no list request at all."""
    LIST_CACHE = "list_cache"
    """A list served from the API server's watch cache."""
    LIST_QUORUM = "list_quorum"
    """A quorum list from etcd, in pages: the last resort."""


class Reflector:
    """Keeps ``store`` in step with the server through ``lw``, until cancelled."""

    def __init__(
        self,
        lw: ListerWatcher,
        store: PodStore,
        metrics: KubeMetrics,
        *,
        settings: KubeSettings,
        backoff: Backoff,
        min_watch_s: float,
        reachability: Reachability | None = None,
    ) -> None:
        self._lw = lw
        self._reach = reachability if reachability is not None else Reachability()
        self._store = store
        self._metrics = metrics
        self._namespace = store.namespace
        self._silence_s = settings.watch_silence_s
        self._sync_timeout_s = settings.stream_sync_timeout_s
        self._min_watch_s = min_watch_s
        self._end_margin_s = end_margin_s(settings)
        self._short_timeout_s = short_timeout_s(settings)
        self.resource_version: str | None = None
        """The last resourceVersion seen (sync, event or bookmark); ``None`` before a sync."""
        self._bookmarks_sent = False
        """Whether the server is known to send periodic bookmarks: set by one, cleared by a
        watch that lived for the silence bound without one."""
        self._stream_bookmarks = 0
        self._silence_log = CauseLog(f"pod watch of namespace {store.namespace}", logger)
        self._page_size = settings.list_page_size
        self._auto = settings.list_mode == "auto"
        self._streams = settings.list_mode != "list"
        """Whether the next sync streams (``LIST_MODE``; in auto, until a server does not)."""
        self._version_gone = False
        """Whether the version last seen is gone: the next sync reads the newest state."""
        self._attempts = Attempts(backoff)
        self._failures = CauseLog(f"list/watch of namespace {self._namespace} fails", logger)
        self.sync_mode: SyncMode | None = None
        """How the store was last filled; ``None`` before the first sync."""
        self._step: SyncMode | None = None
        """The sync step whose request is in flight (``None``: a watch), for :meth:`_refusal`."""
        self._fallback = False
        """Whether the next sync goes on with the one a refusal ended (at once, no relist)."""

    async def run(self) -> None:
        """Sync, watch, resume, relist and back off until cancelled."""
        relist = True
        while True:
            if not self._fallback:
                started = clock.now()
            try:
                await (self._sync() if relist else self._watch())
            except (ExternalError, WatchEnd) as exc:
                relist = await self._failed(exc, started)
            else:
                # The server ended the stream: resume, the backoff left as it was.
                self._metrics.watch_restarts.labels(reason=WatchRestart.CLOSED).inc()
                self._failures.ok()
                self._silence_log.ok()  # a stream followed to its end: the connection works
                relist = not self._store.synced

    async def _failed(self, exc: ExternalError | WatchEnd, started: float) -> bool:
        """What a failure begun at ``started`` means; whether the next attempt syncs. An
        ``ExternalError`` backs off, a 429's Retry-After the least delay."""
        if isinstance(exc, KubeApiError):
            exc = self._refusal(exc) or exc
        if isinstance(exc, WatchEnd):
            return await self._after(exc)
        api_error = exc if isinstance(exc, ApiError) else None
        await self._back_off(
            WatchRestart.TIMEOUT if isinstance(exc, RequestTimeout) else WatchRestart.ERROR,
            f"{type(exc).__name__}: {exc}",
            api_error.retry_after_s if api_error is not None else None,
            cause_of(exc),
            # No answer (an ApiError is one): the server's first answer ends the wait.
            unanswered_since=None if api_error is not None else started,
        )
        # Refused (e.g. a resourceVersion it cannot parse, from a bad bookmark): resuming
        # would fail forever, so sync.
        return (api_error is not None and rejected(api_error.status)) or not self._store.synced

    def _refusal(self, exc: KubeApiError) -> WatchEnd | None:
        """What an answer with another status ends for the request in flight, if anything."""
        step = self._step
        if step is SyncMode.LIST_CACHE:
            refused = rejected(exc.status) or too_large(exc)
            return WatchEnd(End.REFUSED, exc.status, exc.message) if refused else None
        if step is SyncMode.LIST_QUORUM:
            return None
        if gone(exc) or too_large(exc):
            return WatchEnd(End.EXPIRED, exc.status, exc.message)
        if step is SyncMode.STREAM and rejected(exc.status):
            return WatchEnd(End.UNSUPPORTED, exc.status, exc.message)
        return None

    async def _after(self, end: WatchEnd) -> bool:
        """Act on how a stream or a sync step ended; whether the next attempt syncs."""
        synced = self._store.synced
        match end.why:
            case End.SILENT:
                # A dead connection, not a refusal: watch again at once, from the same version.
                self._metrics.watch_restarts.labels(reason=WatchRestart.SILENT).inc()
                self._silence_log.failed(end.message)
                self._reach.unanswered(clock.now() - self._silence_s, "watch stream silent")
                return not synced
            case End.EXPIRED:
                self._metrics.watch_restarts.labels(reason=WatchRestart.EXPIRED).inc()
                if not synced:
                    # The version a sync asked for is gone too: read the newest state.
                    self._version_gone = True
                logger.info(
                    "resourceVersion %s expired; relisting", self.resource_version or "(none)"
                )
                return True
            case End.UNSUPPORTED if self._auto:
                logger.warning("streaming list unavailable (%s); listing from now on", end)
                self._streams = False
                self._fallback = True
                return True
            case End.REFUSED:
                logger.info(
                    "list from the watch cache refused (%d: %s); quorum list",
                    end.status,
                    end.message,
                )
                self._version_gone = True
                self._fallback = True
                return True
            case End.ERROR | End.EMPTY | End.UNSUPPORTED | End.BROKEN:
                # In STREAM mode, an unsupported stream backs off and streams again.
                await self._back_off(
                    WatchRestart.ERROR, str(end), cause=f"watch {end.why} {end.status}"
                )
                return rejected(end.status) or not synced
            case _:
                assert_never(end.why)

    async def _back_off(
        self,
        reason: str,
        what: str,
        floor_s: float | None = None,
        cause: str | None = None,
        *,
        unanswered_since: float | None = None,
    ) -> None:
        """Count, log (once per change of ``cause``, by default ``what``) and wait. After an
        attempt begun at ``unanswered_since`` that got no answer, the wait ends (not before
        :data:`WAKE_FLOOR_S`) once the server has answered anything since: it is back."""
        self._metrics.watch_restarts.labels(reason=reason).inc()
        delay = self._attempts.next_delay(floor_s)
        self._failures.failed(cause or what, what)
        logger.debug("kubernetes list/watch failed (%s); retrying in %.2fs", what, delay)
        if unanswered_since is None or delay <= WAKE_FLOOR_S:
            await anyio.sleep(delay)
            return
        await anyio.sleep(WAKE_FLOOR_S)
        await self._reach.answered_after(unanswered_since, delay - WAKE_FLOOR_S)

    def _worked(self) -> None:
        """A sync completed or a watch delivered: the backoff starts over."""
        self._attempts.reset()
        self._failures.ok()

    async def _sync(self) -> None:
        """Bring the store to the server's state, then follow the watch from there."""
        if self._store.begin_sync() is SyncState.RELISTING and not self._fallback:
            self._metrics.relists.inc()
        self._fallback = False
        if self._streams:
            self._step = SyncMode.STREAM
            await self._stream(None if self._version_gone else self.resource_version)
            return
        # From the watch cache, NotOlderThan the version last seen (any before one); from etcd
        # once that version is gone.
        if self._version_gone:
            mode, version, match = SyncMode.LIST_QUORUM, "", ""
        elif known := self.resource_version:
            mode, version, match = SyncMode.LIST_CACHE, known, "NotOlderThan"
        else:
            mode, version, match = SyncMode.LIST_CACHE, "0", ""
        self._step = mode
        self._synced(await self._list(version, match), mode)
        await self._watch()

    async def _list(self, version: str, match: str) -> str:
        """A list into the store, page by page; its resourceVersion."""
        # As client-go: a list not older than a known version is not paginated, or a server
        # would take it to etcd; resourceVersion=0 ignores the limit where a watch cache serves.
        limit = None if match else self._page_size
        store = self._store
        token: str | None = None
        rv = ""
        restarts = 0
        while True:
            try:
                page = await self._lw.list(
                    resource_version=version, match=match, token=token, limit=limit
                )
            except KubeApiError as exc:
                if gone(exc) and token is not None and restarts < _CONTINUE_RESTARTS:
                    restarts += 1
                    store.begin_sync()
                    token = None
                    continue
                raise
            for snap in page.pods:
                store.put(snap)
            if token is None:
                rv = page.resource_version
            token = page.continue_
            if not token:
                return rv

    def _synced(self, rv: str, mode: SyncMode) -> None:
        self.resource_version = rv
        self.sync_mode = mode
        self._version_gone = False
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
        self._worked()

    async def _stream(self, known: str | None) -> None:
        """A streaming list: its initial events, then the same stream as a watch. Not honoured,
        the events already applied are reconciled by the list that follows."""
        cap = self._timeout_cap()
        stream = await self._lw.stream(known, timeout_cap=cap)
        at = clock.now()
        try:
            rv = await self._read(stream, at, timeout_cap=cap, initial=True)
            assert rv is not None, "the initial events end at their bookmark"
            self._synced(rv, SyncMode.STREAM)
            await self._read(stream, at, timeout_cap=cap, continued=True)
        finally:
            stream.close()

    async def _watch(self) -> None:
        """One watch request from the version last seen, followed until the server ends it."""
        rv = self.resource_version
        assert rv is not None, "watched before any sync"
        self._step = None
        cap = self._timeout_cap()
        stream = await self._lw.watch(rv, timeout_cap=cap)
        try:
            await self._read(stream, clock.now(), timeout_cap=cap)
        finally:
            stream.close()

    def _timeout_cap(self) -> int | None:
        """The longest ``timeoutSeconds`` the next stream may ask for (``None``: any)."""
        return None if self._bookmarks_sent else self._short_timeout_s

    def _silence_bound(self, opened: float, timeout_cap: int | None) -> tuple[float, float] | None:
        """The :class:`_Silence` bound of a watch opened at ``opened``: ``WATCH_SILENCE_SECONDS``
        once the server is known to send bookmarks; before, the end margin past the
        ``timeoutSeconds`` asked for (at most ``timeout_cap``), at which the server ends every
        watch. ``None`` for a watch without a cap before bookmarks (its read timeout ends it)."""
        if self._bookmarks_sent:
            return self._silence_s, -math.inf
        if timeout_cap is not None:
            return self._end_margin_s, opened + timeout_cap
        return None

    async def _read(
        self,
        stream: EventStream,
        opened: float,
        *,
        timeout_cap: int | None,
        initial: bool = False,
        continued: bool = False,
    ) -> str | None:
        """Events into the store until the stream ends, an event ends it, or it stays silent past
        its bound (``initial``: a streaming list's initial events; ``continued``: their rest). The
        initial-events-end bookmark's version, or ``None`` at the server's end; else raises."""
        answered = self._reach.answered
        loop_time = asyncio.get_running_loop().time
        self._stream_bookmarks = 0
        lines = 1 if continued else 0
        proven = self._bookmarks_sent
        if initial:
            bound: tuple[float, float] | None = (self._sync_timeout_s, -math.inf)
        else:
            bound = self._silence_bound(opened, timeout_cap)
        with anyio.CancelScope() as scope:
            silence = _Silence(scope, bound)
            try:
                async for event in stream:
                    answered()
                    silence.last = loop_time()
                    rv = self._apply(event, initial=initial)
                    if rv is not None:
                        return rv
                    if not proven and self._bookmarks_sent:
                        # The first periodic bookmark: silence is evidence from now on.
                        proven = True
                        silence.rebound(self._silence_bound(opened, timeout_cap))
                    lines += 1
                    if lines == 1 and not initial:
                        self._worked()
            finally:
                silence.stop()
                unmarked = not initial and not self._stream_bookmarks
                if unmarked and clock.now() - opened >= self._silence_s:
                    self._bookmarks_sent = False  # lived the bound without one: none are sent
        if scope.cancelled_caught and initial:
            message = f"no initial-events-end bookmark within {self._sync_timeout_s:g}s of silence"
            raise WatchEnd(End.UNSUPPORTED, message=message)
        if scope.cancelled_caught:
            if proven:
                message = f"no event and no bookmark for {self._silence_s:g}s"
            else:
                message = (
                    f"no end of the stream and no line {self._end_margin_s:g}s past its "
                    f"timeoutSeconds (at most {timeout_cap}s), and no bookmark yet"
                )
            raise WatchEnd(End.SILENT, message=f"{message}: the connection is taken for dead")
        if initial:
            message = "streaming list ended before its initial-events-end bookmark"
            raise WatchEnd(End.BROKEN, message=message)
        if lines == 0 and clock.now() - opened < self._min_watch_s:
            raise WatchEnd(End.EMPTY, message="watch stream closed at once without events")
        return None

    def _apply(self, event: WatchEvent, *, initial: bool) -> str | None:
        """One event into the store; the initial-events-end bookmark's version when it is one."""
        store = self._store
        match event:
            case PodChange(pod=pod, deleted=deleted):
                if deleted:
                    store.delete(pod)
                else:
                    store.put(pod)
                if not initial:
                    self.resource_version = pod.resource_version
            case Unreadable(key=key):
                # A pod we can no longer read is a gap in its observation: fail closed by
                # dropping it from the cache until a readable event or a sync brings it back.
                if key is not None:
                    store.forget(key)
            case Bookmark(resource_version=rv, initial_events_end=initial_end):
                if not initial_end:
                    # A periodic one (a server may send the initial-events-end one alone).
                    self._stream_bookmarks += 1
                    self._bookmarks_sent = True
                if not initial:
                    if rv:
                        self.resource_version = rv
                    return None
                if not initial_end:
                    message = "a bookmark came before the initial-events-end bookmark"
                    raise WatchEnd(End.UNSUPPORTED, message=message)
                if not rv:
                    message = "initial-events-end bookmark without resourceVersion"
                    raise WatchEnd(End.BROKEN, message=message)
                return rv
            case ErrorStatus(code=code, message=message):
                raise WatchEnd(End.EXPIRED if code == 410 else End.ERROR, code, message)
        return None
