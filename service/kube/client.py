"""Fresh pod reads and preconditioned deletes (implements ``ports.PodClient``).

Responses are read raw (``_preload_content=False``) and decoded straight into a
:class:`PodSnapshot`; no client models are built. Every call has its own timeout
(``KubeSettings.api_timeout_s``). GET and DELETE report a failure the same way, as a kit error
(``service/kit/errors.py``): ``Unavailable`` when no answer came, :class:`KubeApiError` for an
unexpected status (with the server's ``Retry-After``), :class:`PodDecodeError` (an
``Undecodable``) for a pod that does not decode. Expected answers are values: the pod or ``None``
(404) for a GET, a :class:`DeleteOutcome` (deleted, 404 gone, 409 conflict) for a DELETE.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, cast

import aiohttp
from kubernetes_asyncio import client as k8s_client

from service import checks
from service.config import KubeSettings
from service.domain import DeleteOutcome, DeleteResult, PodSnapshot
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import (
    TRANSIENT_ERRORS,
    KubeApiError,
    parse_retry_after,
    read_whole,
    status_message,
    unavailable,
)
from service.kube.transport import transport_of
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)


class KubePodClient:
    """GET and preconditioned DELETE of single pods."""

    def __init__(
        self,
        api: k8s_client.ApiClient,
        settings: KubeSettings,
        decoder: PodDecoder,
        metrics: KubeMetrics,
    ) -> None:
        self._core = k8s_client.CoreV1Api(api)
        self._transport = transport_of(api)
        self._settings = settings
        self._decoder = decoder
        self._metrics = metrics

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self._settings.api_timeout_s)

    def _count(self, op: str, result: str) -> None:
        self._metrics.api_requests.labels(op=op, result=result).inc()

    def delete_slot(self) -> AbstractAsyncContextManager[None]:
        """The transport's request slot, held by this task while inside
        (``ApiTransport.slot``); nothing to hold on a client without the transport."""
        if self._transport is None:
            return nullcontext()
        return self._transport.slot()

    async def get_pod(self, namespace: str, name: str) -> PodSnapshot | None:
        """The pod as the server has it now; ``None`` on 404. Raises ``Unavailable`` when no
        answer came, :class:`KubeApiError` for any other status, :class:`PodDecodeError` for a
        pod that does not decode (counted and logged here)."""
        try:
            response, body = await read_whole(
                self._core.read_namespaced_pod(
                    name, namespace, _preload_content=False, _request_timeout=self._timeout()
                )
            )
        except TRANSIENT_ERRORS as exc:
            self._count("get", "transport")
            raise unavailable(f"GET pod {namespace}/{name}", exc) from exc
        status = response.status
        if status == 404:
            self._count("get", "404")
            return None
        if status != 200:
            self._count("get", str(status))
            raise KubeApiError(
                status,
                status_message(body),
                retry_after_s=parse_retry_after(response.headers.get("Retry-After")),
            )
        self._count("get", "ok")
        try:
            return self._decoder.decode(body)
        except PodDecodeError as exc:
            self._metrics.decode_errors.labels(source="get").inc()
            # Counted; the reconciler logs it once per change of cause.
            logger.debug("undecodable pod from GET %s/%s: %s", namespace, name, exc)
            raise

    async def delete_pod(
        self, namespace: str, name: str, *, uid: str, resource_version: str
    ) -> DeleteOutcome:
        """DELETE with ``preconditions`` {uid, resourceVersion} and the configured grace period:
        deleted (200, 202), gone (404) or conflict (409). Raises ``Unavailable`` when no answer
        came (the DELETE may or may not have been applied), :class:`KubeApiError` for any other
        status."""
        options: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": checks.delete_preconditions(uid, resource_version),
        }
        if self._settings.delete_grace_period_s is not None:
            options["gracePeriodSeconds"] = self._settings.delete_grace_period_s
        try:
            response, body = await read_whole(
                self._core.delete_namespaced_pod(
                    name,
                    namespace,
                    # A plain dict is serialized as is; no V1DeleteOptions model is needed.
                    body=cast(Any, options),
                    _preload_content=False,
                    _request_timeout=self._timeout(),
                )
            )
        except TRANSIENT_ERRORS as exc:
            self._count("delete", "transport")
            raise unavailable(f"DELETE pod {namespace}/{name}", exc) from exc
        status = response.status
        self._count("delete", "ok" if status in (200, 202) else str(status))
        if status in (200, 202):
            return DeleteOutcome(DeleteResult.DELETED, status)
        message = status_message(body)
        if status == 404:
            return DeleteOutcome(DeleteResult.GONE, status, message)
        if status == 409:
            return DeleteOutcome(DeleteResult.CONFLICT, status, message)
        raise KubeApiError(
            status,
            message,
            retry_after_s=parse_retry_after(response.headers.get("Retry-After")),
        )
