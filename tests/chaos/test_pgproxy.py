"""The campaign's PostgreSQL proxy stalls exactly the listener's connection, silently."""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio
import asyncpg
import pytest

from tests.chaos.pgproxy import PgProxy
from tests.pgfixtures import PgServer


@pytest.mark.anyio
async def test_stall_freezes_only_the_listener_connection_without_closing_it(
    pg_server: PgServer,
) -> None:
    target = urlsplit(pg_server.admin_url)
    proxy = await PgProxy(target.hostname or "127.0.0.1", target.port or 5432).start()
    url = pg_server.admin_url.replace(f":{target.port}/", f":{proxy.port}/")
    try:
        listener = await asyncpg.connect(
            url, server_settings={"application_name": "retired-pod-gc-listener"}
        )
        other = await asyncpg.connect(url, server_settings={"application_name": "retired-pod-gc"})
        assert proxy.listener_connections == 1
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
