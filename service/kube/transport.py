"""The one way a request reaches the API server: send, count, and turn failures into kit errors.

:meth:`ApiTransport.request` (:meth:`ApiTransport.watch` for a stream) is the only request path,
as client-go's ``Request.Do``: it counts each request, turns no answer into ``Unavailable`` and an
unexpected status into :class:`KubeApiError` (``service/kube/errors.py``). Below it, it replaces
a stalled pool (``service/kube/sessions.py``), feeds :attr:`~ApiTransport.reachability`, and
makes requests that are not watches wait for a slot of an adaptive limit (``service/kit/aimd.py``);
Lease requests take none, so that a renewal never waits behind throttled pod requests.

A 429, or a 503 with ``Retry-After``, is sent again after its ``Retry-After``, at most
:data:`MAX_THROTTLE_RETRIES` times and never past the request's own timeout, as client-go's rest
client does; a DELETE's goes back to the reconciler instead: nothing may delay a DELETE after its
final check (docs/architecture.md, invariant 1).

At a 401 it reads the credentials again (once per refused generation) and sends the request once
more when the ``Authorization`` changed, except a DELETE: its 401 goes back to the reconciler,
whose next attempt verifies the pod afresh.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Container, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlencode, urlsplit

import aiohttp
import anyio
from kubernetes_asyncio import client as k8s_client

from service.kit import clock
from service.kit.aimd import AimdLimit
from service.kit.causelog import CauseLog
from service.kit.errors import Unavailable
from service.kube.errors import KubeApiError, answering, parse_retry_after, status_message
from service.kube.reachability import Reachability
from service.kube.sessions import Pools, Sessions, TcpSessions, request_options
from service.metrics import CredentialReload, KubeMetrics, ThrottleAction

logger = logging.getLogger(__name__)

_UNLIMITED_PATH = "/apis/coordination.k8s.io/"
_AUTHORIZATION = "authorization"

Query = Mapping[str, str | int | bool]
"""A request's query parameters, sent in the order of their names."""

_slot_held: ContextVar[bool] = ContextVar("retired_pod_gc_api_slot_held", default=False)

BEARER_TOKEN = "BearerToken"  # noqa: S105 (a key name, not a secret)
"""The ``api_key`` entry of a ``Configuration`` sent as ``authorization``."""
MAX_THROTTLE_RETRIES = 10
"""Most times one request is sent again after a 429 (client-go's rest client: 10)."""
DEFAULT_RETRY_AFTER_S = 1.0
"""The wait after a 429 that carries no ``Retry-After``."""
STALL_FRACTION = 0.9
"""A request its caller cancelled after this fraction of its timeout counts as timed out (the
caller's bound and aiohttp's are the same timeout, and either may fire first)."""


def is_watch(query: Mapping[str, object] | None) -> bool:
    """Whether a request is a watch (or a streaming list): ``watch=true`` in its query."""
    return query is not None and str(query.get("watch")).lower() == "true"


def budget_s(timeout: aiohttp.ClientTimeout) -> float | None:
    """How long one request may take, retries included: its total timeout, or for a stream the
    time to connect."""
    return timeout.total if timeout.total is not None else timeout.connect


def within(timeout: aiohttp.ClientTimeout, deadline: float | None) -> aiohttp.ClientTimeout:
    if deadline is None or timeout.total is None:
        return timeout
    return aiohttp.ClientTimeout(
        total=max(0.001, deadline - clock.now()),
        connect=timeout.connect,
        sock_read=timeout.sock_read,
        sock_connect=timeout.sock_connect,
        ceil_threshold=timeout.ceil_threshold,
    )


def is_throttled(status: int, retry_after_s: float | None) -> bool:
    """The server did not process the request and says when to come back (client-go's
    ``checkWait`` waits on these)."""
    return status == 429 or (status == 503 and retry_after_s is not None)


