"""``migrate`` against a real server: applies, is a no-op the second time, follows the channel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import anyio
import asyncpg
import pytest

from devtools.pg.devdata import FOREIGN_SCHEMA
from service.pg.migrate import (
    DEFAULT_CHANNEL,
    SCHEMA_STEP,
    TRIGGER_STEP,
    MigrationError,
    Step,
    _apply,
    migrate,
    read_sql,
)
from tests.pgfixtures import NAMESPACE, PgServer, payload_rows, seed_execution, seed_sandbox

TRIGGERS_0003 = [
    "retired_pod_gc_executions_deleted",
    "retired_pod_gc_executions_inserted",
    "retired_pod_gc_executions_updated",
]
_TRIGGERS = (
    "SELECT tgname FROM pg_trigger WHERE tgrelid = 'sandbox_k8s_executions'::regclass"
    " AND NOT tgisinternal ORDER BY 1"
)

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


async def _payloads_of(conn: asyncpg.Connection, url: str, statement: str) -> list[str]:
    """The payloads ``statement`` (run on ``conn``) sends on the default channel."""
    got: list[str] = []
    listen = await asyncpg.connect(url)
    try:
        await listen.add_listener(DEFAULT_CHANNEL, lambda _c, _p, _ch, payload: got.append(payload))
        await conn.execute(statement)
        # The server sends what it queued for a listening connection before answering it.
        await listen.fetchval("SELECT 1")
        await anyio.sleep(0)
    finally:
        await listen.close()
    return got


async def _notified_channels(conn: asyncpg.Connection, url: str, channels: list[str]) -> list[str]:
    """Which of ``channels`` receive a notification when an execution is retired."""
    got: list[str] = []
    listen = await asyncpg.connect(url)
    try:
        for ch in channels:
            await listen.add_listener(ch, lambda _c, _p, channel, _payload: got.append(channel))
        await seed_sandbox(conn, "s1")
        await seed_execution(conn, pod_name="space-sbx-s1-g1", sandbox_id="s1")
        await conn.execute("UPDATE sandbox_k8s_executions SET active = false")
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
        assert [r["tgname"] for r in triggers] == TRIGGERS_0003
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


async def _install_0002(conn: asyncpg.Connection) -> None:
    """What ``migrate`` of the release before 0003 left behind: the schema and 0002, recorded."""
    await _apply(
        conn,
        [
            Step(SCHEMA_STEP, read_sql(SCHEMA_STEP)),
            Step("0002_notify_trigger", read_sql("0002_notify_trigger")),
        ],
    )
    assert [r["tgname"] for r in await conn.fetch(_TRIGGERS)] == [
        "retired_pod_gc_execution_inserted_deleted",
        "retired_pod_gc_execution_updated",
    ]


@pytest.mark.anyio
async def test_migrate_replaces_0002_with_0003_in_place(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        await _install_0002(conn)
        await seed_sandbox(conn, "s1")
        await seed_execution(conn, pod_name="space-sbx-s1-g1", sandbox_id="s1")
        # 0002 sends one object per row.
        (before,) = await _payloads_of(
            conn, empty_db, "UPDATE sandbox_k8s_executions SET execution_state = 'activating'"
        )
        assert json.loads(before)["op"] == "update"

        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False) == [TRIGGER_STEP]
        # Only 0003's triggers, and 0002's function is gone.
        assert [r["tgname"] for r in await conn.fetch(_TRIGGERS)] == TRIGGERS_0003
        assert (
            await conn.fetchval(
                "SELECT to_regprocedure('retired_pod_gc_notify_execution_changed()')"
            )
            is None
        )
        recorded = {
            r["name"] for r in await conn.fetch("SELECT name FROM retired_pod_gc_migrations")
        }
        assert recorded == {SCHEMA_STEP, "0002_notify_trigger", TRIGGER_STEP}
        # One batch for the statement, nothing sent twice (no row trigger left behind).
        (after,) = await _payloads_of(
            conn,
            empty_db,
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced'",
        )
        assert json.loads(after) == {"pods": [["update", False, "replaced", ["space-sbx-s1-g1"]]]}

        # A second run changes nothing at all.
        catalog = [tuple(r) for r in await conn.fetch(_CATALOG_STATE)]
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False) == []
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True) == []
        assert [tuple(r) for r in await conn.fetch(_CATALOG_STATE)] == catalog
    finally:
        await conn.close()


# What 0003's first form (the `rows` payload) left in a database besides its trigger function
# and triggers, which the current file replaces: its two helper functions, and its record.
_FIRST_FORM_HELPERS = """
CREATE FUNCTION retired_pod_gc_change_json(
    op text, namespace text, pod_name text, active boolean, execution_state text
) RETURNS text LANGUAGE sql STABLE AS $fn$ SELECT op $fn$;
CREATE FUNCTION retired_pod_gc_change_batch(bytes integer, packed bigint, nth bigint)
RETURNS bigint LANGUAGE sql IMMUTABLE AS $fn$ SELECT nth $fn$;
UPDATE retired_pod_gc_migrations SET sha256 = 'the first form' WHERE name = '%s';
"""


@pytest.mark.anyio
async def test_migrate_replaces_0003s_first_form_in_place(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
        await conn.execute(_FIRST_FORM_HELPERS % TRIGGER_STEP)
        # The recorded checksum is not the file's: the step is applied again, in place.
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False) == [TRIGGER_STEP]
        for helper in (
            "retired_pod_gc_change_json(text, text, text, boolean, text)",
            "retired_pod_gc_change_batch(integer, bigint, bigint)",
        ):
            assert await conn.fetchval("SELECT to_regprocedure($1)", helper) is None
        assert [r["tgname"] for r in await conn.fetch(_TRIGGERS)] == TRIGGERS_0003
        await seed_sandbox(conn, "s1")
        await seed_execution(conn, pod_name="space-sbx-s1-g1", sandbox_id="s1")
        (after,) = await _payloads_of(
            conn,
            empty_db,
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced'",
        )
        assert json.loads(after) == {"pods": [["update", False, "replaced", ["space-sbx-s1-g1"]]]}
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_the_0003_file_itself_runs_twice_in_a_row(empty_db: str) -> None:
    # Applied by hand (psql -f) more than once, the file is idempotent too.
    conn = await asyncpg.connect(empty_db)
    try:
        await _install_0002(conn)
        for _ in range(2):
            async with conn.transaction():
                await conn.execute(read_sql(TRIGGER_STEP))
        assert [r["tgname"] for r in await conn.fetch(_TRIGGERS)] == TRIGGERS_0003
    finally:
        await conn.close()


# A production-like schema the project did not write: other column order, extra columns, an
# identity key, constraints, an index and a row trigger of its owner's, another schema's table
# of the same name that must not be touched.
_FOREIGN_SCHEMA = (
    """
