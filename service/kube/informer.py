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
from typing import cast

import aiohttp
import anyio
import msgspec
from anyio.abc import TaskStatus
from kubernetes_asyncio import client as k8s_client

from service.config import KubeSettings
from service.domain import PodSnapshot
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import (
    KubeApiError,
    WireStatus,
    parse_retry_after,
    raw_response,
    status_message,
)
from service.metrics import Metrics
from service.ports import Clock, PodEventHandler

logger = logging.getLogger(__name__)

_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
_RELIST_RESTARTS = 3


class _WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str = ""


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
        backoff_max_s: float = 30.0,
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
        """List and watch until cancelled. Signals ``task_status`` at once (not at sync: use
        :meth:`wait_synced`), so a caller's start never blocks on an unreachable server."""
        task_status.started()
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    rv = await self._relist()
                    self._backoff.reset()
                rv = await self._watch(rv)
            except _ExpiredError:
                self._metrics.watch_restarts.labels(reason="expired").inc()
                logger.info("watch resourceVersion %s expired; relisting", rv)
                rv = None
            except KubeApiError as exc:
                if 400 <= exc.status < 500 and exc.status != 429:
                    # The server rejects the request itself (e.g. a resourceVersion it cannot
                    # parse, taken from a bad bookmark): resuming would fail forever; relist.
                    rv = None
                rv = self._resume_from(rv)
                await self._back_off("error", exc, exc.retry_after_s)
            except TimeoutError as exc:
                rv = self._resume_from(rv)
                await self._back_off("timeout", exc, None)
            except _TRANSPORT_ERRORS as exc:
                rv = self._resume_from(rv)
                await self._back_off("error", exc, None)

    def _resume_from(self, rv: str | None) -> str | None:
        """Where a watch that failed mid-stream resumes: after the last event it applied (or
        the last bookmark), not where it started, or the events in between are replayed onto
        a newer cache and take pods back in time. ``None`` (relist) stays ``None``."""
        return None if rv is None else (self._resource_version or rv)

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

    # ------------------------------------------------------------------ list

    async def _relist(self) -> str:
        if self._listed_once:
            self._metrics.relists.inc()
            if self._synced:
                self._set_synced(False)
                self._handler.cache_cold()
        fresh: dict[str, PodSnapshot] = {}
        token: str | None = None
        rv = ""
        restarts = 0
        settings = self._settings
        while True:
            body, status, headers = await self._list_page(token)
            if status == 410 and token is not None and restarts < _RELIST_RESTARTS:
                # The continue token expired (compaction): start the list over.
                restarts += 1
                fresh.clear()
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
                fresh[snap.key] = snap
            if token is None:
                rv = page.metadata.resourceVersion
            token = page.metadata.continue_
            if not token:
                break
        old = self._cache
        self._cache = fresh
        self._resource_version = rv
        self._metrics.cache_pods.set(len(fresh))
        handler = self._handler
        for key, snap in fresh.items():
            before = old.get(key)
            if before is None:
                handler.pod_changed(None, snap)
            elif before.resource_version != snap.resource_version or before.uid != snap.uid:
                handler.pod_changed(before, snap)
        for key, before in old.items():
            if key not in fresh:
                handler.pod_changed(before, None)
        self._listed_once = True
        self._set_synced(True)
        handler.cache_synced()
        logger.info(
            "pod cache synced: %d pods at resourceVersion %s (namespace %s)",
            len(fresh),
            rv,
            settings.namespace,
        )
        return rv

    async def _list_page(self, token: str | None) -> tuple[bytes, int, dict[str, str]]:
        settings = self._settings
        try:
            response = await raw_response(
                self._core.list_namespaced_pod(
                    settings.namespace,
                    label_selector=settings.label_selector,
                    limit=settings.list_page_size,
                    _continue=cast(str, token),  # None (first page): not sent
                    _preload_content=False,
                    _request_timeout=aiohttp.ClientTimeout(total=settings.api_timeout_s),
                )
            )
            try:
                body = await response.read()
            finally:
                response.release()
        except _TRANSPORT_ERRORS:
            self._metrics.api_requests.labels(op="list", result="transport").inc()
            raise
        status = response.status
        self._metrics.api_requests.labels(
            op="list", result="ok" if status == 200 else str(status)
        ).inc()
        return body, status, {"Retry-After": response.headers.get("Retry-After", "")}

    # ------------------------------------------------------------------ watch

    async def _watch(self, rv: str) -> str:
        """One watch request from ``rv``; returns the last resourceVersion seen at a clean end."""
        settings = self._settings
        timeout_s = max(
            1, int(settings.watch_timeout_s * (1 + self._watch_jitter * self._rng.random()))
        )
        started = self._clock.monotonic()
        try:
            response = await raw_response(
                self._core.list_namespaced_pod(
                    settings.namespace,
                    label_selector=settings.label_selector,
                    watch=True,
                    allow_watch_bookmarks=True,
                    resource_version=rv,
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
                )
            )
        except _TRANSPORT_ERRORS:
            self._metrics.api_requests.labels(op="watch", result="transport").inc()
            raise
        events = 0
        try:
            status = response.status
            if status != 200:
                body = await response.read()
                self._metrics.api_requests.labels(op="watch", result=str(status)).inc()
                if status == 410:
                    raise _ExpiredError(status_message(body))
                raise KubeApiError(
                    status,
                    status_message(body),
                    retry_after_s=parse_retry_after(response.headers.get("Retry-After")),
                )
            self._metrics.api_requests.labels(op="watch", result="ok").inc()
            async for line in response.content:
                if not line.strip():
                    continue
                rv = self._apply(line, rv)
                self._resource_version = rv
                events += 1
                if events == 1:
                    self._backoff.reset()
        finally:
            response.close()
        if events == 0 and self._clock.monotonic() - started < self._min_watch_s:
            raise KubeApiError(0, "watch stream closed at once without events")
        self._metrics.watch_restarts.labels(reason="closed").inc()
        return rv

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
            if kind == "DELETED":
                before = self._cache.pop(key, None)
                self._handler.pod_changed(before if before is not None else snap, None)
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
            return mark.metadata.resourceVersion or rv
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