def throttle_wait(
    retry_after_s: float | None, *, delete: bool, retries: int, now: float, deadline: float | None
) -> float | None:
    """How long to wait before sending a throttled request again, after ``retries`` retries;
    ``None`` when its answer goes back to the caller instead (see the module docstring)."""
    wait_s = DEFAULT_RETRY_AFTER_S if retry_after_s is None else retry_after_s
    if delete or retries >= MAX_THROTTLE_RETRIES:
        return None
    if deadline is not None and now + wait_s >= deadline:
        return None
    return wait_s


def _given_up(exc: BaseException, waited_s: float, bound_s: float | None) -> bool:
    cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
    return cancelled and bound_s is not None and waited_s >= STALL_FRACTION * bound_s


def stalled(exc: BaseException, waited_s: float, timeout_s: float | None) -> bool:
    """Whether a request had no answer for (about) its whole timeout: its pool is suspect."""
    return isinstance(exc, TimeoutError) or _given_up(exc, waited_s, timeout_s)


def unanswered(exc: BaseException, waited_s: float, bound_s: float | None) -> bool:
    """Whether a request ended without an answer from the server: timed out, refused, reset, or
    given up by its caller after most of its budget (an earlier cancellation is the caller's
    business, e.g. a shutdown)."""
    if isinstance(exc, TimeoutError | aiohttp.ClientConnectionError | OSError):
        return True
    return _given_up(exc, waited_s, bound_s)


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer read whole: its status (one the caller expects) and body."""

    status: int
    body: bytes


class Credentials(Protocol):
    """A source of the bearer token (``service/kube/api.py``), read again at a 401."""

    source: str
    """What is read (for logs)."""

    async def reload(self, configuration: k8s_client.Configuration) -> None:
        """Read the token into ``configuration``; ``OSError`` or ``ValueError`` when it cannot."""


class ApiTransport:
    def __init__(
        self,
        configuration: k8s_client.Configuration,
        *,
        pool_size: int,
        metrics: KubeMetrics,
        credentials: Credentials | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        self.configuration = configuration
        self.metrics = metrics
        self._pools = Pools(
            sessions if sessions is not None else TcpSessions(configuration, pool_size=pool_size)
        )
        self._extra = request_options(configuration)
        self.limit = AimdLimit(ceiling=pool_size)
        self._stall_log = CauseLog(
            "a Kubernetes API request got no answer in time; its connection pool was replaced",
            logger,
        )
        metrics.api_concurrency_limit.set(self.limit.slots)
        self.reachability = Reachability(metrics)
        self.credentials = credentials
        """What is read again at a 401 (``None``: nothing, a client without a token)."""
        self._generation = 0
        """Counts reloads: a 401 reloads only the credentials it was sent with."""
        self._refused: str | None = None
        """Why the last answer was a 401 that stands (``None``: it was not)."""
        self._reload_lock = anyio.Lock()
        self._auth_log = CauseLog("the Kubernetes API refuses the credentials", logger)
        self._reload_log = CauseLog("could not read the Kubernetes API credentials", logger)
        metrics.api_unauthorized.set(0)

    @property
    def problem(self) -> str | None:
        """Why the replica is not ready as far as the API server goes (``None``: nothing)."""
        if self._refused is not None:
            return f"credentials refused: {self._refused}"
        return self.reachability.problem

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot of the limit for the requests this task makes inside (the reconciler's
        final check and DELETE: the DELETE never waits for a slot)."""
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
        """The stream of a watch's 200 answer (``watch=true`` in ``query``), which the caller
        closes; its headers come within ``open_within_s``, the stream has no total timeout."""
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
        url = f"{self.configuration.host}{path}"
        if query:
            url += "?" + urlencode(sorted(query.items()))
        watch = is_watch(query)
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
            self.metrics.api_requests.labels(op=op, result=result).inc()

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
        """Send until an answer not retried here; the answer and its ``Retry-After``."""
        delete = method == "DELETE"
        total_s = budget_s(timeouts)
        deadline = None if total_s is None else clock.now() + total_s
        unlimited = url.startswith(f"{self.configuration.host}{_UNLIMITED_PATH}")
        limited = not watch and not _slot_held.get() and not unlimited
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
                generation = self._generation
                sent_at = clock.now()
                response = await self._send(
                    method, url, headers, within(timeouts, deadline), watch=watch, data=data
                )
                status = response.status
                retry_after_s = parse_retry_after(response.headers.get("Retry-After"))
                if status == 401:
                    retry = not delete and not reauthenticated
                    if await self._renewed(response, headers, generation, retry=retry):
                        reauthenticated = True
                        continue
                    return response, retry_after_s
                if self._refused is not None:  # an answer other than 401
                    self._refused = None
                    self.metrics.api_unauthorized.set(0)
                    self._auth_log.ok()
                if not is_throttled(status, retry_after_s):
                    self.limit.succeeded()
                    self.metrics.api_concurrency_limit.set(self.limit.slots)
                    return response, retry_after_s
                if status == 429 and self.limit.throttled(sent_at):
                    self.metrics.api_concurrency_limit.set(self.limit.slots)
                wait_s = throttle_wait(
                    retry_after_s,
                    delete=delete,
                    retries=throttles,
                    now=clock.now(),
                    deadline=deadline,
                )
                if wait_s is None:
                    self.metrics.api_throttled.labels(action=ThrottleAction.RETURNED).inc()
                    return response, retry_after_s
                try:
                    await response.read()
                finally:
                    response.release()
                self.metrics.api_throttled.labels(action=ThrottleAction.RETRIED).inc()
                throttles += 1
            finally:
                if limited:
                    self.limit.release()
            await anyio.sleep(wait_s)

    async def _acquire(self, deadline: float | None) -> None:
        """A slot of the limit before ``deadline`` (else ``TimeoutError``)."""
        with anyio.move_on_after(None if deadline is None else max(0.0, deadline - clock.now())):
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
            if (
                not watch
                and stalled(exc, waited_s, timeouts.total)
                and self._pools.replace(session, timeouts.total)
            ):
                self.metrics.api_pool_replacements.inc()
                self._stall_log.failed("no answer within the request timeout")
            if unanswered(exc, waited_s, budget_s(timeouts)):
                cause = f"{type(exc).__name__} {method} {urlsplit(url).path}"
                self.reachability.unanswered(started, cause)
            raise
        self.reachability.answered()
        if not watch:
            self._stall_log.ok()
        return response

    async def _renewed(
        self,
        response: aiohttp.ClientResponse,
        headers: dict[str, str],
        generation: int,
        *,
        retry: bool,
    ) -> bool:
        """At a 401, read the credentials again; whether the request is to be sent again
        (``retry``: it may be) with the new ``Authorization``, now in ``headers``. The answer is
        read whole (readable for the caller), released only when sent again."""
        message = status_message(await response.read())
        authorization = await self._reauthenticate(generation)
        if authorization is None or authorization == headers.get(_AUTHORIZATION):
            # A 401 that stands: unready until an answer other than 401 comes.
            self.metrics.api_unauthorized_answers.inc()
            self.metrics.api_unauthorized.set(1)
            source = self.credentials.source if self.credentials is not None else "no source"
            self._auth_log.failed(f"401 {message} (credentials read again from {source})")
            self._refused = f"401 {message}"
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
        if self.credentials is not None:
            async with self._reload_lock:
                if self._generation == generation:
                    await self._reload(self.credentials)
                    self._generation += 1
        return await self._authorization()

    async def _reload(self, credentials: Credentials) -> None:
        before = self.configuration.api_key.get(BEARER_TOKEN)
        try:
            await credentials.reload(self.configuration)
        except (OSError, ValueError) as exc:
            self.metrics.api_credential_reloads.labels(result=CredentialReload.FAILED).inc()
            self._reload_log.failed(f"{credentials.source}: {exc}")
        else:
            self._reload_log.ok()
            changed = self.configuration.api_key.get(BEARER_TOKEN) != before
            result = CredentialReload.CHANGED if changed else CredentialReload.UNCHANGED
            self.metrics.api_credential_reloads.labels(result=result).inc()

    async def _authorization(self) -> str | None:
        auth: dict[str, dict[str, str]] = await self.configuration.auth_settings()
        entry = auth.get(BEARER_TOKEN)
        return entry["value"] if entry else None
