"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's semantics: a replica
leads by writing its identity into the Lease (optimistic concurrency on ``resourceVersion``), and
stops leading once it has not renewed for the renew deadline, shorter than the lease duration, so a
partitioned leader steps down before anybody else can take the lease. Another holder's lease
expires on this replica's own clock, counted from when it last saw the record change; the wall
clock only writes ``acquireTime``/``renewTime``, as Kubernetes defines them.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import anyio
import msgspec
from anyio.abc import TaskStatus

from service.config import LeaderSettings
from service.kit import clock
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ExternalError, Undecodable
from service.kit.timeouts import fail_after
from service.kube.decode import decode_json
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)

MIN_ATTEMPT_SHARE = 0.1


def attempt_timeout_s(settings: LeaderSettings, api_timeout_s: float) -> float:
    """The bound of one attempt (GET and write), so that a request stuck on a dead connection
    leaves the next attempt time to renew (docs/configuration.md): at most the API timeout, two
    attempts fit in the renew deadline, ``2 * (retry period + bound) <= renew deadline``
    (defaults: min(10, 10/2 - 2) = 3 s), and at least :data:`MIN_ATTEMPT_SHARE` of it."""
    two_fit_s = settings.renew_deadline_s / 2 - settings.retry_period_s
    return min(api_timeout_s, max(two_fit_s, settings.renew_deadline_s * MIN_ATTEMPT_SHARE))


def default_identity() -> str:
    return f"{socket.gethostname()}_{os.getpid()}"


@dataclass(frozen=True, slots=True)
class _Observed:
    holder: str
    renew_time: str
    duration_s: float
    resource_version: str
    transitions: int
    acquire_time: Any


