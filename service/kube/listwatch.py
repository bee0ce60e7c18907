"""The pod informer's requests: list, watch and streaming list, and the fallback between them.

:class:`ListWatch` makes the requests, as client-go's reflector makes them: a list in pages
(``limit``/``continue``, restarted when a continue token expires) from the API server's watch
cache (``resourceVersion=0`` or ``NotOlderThan`` the version already seen) or a quorum list; a
watch from a resourceVersion, with bookmarks and a jittered server ``timeoutSeconds``; and a
streaming list (``sendInitialEvents``), a watch that starts with the state as ADDED events.

What the protocol answers is a value: a 410 (or a version too large) is :attr:`End.EXPIRED`, a
rejected streaming list :attr:`End.UNSUPPORTED`, a watch cache that cannot serve a list
:class:`Refused`. Only failures raise: ``Unavailable`` when no answer came, :class:`KubeApiError`
for any other status. :class:`SyncRequest` is how the next sync asks, and how that falls back
(docs/architecture.md, "How the cache is filled").
"""

from __future__ import annotations

import enum
import logging
import random
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from kubernetes_asyncio import client as k8s_client

from service.config import KubeSettings
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import (
    TRANSIENT_ERRORS,
    KubeApiError,
    parse_retry_after,
    raw_response,
    read_whole,
    status_message,
    unavailable,
)
from service.kube.store import PodStore
from service.metrics import Metrics

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True, slots=True)
class WatchEnd:
    """How a watch stream ended: the reason, and the server's status and message if any."""

    why: End
    status: int = 0
    message: str = ""

    def __str__(self) -> str:
        status = f" {self.status}" if self.status else ""
        return f"watch {self.why}{status}: {self.message}" if self.message else f"watch {self.why}"


@dataclass(frozen=True, slots=True)
class Refused:
    """The watch cache cannot serve a list from that version (410, 4xx, or too large)."""

    status: int
    message: str


def _too_large(status: int, message: str) -> bool:
    return status == 504 and "Too large resource version" in message


def rejected(status: int) -> bool:
    """A 4xx other than 429: the server refuses the request itself, retrying it is useless."""
    return 400 <= status < 500 and status != 429


