"""The pod informer: a slim cache of the sandbox namespace kept by list + watch.

Lifecycle (``run``): list in pages, then watch from the list's resourceVersion with bookmarks and
a jittered server ``timeoutSeconds``. A normal end of stream re-watches from the last seen
resourceVersion (bookmarks advance it). A 410 (HTTP or ``ERROR`` event) means the history is
gone: the cache goes cold, is rebuilt by a relist, and the difference is reported as changes
(vanished pods as deletes). Other failures (5xx, 429 with Retry-After, refused or dropped
connections, read timeouts) back off exponentially with jitter and resume from the last seen
resourceVersion. Objects are decoded from raw JSON straight into :class:`PodSnapshot`; client
models are never built. Malformed objects are skipped, counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, cast

import aiohttp
import anyio
import msgspec
from anyio.abc import TaskStatus
from kubernetes_asyncio import client as k8s_client

from service.config import KubeSettings
from service.domain import PodSnapshot
from service.kit.clock import Clock
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import (
    KubeApiError,
    WireStatus,
    parse_retry_after,
    raw_response,
    read_whole,
    status_message,
)
from service.metrics import Metrics
from service.ports import PodEventHandler

logger = logging.getLogger(__name__)

_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
_RELIST_RESTARTS = 3
BACKOFF_MAX_S = 30.0
"""Cap of the delay between list/watch attempts after failures."""


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


class _ExpiredError(Exception):
    """410 Gone/Expired: the requested resourceVersion is no longer served; relist."""


class _StreamUnsupportedError(Exception):
    """The server rejected a streaming list (a 4xx) or did not honour it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ListMode(StrEnum):
    """How the cache is filled (the ``LIST_MODE`` setting)."""

    AUTO = "auto"
    """Stream; on a server that rejects or does not honour it, list from then on."""
    STREAM = "stream"
    LIST = "list"


class SyncMode(StrEnum):
    """How the last sync actually filled the cache."""

    STREAM = "stream"
    """A streaming list (``sendInitialEvents``): no list request at all."""
    LIST_CACHE = "list_cache"
    """A list served from the API server's watch cache."""
    LIST_QUORUM = "list_quorum"
    """A quorum list from etcd, in pages: the last resort."""


_INITIAL_EVENTS_END = "k8s.io/initial-events-end"


class _MonotonicClock:
    def monotonic(self) -> float:
        return time.monotonic()


class Backoff:
    """Exponential backoff with jitter: delay n is uniform in [0.5, 1] * min(max, initial * 2**n)."""

    def __init__(self, *, initial_s: float, max_s: float, rng: random.Random) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._rng = rng
        self._attempt = 0

    def next_delay(self, floor_s: float | None = None) -> float:
        base = min(self._max_s, self._initial_s * (2.0 ** min(self._attempt, 32)))
        self._attempt += 1
        delay = base * (0.5 + 0.5 * self._rng.random())
        return max(delay, floor_s) if floor_s is not None else delay

    def reset(self) -> None:
        self._attempt = 0


