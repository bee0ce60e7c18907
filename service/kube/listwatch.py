"""The pod informer's requests: one list page, a watch, a streaming list, and nothing more.

:class:`ListWatch` makes the requests for the pods of one namespace and selector, as client-go's
``ListerWatcher`` does: a page of a list (``limit``/``continue``, from the API server's watch
cache with ``resourceVersion=0`` or ``NotOlderThan`` a version, or a quorum list), a watch from a
resourceVersion (bookmarks, a jittered server ``timeoutSeconds`` within the cap the reflector
gives), and a streaming list (``sendInitialEvents``: a watch that starts with the state as ADDED
events). It holds no state between requests and writes into no cache; what an answer means and
what to ask next are the reflector's (``service/kube/reflector.py``).

A request answers a decoded :class:`Page` or an open stream, and fails with a kit error:
``Unavailable`` when no answer came, :class:`KubeApiError` for any other status (the reflector
classifies it with ``gone``, ``too_large`` and ``rejected``), a
:class:`~service.kube.decode.PodDecodeError` for a page that does not decode at all. A pod of a
page that does not decode is skipped, counted and logged.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import anyio
from kubernetes_asyncio import client as k8s_client

from service.config import KubeSettings
from service.domain import PodSnapshot
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
from service.kube.reachability import Reachability
from service.kube.transport import transport_of
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)

WATCH_JITTER = 0.1
"""The default fraction by which a watch's server ``timeoutSeconds`` is randomly lengthened."""


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a list: its pods (those that decode), the list's resourceVersion and the
    ``continue`` token of the next page (``""`` on the last)."""

    pods: list[PodSnapshot]
    resource_version: str
    continue_: str


class ListWatch:
    """The list, watch and streaming-list requests for the pods of one namespace and selector.

    ``watch_jitter`` is the fraction by which the server ``timeoutSeconds`` is randomly
    lengthened, so that replicas started together do not reconnect together.
    """

    def __init__(
        self,
        api: k8s_client.ApiClient,
        *,
        settings: KubeSettings,
        metrics: KubeMetrics,
        namespace: str,
        rng: random.Random | None = None,
        watch_jitter: float = WATCH_JITTER,
    ) -> None:
        self._core = k8s_client.CoreV1Api(api)
        self._settings = settings
        self.namespace = namespace
        """The namespace whose pods are asked for (never a cluster-wide request)."""
        transport = transport_of(api)
        self.reachability: Reachability | None = (
            transport.reachability if transport is not None else None
        )
        """Whether the server answers, as the client's transport sees it (``None`` without it)."""
        self._decoder = PodDecoder(settings.label_keys)
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._watch_jitter = watch_jitter
        self._decode_errors = metrics.decode_errors.labels(source="list")

    # ------------------------------------------------------------------ list

    async def list(
        self,
        *,
        resource_version: str = "",
        match: str = "",
        token: str | None = None,
        limit: int | None = None,
    ) -> Page:
        """One page of the pods: ``resource_version`` and ``match`` as the API takes them
        (``""``: not sent, a quorum list), ``token`` the previous page's ``continue``, ``limit``
        the page size (``None``: not sent)."""
        try:
            response, body = await read_whole(
                self._core.list_namespaced_pod(
                    self.namespace,
                    label_selector=self._settings.label_selector,
                    limit=cast(int, limit),  # None: not sent
                    _continue=cast(str, token),  # None (first page): not sent
                    resource_version=cast(str, resource_version or None),
                    resource_version_match=cast(str, match or None),
                    _preload_content=False,
                    _request_timeout=aiohttp.ClientTimeout(total=self._settings.api_timeout_s),
                )
            )
        except TRANSIENT_ERRORS as exc:
            self._metrics.api_requests.labels(op="list", result="transport").inc()
            raise unavailable("list pods", exc) from exc
        status = response.status
        self._metrics.api_requests.labels(
            op="list", result="ok" if status == 200 else str(status)
        ).inc()
        if status != 200:
            retry_after_s = parse_retry_after(response.headers.get("Retry-After"))
            raise KubeApiError(status, status_message(body), retry_after_s=retry_after_s)
        try:
            wire, pods, bad = self._decoder.decode_list(body)
        except PodDecodeError:
            self._decode_errors.inc()
            raise
        if bad:
            self._decode_errors.inc(bad)
            logger.warning("skipped %d malformed pod(s) in a list page", bad)
        return Page(pods, wire.metadata.resourceVersion, wire.metadata.continue_ or "")

    # ------------------------------------------------------------------ watch

    async def stream(
        self, known: str | None, *, timeout_cap: int | None = None
    ) -> aiohttp.ClientResponse:
        """Open a streaming list not older than ``known`` (``None``: the newest state), asking
        the server to end it within ``timeout_cap`` seconds at most (see :meth:`watch`)."""
        return await self._open(
            "watchlist",
            timeout_cap,
            send_initial_events=True,
            resource_version_match="NotOlderThan",
            resource_version=cast(str, known),  # None: not sent
        )

    async def watch(self, rv: str, *, timeout_cap: int | None = None) -> aiohttp.ClientResponse:
        """Open a watch of the changes after ``rv``. Its ``timeoutSeconds`` is the jittered
        ``WATCH_TIMEOUT_SECONDS``, or ``timeout_cap`` when that is shorter."""
        return await self._open("watch", timeout_cap, resource_version=rv)

    def _watch_timeout_s(self, cap: int | None) -> int:
        timeout_s = self._settings.watch_timeout_s
        jittered = max(1, int(timeout_s * (1 + self._watch_jitter * self._rng.random())))
        return jittered if cap is None else min(jittered, cap)

    async def _open(self, op: str, cap: int | None, **params: Any) -> aiohttp.ClientResponse:
        """Open a watch stream (``op``: watch or watchlist): the response on a 200."""
        settings = self._settings
        timeout_s = self._watch_timeout_s(cap)
        requests = self._metrics.api_requests
        try:
            # The answer's status and headers within the API timeout, as any request's (the
            # server sends them at once); the stream itself has no total timeout.
            with anyio.fail_after(settings.api_timeout_s):
                response = await raw_response(
                    self._core.list_namespaced_pod(
                        self.namespace,
                        label_selector=settings.label_selector,
                        watch=True,
                        allow_watch_bookmarks=True,
                        timeout_seconds=timeout_s,
                        _preload_content=False,
                        # The read timeout is only a backstop, an API timeout past both the
                        # stream's own timeoutSeconds and the silence bound by which the
                        # reflector ends a silent stream first (docs/architecture.md, "A
                        # silent watch"): the reflector's end is the one counted as silence.
                        _request_timeout=aiohttp.ClientTimeout(
                            total=None,
                            connect=settings.api_timeout_s,
                            sock_connect=settings.api_timeout_s,
                            sock_read=max(timeout_s, settings.watch_silence_s)
                            + settings.api_timeout_s,
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
        retry_after_s = parse_retry_after(response.headers.get("Retry-After"))
        raise KubeApiError(status, status_message(body), retry_after_s=retry_after_s)