class LeaderElector:
    """Runs the acquire/renew loop and tells every handler added with :meth:`add_handler`
    ``True``/``False`` on each transition."""

    def __init__(
        self,
        api: ApiTransport,
        *,
        settings: LeaderSettings,
        namespace: str,
        metrics: KubeMetrics,
        request_timeout_s: float = 5.0,
    ) -> None:
        self._api = api
        self._settings = settings
        self._namespace = namespace
        self._leases = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._path = f"{self._leases}/{settings.lease_name}"
        self._identity = settings.identity or default_identity()
        self._handlers: list[Callable[[bool], None]] = []
        self._metrics = metrics
        self._timeout_s = attempt_timeout_s(settings, request_timeout_s)
        self._observed: _Observed | None = None
        self._observed_at = -math.inf
        self._last_renew = -math.inf
        self._leading = False
        self._failures = CauseLog(f"lease {settings.lease_name}", logger)

    def is_leader(self) -> bool:
        """True only while the last successful renewal is within the renew deadline."""
        return self._leading and clock.now() - self._last_renew < self._settings.renew_deadline_s

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Loop until cancelled; on cancellation release the lease if held."""
        task_status.started()
        try:
            while True:
                await self._tick()
                await anyio.sleep(self._settings.retry_period_s)
        finally:
            if self._leading:
                self._set_leading(False)
                with anyio.move_on_after(self._timeout_s, shield=True):
                    await self._release()

    async def _tick(self) -> None:
        try:
            with fail_after(self._timeout_s):
                acquired = await self._try_acquire_or_renew()
        except (ExternalError, TimeoutError) as exc:  # API down, timeouts: judged below
            detail = str(exc) or f"no answer within {self._timeout_s:.1f}s"
            self._failures.failed(cause_of(exc), f"{type(exc).__name__}: {detail}")
            logger.debug("lease %s: %s", self._settings.lease_name, exc)
            acquired = False
        else:
            self._failures.ok()
        now = clock.now()
        if acquired:
            self._last_renew = now
            if not self._leading:
                logger.info("became leader", extra={"identity": self._identity})
                self._set_leading(True)
        elif self._leading and now - self._last_renew >= self._settings.renew_deadline_s:
            logger.warning("lost leadership: could not renew within the renew deadline")
            self._set_leading(False)
        elif self._leading and self._observed and self._observed.holder != self._identity:
            logger.warning("lost leadership to %s", self._observed.holder)
            self._set_leading(False)

    def _set_leading(self, leading: bool) -> None:
        self._leading = leading
        self._metrics.is_leader.set(1 if leading else 0)
        for handler in self._handlers:
            handler(leading)

    def add_handler(self, on_change: Callable[[bool], None]) -> None:
        """Register ``on_change(leading)`` for every later transition (before :meth:`run`)."""
        self._handlers.append(on_change)

    async def _request(
        self, method: str, path: str, expect: tuple[int, ...], body: Any = None
    ) -> int:
        """The status of the answer, one of ``expect``, after observing the Lease of a success;
        failures as ``ApiTransport.request``'s, ``Undecodable`` for a Lease that is not JSON."""
        answer = await self._api.request(
            method,
            path,
            op="lease",
            body=body,
            timeouts=aiohttp.ClientTimeout(total=self._timeout_s),
            expect=expect,
        )
        if answer.status < 400:
            self._observe(answer.body)
        return answer.status

    def _lease_body(self, *, holder: str, duration_s: float, acquire: bool) -> dict[str, Any]:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # noqa: TID251 (Lease times)
        spec: dict[str, Any] = {
            "holderIdentity": holder,
            "leaseDurationSeconds": max(1, math.ceil(duration_s)),
            "renewTime": now,
        }
        if acquire:
            spec["acquireTime"] = now
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self._settings.lease_name, "namespace": self._namespace},
            "spec": spec,
        }
        if self._observed is not None:
            body["metadata"]["resourceVersion"] = self._observed.resource_version
        return body

    def _observe(self, raw: bytes) -> None:
        try:
            lease = decode_json(raw)
            spec = lease.get("spec") or {}
            current = _Observed(
                holder=str(spec.get("holderIdentity") or ""),
                renew_time=str(spec.get("renewTime") or ""),
                duration_s=float(
                    spec.get("leaseDurationSeconds") or self._settings.lease_duration_s
                ),
                resource_version=str((lease.get("metadata") or {}).get("resourceVersion") or ""),
                transitions=int(spec.get("leaseTransitions") or 0),
                acquire_time=spec.get("acquireTime"),
            )
        except msgspec.DecodeError as exc:
            raise Undecodable(f"undecodable lease: {exc}") from exc
        except (AttributeError, TypeError, ValueError) as exc:
            # The server's answer, not our bug: typed at the edge, like any unreadable answer.
            raise Undecodable(f"malformed lease: {type(exc).__name__}: {exc}") from exc
        last = self._observed
        if last is None or (last.holder, last.renew_time) != (current.holder, current.renew_time):
            self._observed_at = clock.now()
        self._observed = current

    async def _try_acquire_or_renew(self) -> bool:
        """Whether the Lease is ours: read, then written when it is free, expired or ours; a 409
        on the write (somebody else wrote first) is an answer all the same."""
        if await self._request("GET", self._path, (200, 404)) == 404:
            self._observed = None
            body = self._lease_body(
                holder=self._identity, duration_s=self._settings.lease_duration_s, acquire=True
            )
            return await self._request("POST", self._leases, (200, 201, 409), body) != 409
        observed = self._observed
        assert observed is not None
        mine = observed.holder == self._identity
        expired = clock.now() - self._observed_at > observed.duration_s
        if observed.holder and not mine and not expired:
            return False
        body = self._lease_body(
            holder=self._identity, duration_s=self._settings.lease_duration_s, acquire=not mine
        )
        if mine:
            body["spec"]["acquireTime"] = observed.acquire_time
        body["spec"]["leaseTransitions"] = observed.transitions + (not mine)
        return await self._request("PUT", self._path, (200, 201, 409), body) != 409

    async def _release(self) -> None:
        """Hand the lease back so a standby takes over at once. A 409 means our view is stale (a
        renewal applied whose answer the cancellation lost): read it again, retry once if ours."""
        for _ in range(2):
            observed = self._observed
            if observed is None or observed.holder != self._identity:
                return
            body = self._lease_body(holder="", duration_s=1, acquire=False)
            body["spec"]["leaseTransitions"] = observed.transitions
            try:
                if await self._request("PUT", self._path, (200, 409), body) == 409:
                    await self._request("GET", self._path, (200,))
                    continue
            except ExternalError as exc:
                logger.warning("could not release the lease: %s", exc)
                return
            logger.info("released the lease")
            return
        logger.warning("could not release the lease: it kept changing")
