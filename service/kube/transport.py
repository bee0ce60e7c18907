"""How requests reach the API server: connections, credentials at a 401, and throttling.

:class:`ApiTransport` is the ``rest_client`` of the service's ``kubernetes_asyncio`` ApiClient
(installed by :func:`service.kube.api.new_api_client`): it sends the requests the generated API
methods build and returns what the library's ``RESTClientObject`` returns. It decides:

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
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, cast
from urllib.parse import urlencode

import aiohttp
import anyio
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client.exceptions import ApiException, ApiValueError
from kubernetes_asyncio.client.rest import RESTResponse

from service.kit import clock
from service.kit.aimd import AimdLimit
from service.kit.causelog import CauseLog
from service.kube import requestpolicy as policy
from service.kube.credentials import BEARER_TOKEN, Credentials, Reauthentication
from service.kube.errors import parse_retry_after, status_message
from service.kube.reachability import Reachability
from service.kube.sessions import HttpSession, Pools, Sessions, TcpSessions, request_options
from service.metrics import KubeMetrics

logger = logging.getLogger(__name__)

_UNLIMITED_PATHS = ("/apis/coordination.k8s.io/",)
_AUTHORIZATION = "authorization"
_JSON = re.compile("json", re.IGNORECASE)

_slot_held: ContextVar[bool] = ContextVar("retired_pod_gc_api_slot_held", default=False)
"""True inside :meth:`ApiTransport.slot`: this task's requests use the slot it holds."""


def _encode(method: str, headers: dict[str, str], body: Any, post_params: Any) -> Any:
    """The request body as the library's ``RESTClientObject`` encodes it (JSON only: the
    service sends nothing else)."""
    if post_params and body:
        raise ApiValueError("body parameter cannot be used with post_params parameter.")
    if method not in ("POST", "PUT", "PATCH", "OPTIONS", "DELETE"):
        return None
    content_type = headers["Content-Type"]
    if _JSON.search(content_type) or content_type == "application/apply-patch+yaml":
        return json.dumps(body) if body is not None else None
    if isinstance(body, bytes):
        return body
    raise ApiException(status=0, reason=f"cannot send a {content_type} body")


async def _drain(response: aiohttp.ClientResponse) -> bytes:
    """Read a short answer whole and give its connection back."""
    try:
        return await response.read()
    finally:
        response.release()


def _verb(method: str) -> Callable[..., Awaitable[Any]]:
    """The library's ``rest_client.GET`` and its siblings: :meth:`ApiTransport.request`."""

    async def send(self: ApiTransport, url: str, **kwargs: Any) -> Any:
        return await self.request(method, url, **kwargs)

    send.__name__ = method
    return send


class ApiTransport:
    """The ``rest_client`` of an ApiClient: see the module docstring."""

    def __init__(
        self,
        configuration: k8s_client.Configuration,
        *,
        pool_size: int,
        credentials: Credentials | None = None,
        metrics: KubeMetrics | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        self._configuration = configuration
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

    # ---------------------------------------------------------- the library's API

    async def request(  # noqa: PLR0917 (the library's signature)
        self,
        method: str,
        url: str,
        query_params: Any = None,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        post_params: Any = None,
        _preload_content: bool = True,
        _request_timeout: Any = None,
    ) -> Any:
        """One request, as the library's ``RESTClientObject.request`` makes it."""
        method = method.upper()
        sent_headers = dict(headers or {})
        sent_headers.setdefault("Content-Type", "application/json")
        data = _encode(method, sent_headers, body, post_params)
        watch = policy.is_watch(query_params)
        if query_params:
            url += "?" + urlencode(query_params)
        response = await self._exchange(
            method, url, sent_headers, data, policy.client_timeout(_request_timeout), watch=watch
        )
        if not _preload_content:
            return response
        result = RESTResponse(response, await _drain(response))
        if not 200 <= result.status <= 299:
            raise ApiException(http_resp=cast(Any, result))  # as the library raises it
        return result

    GET = _verb("GET")
    HEAD = _verb("HEAD")
    OPTIONS = _verb("OPTIONS")
    DELETE = _verb("DELETE")
    POST = _verb("POST")
    PUT = _verb("PUT")
    PATCH = _verb("PATCH")

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
    ) -> aiohttp.ClientResponse:
        """Send until an answer that is not retried here (see the module docstring)."""
        delete = method == "DELETE"
        budget_s = policy.budget_s(timeouts)
        deadline = None if budget_s is None else clock.now() + budget_s
        limited = (
            not watch
            and not _slot_held.get()
            and not url.startswith(
                tuple(f"{self._configuration.host}{path}" for path in _UNLIMITED_PATHS)
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
                if status == 401:
                    # Read whole (it stays readable for the caller), released only when sent
                    # again.
                    message = status_message(await response.read())
                    authorization = await self._reauthenticate(generation)
                    renewed = authorization is not None and authorization != headers.get(
                        _AUTHORIZATION
                    )
                    if renewed and not delete and not reauthenticated:
                        response.release()
                        reauthenticated = True
                        headers[_AUTHORIZATION] = cast(str, authorization)
                        continue
                    if not renewed:
                        self._auth.refuse(f"401 {message}")
                    # A DELETE refused with a token since replaced goes back to its reconciler,
                    # whose next attempt carries the new one: not a refusal that stands.
                    return response
                self._auth.accept()
                retry_after_s = parse_retry_after(response.headers.get("Retry-After"))
                if not policy.is_throttled(status, retry_after_s):
                    self.limit.succeeded()
                    self._metrics.api_concurrency_limit.set(self.limit.slots)
                    return response
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
                    self._metrics.api_throttled.labels(action="returned").inc()
                    return response
                await _drain(response)
                self._metrics.api_throttled.labels(action="retried").inc()
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

    async def _reauthenticate(self, generation: int) -> str | None:
        """Read the credentials again (unless that happened since ``generation``); the
        ``Authorization`` to send now."""
        await self._auth.reload(generation)
        auth = await self._configuration.auth_settings()
        entry = cast(dict[str, dict[str, str]], auth).get(BEARER_TOKEN)
        return entry["value"] if entry else None


def _path(url: str) -> str:
    """The path of ``url``, without host or query (a log line's cause)."""
    without_scheme = url.split("://", 1)[-1]
    slash = without_scheme.find("/")
    return without_scheme[slash:].split("?", 1)[0] if slash >= 0 else "/"


def transport_of(api: Any) -> ApiTransport | None:
    """The :class:`ApiTransport` of an ApiClient, when it has one."""
    rest_client = getattr(api, "rest_client", None)
    return rest_client if isinstance(rest_client, ApiTransport) else None