CREATE SCHEMA other;
CREATE TABLE other.sandbox_k8s_executions (x int);
"""
    + FOREIGN_SCHEMA
    + """
CREATE FUNCTION touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN NEW.updated_at := now(); RETURN NEW; END $$;
CREATE TRIGGER owners_touch BEFORE UPDATE ON sandbox_k8s_executions
    FOR EACH ROW EXECUTE FUNCTION touch();
"""
)


@pytest.mark.anyio
async def test_migrate_on_a_schema_the_project_did_not_write(empty_db: str) -> None:
    conn = await asyncpg.connect(empty_db)
    try:
        await conn.execute(_FOREIGN_SCHEMA)
        await conn.execute(read_sql("0002_notify_trigger"))  # installed by hand, unrecorded
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False) == [TRIGGER_STEP]
        assert [r["tgname"] for r in await conn.fetch(_TRIGGERS)] == sorted(
            [*TRIGGERS_0003, "owners_touch"]
        )
        await conn.execute(
            "INSERT INTO sandboxes (managed_by, namespace, id) VALUES ('kubernetes', $1, 's1'),"
            " ('kubernetes', 'elsewhere', 's2')",
            NAMESPACE,
        )
        inserted = await _payloads_of(
            conn,
            empty_db,
            "INSERT INTO sandbox_k8s_executions (pod_name, sandbox_id, execution_state,"
            " generation, pod_kind, active) VALUES ('space-sbx-s1-g1', 's1', 'active', 1,"
            " 'create', true), ('space-sbx-s2-g1', 's2', 'suspended', 1, 'create', false)",
        )
        # Only the execution inserted inactive can start a clock.
        assert sorted(r for p in inserted for r in payload_rows(p)) == [
            ["insert", "space-sbx-s2-g1", False, "suspended"],
        ]
        retired = await _payloads_of(
            conn,
            empty_db,
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended',"
            " notes = '{}' WHERE sandbox_id = 's1'",
        )
        assert [payload_rows(p) for p in retired] == [
            [["update", "space-sbx-s1-g1", False, "suspended"]]
        ]
        # The owner's trigger still runs. A cascade from sandboxes reports the delete (the
        # payload names the pod, not the sandbox's namespace, which is gone by then).
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM sandbox_k8s_executions WHERE updated_at IS NOT NULL"
            )
            == 1
        )
        deleted = await _payloads_of(conn, empty_db, "DELETE FROM sandboxes WHERE id = 's2'")
        assert [json.loads(p) for p in deleted] == [
            {"pods": [["delete", False, "suspended", ["space-sbx-s2-g1"]]]}
        ]
        assert await conn.fetchval("SELECT count(*) FROM other.sandbox_k8s_executions") == 0
    finally:
        await conn.close()


_PROSRC = (
    "SELECT prosrc FROM pg_proc"
    " WHERE oid = 'retired_pod_gc_notify_executions_changed()'::regprocedure"
)
_JIT_OFF = "PERFORM set_config('jit', 'off', true),"
# The general path's statements that save, set and restore the planner's settings.
_SETTINGS = re.compile(
    r"\n *(?:PERFORM set_config|settings_before :=)[^;]*;|\n *settings_before text\[\];"
)


@pytest.mark.anyio
async def test_migrate_upgrades_a_database_migrated_with_an_earlier_0003(empty_db: str) -> None:
    # The 0003 an earlier release's `migrate` installed and recorded: its general query planned
    # with the server's settings (JIT on where the server has it). The next `migrate` applies the
    # current text in place.
    current = read_sql(TRIGGER_STEP)
    earlier = _SETTINGS.sub("", current)
    assert current.count(_JIT_OFF) == 3 and "PERFORM set_config" not in earlier
    conn = await asyncpg.connect(empty_db)
    try:
        await _apply(conn, [Step(SCHEMA_STEP, read_sql(SCHEMA_STEP)), Step(TRIGGER_STEP, earlier)])
        assert _JIT_OFF not in await conn.fetchval(_PROSRC)
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True) == [TRIGGER_STEP]
        assert (await conn.fetchval(_PROSRC)).count(_JIT_OFF) == 3
        assert [r["tgname"] for r in await conn.fetch(_TRIGGERS)] == TRIGGERS_0003
        assert await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True) == []
    finally:
        await conn.close()
