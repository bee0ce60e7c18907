"""How requests reach the API server: connections, credentials at a 401, and throttling.

:class:`ApiTransport` is the ``rest_client`` of the service's ``kubernetes_asyncio`` ApiClient
(installed by :func:`service.kube.api.new_api_client`): the generated API methods build each
request (path, query, headers, body) and hand it here, and what comes back is what the library's
own ``RESTClientObject`` returns (the aiohttp response with ``_preload_content=False``, which is
how every call of the service is made). It decides four things, and nothing else:

**Connections.** Ordinary requests share one keep-alive pool (``pool_size`` connections, the
TLS settings of the configuration). A request that gets no answer within its timeout (aiohttp's
timeout, or its caller's cancellation after :data:`STALL_FRACTION` of that timeout) leaves the
pool suspect: its idle siblings were opened the same way and may be black-holed too (a dropped
conntrack entry, a load balancer's idle timeout, a dead node behind a NAT). The pool is then
replaced by a new one (counted in ``retired_pod_gc_api_pool_replacements_total``); the old one is
closed once the requests in flight on it have had their timeout. So one request per outage waits
its full timeout, not one per pooled connection. Watches (``watch=true``: watches and streaming
lists) go over connections that are never reused (``force_close``): a re-established watch never
lands on a connection that died while it sat in the pool. The sessions come from a
:class:`Sessions` factory: :class:`TcpSessions` in the service; the deterministic simulator's
model of the API server in ``tests/sim`` (docs/reliability.md, "Deterministic simulation"), so
that everything below runs there unchanged.

Every connection has TCP keepalive on (aiohttp's client leaves ``SO_KEEPALIVE`` off; Linux's
defaults would probe after two hours): the first probe after :data:`KEEPALIVE_IDLE_S` of silence,
then every :data:`KEEPALIVE_INTERVAL_S`, and the kernel resets the connection after
:data:`KEEPALIVE_PROBES` unanswered probes (about a minute). It catches a peer or path that is
gone (a dead node, a dropped NAT mapping: nothing answers the probes) on an idle connection —
a watch waiting for events, a pooled connection between requests. It does not catch a silent
server behind a live TCP endpoint (a load balancer or proxy that answers the probes itself), nor
a request whose bytes are unacknowledged (retransmission rules apply then, not keepalive): those
are the request timeouts' (above) and the watch's silence bound's.

**Credentials.** A 401 makes the transport read the credentials again (``credentials``: the
token file, or the kubeconfig's tokenFile or exec plugin; at most once per refused generation of
them, however many requests were refused together) and send the request once more with the new
``Authorization``, when it changed. A DELETE is not sent again: its 401 goes back to the
reconciler, which requeues the key at once, and the next attempt verifies the pod afresh and
carries the new token (a DELETE is never delayed between its final check and its send:
docs/architecture.md, invariant 1). A 401 that stands after the reload is logged once per cause,
counted, and makes the replica unready (:attr:`ApiTransport.problem`) until an answer other than
401 comes; a DELETE's 401 whose reload gave a new token is no such refusal (its next attempt
carries the new token).

**Throttling.** A 429, or a 503 with ``Retry-After``, is retried after its ``Retry-After``
(:data:`DEFAULT_RETRY_AFTER_S` without one), at most :data:`MAX_THROTTLE_RETRIES` times, never past
the request's own timeout — as client-go's rest client does — except a DELETE's, which goes back
to the reconciler (it requeues the key after the ``Retry-After``). Requests that are not watches
wait for a slot of an adaptive concurrency limit (``service/kit/aimd.py``): halved on a 429,
grown by one slot a round on answers, from 1 up to the pool size, so that a throttled priority
level is used at the rate it admits instead of being fought by every worker at once. Lease
requests (``coordination.k8s.io``) do not wait for a slot: a renewal stuck behind throttled pod
requests would cost the leadership. The reconciler takes its slot before its final check with
:meth:`ApiTransport.slot`, which marks it held for the task (a context variable), so the DELETE
that follows does not wait for another.

**Reachability.** Every answer, and every request that ends without one, is told to
:attr:`ApiTransport.reachability` (``service/kube/reachability.py``): the replica is unready
while the server is taken for unreachable. No pool is replaced when it answers again: a
connection opened while nothing answered carries an unanswered request, and aiohttp closes it when
that request times out; only an answered request leaves its connection idle in the pool.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, Protocol, cast
from urllib.parse import urlencode

import aiohttp
import anyio
from aiohttp.connector import AddrInfoType
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client.exceptions import ApiException, ApiValueError
from kubernetes_asyncio.client.rest import RESTResponse

from service.kit import clock
from service.kit.aimd import AimdLimit
from service.kit.causelog import CauseLog
from service.kube.credentials import BEARER_TOKEN, Credentials
from service.kube.errors import parse_retry_after, status_message
from service.kube.reachability import Reachability
from service.metrics import Metrics

logger = logging.getLogger(__name__)

MAX_THROTTLE_RETRIES = 10
"""Most times one request is sent again after a 429 (client-go's rest client: 10)."""
DEFAULT_RETRY_AFTER_S = 1.0
"""The wait after a 429 that carries no ``Retry-After``."""
STALL_FRACTION = 0.9
"""A request its caller cancelled after this fraction of its timeout without an answer counts
as timed out (the caller's bound and aiohttp's are the same timeout, and either may fire
first)."""
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3
RETIRED_POOL_GRACE_S = 60.0
"""A replaced pool is closed this long after the replacement when the request that timed out had
no timeout of its own (else after twice that timeout)."""
READ_BUFSIZE = 2**21
"""As the library's: a watch event with a large object exceeds aiohttp's default buffer."""
_UNLIMITED_PATHS = ("/apis/coordination.k8s.io/",)
_AUTHORIZATION = "authorization"
_JSON = re.compile("json", re.IGNORECASE)

_slot_held: ContextVar[bool] = ContextVar("retired_pod_gc_api_slot_held", default=False)
"""True inside :meth:`ApiTransport.slot`: this task's requests use the slot it holds."""


def keepalive_socket(addr_info: AddrInfoType) -> socket.socket:
    """A socket for aiohttp's connector with TCP keepalive on (see the module docstring)."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    return sock


def ssl_context(configuration: k8s_client.Configuration) -> ssl.SSLContext:
    """The TLS settings of ``configuration``, as the library's ``RESTClientObject`` makes them."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.disable_strict_ssl_verification:
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


def is_watch(query_params: Sequence[tuple[str, Any]] | Mapping[str, Any] | None) -> bool:
    """Whether a request is a watch (or a streaming list): ``watch=true`` in its query."""
    if not query_params:
        return False
    items = query_params.items() if isinstance(query_params, Mapping) else query_params
    return any(key == "watch" and str(value).lower() == "true" for key, value in items)


def client_timeout(request_timeout: Any) -> aiohttp.ClientTimeout:
    """``_request_timeout`` as the library takes it: a number (total), a (connect, read) pair,
    or an ``aiohttp.ClientTimeout``; none at all when not given."""
    if isinstance(request_timeout, aiohttp.ClientTimeout):
        return request_timeout
    if isinstance(request_timeout, int | float) and request_timeout:
        return aiohttp.ClientTimeout(total=request_timeout)
    if isinstance(request_timeout, tuple) and len(request_timeout) == 2:
        return aiohttp.ClientTimeout(
            connect=request_timeout[0],
            sock_connect=request_timeout[0],
            sock_read=request_timeout[1],
        )
    return aiohttp.ClientTimeout()


def is_throttled(status: int, retry_after_s: float | None) -> bool:
    """A 429, or a 503 with ``Retry-After``: the server did not process the request and says
    when to come back (client-go's ``checkWait`` waits on these)."""
    return status == 429 or (status == 503 and retry_after_s is not None)


def throttle_wait(
    retry_after_s: float | None,
    *,
    delete: bool,
    retries: int,
    now: float,
    deadline: float | None,
) -> float | None:
    """How long to wait before sending a throttled request again, after ``retries`` retries;
    ``None`` when its answer goes back to the caller instead: a DELETE (never delayed after its
    final check), the :data:`MAX_THROTTLE_RETRIES`-th retry, or a wait that would outlast the
    request's ``deadline``."""
    wait_s = DEFAULT_RETRY_AFTER_S if retry_after_s is None else retry_after_s
    if delete or retries >= MAX_THROTTLE_RETRIES:
        return None
    if deadline is not None and now + wait_s >= deadline:
        return None
    return wait_s


def _budget_s(timeout: aiohttp.ClientTimeout) -> float | None:
    """How long one request may take in all, retries included: its total timeout, or for a
    stream (no total) the time to connect."""
    return timeout.total if timeout.total is not None else timeout.connect


def _within(timeout: aiohttp.ClientTimeout, deadline: float | None) -> aiohttp.ClientTimeout:
    """``timeout`` with its total cut to what is left before ``deadline``."""
    if deadline is None or timeout.total is None:
        return timeout
    return aiohttp.ClientTimeout(
        total=max(0.001, deadline - clock.now()),
        connect=timeout.connect,
        sock_read=timeout.sock_read,
        sock_connect=timeout.sock_connect,
        ceil_threshold=timeout.ceil_threshold,
    )


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


class HttpSession(Protocol):
    """What the transport uses of an HTTP session (``aiohttp.ClientSession``'s ``request`` and
    ``close``)."""

    def request(
        self, method: str, url: str, **kwargs: Any
    ) -> Awaitable[aiohttp.ClientResponse]: ...

    async def close(self) -> None: ...


class Sessions(Protocol):
    """Where the transport's HTTP sessions come from: :class:`TcpSessions` (the service's
    only one); the deterministic simulator (``tests/sim/kube.py``) answers with its model of the
    API server instead, so that all of the transport's own logic runs there too."""

    def pool(self) -> HttpSession:
        """A new keep-alive pool for ordinary requests (also after a stalled one replaced the
        last)."""
        ...

    def watches(self) -> HttpSession:
        """The session of watches: connections that are never reused."""
        ...


class TcpSessions:
    """aiohttp sessions over TCP with the configuration's TLS settings and TCP keepalive (see
    the module docstring): a pool of ``pool_size`` connections, and watches on connections of
    their own (``force_close``)."""

    def __init__(self, configuration: k8s_client.Configuration, *, pool_size: int) -> None:
        self._ssl = ssl_context(configuration)
        self._pool_size = pool_size

    def pool(self) -> HttpSession:
        return self._session_of(
            aiohttp.TCPConnector(
                limit=self._pool_size, ssl=self._ssl, socket_factory=keepalive_socket
            )
        )

    def watches(self) -> HttpSession:
        return self._session_of(
            aiohttp.TCPConnector(
                limit=0, force_close=True, ssl=self._ssl, socket_factory=keepalive_socket
            )
        )

    @staticmethod
    def _session_of(connector: aiohttp.TCPConnector) -> HttpSession:
        return cast(
            HttpSession,
            aiohttp.ClientSession(connector=connector, trust_env=True, read_bufsize=READ_BUFSIZE),
        )


class ApiTransport:
    """The ``rest_client`` of an ApiClient: see the module docstring."""

    def __init__(
        self,
        configuration: k8s_client.Configuration,
        *,
        pool_size: int,
        credentials: Credentials | None = None,
        metrics: Metrics | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        self._configuration = configuration
        self._sessions = (
            sessions if sessions is not None else TcpSessions(configuration, pool_size=pool_size)
        )
        self._extra: dict[str, Any] = {}
        if configuration.proxy:
            self._extra["proxy"] = configuration.proxy
        if configuration.proxy_headers:
            self._extra["proxy_headers"] = configuration.proxy_headers
        if configuration.tls_server_name:
            self._extra["server_hostname"] = configuration.tls_server_name
        self._session = self._sessions.pool()
        self._watch_session = self._sessions.watches()
        self._retired: list[tuple[float, HttpSession]] = []
        self.limit = AimdLimit(ceiling=pool_size)
        """The adaptive concurrency limit of requests that are not watches."""
        self._credentials = credentials
        self._generation = 0
        """Counts credential reloads: a 401 reloads only the credentials it was sent with."""
        self._reload_lock = anyio.Lock()
        self._refused: str | None = None
        self._auth_log = CauseLog("the Kubernetes API refuses the credentials", logger)
        self._reload_log = CauseLog("could not read the Kubernetes API credentials", logger)
        self._stall_log = CauseLog(
            "a Kubernetes API request got no answer in time; its connection pool was replaced",
            logger,
        )
        self._metrics = metrics if metrics is not None else Metrics()
        self._metrics.api_concurrency_limit.set(self.limit.slots)
        self.reachability = Reachability(self._metrics)
        """Whether the server answers (fed here and by the reflector's watch lines)."""

    # ------------------------------------------------------------------ wiring

    def bind(self, metrics: Metrics) -> None:
        """Count into ``metrics`` from now on (the client is built before the service's
        metrics)."""
        self._metrics = metrics
        metrics.api_concurrency_limit.set(self.limit.slots)
        metrics.api_unauthorized.set(1 if self._refused is not None else 0)
        self.reachability.bind(metrics)

    @property
    def credentials(self) -> Credentials | None:
        """What is read again at a 401 (``None``: nothing, a client without a token)."""
        return self._credentials

    @property
    def problem(self) -> str | None:
        """Why the replica is not ready as far as the API server goes (``None``: nothing)."""
        if self._refused is not None:
            return f"credentials refused: {self._refused}"
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
        for _, session in self._retired:
            await session.close()
        self._retired.clear()
        await self._session.close()
        await self._watch_session.close()

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
        watch = is_watch(query_params)
        if query_params:
            url += "?" + urlencode(query_params)
        response = await self._exchange(
            method, url, sent_headers, data, client_timeout(_request_timeout), watch=watch
        )
        if not _preload_content:
            return response
        result = RESTResponse(response, await _drain(response))
        if not 200 <= result.status <= 299:
            raise ApiException(http_resp=cast(Any, result))  # as the library raises it
        return result

    async def GET(self, url: str, **kwargs: Any) -> Any:
        return await self.request("GET", url, **kwargs)

    async def HEAD(self, url: str, **kwargs: Any) -> Any:
        return await self.request("HEAD", url, **kwargs)

    async def OPTIONS(self, url: str, **kwargs: Any) -> Any:
        return await self.request("OPTIONS", url, **kwargs)

    async def DELETE(self, url: str, **kwargs: Any) -> Any:
        return await self.request("DELETE", url, **kwargs)

    async def POST(self, url: str, **kwargs: Any) -> Any:
        return await self.request("POST", url, **kwargs)

    async def PUT(self, url: str, **kwargs: Any) -> Any:
        return await self.request("PUT", url, **kwargs)

    async def PATCH(self, url: str, **kwargs: Any) -> Any:
        return await self.request("PATCH", url, **kwargs)

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
        budget_s = _budget_s(timeouts)
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
                await self._close_retired()
            if limited:
                await self._acquire(deadline)
            try:
                generation = self._generation
                sent_at = clock.now()
                response = await self._send(
                    method, url, headers, _within(timeouts, deadline), watch=watch, data=data
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
                        self._refuse(f"401 {message}")
                    # A DELETE refused with a token since replaced goes back to its reconciler,
                    # whose next attempt carries the new one: not a refusal that stands.
                    return response
                self._accept()
                retry_after_s = parse_retry_after(response.headers.get("Retry-After"))
                if not is_throttled(status, retry_after_s):
                    self.limit.succeeded()
                    self._metrics.api_concurrency_limit.set(self.limit.slots)
                    return response
                if status == 429 and self.limit.throttled(sent_at):
                    self._metrics.api_concurrency_limit.set(self.limit.slots)
                wait_s = throttle_wait(
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
        session = self._watch_session if watch else self._session
        started = clock.now()
        try:
            response = await session.request(
                method, url, headers=headers, data=data, timeout=timeouts, **self._extra
            )
        except BaseException as exc:
            waited_s = clock.now() - started
            if not watch and self._stalled(exc, waited_s, timeouts.total):
                self._replace(session, timeouts.total)
            if _unanswered(exc, waited_s, _budget_s(timeouts)):
                self.reachability.unanswered(started, f"{type(exc).__name__} {method} {_path(url)}")
            raise
        self.reachability.answered()
        if not watch:
            self._stall_log.ok()
        return response

    # -------------------------------------------------------------------- pools

    @staticmethod
    def _stalled(exc: BaseException, waited_s: float, timeout_s: float | None) -> bool:
        """Whether a request ended without an answer for (about) its whole timeout."""
        if isinstance(exc, TimeoutError):
            return True
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        return cancelled and timeout_s is not None and waited_s >= STALL_FRACTION * timeout_s

    def _replace(self, session: HttpSession, timeout_s: float | None) -> None:
        """Replace the pool ``session`` (when it still is the pool) by a new one."""
        if session is not self._session:
            return  # replaced already, by a sibling that timed out with it
        self._retire(session, 2 * timeout_s if timeout_s else RETIRED_POOL_GRACE_S)
        self._session = self._sessions.pool()
        self._metrics.api_pool_replacements.inc()
        self._stall_log.failed("no answer within the request timeout")

    def _retire(self, session: HttpSession, grace_s: float) -> None:
        """Close ``session`` once the requests in flight on it have had ``grace_s``."""
        self._retired.append((clock.now() + grace_s, session))

    async def _close_retired(self) -> None:
        if not self._retired:
            return
        now = clock.now()
        due = [session for close_at, session in self._retired if close_at <= now]
        if not due:
            return
        self._retired = [(at, session) for at, session in self._retired if at > now]
        for session in due:
            await session.close()

    # -------------------------------------------------------------- credentials

    async def _reauthenticate(self, generation: int) -> str | None:
        """Read the credentials again (unless that happened since ``generation``); the
        ``Authorization`` to send now."""
        if self._credentials is not None:
            async with self._reload_lock:
                if self._generation == generation:
                    await self._reload(self._credentials)
        auth = await self._configuration.auth_settings()
        entry = cast(dict[str, dict[str, str]], auth).get(BEARER_TOKEN)
        return entry["value"] if entry else None

    async def _reload(self, credentials: Credentials) -> None:
        before = self._configuration.api_key.get(BEARER_TOKEN)
        try:
            await credentials.reload(self._configuration)
        except (OSError, ValueError) as exc:
            self._metrics.api_credential_reloads.labels(result="failed").inc()
            self._reload_log.failed(f"{credentials.source}: {exc}")
        else:
            self._reload_log.ok()
            changed = self._configuration.api_key.get(BEARER_TOKEN) != before
            result = "changed" if changed else "unchanged"
            self._metrics.api_credential_reloads.labels(result=result).inc()
        self._generation += 1

    def _refuse(self, cause: str) -> None:
        """A 401 that stands: unready until an answer other than 401 comes."""
        self._metrics.api_unauthorized_answers.inc()
        self._metrics.api_unauthorized.set(1)
        source = self._credentials.source if self._credentials is not None else "no source"
        self._auth_log.failed(f"{cause} (credentials read again from {source})")
        self._refused = cause

    def _accept(self) -> None:
        if self._refused is not None:
            self._refused = None
            self._metrics.api_unauthorized.set(0)
            self._auth_log.ok()


def _unanswered(exc: BaseException, waited_s: float, budget_s: float | None) -> bool:
    """Whether a request that raised ``exc`` after ``waited_s`` ended without an answer from the
    server: timed out, refused, reset, or given up by its caller after most of its budget (a
    cancellation before that is the caller's business, e.g. a shutdown)."""
    if isinstance(exc, TimeoutError | aiohttp.ClientConnectionError | OSError):
        return True
    cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
    return cancelled and budget_s is not None and waited_s >= STALL_FRACTION * budget_s


def _path(url: str) -> str:
    """The path of ``url``, without host or query (a log line's cause)."""
    without_scheme = url.split("://", 1)[-1]
    slash = without_scheme.find("/")
    return without_scheme[slash:].split("?", 1)[0] if slash >= 0 else "/"


def transport_of(api: Any) -> ApiTransport | None:
    """The :class:`ApiTransport` of an ApiClient, when it has one."""
    rest_client = getattr(api, "rest_client", None)
    return rest_client if isinstance(rest_client, ApiTransport) else None
