"""``migrate`` against a real server: applies, is a no-op the second time, follows the channel."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import asyncpg
import pytest

from service.pg.migrate import DEFAULT_CHANNEL, SCHEMA_STEP, TRIGGER_STEP, MigrationError, migrate
from tests.pgfixtures import PgServer, seed_execution, seed_sandbox

# Every catalog row the migration could touch, with xmin: CREATE OR REPLACE or DROP + CREATE
# of anything changes at least the xmin of its row even when the definition is identical.
_CATALOG_STATE = """
SELECT 'class' AS kind, c.relname AS name, c.oid::text AS oid, c.xmin::text AS xmin
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public'
UNION ALL
SELECT 'proc', p.proname, p.oid::text, p.xmin::text
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public'
UNION ALL
SELECT 'trigger', t.tgname, t.oid::text, t.xmin::text
FROM pg_trigger t WHERE NOT t.tgisinternal
UNION ALL
SELECT 'migration', m.name, m.sha256, m.applied_at::text || '/' || m.xmin::text
FROM retired_pod_gc_migrations m
ORDER BY 1, 2
"""


@pytest.fixture
def empty_db(pg_server: PgServer, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"rpg_empty_{abs(hash(request.node.name)) % 10**8}"
    pg_server.drop_database(name)
    url = pg_server.create_database(name)
    try:
        yield url
    finally:
        pg_server.drop_database(name)


async def _notified_channels(conn: asyncpg.Connection, url: str, channels: list[str]) -> list[str]:
    """Which of ``channels`` receive a notification when a row is inserted."""
    got: list[str] = []
    listen = await asyncpg.connect(url)
    try:
        for ch in channels:
            await listen.add_listener(ch, lambda _c, _p, channel, _payload: got.append(channel))
        await seed_sandbox(conn, "s1")
        await seed_execution(conn, pod_name="space-sbx-s1-g1", sandbox_id="s1")
        with anyio.move_on_after(0.5):
            while not got:
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)
    finally:
        await listen.close()
    return got


@pytest.mark.anyio
async def test_migrate_on_empty_database_applies_schema_and_trigger(empty_db: str) -> None:
    applied = await migrate(empty_db, channel=DEFAULT_CHANNEL, with_schema=True)
    assert applied == [SCHEMA_STEP, TRIGGER_STEP]
    conn = await asyncpg.connect(empty_db)
    try:
        triggers = await conn.fetch(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'sandbox_k8s_executions'::regclass"
            " AND NOT tgisinternal ORDER BY 1"
        )
        assert [r["tgname"] for r in triggers] == [
            "retired_pod_gc_execution_inserted_deleted",
            "retired_pod_gc_execution_updated",
        ]
        assert await _notified_channels(conn, empty_db, [DEFAULT_CHANNEL]) == [DEFAULT_CHANNEL]
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_migrate_twice_changes_nothing(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True) != []
        before = [tuple(r) for r in await conn.fetch(_CATALOG_STATE)]
        assert any(kind == "trigger" for kind, *_ in before)
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True) == []
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False) == []
        after = [tuple(r) for r in await conn.fetch(_CATALOG_STATE)]
        assert after == before
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_migrate_with_another_channel_moves_the_trigger_to_it(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
        before = [tuple(r) for r in await conn.fetch(_CATALOG_STATE)]
        assert await migrate(conn, channel="gc_changes", with_schema=True) == [TRIGGER_STEP]
        after = [tuple(r) for r in await conn.fetch(_CATALOG_STATE)]
        assert after != before
        got = await _notified_channels(conn, empty_db, [DEFAULT_CHANNEL, "gc_changes"])
        assert got == ["gc_changes"]
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_migrate_trigger_without_schema_on_empty_database_fails_and_commits_nothing(
    empty_db: str,
) -> None:
    with pytest.raises(MigrationError):
        await migrate(empty_db, channel=DEFAULT_CHANNEL, with_schema=False)
    conn = await asyncpg.connect(empty_db)
    try:
        assert await conn.fetchval("SELECT to_regclass('retired_pod_gc_migrations')") is None
    finally:
        await conn.close()
