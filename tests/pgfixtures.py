"""PostgreSQL test harness (a pytest plugin): one real server per session, one database per test.

Fixtures:

* ``pg_server`` (session): a :class:`PgServer`; a :class:`ThrowawayPostgres` started for the
  session, or the server named by ``$TEST_DATABASE_URL`` (which must load
  ``pg_stat_statements`` through ``shared_preload_libraries``: some tests count queries there).
* ``pg_template`` (session): a template database with the dev schema, the notify trigger on the
  default channel and ``pg_stat_statements``, migrated once.
* ``pg_url`` (function): a fresh database cloned from the template; dropped afterwards.
* ``pg_conn`` (function, async): an asyncpg connection to ``pg_url``.

Helpers: :func:`db_settings` (test-friendly ``DatabaseSettings``), :func:`seed_sandbox`,
:func:`seed_execution`, :func:`seed_executions`, :func:`metric` (read one sample).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from devtools.pg.devdata import (
    NAMESPACE,
    seed_execution,
    seed_executions,
    seed_sandbox,
    set_execution,
)
from devtools.pg.throwaway import (
    ThrowawayPostgres,
    create_database_async,
    drop_database_async,
    run_async,
    with_database,
)
from service.config import DatabaseSettings
from service.pg.migrate import DEFAULT_CHANNEL, migrate

__all__ = [
    "NAMESPACE",
    "db_settings",
    "metric",
    "seed_execution",
    "seed_executions",
    "seed_sandbox",
    "set_execution",
]
_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class PgServer:
    """The session's server: an admin URL, and the throwaway when we started one."""

    admin_url: str
    throwaway: ThrowawayPostgres | None

    def create_database(self, name: str, *, template: str | None = None) -> str:
        run_async(lambda: create_database_async(self.admin_url, name, template=template))
        return with_database(self.admin_url, name)

    def drop_database(self, name: str) -> None:
        run_async(lambda: drop_database_async(self.admin_url, name))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    external = os.environ.get("TEST_DATABASE_URL")
    if external:
        yield PgServer(admin_url=external, throwaway=None)
        return
    server = ThrowawayPostgres(settings={"shared_preload_libraries": "pg_stat_statements"})
    server.start()
    try:
        yield PgServer(admin_url=server.url, throwaway=server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_template(pg_server: PgServer) -> Iterator[str]:
    name = f"rpg_template_{os.getpid()}"
    pg_server.drop_database(name)
    url = pg_server.create_database(name)

    async def prepare() -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        finally:
            await conn.close()

    run_async(prepare)
    try:
        yield name
    finally:
        pg_server.drop_database(name)


@pytest.fixture
def pg_url(pg_server: PgServer, pg_template: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database (schema + trigger applied) for this test only."""
    slug = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:30]
    name = f"rpg_{os.getpid()}_{next(_counter)}_{slug}"[:63]
    url = pg_server.create_database(name, template=pg_template)
    try:
        yield url
    finally:
        pg_server.drop_database(name)


@pytest.fixture
async def pg_conn(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_url, timeout=10)
    try:
        yield conn
    finally:
        await conn.close(timeout=5)


def db_settings(url: str, **overrides: Any) -> DatabaseSettings:
    """``DatabaseSettings`` for tests: short timeouts and heartbeats, a large batch."""
    values: dict[str, Any] = {
        "url": url,
        "pool_size": 4,
        "connect_timeout_s": 5.0,
        "statement_timeout_s": 5.0,
        "notify_channel": DEFAULT_CHANNEL,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 0.5,
        "batch_max_size": 1000,
        "batch_max_wait_s": 0.005,
    }
    values.update(overrides)
    return DatabaseSettings(**values)


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """One sample's value (0 when the sample does not exist yet).

    As ``registry.get_sample_value``, but collecting only the metric that can hold the sample:
    tests poll this every few milliseconds, and a whole registry's collection costs ~1 ms.
    """
    for family in registry.restricted_registry([name]).collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
