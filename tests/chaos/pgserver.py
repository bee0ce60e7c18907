"""The one throwaway PostgreSQL server that every seed of a campaign shares.

The server logs every statement (:mod:`tests.chaos.pglog`); a migrated template database is
copied for each seed, and a restart of the server is one of the schedule's faults, which is why
:attr:`SharedPostgres.restarted_at` matters to every seed's liveness bound.
"""

from __future__ import annotations

import math
import time

import anyio
import asyncpg

from devtools.pg.throwaway import ThrowawayPostgres, create_database_async, with_database
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from tests.chaos.pglog import SERVER_SETTINGS, StatementLog


class SharedPostgres:
    """One throwaway server for a whole campaign, a migrated template, and a restart lock."""

    TEMPLATE = "chaos_template"

    def __init__(self) -> None:
        self.server = ThrowawayPostgres(settings={"max_connections": "500", **SERVER_SETTINGS})
        self.statements: StatementLog | None = None
        self._lock = anyio.Lock()
        self._counter = 0
        self.restarts = 0
        self.restarted_at = 0.0
        """Wall-clock time the last restart ended (``inf`` while one is under way)."""

    async def start(self) -> None:
        await anyio.to_thread.run_sync(self.server.start)
        assert self.server.root_dir is not None
        self.statements = StatementLog(self.server.root_dir / "server.log")
        await create_database_async(self.server.url, self.TEMPLATE)
        conn = await asyncpg.connect(with_database(self.server.url, self.TEMPLATE), timeout=10)
        try:
            await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
        finally:
            await conn.close()

    def stop(self) -> None:
        self.server.stop()

    async def new_database(self, seed: int) -> str:
        self._counter += 1
        name = f"chaos_{seed}_{self._counter}"
        async with self._lock:  # CREATE DATABASE ... TEMPLATE needs the template idle
            await create_database_async(self.server.url, name, template=self.TEMPLATE)
        return name

    async def restart(self) -> None:
        async with self._lock:
            self.restarted_at = math.inf
            try:
                await anyio.to_thread.run_sync(self.server.restart)
            finally:
                self.restarted_at = time.time()
            self.restarts += 1
