"""A TCP proxy between the service and PostgreSQL that can silently stall the listener's link.

The service connects to the proxy; each connection is piped to the real server
(``tests/tcpproxy.py`` does the piping). A connection whose startup message names the
listener's ``application_name`` is a *listener* connection: :meth:`PgProxy.stall` makes the
proxy hold every byte of those connections in both directions without closing anything (a
frozen middlebox / black-holed path), until :meth:`unstall`. Only the listener's heartbeat can
notice that.
"""

from __future__ import annotations

import time

from tests.tcpproxy import Link, TcpProxy

LISTENER_APPLICATION_NAME = b"retired-pod-gc-listener"


class PgProxy(TcpProxy):
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        super().__init__(upstream_host, upstream_port)
        self._stalled = False
        self._early: dict[Link, bytes] = {}
        """The first bytes of connections not yet known to be the listener's, or not."""
        self._listeners: list[Link] = []
        self.listener_connected_at: list[float] = []
        """Wall-clock times at which listener connections sent their startup message."""

    @property
    def stalled(self) -> bool:
        return self._stalled

    async def start(self) -> PgProxy:
        await super().start()
        return self

    def stall(self) -> None:
        self._stalled = True
        self._listeners = [link for link in self._listeners if link in self.links]
        for link in self._listeners:
            link.black_hole()

    def unstall(self) -> None:
        self._stalled = False
        for link in self._listeners:
            link.heal()

    def on_client_bytes(self, link: Link, data: bytes) -> None:
        if link.client_bytes > 8192 or link in self._listeners:
            self._early.pop(link, None)
            return
        # asyncpg may send an SSLRequest first: the startup message (which names the
        # application) comes in a later packet.
        early = self._early.get(link, b"") + data
        if LISTENER_APPLICATION_NAME in early:
            self._early.pop(link, None)
            self._listeners.append(link)
            self.listener_connected_at.append(time.time())
            if self._stalled:
                link.black_hole()
        elif len(early) > 8192:
            self._early.pop(link, None)
        else:
            self._early[link] = early