class PodInformer:
    """Implements ``ports.PodCache``; feeds a ``ports.PodEventHandler``.

    ``backoff_initial_s``/``backoff_max_s`` bound reconnect delays, ``watch_jitter`` is the
    fraction by which the server ``timeoutSeconds`` is randomly lengthened, and a stream that
    ends cleanly within ``min_watch_s`` without any event is treated as a failure (backoff) so a
    misbehaving server cannot make the informer spin.
    """

    def __init__(
        self,
        api: k8s_client.ApiClient,
        settings: KubeSettings,
        decoder: PodDecoder,
        handler: PodEventHandler,
        metrics: Metrics,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = BACKOFF_MAX_S,
        watch_jitter: float = 0.1,
        min_watch_s: float = 1.0,
    ) -> None:
        self._core = k8s_client.CoreV1Api(api)
        self._settings = settings
        self._decoder = decoder
        self._handler = handler
        self._metrics = metrics
        self._clock = clock or _MonotonicClock()
        self._rng = rng or random.Random()
        self._backoff = Backoff(initial_s=backoff_initial_s, max_s=backoff_max_s, rng=self._rng)
        self._watch_jitter = watch_jitter
        self._min_watch_s = min_watch_s
        self._cache: dict[str, PodSnapshot] = {}
        self._synced = False
        self._synced_event = anyio.Event()
        self._listed_once = False
        self._resource_version: str | None = None
        self._list_mode = ListMode(settings.list_mode)
        self._need_sync = True
        self._rv_unavailable = False
        self._stream_unsupported = False
        self._seen: set[str] | None = None
        """The keys a streaming list has sent so far; ``None`` outside its initial events."""
        self.sync_mode: SyncMode | None = None
        """How the cache was last filled; ``None`` before the first sync."""
        self._event_counters = {
            t: metrics.watch_events.labels(type=t)
            for t in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
        }
        metrics.cache_synced.set(0)
        metrics.cache_pods.set(0)

    # ------------------------------------------------------------------ PodCache

    def get(self, key: str) -> PodSnapshot | None:
        return self._cache.get(key)

    def keys(self) -> Iterable[str]:
        """A copy of the cached keys (safe to iterate while events arrive)."""
        return list(self._cache)

    @property
    def synced(self) -> bool:
        return self._synced

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def resource_version(self) -> str | None:
        """The last resourceVersion seen (list, event or bookmark); ``None`` before the list."""
        return self._resource_version

    async def wait_synced(self) -> None:
        """Return once the cache matches the server (immediately if it does now)."""
        while not self._synced:
            await self._synced_event.wait()

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sync and watch until cancelled. Signals ``task_status`` at once (not at sync: use
        :meth:`wait_synced`), so a caller's start never blocks on an unreachable server."""
        task_status.started()
        while True:
            try:
                if self._need_sync:
                    await self._sync()
                else:
                    assert self._resource_version is not None
                    await self._watch(self._resource_version)
            except _ExpiredError:
                self._metrics.watch_restarts.labels(reason="expired").inc()
                if self._need_sync:
                    # The version a relist started from is gone too: read the newest state.
                    self._rv_unavailable = True
                logger.info(
                    "resourceVersion %s expired; relisting", self._resource_version or "(none)"
                )
                self._need_sync = True
            except KubeApiError as exc:
                if 400 <= exc.status < 500 and exc.status != 429:
                    # The server rejects the request itself (e.g. a resourceVersion it cannot
                    # parse, taken from a bad bookmark): resuming would fail forever; relist.
                    self._need_sync = True
                await self._back_off("error", exc, exc.retry_after_s)
            except TimeoutError as exc:
                await self._back_off("timeout", exc, None)
            except _TRANSPORT_ERRORS as exc:
                await self._back_off("error", exc, None)

    async def _back_off(self, reason: str, exc: Exception, floor_s: float | None) -> None:
        self._metrics.watch_restarts.labels(reason=reason).inc()
        delay = self._backoff.next_delay(floor_s)
        logger.warning(
            "kubernetes list/watch failed (%s: %s); retrying in %.2fs",
            type(exc).__name__,
            exc,
            delay,
        )
        await anyio.sleep(delay)

    def _set_synced(self, synced: bool) -> None:
        self._synced = synced
        self._metrics.cache_synced.set(1 if synced else 0)
        if synced:
            self._synced_event.set()
        else:
            self._synced_event = anyio.Event()

    # ------------------------------------------------------------------ sync

    async def _sync(self) -> None:
        """Bring the cache to the server's state: by streaming list (which then goes on as the
        watch, so this returns only when that stream ends) or by list. The cache is updated in
        place; every pod the sync did not see is reported deleted once it is complete."""
        if self._listed_once:
            self._metrics.relists.inc()
            if self._synced:
                self._set_synced(False)
                self._handler.cache_cold()
        if self._list_mode != ListMode.LIST and not self._stream_unsupported:
            try:
                await self._stream()
                return
            except _StreamUnsupportedError as exc:
                if self._list_mode == ListMode.STREAM:
                    raise KubeApiError(exc.status, str(exc)) from exc
                self._stream_unsupported = True
                logger.warning("streaming list unavailable (%s); listing from now on", exc)
        await self._list()
        self._backoff.reset()

    def _take(self, snap: PodSnapshot, seen: set[str]) -> None:
        """One pod of a sync: cached, and reported if it is new or changed."""
        key = snap.key
        seen.add(key)
        before = self._cache.get(key)
        if (
            before is None
            or before.resource_version != snap.resource_version
            or before.uid != snap.uid
        ):
            self._cache[key] = snap
            self._handler.pod_changed(before, snap)

    def _finish_sync(self, seen: set[str], rv: str, mode: SyncMode) -> None:
        cache = self._cache
        handler = self._handler
        for key in [k for k in cache if k not in seen]:
            handler.pod_changed(cache.pop(key), None)
        self._resource_version = rv
        self._metrics.cache_pods.set(len(cache))
        for m in SyncMode:
            self._metrics.list_mode.labels(mode=m.value).set(1 if m is mode else 0)
        self._listed_once = True
        self._rv_unavailable = False
        self._need_sync = False
        self.sync_mode = mode
        self._set_synced(True)
        handler.cache_synced()
        logger.info(
            "pod cache synced by %s: %d pods at resourceVersion %s (namespace %s)",
            mode.value,
            len(cache),
            rv,
            self._settings.namespace,
        )

    # ------------------------------------------------------------------ list

    async def _list(self) -> None:
        """A list from the watch cache (``resourceVersion=0``, or not older than the version
        already seen), and a quorum list only when that version is unavailable."""
        seen: set[str] = set()
        if self._rv_unavailable:
            rv = await self._list_pages("", "", seen)
            self._finish_sync(seen, rv, SyncMode.LIST_QUORUM)
            return
        known = self._resource_version
        try:
            rv = await self._list_pages(known or "0", "NotOlderThan" if known else "", seen)
        except KubeApiError as exc:
            too_large = exc.status == 504 and "Too large resource version" in str(exc)
            if not (too_large or (400 <= exc.status < 500 and exc.status != 429)):
                raise
            logger.info("list from the watch cache refused (%s); quorum list", exc)
            self._rv_unavailable = True
            seen.clear()
            rv = await self._list_pages("", "", seen)
            self._finish_sync(seen, rv, SyncMode.LIST_QUORUM)
            return
        self._finish_sync(seen, rv, SyncMode.LIST_CACHE)

    async def _list_pages(self, version: str, match: str, seen: set[str]) -> str:
        """Every page of one list into the cache; returns the list's resourceVersion."""
        token: str | None = None
        rv = ""
        restarts = 0
        while True:
            body, status, headers = await self._list_page(token, version, match)
            if status == 410 and token is not None and restarts < _RELIST_RESTARTS:
                # The continue token expired (compaction): start the list over.
                restarts += 1
                seen.clear()
                token = None
                continue
            if status != 200:
                raise KubeApiError(
                    status,
                    status_message(body),
                    retry_after_s=parse_retry_after(headers.get("Retry-After")),
                )
            try:
                page, pods, bad = self._decoder.decode_list(body)
            except PodDecodeError as exc:
                self._metrics.decode_errors.labels(source="list").inc()
                raise KubeApiError(status, f"undecodable list page: {exc}") from exc
            if bad:
                self._metrics.decode_errors.labels(source="list").inc(bad)
                logger.warning("skipped %d malformed pod(s) in a list page", bad)
            for snap in pods:
                self._take(snap, seen)
            if token is None:
                rv = page.metadata.resourceVersion
            token = page.metadata.continue_
            if not token:
                return rv

    async def _list_page(
        self, token: str | None, version: str, match: str
    ) -> tuple[bytes, int, dict[str, str]]:
        settings = self._settings
        # As client-go: a list not older than a known version is not paginated, or a server
        # would take it to etcd; resourceVersion=0 ignores the limit where a watch cache serves.
        limit = None if match else settings.list_page_size
        try:
            response, body = await read_whole(
                self._core.list_namespaced_pod(
                    settings.namespace,
                    label_selector=settings.label_selector,
                    limit=cast(int, limit),  # None: not sent
                    _continue=cast(str, token),  # None (first page): not sent
                    resource_version=cast(str, version or None),
                    resource_version_match=cast(str, match or None),
                    _preload_content=False,
                    _request_timeout=aiohttp.ClientTimeout(total=settings.api_timeout_s),
                )
            )
        except _TRANSPORT_ERRORS:
            self._metrics.api_requests.labels(op="list", result="transport").inc()
            raise
        status = response.status
        self._metrics.api_requests.labels(
            op="list", result="ok" if status == 200 else str(status)
        ).inc()
        return body, status, {"Retry-After": response.headers.get("Retry-After", "")}

    # ------------------------------------------------------------------ watch

    def _watch_timeout_s(self) -> int:
        settings = self._settings
        return max(1, int(settings.watch_timeout_s * (1 + self._watch_jitter * self._rng.random())))

    async def _open(self, op: str, timeout_s: int, **params: Any) -> aiohttp.ClientResponse:
        """Open a watch stream (``op``: watch or watchlist); raises on any status but 200."""
        settings = self._settings
        try:
            response = await raw_response(
                self._core.list_namespaced_pod(
                    settings.namespace,
                    label_selector=settings.label_selector,
                    watch=True,
                    allow_watch_bookmarks=True,
                    timeout_seconds=timeout_s,
                    _preload_content=False,
                    # No total timeout (the stream is long-lived); a silent connection is dead
                    # once nothing arrived for longer than the server's own timeout.
                    _request_timeout=aiohttp.ClientTimeout(
                        total=None,
                        connect=settings.api_timeout_s,
                        sock_connect=settings.api_timeout_s,
                        sock_read=timeout_s + settings.api_timeout_s,
                    ),
                    **params,
                )
            )
        except _TRANSPORT_ERRORS:
            self._metrics.api_requests.labels(op=op, result="transport").inc()
            raise
        status = response.status
        if status == 200:
            self._metrics.api_requests.labels(op=op, result="ok").inc()
            return response
        try:
            body = await response.read()
        finally:
            response.close()
        self._metrics.api_requests.labels(op=op, result=str(status)).inc()
        message = status_message(body)
        if status == 410 or (status == 504 and "Too large resource version" in message):
            raise _ExpiredError(message)
        if op == "watchlist" and 400 <= status < 500 and status != 429:
            raise _StreamUnsupportedError(status, message)
        raise KubeApiError(
            status, message, retry_after_s=parse_retry_after(response.headers.get("Retry-After"))
        )

    async def _stream(self) -> None:
        """A streaming list: the state as ADDED events up to the BOOKMARK annotated
        ``k8s.io/initial-events-end``, then the same stream goes on as an ordinary watch.

        Not honoured (:class:`_StreamUnsupportedError`) when a plain bookmark comes first or the
        stream stays silent for ``stream_sync_timeout_s`` before that bookmark; the events
        already applied are then reconciled by the list that follows."""
        known = None if self._rv_unavailable else self._resource_version
        started = self._clock.monotonic()
        response = await self._open(
            "watchlist",
            self._watch_timeout_s(),
            send_initial_events=True,
            resource_version_match="NotOlderThan",
            resource_version=cast(str, known),  # None: not sent (the newest state)
        )
        self._seen = set()
        bound_s = self._settings.stream_sync_timeout_s
        events = 0
        try:
            # The deadline follows the events (moved once half the bound has passed, to keep
            # timer rescheduling off the per-event path): it measures silence, not total time.
            # anyio.current_time() looks the backend up on every call (a fifth of this loop's
            # time at 150k events); the loop's clock is time.monotonic() plus a fixed offset.
            offset_s = anyio.current_time() - time.monotonic()
            with anyio.CancelScope(deadline=anyio.current_time() + bound_s) as silence:
                async for line in response.content:
                    if not line.strip():
                        continue
                    now = time.monotonic() + offset_s
                    if now + bound_s - silence.deadline > bound_s / 2:
                        silence.deadline = now + bound_s
                    self._consume(line)
                    events += 1
                    if not self._initial_events():
                        break  # synced: the rest of the stream is an ordinary watch
            if self._initial_events():
                if silence.cancelled_caught:
                    raise _StreamUnsupportedError(
                        0, f"no initial-events-end bookmark within {bound_s:g}s of silence"
                    )
                raise KubeApiError(0, "streaming list ended before its initial-events-end bookmark")
            self._backoff.reset()
            await self._follow(response, started, events)
        finally:
            self._seen = None
            response.close()

    def _initial_events(self) -> bool:
        return self._seen is not None

    async def _watch(self, rv: str) -> None:
        """One watch request from ``rv``, followed until the stream ends."""
        started = self._clock.monotonic()
        response = await self._open("watch", self._watch_timeout_s(), resource_version=rv)
        try:
            await self._follow(response, started, 0)
        finally:
            response.close()

    async def _follow(self, response: aiohttp.ClientResponse, started: float, events: int) -> None:
        async for line in response.content:
            if not line.strip():
                continue
            self._consume(line)
            events += 1
            if events == 1:
                self._backoff.reset()
        if events == 0 and self._clock.monotonic() - started < self._min_watch_s:
            raise KubeApiError(0, "watch stream closed at once without events")
        self._metrics.watch_restarts.labels(reason="closed").inc()

    def _consume(self, line: bytes) -> None:
        rv = self._apply(line, self._resource_version or "")
        if self._seen is None and rv:
            self._resource_version = rv

    def _apply(self, line: bytes, rv: str) -> str:
        """Apply one watch event line to the cache; returns the resourceVersion to resume at."""
        try:
            event = _event_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._decode_error("malformed watch event: %s", exc)
            return rv
        kind = event.type
        counter = self._event_counters.get(kind)
        if counter is not None:
            counter.inc()
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            try:
                snap = self._decoder.decode(event.object)
            except PodDecodeError as exc:
                self._decode_error("skipped malformed pod in a %s event: %s", exc, kind)
                self._forget_unreadable(event.object)
                return rv
            key = snap.key
            seen = self._seen
            if kind == "DELETED":
                before = self._cache.pop(key, None)
                if seen is not None:
                    seen.discard(key)
                self._handler.pod_changed(before if before is not None else snap, None)
            elif seen is not None:
                # Initial events: not ordered by resourceVersion, so the stream's position is
                # only known at the initial-events-end bookmark.
                self._take(snap, seen)
                return rv
            else:
                before = self._cache.get(key)
                self._cache[key] = snap
                self._handler.pod_changed(before, snap)
            self._metrics.cache_pods.set(len(self._cache))
            return snap.resource_version
        if kind == "BOOKMARK":
            try:
                mark = _bookmark_decoder.decode(event.object)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._decode_error("malformed bookmark: %s", exc)
                return rv
            meta = mark.metadata
            if self._seen is not None:
                if (meta.annotations or {}).get(_INITIAL_EVENTS_END) != "true":
                    raise _StreamUnsupportedError(
                        0, "a bookmark came before the initial-events-end bookmark"
                    )
                if not meta.resourceVersion:
                    raise KubeApiError(0, "initial-events-end bookmark without resourceVersion")
                seen, self._seen = self._seen, None
                self._finish_sync(seen, meta.resourceVersion, SyncMode.STREAM)
            return meta.resourceVersion or rv
        if kind == "ERROR":
            try:
                status = _status_decoder.decode(event.object)
            except (msgspec.DecodeError, msgspec.ValidationError):
                status = WireStatus(message="undecodable ERROR event", code=500)
            if status.code == 410:
                raise _ExpiredError(status.message)
            raise KubeApiError(status.code or 500, status.message or status.reason)
        self._decode_error("unknown watch event type %r", kind)
        return rv

    def _forget_unreadable(self, raw: msgspec.Raw) -> None:
        """A pod we can no longer read is a gap in its observation: fail closed by dropping it
        from the cache (its clock is cleared and it cannot be acted on) until a readable event
        or a relist brings it back."""
        try:
            meta = _key_decoder.decode(raw).metadata
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if not isinstance(meta.namespace, str) or not isinstance(meta.name, str):
            return
        before = self._cache.pop(f"{meta.namespace}/{meta.name}", None)
        if before is not None:
            self._handler.pod_changed(before, None)
            self._metrics.cache_pods.set(len(self._cache))

    def _decode_error(self, message: str, *args: object) -> None:
        self._metrics.decode_errors.labels(source="watch").inc()
        logger.warning(message, *args)
