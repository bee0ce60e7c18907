"""The campaign's PostgreSQL proxy stalls exactly the listener's connection, silently."""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio
import asyncpg
import pytest

from tests.chaos.pgproxy import PgProxy
from tests.pgfixtures import PgServer


async def _proxied(pg_server: PgServer) -> tuple[PgProxy, str]:
    """A started proxy in front of the test server, and the URL through it."""
    target = urlsplit(pg_server.admin_url)
    proxy = await PgProxy(target.hostname or "127.0.0.1", target.port or 5432).start()
    return proxy, pg_server.admin_url.replace(f":{target.port}/", f":{proxy.port}/")


@pytest.mark.anyio
async def test_stall_freezes_only_the_listener_connection_without_closing_it(
    pg_server: PgServer,
) -> None:
    proxy, url = await _proxied(pg_server)
    try:
        listener = await asyncpg.connect(
            url, server_settings={"application_name": "retired-pod-gc-listener"}
        )
        other = await asyncpg.connect(url, server_settings={"application_name": "retired-pod-gc"})
        assert len(proxy.listener_connected_at) == 1
        proxy.stall()
        with pytest.raises(TimeoutError), anyio.fail_after(0.5):
            await listener.fetchval("SELECT 1")
        assert await other.fetchval("SELECT 2") == 2
        assert not listener.is_closed()
        listener.terminate()
        proxy.unstall()
        await other.close()
    finally:
        await proxy.aclose()


@pytest.mark.anyio
async def test_closing_the_proxy_under_open_connections_raises_nothing_into_the_loop(
    pg_server: PgServer,
) -> None:
    # aclose() ends every connection's task. The event-loop guard (tests/conftest.py) fails
    # this test if that reaches the loop's exception handler: on Python 3.11 the streams
    # server's done-callback calls ``task.exception()``, which raises on a cancelled task.
    proxy, url = await _proxied(pg_server)
    conns = [await asyncpg.connect(url) for _ in range(3)]
    try:
        assert [await c.fetchval("SELECT 1") for c in conns] == [1, 1, 1]
        await proxy.aclose()
        for c in conns:
            with pytest.raises((asyncpg.InterfaceError, asyncpg.PostgresConnectionError, OSError)):
                await c.fetchval("SELECT 1")
    finally:
        for c in conns:
            c.terminate()
