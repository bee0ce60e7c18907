"""The pod informer's loop, as client-go's reflector: the one writer of the :class:`PodStore`
and the one place that decides what to ask next (:class:`ListerWatcher` makes the requests,
:class:`~service.kube.watching.Watcher` reads the streams).

A sync is a streaming list that goes on as the watch, or a paged list followed by a watch from
its resourceVersion; the fallback runs streaming list → list from the watch cache → quorum list
(docs/architecture.md, "How the cache is filled"). A watch that ends is resumed from the last
resourceVersion seen; a 410 relists. Every failure is raised (an ``ExternalError`` of a request,
a :class:`~service.kube.watching.WatchEnd` of a stream) and classified in :meth:`Reflector._failed`:
an ``ExternalError`` is retried after a jittered exponential backoff with a 429's Retry-After as
the least delay, and a 4xx other than 429 makes the next attempt sync. Anything else raised is a
bug and ends the process.
"""

from __future__ import annotations

import enum
import logging
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
from service.kube.watching import End, WatchEnd, Watcher
from service.kube.watchstream import EventStream
from service.metrics import KubeMetrics, WatchRestart

logger = logging.getLogger(__name__)

WAKE_FLOOR_S = 1.0
"""The least wait after a failure without an answer, however soon the server answers again."""

_CONTINUE_RESTARTS = 3
"""How often a list whose continue token expired (compaction) is started over."""


class ListerWatcher(Protocol):
    """The requests the loop makes (:class:`service.kube.listwatch.ListWatch`); each raises a
    kit error when it fails (``KubeApiError`` for an answer with another status)."""

    async def list(
        self, *, resource_version: str, match: str, token: str | None, limit: int | None
    ) -> Page: ...

    async def stream(self, known: str | None, *, timeout_cap: int | None) -> EventStream: ...

    async def watch(self, rv: str, *, timeout_cap: int | None) -> EventStream: ...


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
        self._watcher = Watcher(
            store,
            self._reach,
            settings=settings,
            min_watch_s=min_watch_s,
            worked=self._worked,
        )
        self._silence_log = CauseLog(f"pod watch of namespace {store.namespace}", logger)
        self._page_size = settings.list_page_size
        self._mode = ListMode(settings.list_mode)
        self._streams = self._mode is not ListMode.LIST
        """Whether the next sync streams (cleared in ``AUTO`` mode by a server that does not)."""
        self._version_gone = False
        """Whether the version last seen is gone: the next sync reads the newest state."""
        self._attempts = Attempts(backoff)
        self._failures = CauseLog(f"list/watch of namespace {self._namespace} fails", logger)
        self.sync_mode: SyncMode | None = None
        """How the store was last filled; ``None`` before the first sync."""
        self._step: SyncMode | None = None
        """The sync step whose request is in flight (``None``: a watch), for :meth:`_refusal`."""
        self._fallback = False
        """Whether the next sync goes on with the one a refusal ended: at once, and not
        counted as another relist."""

    @property
    def resource_version(self) -> str | None:
        """The last resourceVersion seen (sync, event or bookmark); ``None`` before a sync."""
        return self._watcher.resource_version

    async def run(self) -> None:
        """Sync, watch, resume, relist and back off until cancelled."""
        relist = True
        started = clock.now()
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
        """What a failure means; whether the next attempt syncs. ``started``: when the failed
        attempt began."""
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
        """The end of a stream or sync step that an answer with another status means for the
        request in flight, if any."""
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
            case End.UNSUPPORTED if self._mode is ListMode.AUTO:
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
        """Bring the store to the server's state, then follow the watch that goes on from
        there until the server ends it."""
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
        self._watcher.resource_version = rv
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
        cap = self._watcher.timeout_cap()
        stream = await self._lw.stream(known, timeout_cap=cap)
        at = clock.now()
        try:
            rv = await self._watcher.read(stream, at, timeout_cap=cap, initial=True)
            assert rv is not None, "the initial events end at their bookmark"
            self._synced(rv, SyncMode.STREAM)
            await self._watcher.read(stream, at, timeout_cap=cap, continued=True)
        finally:
            stream.close()

    async def _watch(self) -> None:
        """One watch request from the version last seen, followed until the server ends it."""
        rv = self.resource_version
        assert rv is not None, "watched before any sync"
        self._step = None
        cap = self._watcher.timeout_cap()
        stream = await self._lw.watch(rv, timeout_cap=cap)
        try:
            await self._watcher.read(stream, clock.now(), timeout_cap=cap)
        finally:
            stream.close()