class ListWatch:
    """The list, watch and streaming-list requests for the pods of one namespace and selector.

    ``watch_jitter`` is the fraction by which the server ``timeoutSeconds`` is randomly
    lengthened, so that replicas started together do not reconnect together.
    """

    def __init__(
        self,
        api: k8s_client.ApiClient,
        settings: KubeSettings,
        decoder: PodDecoder,
        metrics: Metrics,
        *,
        namespace: str,
        rng: random.Random,
        watch_jitter: float,
    ) -> None:
        self._core = k8s_client.CoreV1Api(api)
        self._settings = settings
        self._namespace = namespace
        self._decoder = decoder
        self._metrics = metrics
        self._rng = rng
        self._watch_jitter = watch_jitter

    # ------------------------------------------------------------------ list

    async def list_cached(self, store: PodStore, known: str | None) -> str | Refused:
        """One list from the watch cache into ``store`` (``NotOlderThan`` ``known``, or
        ``resourceVersion=0`` before any); its resourceVersion, or :class:`Refused`."""
        if known:
            return await self._list(store, known, "NotOlderThan", refusable=True)
        return await self._list(store, "0", "", refusable=True)

    async def list_quorum(self, store: PodStore) -> str:
        """One quorum list into ``store``, in pages; its resourceVersion."""
        rv = await self._list(store, "", "", refusable=False)
        assert not isinstance(rv, Refused)
        return rv

    async def _list(
        self, store: PodStore, version: str, match: str, *, refusable: bool
    ) -> str | Refused:
        token: str | None = None
        rv = ""
        restarts = 0
        decode_errors = self._metrics.decode_errors.labels(source="list")
        while True:
            body, status, retry_after = await self._list_page(token, version, match)
            if status == 410 and token is not None and restarts < _CONTINUE_RESTARTS:
                # The continue token expired (compaction): start the list over.
                restarts += 1
                store.begin_sync()
                token = None
                continue
            if status != 200:
                message = status_message(body)
                if refusable and (rejected(status) or _too_large(status, message)):
                    return Refused(status, message)
                raise KubeApiError(status, message, retry_after_s=parse_retry_after(retry_after))
            try:
                page, pods, bad = self._decoder.decode_list(body)
            except PodDecodeError as exc:
                decode_errors.inc()
                raise KubeApiError(status, f"undecodable list page: {exc}") from exc
            if bad:
                decode_errors.inc(bad)
                logger.warning("skipped %d malformed pod(s) in a list page", bad)
            put = store.put
            for snap in pods:
                put(snap)
            if token is None:
                rv = page.metadata.resourceVersion
            token = page.metadata.continue_
            if not token:
                return rv

    async def _list_page(
        self, token: str | None, version: str, match: str
    ) -> tuple[bytes, int, str | None]:
        """One page: (body, status, Retry-After)."""
        settings = self._settings
        # As client-go: a list not older than a known version is not paginated, or a server
        # would take it to etcd; resourceVersion=0 ignores the limit where a watch cache serves.
        limit = None if match else settings.list_page_size
        try:
            response, body = await read_whole(
                self._core.list_namespaced_pod(
                    self._namespace,
                    label_selector=settings.label_selector,
                    limit=cast(int, limit),  # None: not sent
                    _continue=cast(str, token),  # None (first page): not sent
                    resource_version=cast(str, version or None),
                    resource_version_match=cast(str, match or None),
                    _preload_content=False,
                    _request_timeout=aiohttp.ClientTimeout(total=settings.api_timeout_s),
                )
            )
        except TRANSIENT_ERRORS as exc:
            self._metrics.api_requests.labels(op="list", result="transport").inc()
            raise unavailable("list pods", exc) from exc
        status = response.status
        self._metrics.api_requests.labels(
            op="list", result="ok" if status == 200 else str(status)
        ).inc()
        return body, status, response.headers.get("Retry-After")

    # ------------------------------------------------------------------ watch

    async def open_stream(self, known: str | None) -> aiohttp.ClientResponse | WatchEnd:
        """Open a streaming list not older than ``known`` (``None``: the newest state)."""
        return await self._open(
            "watchlist",
            send_initial_events=True,
            resource_version_match="NotOlderThan",
            resource_version=cast(str, known),  # None: not sent
        )

    async def open_watch(self, rv: str) -> aiohttp.ClientResponse | WatchEnd:
        """Open a watch of the changes after ``rv``."""
        return await self._open("watch", resource_version=rv)

    def _watch_timeout_s(self) -> int:
        timeout_s = self._settings.watch_timeout_s
        return max(1, int(timeout_s * (1 + self._watch_jitter * self._rng.random())))

    async def _open(self, op: str, **params: Any) -> aiohttp.ClientResponse | WatchEnd:
        """Open a watch stream (``op``: watch or watchlist): the response on a 200, or why not."""
        settings = self._settings
        timeout_s = self._watch_timeout_s()
        requests = self._metrics.api_requests
        try:
            response = await raw_response(
                self._core.list_namespaced_pod(
                    self._namespace,
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
        except TRANSIENT_ERRORS as exc:
            requests.labels(op=op, result="transport").inc()
            raise unavailable(f"{op} pods", exc) from exc
        status = response.status
        if status == 200:
            requests.labels(op=op, result="ok").inc()
            return response
        requests.labels(op=op, result=str(status)).inc()
        try:
            body = await response.read()
        except TRANSIENT_ERRORS as exc:
            raise unavailable(f"{op} pods: reading the {status} answer", exc) from exc
        finally:
            response.close()
        message = status_message(body)
        if status == 410 or _too_large(status, message):
            return WatchEnd(End.EXPIRED, status, message)
        if op == "watchlist" and rejected(status):
            return WatchEnd(End.UNSUPPORTED, status, message)
        raise KubeApiError(
            status, message, retry_after_s=parse_retry_after(response.headers.get("Retry-After"))
        )
