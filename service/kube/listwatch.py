"""The pod informer's requests, as client-go's ``ListerWatcher``: a list page, a watch, a
streaming list (``sendInitialEvents``), with no state between them. Each fails as
:meth:`ApiTransport.request` does, or with a ``PodDecodeError`` for a page that does not decode
at all; a pod of a page that does not decode is skipped, counted and logged.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import aiohttp

from service.config import KubeSettings
from service.domain import PodSnapshot
from service.kube.client import pod_path
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.transport import ApiTransport
from service.kube.watchstream import EventStream, WatchDecoder
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)

WATCH_JITTER = 0.1
"""The fraction by which a watch's server ``timeoutSeconds`` is randomly lengthened, so that
replicas started together do not reconnect together."""


@dataclass(frozen=True, slots=True)
class Page:
    """A list's page: the pods that decode, its resourceVersion, the next ``continue`` or ``""``."""

    pods: list[PodSnapshot]
    resource_version: str
    continue_: str


class ListWatch:
    """The requests for the pods of one namespace and selector, decoded with ``decoder`` (the
    process's one, ``service/app/service.py``)."""

    def __init__(
        self,
        api: ApiTransport,
        *,
        settings: KubeSettings,
        metrics: KubeMetrics,
        namespace: str,
        decoder: PodDecoder | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._api = api
        self._settings = settings
        self.namespace = namespace
        """The namespace whose pods are asked for (never a cluster-wide request)."""
        self._path = pod_path(namespace)
        self.reachability = api.reachability
        self._decoder = decoder or PodDecoder(settings.label_keys)
        self._watch_decoder = WatchDecoder(self._decoder, metrics)
        self._rng = rng or random.Random()
        self._decode_errors = metrics.decode_errors.labels(source="list")

    async def list(
        self,
        *,
        resource_version: str = "",
        match: str = "",
        token: str | None = None,
        limit: int | None = None,
    ) -> Page:
        """One page: ``resource_version`` and ``match`` as the API takes them (both ``""``: a
        quorum list), ``token`` the last page's ``continue``, ``limit`` the page size."""
        asked = {
            "limit": limit,
            "continue": token,
            "resourceVersion": resource_version,
            "resourceVersionMatch": match,
        }
        query = {k: v for k, v in asked.items() if v}  # "" and None: not sent
        answer = await self._api.request(
            "GET",
            self._path,
            op="list",
            query={"labelSelector": self._settings.label_selector, **query},
            timeouts=aiohttp.ClientTimeout(total=self._settings.api_timeout_s),
        )
        try:
            wire, pods, bad = self._decoder.decode_list(answer.body)
        except PodDecodeError:
            self._decode_errors.inc()
            raise
        if bad:
            self._decode_errors.inc(bad)
            logger.warning("skipped %d malformed pod(s) in a list page", bad)
        return Page(pods, wire.metadata.resourceVersion, wire.metadata.continue_ or "")

    async def stream(self, known: str | None, *, timeout_cap: int | None = None) -> EventStream:
        """Open a streaming list not older than ``known`` (``None``: the newest state)."""
        query: dict[str, str | int | bool] = {
            "sendInitialEvents": True,
            "resourceVersionMatch": "NotOlderThan",
        }
        if known is not None:
            query["resourceVersion"] = known
        return await self._open("watchlist", timeout_cap, query)

    async def watch(self, rv: str, *, timeout_cap: int | None = None) -> EventStream:
        """Open a watch of the changes after ``rv``, for at most ``timeout_cap`` seconds."""
        return await self._open("watch", timeout_cap, {"resourceVersion": rv})

    async def _open(
        self, op: str, cap: int | None, params: dict[str, str | int | bool]
    ) -> EventStream:
        settings = self._settings
        timeout_s = max(1, int(settings.watch_timeout_s * (1 + WATCH_JITTER * self._rng.random())))
        if cap is not None:
            timeout_s = min(timeout_s, cap)
        query: dict[str, str | int | bool] = {
            "allowWatchBookmarks": True,
            **params,
            "labelSelector": settings.label_selector,
            "timeoutSeconds": timeout_s,
            "watch": True,
        }
        response = await self._api.watch(
            self._path,
            op=op,
            query=query,
            # The read timeout is only a backstop, past both the stream's timeoutSeconds and the
            # silence bound by which the reflector ends a silent stream first.
            timeouts=aiohttp.ClientTimeout(
                total=None,
                connect=settings.api_timeout_s,
                sock_connect=settings.api_timeout_s,
                sock_read=max(timeout_s, settings.watch_silence_s) + settings.api_timeout_s,
            ),
            open_within_s=settings.api_timeout_s,
        )
        what = "streaming list" if op == "watchlist" else "watch stream"
        return EventStream(response, self._watch_decoder, what)
