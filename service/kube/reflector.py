"""The pod informer's loop: sync the store, follow the watch, and decide what comes next.

As client-go's reflector, it is the one writer of the :class:`PodStore` and the one place that
decides what to ask next; :class:`ListerWatcher` (``service/kube/listwatch.py``) makes the
requests and :class:`~service.kube.watching.Watcher` reads the streams. A sync fills the store
with a streaming list that then goes on as the watch, or with a list, page by page, followed by a
watch from its resourceVersion. Two fields choose the next sync, as client-go's: whether it
streams, and whether the version last seen is gone; the fallback runs streaming list → list from
the watch cache → quorum list (docs/architecture.md, "How the cache is filled").

A list whose continue token expired is started over. A watch that ends is resumed from the last
resourceVersion seen; a 410 means that history is gone, and the store is synced again. Every
stream asks for the ``timeoutSeconds`` cap the :class:`~service.kube.watching.Watcher` gives
(short of the silence bound until the server is known to send bookmarks), and a stream silent
past its bound is watched again at once. A failure of the outside world (an
``ExternalError``) is retried after a jittered exponential backoff (kit ``Attempts``), with a
429's Retry-After as the least delay; a 4xx other than 429 means the request itself is refused,
so the next attempt syncs. After a failure without an answer, the backoff ends once the server
answers anything again (its :class:`~service.kube.reachability.Reachability`). Anything else
raised is a bug: it ends the loop, and with it the process.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable
from typing import Protocol, assert_never

import anyio

from service.config import KubeSettings
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ApiError, ExternalError
from service.kit.memory import trim_heap
from service.kube.decode import PodDecoder
from service.kube.errors import KubeApiError, gone, rejected, too_large
from service.kube.listwatch import Page
from service.kube.reachability import Reachability
from service.kube.store import PodStore, SyncState
from service.kube.watching import End, WatchEnd, Watcher
from service.kube.watchstream import Stream, WatchDecoder
from service.metrics import KubeMetrics

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

    async def stream(self, known: str | None, *, timeout_cap: int | None) -> Stream: ...

    async def watch(self, rv: str, *, timeout_cap: int | None) -> Stream: ...


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


def _reason(exc: ExternalError) -> str:
    """The ``watch_restarts`` reason of a failure."""
    return "timeout" if isinstance(exc.__cause__, TimeoutError) else "error"


async def _opened(request: Awaitable[Stream], *, streaming: bool) -> Stream | WatchEnd:
    """The stream a watch request opened, or why it ended before it began: a 410 (or a version
    too large) is :attr:`End.EXPIRED`, a rejected streaming list :attr:`End.UNSUPPORTED`; any
    other failure is raised."""
    try:
        return await request
    except KubeApiError as exc:
        if gone(exc) or too_large(exc):
            return WatchEnd(End.EXPIRED, exc.status, exc.message)
        if streaming and rejected(exc.status):
            return WatchEnd(End.UNSUPPORTED, exc.status, exc.message)
        raise


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
            WatchDecoder(decoder, metrics),
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
        """Whether the version last seen can no longer be served: the next sync reads the
        newest state (a streaming list without a version, or a quorum list)."""
        self._attempts = Attempts(backoff)
        # Logged once per change of cause, with a count; each retry is a debug line.
        self._failures = CauseLog(f"list/watch of namespace {self._namespace} fails", logger)
        self.sync_mode: SyncMode | None = None
        """How the store was last filled; ``None`` before the first sync."""

    @property
    def resource_version(self) -> str | None:
        """The last resourceVersion seen (sync, event or bookmark); ``None`` before a sync."""
        return self._watcher.resource_version

    async def run(self) -> None:
        """Sync, watch, resume, relist and back off until cancelled."""
        relist = True
        while True:
            started = clock.now()
            try:
                end = await self._sync() if relist else await self._resume()
            except ExternalError as exc:
                api_error = exc if isinstance(exc, ApiError) else None
                # Refused (e.g. a resourceVersion it cannot parse, from a bad bookmark):
                # resuming would fail forever, so sync.
                relist = (
                    api_error is not None and rejected(api_error.status)
                ) or not self._store.synced
                await self._back_off(
                    _reason(exc),
                    f"{type(exc).__name__}: {exc}",
                    api_error.retry_after_s if api_error is not None else None,
                    cause_of(exc),
                    # No answer (an ApiError is one): the server's first answer ends the wait.
                    unanswered_since=None if api_error is not None else started,
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
                self._reach.unanswered(clock.now() - self._silence_s, "watch stream silent")
                return not synced
            case End.EXPIRED:
                self._metrics.watch_restarts.labels(reason="expired").inc()
                if not synced:
                    # The version a sync asked for is gone too: read the newest state.
                    self._version_gone = True
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
        self,
        reason: str,
        what: str,
        floor_s: float | None = None,
        cause: str | None = None,
        *,
        unanswered_since: float | None = None,
    ) -> None:
        """Count, log (once per change of ``cause``, by default ``what``) and wait. After an
        attempt begun at ``unanswered_since`` that got no answer, the wait ends
        :data:`WAKE_FLOOR_S` after it began once the server has answered anything since that
        attempt began: the server is back, and the watch follows within seconds."""
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
        if self._streams:
            end = await self._stream(None if self._version_gone else self.resource_version)
            if end.why is not End.UNSUPPORTED or self._mode is ListMode.STREAM:
                return end  # in STREAM mode, an unsupported stream backs off and streams again
            logger.warning("streaming list unavailable (%s); listing from now on", end)
            self._streams = False
            store.begin_sync()
        if not self._version_gone:
            listed = await self._list_cached()
            if not isinstance(listed, KubeApiError):
                return await self._listed(listed, SyncMode.LIST_CACHE)
            logger.info(
                "list from the watch cache refused (%d: %s); quorum list",
                listed.status,
                listed.message,
            )
            self._version_gone = True
            store.begin_sync()
        rv = await self._list("", "", refusable=False)
        assert isinstance(rv, str)
        return await self._listed(rv, SyncMode.LIST_QUORUM)

    async def _list_cached(self) -> str | KubeApiError:
        """One list from the watch cache into the store (``NotOlderThan`` the version last
        seen, or ``resourceVersion=0`` before any); its resourceVersion, or the refusal when the
        cache cannot serve that version (a 4xx other than 429, or a version too large)."""
        known = self.resource_version
        if known:
            return await self._list(known, "NotOlderThan", refusable=True)
        return await self._list("0", "", refusable=True)

    async def _list(self, version: str, match: str, *, refusable: bool) -> str | KubeApiError:
        """A list into the store, page by page; started over when its continue token expires
        (compaction), at most :data:`_CONTINUE_RESTARTS` times. A refusal of a ``refusable``
        list is returned; any other failure is raised."""
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
                if refusable and (rejected(exc.status) or too_large(exc)):
                    return exc
                raise
            for snap in page.pods:
                store.put(snap)
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

    async def _stream(self, known: str | None) -> WatchEnd:
        """A streaming list: the state as ADDED events up to the BOOKMARK annotated
        ``k8s.io/initial-events-end``, then the same stream goes on as an ordinary watch.
        Not honoured (:attr:`End.UNSUPPORTED`) when a plain bookmark comes first or the stream
        stays silent for ``stream_sync_timeout_s`` before that bookmark; the events already
        applied are then reconciled by the list that follows."""
        cap = self._watcher.timeout_cap()
        opened = await _opened(self._lw.stream(known, timeout_cap=cap), streaming=True)
        if isinstance(opened, WatchEnd):
            return opened
        at = clock.now()
        try:
            synced = await self._watcher.initial_events(opened, at, timeout_cap=cap)
            if isinstance(synced, WatchEnd):
                return synced
            self._synced(synced, SyncMode.STREAM)
            self._worked()
            return await self._watcher.follow(opened, at, timeout_cap=cap, continued=True)
        finally:
            opened.close()

    # ------------------------------------------------------------------ watch

    async def _resume(self) -> WatchEnd:
        rv = self.resource_version
        assert rv is not None, "resumed before any sync"
        return await self._watch(rv)

    async def _watch(self, rv: str) -> WatchEnd:
        """One watch request from ``rv``, followed until the stream ends."""
        cap = self._watcher.timeout_cap()
        opened = await _opened(self._lw.watch(rv, timeout_cap=cap), streaming=False)
        if isinstance(opened, WatchEnd):
            return opened
        try:
            return await self._watcher.follow(opened, clock.now(), timeout_cap=cap, continued=False)
        finally:
            opened.close()
