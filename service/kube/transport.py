"""The one way a request reaches the API server: send, count, and turn failures into kit errors.

:meth:`ApiTransport.request` (and :meth:`ApiTransport.watch`, for a stream) is the service's only
request path, as client-go's ``Request.Do`` and kopf's ``api.request``: callers give a method, a
path they built and a query, and get an :class:`Answer` (or the open stream). One place counts
each request in ``retired_pod_gc_api_requests_total`` by ``op`` and result, turns no answer into
``Unavailable`` (``RequestTimeout`` when it timed out) and an unexpected status into
:class:`KubeApiError` with its ``Retry-After`` (``service/kube/errors.py``). Below it, it decides:

**Connections** (``service/kube/sessions.py``): a keep-alive pool replaced after a request that
got no answer within its timeout, and watches (``watch=true``) on connections never reused.

**Credentials.** A 401 makes the transport read the credentials again (once per refused
generation of them) and send the request once more with the new ``Authorization``, when it
changed. A DELETE is not sent again: its 401 goes back to the reconciler, whose next attempt
verifies the pod afresh (docs/architecture.md, invariant 1). A 401 that stands after the reload
is logged once per cause, counted, and makes the replica unready (:attr:`ApiTransport.problem`)
until an answer other than 401 comes.

**Throttling** (``service/kube/requestpolicy.py``): a 429, or a 503 with ``Retry-After``, is
sent again after its ``Retry-After``. Requests that are not watches wait for a slot of an
adaptive concurrency limit (``service/kit/aimd.py``), from 1 up to the pool size. Lease requests
(``coordination.k8s.io``) take no slot: a renewal stuck behind throttled pod requests would cost
the leadership. The reconciler takes its slot before its final check with
:meth:`ApiTransport.slot`, so its DELETE waits for no other.

**Reachability.** Every answer, and every request that ends without one, is told to
:attr:`ApiTransport.reachability` (``service/kube/reachability.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Container, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp
import anyio
from kubernetes_asyncio import client as k8s_client

from service.kit import clock
from service.kit.aimd import AimdLimit
from service.kit.causelog import CauseLog
from service.kit.errors import Unavailable
from service.kube import requestpolicy as policy
from service.kube.credentials import BEARER_TOKEN, Credentials, Reauthentication
from service.kube.errors import KubeApiError, answering, parse_retry_after, status_message
from service.kube.reachability import Reachability
from service.kube.sessions import HttpSession, Pools, Sessions, TcpSessions, request_options
from service.metrics import KubeMetrics, ThrottleAction

logger = logging.getLogger(__name__)

_UNLIMITED_PATHS = ("/apis/coordination.k8s.io/",)
_AUTHORIZATION = "authorization"

Query = Mapping[str, str | int | bool]
"""A request's query parameters, sent in the order of their names (as the library sent them)."""

_slot_held: ContextVar[bool] = ContextVar("retired_pod_gc_api_slot_held", default=False)
"""True inside :meth:`ApiTransport.slot`: this task's requests use the slot it holds."""


