"""Fresh pod reads and preconditioned deletes (implements ``ports.PodClient``).

Both fail as :meth:`ApiTransport.request` does; expected answers are values: the pod or ``None``
(404) for a GET, a :class:`DeleteOutcome` (deleted, 404 gone, 409 conflict) for a DELETE.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp

from service import checks
from service.config import KubeSettings
from service.domain import DeleteOutcome, DeleteResult, PodSnapshot
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import status_message
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)


def pod_path(namespace: str, name: str = "") -> str:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    return f"{pods}/{name}" if name else pods


class KubePodClient:
    """GET and preconditioned DELETE of single pods."""

    def __init__(
        self, api: ApiTransport, settings: KubeSettings, decoder: PodDecoder, metrics: KubeMetrics
    ) -> None:
        self._api = api
        self._settings = settings
        self._decoder = decoder
        self._metrics = metrics
        self._timeouts = aiohttp.ClientTimeout(total=settings.api_timeout_s)

    def delete_slot(self) -> AbstractAsyncContextManager[None]:
        return self._api.slot()

    async def get_pod(self, namespace: str, name: str) -> PodSnapshot | None:
        """The pod as the server has it now; ``None`` on 404. Raises :class:`PodDecodeError`
        (an ``Undecodable``, counted here) for a pod that does not decode."""
        answer = await self._api.request(
            "GET", pod_path(namespace, name), op="get", timeouts=self._timeouts, expect=(200, 404)
        )
        if answer.status == 404:
            return None
        try:
            return self._decoder.decode(answer.body)
        except PodDecodeError as exc:
            self._metrics.decode_errors.labels(source="get").inc()
            # Counted; the reconciler logs it once per change of cause.
            logger.debug("undecodable pod from GET %s/%s: %s", namespace, name, exc)
            raise

    async def delete_pod(
        self, namespace: str, name: str, *, uid: str, resource_version: str
    ) -> DeleteOutcome:
        """DELETE with ``preconditions`` {uid, resourceVersion} and the configured grace period.
        ``Unavailable``: the DELETE may or may not have been applied."""
        options: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": checks.delete_preconditions(uid, resource_version),
        }
        if self._settings.delete_grace_period_s is not None:
            options["gracePeriodSeconds"] = self._settings.delete_grace_period_s
        answer = await self._api.request(
            "DELETE",
            pod_path(namespace, name),
            op="delete",
            body=options,
            timeouts=self._timeouts,
            expect=(200, 202, 404, 409),
        )
        match answer.status:
            case 404:
                return DeleteOutcome(DeleteResult.GONE, 404, status_message(answer.body))
            case 409:
                return DeleteOutcome(DeleteResult.CONFLICT, 409, status_message(answer.body))
            case status:
                return DeleteOutcome(DeleteResult.DELETED, status)
