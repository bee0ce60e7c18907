"""asyncpg's TLS probe (``sslmode=prefer``) never leaves an unretrieved exception behind.

The probe is asyncpg's own protocol object; these tests drive it the way a connection lost
during the ``SSLRequest`` exchange does, with the adapter imported (which installs the fix).
"""

from __future__ import annotations

import asyncio
import gc
import ssl

import pytest
from asyncpg import connect_utils

import service.pg  # noqa: F401  (installs the fix, as the service does)
from tests.loopguard import under_guard


def _probe(loop: asyncio.AbstractEventLoop) -> connect_utils.TLSUpgradeProto:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return connect_utils.TLSUpgradeProto(loop, "127.0.0.1", 5432, context, True)


@pytest.mark.anyio
async def test_an_abandoned_probe_whose_connection_was_lost_reports_nothing() -> None:
    async def body() -> None:
        probe = _probe(asyncio.get_running_loop())
        probe.connection_lost(None)  # nobody awaits on_data: its connect was abandoned
        del probe
        gc.collect()

    assert await under_guard(body) is None


@pytest.mark.anyio
async def test_a_probe_still_awaited_raises_the_lost_connection() -> None:
    probe = _probe(asyncio.get_running_loop())
    waiting = asyncio.ensure_future(probe.on_data)
    await asyncio.sleep(0)
    probe.connection_lost(None)
    with pytest.raises(ConnectionError, match="unexpected connection_lost"):
        await waiting