async def _drain(response: aiohttp.ClientResponse) -> bytes:
    """Read a short answer whole and give its connection back."""
    try:
        return await response.read()
    finally:
        response.release()


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer read whole: its status (one the caller expects) and body."""

    status: int
    body: bytes


class ApiTransport:
    """The service's connection to the API server: see the module docstring."""

    def __init__(
        self,
        configuration: k8s_client.Configuration,
        *,
        pool_size: int,
        credentials: Credentials | None = None,
        metrics: KubeMetrics | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        self.configuration = configuration
        """The connection's configuration (host, CA, credentials) as the library loaded it."""
        self._pools = Pools(
            sessions if sessions is not None else TcpSessions(configuration, pool_size=pool_size)
        )
        self._extra = request_options(configuration)
        self.limit = AimdLimit(ceiling=pool_size)
        """The adaptive concurrency limit of requests that are not watches."""
        self._stall_log = CauseLog(
            "a Kubernetes API request got no answer in time; its connection pool was replaced",
            logger,
        )
        self._metrics = metrics if metrics is not None else KubeMetrics()
        self._auth = Reauthentication(
            configuration, credentials, metrics=self._metrics, logger=logger
        )
        self._metrics.api_concurrency_limit.set(self.limit.slots)
        self.reachability = Reachability(self._metrics)
        """Whether the server answers (fed here and by the reflector's watch lines)."""

    # ------------------------------------------------------------------ wiring

    def bind(self, metrics: KubeMetrics) -> None:
        """Count into ``metrics`` from now on (the client is built before the service's
        metrics)."""
        self._metrics = metrics
        metrics.api_concurrency_limit.set(self.limit.slots)
        self._auth.bind(metrics)
        self.reachability.bind(metrics)

    @property
    def credentials(self) -> Credentials | None:
        """What is read again at a 401 (``None``: nothing, a client without a token)."""
        return self._auth.credentials

    @property
    def problem(self) -> str | None:
        """Why the replica is not ready as far as the API server goes (``None``: nothing)."""
        if self._auth.refused is not None:
            return f"credentials refused: {self._auth.refused}"
        return self.reachability.problem

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot of the concurrency limit while inside: the requests this task makes
        inside take no other (the reconciler holds one from before its final check until its
        DELETE is sent, so that the DELETE never waits for one)."""
        if _slot_held.get():
            yield
            return
        await self.limit.acquire()
        token = _slot_held.set(True)
        try:
            yield
        finally:
            _slot_held.reset(token)
            self.limit.release()

    async def close(self) -> None:
        await self._pools.close()

    # ------------------------------------------------------------------ the request path

    async def request(
        self,
        method: str,
        path: str,
        *,
        op: str | None,
        query: Query | None = None,
        body: object = None,
        timeouts: aiohttp.ClientTimeout,
        expect: Container[int] = (200,),
    ) -> Answer:
        """Send one request and read its answer whole. ``op`` labels it in ``api_requests``
        (``None``: not counted there); a status in ``expect`` is answered, any other raises
        :class:`KubeApiError`; no answer raises ``Unavailable``."""
        answer = await self._call(method, path, op, query, body, timeouts, expect)
        assert isinstance(answer, Answer)
        return answer

    async def watch(
        self,
        path: str,
        *,
        op: str,
        query: Query,
        timeouts: aiohttp.ClientTimeout,
        open_within_s: float,
    ) -> aiohttp.ClientResponse:
        """Open a watch (``watch=true`` in ``query``): the stream of a 200 answer, which the
        caller closes; failures as :meth:`request`'s. The answer's status and headers come
        within ``open_within_s`` (the server sends them at once); the stream has no total
        timeout."""
        stream = await self._call("GET", path, op, query, None, timeouts, (), open_within_s)
        assert not isinstance(stream, Answer)
        return stream

    async def _call(  # noqa: PLR0917 (the request's parts; private)
        self,
        method: str,
        path: str,
        op: str | None,
        query: Query | None,
        body: object,
        timeouts: aiohttp.ClientTimeout,
        expect: Container[int],
        open_within_s: float | None = None,
    ) -> Answer | aiohttp.ClientResponse:
        """The one place a request is sent, counted and judged (see the module docstring)."""
        url = f"{self.configuration.host}{path}"
        if query:
            url += "?" + urlencode(sorted(query.items()))
        watch = policy.is_watch(query)
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        try:
            with answering(f"{method} {path}"):
                authorization = await self._authorization()
                if authorization is not None:
                    headers[_AUTHORIZATION] = authorization
                data = None if body is None else json.dumps(body)
                with anyio.fail_after(open_within_s):
                    response, retry_after_s = await self._exchange(
                        method, url, headers, data, timeouts, watch=watch
                    )
                status = response.status
                if watch and status == 200:
                    self._count(op, "ok")
                    return response
                try:
                    raw = await response.read()
                finally:
                    if watch:
                        response.close()
                    else:
                        response.release()
        except Unavailable:
            self._count(op, "transport")
            raise
        self._count(op, "ok" if status < 300 else str(status))
        if status in expect:
            return Answer(status, raw)
        raise KubeApiError(status, status_message(raw), retry_after_s=retry_after_s)

    def _count(self, op: str | None, result: str) -> None:
        if op is not None:
            self._metrics.api_requests.labels(op=op, result=result).inc()

    # ------------------------------------------------------------------ requests

    async def _exchange(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        data: Any,
        timeouts: aiohttp.ClientTimeout,
        *,
        watch: bool,
    ) -> tuple[aiohttp.ClientResponse, float | None]:
        """Send until an answer that is not retried here (see the module docstring); the answer
        and its ``Retry-After``."""
        delete = method == "DELETE"
        budget_s = policy.budget_s(timeouts)
        deadline = None if budget_s is None else clock.now() + budget_s
        limited = (
            not watch
            and not _slot_held.get()
            and not url.startswith(
                tuple(f"{self.configuration.host}{path}" for path in _UNLIMITED_PATHS)
            )
        )
        throttles = 0
        reauthenticated = False
        while True:
            if not delete:
                # Never before a DELETE: nothing may suspend between its final check and its
                # send (closing a session does).
                await self._pools.close_retired()
            if limited:
                await self._acquire(deadline)
            try:
                generation = self._auth.generation
                sent_at = clock.now()
                response = await self._send(
                    method, url, headers, policy.within(timeouts, deadline), watch=watch, data=data
                )
                status = response.status
                retry_after_s = parse_retry_after(response.headers.get("Retry-After"))
                if status == 401:
                    retry = not delete and not reauthenticated
                    if await self._renewed(response, headers, generation, retry=retry):
                        reauthenticated = True
                        continue
                    return response, retry_after_s
                self._auth.accept()
                if not policy.is_throttled(status, retry_after_s):
                    self.limit.succeeded()
                    self._metrics.api_concurrency_limit.set(self.limit.slots)
                    return response, retry_after_s
                if status == 429 and self.limit.throttled(sent_at):
                    self._metrics.api_concurrency_limit.set(self.limit.slots)
                wait_s = policy.throttle_wait(
                    retry_after_s,
                    delete=delete,
                    retries=throttles,
                    now=clock.now(),
                    deadline=deadline,
                )
                if wait_s is None:
                    self._metrics.api_throttled.labels(action=ThrottleAction.RETURNED).inc()
                    return response, retry_after_s
                await _drain(response)
                self._metrics.api_throttled.labels(action=ThrottleAction.RETRIED).inc()
                throttles += 1
            finally:
                if limited:
                    self.limit.release()
            await anyio.sleep(wait_s)

    async def _acquire(self, deadline: float | None) -> None:
        """A slot of the limit before ``deadline`` (else ``TimeoutError``)."""
        if deadline is None:
            await self.limit.acquire()
            return
        with anyio.move_on_after(max(0.0, deadline - clock.now())):
            await self.limit.acquire()
            return
        raise TimeoutError(
            f"no request slot in time ({self.limit.slots} allowed at once, the API server "
            "throttles)"
        )

    async def _send(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        timeouts: aiohttp.ClientTimeout,
        *,
        watch: bool,
        data: Any,
    ) -> aiohttp.ClientResponse:
        """One HTTP exchange up to the response headers."""
        session = self._pools.watches if watch else self._pools.pool
        started = clock.now()
        try:
            response = await session.request(
                method, url, headers=headers, data=data, timeout=timeouts, **self._extra
            )
        except BaseException as exc:
            waited_s = clock.now() - started
            if not watch and policy.stalled(exc, waited_s, timeouts.total):
                self._replace(session, timeouts.total)
            if policy.unanswered(exc, waited_s, policy.budget_s(timeouts)):
                self.reachability.unanswered(started, f"{type(exc).__name__} {method} {_path(url)}")
            raise
        self.reachability.answered()
        if not watch:
            self._stall_log.ok()
        return response

    def _replace(self, session: HttpSession, timeout_s: float | None) -> None:
        """Replace the pool ``session`` (when it still is the pool) by a new one."""
        if self._pools.replace(session, timeout_s):
            self._metrics.api_pool_replacements.inc()
            self._stall_log.failed("no answer within the request timeout")

    # -------------------------------------------------------------- credentials

    async def _renewed(
        self,
        response: aiohttp.ClientResponse,
        headers: dict[str, str],
        generation: int,
        *,
        retry: bool,
    ) -> bool:
        """At a 401, read the credentials again; whether the request is to be sent again
        (``retry``: it may be) with the new ``Authorization``, now in ``headers``."""
        # Read whole (it stays readable for the caller), released only when sent again.
        message = status_message(await response.read())
        authorization = await self._reauthenticate(generation)
        if authorization is None or authorization == headers.get(_AUTHORIZATION):
            self._auth.refuse(f"401 {message}")
            return False
        if not retry:
            # A DELETE refused with a token since replaced goes back to its reconciler, whose
            # next attempt carries the new one: not a refusal that stands.
            return False
        response.release()
        headers[_AUTHORIZATION] = authorization
        return True

    async def _reauthenticate(self, generation: int) -> str | None:
        """Read the credentials again (unless that happened since ``generation``); the
        ``Authorization`` to send now."""
        await self._auth.reload(generation)
        return await self._authorization()

    async def _authorization(self) -> str | None:
        """The ``Authorization`` the credentials give now (``None``: none)."""
        auth: dict[str, dict[str, str]] = await self.configuration.auth_settings()
        entry = auth.get(BEARER_TOKEN)
        return entry["value"] if entry else None


def _path(url: str) -> str:
    """The path of ``url``, without host or query (a log line's cause)."""
    without_scheme = url.split("://", 1)[-1]
    slash = without_scheme.find("/")
    return without_scheme[slash:].split("?", 1)[0] if slash >= 0 else "/"
