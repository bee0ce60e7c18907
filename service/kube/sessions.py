"""The HTTP connections requests go over: a keep-alive pool replaced when it stalls, and watches.

A request with no answer within its timeout leaves the pool suspect: its idle siblings may be
black-holed too (a dropped conntrack entry, a load balancer's idle timeout). :class:`Pools` then
replaces it, so one request per outage waits its full timeout. Watches go over connections never
reused, so a new watch never lands on a connection that died in the pool. TCP keepalive is on
(Linux's default would probe after two hours): the kernel resets a connection whose peer is gone
about a minute after it went silent.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable
from typing import Any, Protocol

import aiohttp
from aiohttp.connector import AddrInfoType
from kubernetes_asyncio import client as k8s_client

from service.kit import clock

KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3
RETIRED_POOL_GRACE_S = 60.0
"""A replaced pool is closed this long after (twice the stalled request's timeout if it had one),
when the requests in flight on it have had their time."""
READ_BUFSIZE = 2**21
"""As the library's: a watch event with a large object exceeds aiohttp's default buffer."""


def keepalive_socket(addr_info: AddrInfoType) -> socket.socket:
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


def request_options(configuration: k8s_client.Configuration) -> dict[str, Any]:
    """The proxy and TLS server name of ``configuration``, passed with every request."""
    options: dict[str, Any] = {}
    if configuration.proxy:
        options["proxy"] = configuration.proxy
    if configuration.proxy_headers:
        options["proxy_headers"] = configuration.proxy_headers
    if configuration.tls_server_name:
        options["server_hostname"] = configuration.tls_server_name
    return options


class HttpSession(Protocol):
    """What the transport uses of an ``aiohttp.ClientSession``."""

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str],
        data: Any,
        timeout: aiohttp.ClientTimeout,
        proxy: str | None = None,
        proxy_headers: dict[str, str] | None = None,
        server_hostname: str | None = None,
    ) -> Awaitable[aiohttp.ClientResponse]: ...

    async def close(self) -> None: ...


class Sessions(Protocol):
    """Where the transport's sessions come from: :class:`TcpSessions`, or the simulator's model
    of the API server (``tests/sim/kube.py``), so that the transport runs there unchanged."""

    def pool(self) -> HttpSession: ...

    def watches(self) -> HttpSession: ...


class TcpSessions:
    def __init__(self, configuration: k8s_client.Configuration, *, pool_size: int) -> None:
        # The TLS settings of the configuration, as the library's ``RESTClientObject`` has them.
        self._ssl = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if configuration.cert_file:
            self._ssl.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
        if not configuration.verify_ssl:
            self._ssl.check_hostname = False
            self._ssl.verify_mode = ssl.CERT_NONE
        if configuration.disable_strict_ssl_verification:
            self._ssl.verify_flags &= ~ssl.VERIFY_X509_STRICT
        self._pool_size = pool_size

    def pool(self) -> HttpSession:
        return self._session(limit=self._pool_size)

    def watches(self) -> HttpSession:
        return self._session(limit=0, force_close=True)

    def _session(self, *, limit: int, force_close: bool = False) -> HttpSession:
        connector = aiohttp.TCPConnector(
            limit=limit, force_close=force_close, ssl=self._ssl, socket_factory=keepalive_socket
        )
        return aiohttp.ClientSession(connector=connector, trust_env=True, read_bufsize=READ_BUFSIZE)


class Pools:
    """The current keep-alive pool, the watches' session, and the replaced pools still open."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions
        self.pool = sessions.pool()
        self.watches = sessions.watches()
        self._retired: list[tuple[float, HttpSession]] = []  # (when to close it, the pool)

    def replace(self, session: HttpSession, timeout_s: float | None) -> bool:
        """Replace the pool ``session`` unless a sibling that timed out with it did already;
        whether this did."""
        if session is not self.pool:
            return False
        grace_s = 2 * timeout_s if timeout_s else RETIRED_POOL_GRACE_S
        self._retired.append((clock.now() + grace_s, session))
        self.pool = self._sessions.pool()
        return True

    async def close_retired(self) -> None:
        now = clock.now()
        due = [session for close_at, session in self._retired if close_at <= now]
        self._retired = [(at, session) for at, session in self._retired if at > now]
        for session in due:
            await session.close()

    async def close(self) -> None:
        for _, session in self._retired:
            await session.close()
        self._retired.clear()
        await self.pool.close()
        await self.watches.close()
