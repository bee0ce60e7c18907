"""PostgreSQL test harness (a pytest plugin): one real server per session, one database per test.

Fixtures:

* ``pg_server`` (session): a :class:`PgServer`; a :class:`ThrowawayPostgres` started for the
  session, or the server named by ``$TEST_DATABASE_URL`` (which must load
  ``pg_stat_statements`` through ``shared_preload_libraries``: some tests count queries there).
* ``pg_template`` (session): a template database with the dev schema, the notify trigger on the
  default channel and ``pg_stat_statements``, migrated once.
* ``pg_clones`` (session): :class:`TemplateClones`, which clones the template one test ahead.
* ``pg_url`` (function): a fresh database cloned from the template; dropped afterwards.
* ``pg_conn`` (function, async): an asyncpg connection to ``pg_url``.
* ``pg_debian_server`` (session): a :class:`PgServer` running Debian's PostgreSQL 15 with its
  default settings, JIT on (``Flavor.DEBIAN``; ``make test`` installs it when absent).
* ``planner_url`` (function, parametrized ``session`` / ``debian15``): a fresh migrated database
  (dev schema, trigger on the default channel) on the session's server, then on Debian's: for
  the tests whose outcome depends on the server's planner.

Helpers: :func:`db_settings` (test-friendly ``DatabaseSettings``), :func:`seed_sandbox`,
:func:`seed_execution`, :func:`seed_executions`, :func:`metric` (read one sample).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
    Flavor,
    ThrowawayPostgres,
    create_database_async,
    drop_database_async,
    run_async,
    with_database,
)
from service import config
from service.config import DatabaseSettings
from service.pg.migrate import DEFAULT_CHANNEL, migrate

__all__ = [
    "NAMESPACE",
    "db_settings",
    "metric",
    "probe_sender",
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
def pg_debian_server() -> Iterator[PgServer]:
    server = ThrowawayPostgres(flavor=Flavor.DEBIAN)
    server.start()
    try:
        yield PgServer(admin_url=server.url, throwaway=server)
    finally:
        server.stop()


_PLANNER_SERVERS = {"session": "pg_server", "debian15": "pg_debian_server"}


@pytest.fixture(params=list(_PLANNER_SERVERS))
def planner_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database, migrated with the dev schema, on each server the planner tests use."""
    server: PgServer = request.getfixturevalue(_PLANNER_SERVERS[request.param])
    name = f"rpg_planner_{os.getpid()}_{next(_counter)}"
    url = server.create_database(name)

    async def prepare() -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
        finally:
            await conn.close()

    try:
        run_async(prepare)
        yield url
    finally:
        server.drop_database(name)


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


class TemplateClones:
    """Fresh clones of the template for one test each, made one test ahead on a worker thread.

    A clone costs ~60 ms of the server's time (more on a loaded machine), and most tests that
    take one spend their time waiting on real timers: cloning the next test's database and
    dropping the last one while a test runs takes both off the tests' path. Each test still gets
    a database nobody else has used, cloned from the template as it was migrated; one thread does
    every create and drop, in order. A failed drop fails the next :meth:`take` (or the session's
    end), as it failed the test's teardown before.
    """

    def __init__(self, server: PgServer, template: str) -> None:
        self._server = server
        self._template = template
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pg-clones")
        self._next: Future[str] | None = None
        self._drops: list[Future[None]] = []

    def _clone(self) -> str:
        name = f"rpg_{os.getpid()}_{next(_counter)}"
        self._server.create_database(name, template=self._template)
        return name

    def _check_drops(self) -> None:
        done = [f for f in self._drops if f.done()]
        self._drops = [f for f in self._drops if not f.done()]
        for f in done:
            f.result()  # raises what the drop raised

    def take(self) -> str:
        """A fresh clone's name (the one made ahead, or one made now); starts the next."""
        self._check_drops()
        ahead = self._next if self._next is not None else self._worker.submit(self._clone)
        self._next = self._worker.submit(self._clone)
        return ahead.result(timeout=120)

    def drop(self, name: str) -> None:
        """Drop ``name`` on the worker (after the clone made ahead)."""
        self._drops.append(self._worker.submit(self._server.drop_database, name))

    def close(self) -> None:
        """Drop the clone made ahead, wait for every pending drop, raise the first failure."""
        try:
            if self._next is not None:
                ahead, self._next = self._next, None
                self.drop(ahead.result(timeout=120))
        finally:
            self._worker.shutdown(wait=True)
        self._check_drops()


@pytest.fixture(scope="session")
def pg_clones(pg_server: PgServer, pg_template: str) -> Iterator[TemplateClones]:
    clones = TemplateClones(pg_server, pg_template)
    try:
        yield clones
    finally:
        clones.close()


@pytest.fixture
def pg_url(pg_server: PgServer, pg_clones: TemplateClones) -> Iterator[str]:
    """A fresh database (schema + trigger applied) for this test only."""
    name = pg_clones.take()
    try:
        yield with_database(pg_server.admin_url, name)
    finally:
        pg_clones.drop(name)


@pytest.fixture
async def pg_conn(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_url, timeout=10)
    try:
        yield conn
    finally:
        await conn.close(timeout=5)


def db_settings(url: str, **overrides: Any) -> DatabaseSettings:
    """``DatabaseSettings`` for tests: the declared defaults with short timeouts and heartbeats,
    a large batch."""
    values: dict[str, Any] = {
        "url": url,
        "pool_size": 4,
        "connect_timeout_s": 5.0,
        "statement_timeout_s": 5.0,
        "notify_channel": DEFAULT_CHANNEL,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 0.5,
        "batch_max_size": 1000,
    }
    values.update(overrides)
    return dataclasses.replace(config.load({}).database, **values)


def probe_sender(url: str) -> Callable[[str, str], Awaitable[float]]:
    """A notify listener's delivery-probe sender for tests that run a listener without a
    store: each probe a ``pg_notify`` committed on a connection of its own, as the store's pool
    sends it (``PgExecutionStore.notify``)."""

    async def send(channel: str, payload: str) -> float:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            usage = await conn.fetchval(
                "SELECT pg_notification_queue_usage() FROM (SELECT pg_notify($1, $2)) AS n",
                channel,
                payload,
            )
        finally:
            await conn.close(timeout=5)
        return float(usage)

    return send


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


def payload_rows(payload: str) -> list[list[object]]:
    """Trigger 0003's payload (``{"pods": [[op, active, state, [name, ...]], ...]}``) as one
    ``[op, pod_name, active, state]`` row per name; read with ``json`` here, not with the
    listener's parser, so that tests of the trigger check its text themselves. Fails the test if
    the payload is not of that shape."""
    body = json.loads(payload)
    assert list(body) == ["pods"], payload[:200]
    rows: list[list[object]] = []
    for group in body["pods"]:
        assert isinstance(group, list) and len(group) == 4, group
        op, active, state, names = group
        assert isinstance(names, list) and names, group
        rows.extend([op, name, active, state] for name in names)
    return rows
