"""``migrate`` never queues the platform's writers (issue 46), on Debian's PostgreSQL 15.

A writer transaction is held open on ``sandbox_k8s_executions`` (an uncommitted one-row UPDATE:
a row lock and the table's ROW EXCLUSIVE lock) while ``migrate`` runs and a stream of one-row
writers updates other rows. What the writers wait for is measured twice: each write's latency on
the client, and, on the server, how long a write had been waiting on a lock whenever a sampler
found it waiting (``pg_stat_activity``), with who it waited for (``pg_blocking_pids``). The
claims: no write waits more than 2 s (the issue's bound) nor, on the server, longer than the
lock_timeout of one request (the product's bound) plus a tolerance far below what holding the
table for the writer's whole transaction would cost; ``migrate`` applies once the transaction
ends, or stops at its deadline naming the holder, having changed nothing. A ``migrate`` with
nothing to apply returns at once. And every step file under ``service/pg/sql`` locks no platform
table that ``migrate`` does not lock up front.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import asyncpg
import pytest

from devtools.pg.throwaway import run_async
from service.app.service import APPLICATION_NAME
from service.config import MIGRATE_LOCK_TIMEOUT_SECONDS
from service.kit import clock
from service.pg.migrate import (
    DEFAULT_CHANNEL,
    PLATFORM_TABLES,
    SCHEMA_STEP,
    TRIGGER_STEP,
    LockNotGranted,
    Step,
    migrate,
    read_sql,
    render_trigger_sql,
)
from tests.e2e.harness import CliResult, base_env, run_cli_async
from tests.pgfixtures import PgServer, seed_execution, seed_sandbox

pytestmark = pytest.mark.anyio
T = TypeVar("T")

HOLD_S = 6.0
"""How long the writer transaction stays open (the issue measured 30 s)."""
LOCK_TIMEOUT_S = MIGRATE_LOCK_TIMEOUT_SECONDS.default
WRITE_BOUND_S = 2.0
"""The issue's bound: no write of the stream waits longer."""
LOCK_WAIT_TOLERANCE_S = 0.5
"""Above the lock_timeout, for the server's own timer and the sampler's: a write that waited
for the held transaction instead would have waited up to HOLD_S."""
ROWS = 20
HELD_POD = "space-sbx-s0-g0"
HELD_APP = "held-writer"
STREAM_APP = "writer-stream"
MIGRATE_APP = "migrate-under-test"
MIGRATORS = {MIGRATE_APP, APPLICATION_NAME}
"""The application_name of migrate's session: the test's own connection, or the command's."""
SQL_DIR = Path(__file__).resolve().parents[2] / "service" / "pg" / "sql"

# What a step or its record changes, with xmin: any CREATE OR REPLACE or DROP + CREATE moves it.
_CATALOG_STATE = """
SELECT 'proc' AS kind, p.proname AS name, p.xmin::text AS xmin
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'
UNION ALL
SELECT 'trigger', t.tgname, t.xmin::text FROM pg_trigger t WHERE NOT t.tgisinternal
ORDER BY 1, 2
"""
_RECORDS = "SELECT name, sha256 || '/' || xmin::text FROM retired_pod_gc_migrations ORDER BY 1"
_TRIGGERS = (
    "SELECT tgname FROM pg_trigger WHERE tgrelid = 'sandbox_k8s_executions'::regclass"
    " AND NOT tgisinternal ORDER BY 1"
)


@pytest.fixture
def tables_only(pg_debian_server: PgServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database with the platform's two tables (no trigger, no record) and ROWS + 1 rows."""
    name = f"rpg_locks_{abs(hash(request.node.name)) % 10**8}"
    pg_debian_server.drop_database(name)
    url = pg_debian_server.create_database(name)

    async def seed() -> None:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            await conn.execute(read_sql(SCHEMA_STEP))
            await seed_sandbox(conn, "s0")
            for g in range(ROWS + 1):
                await seed_execution(conn, pod_name=f"space-sbx-s0-g{g}", sandbox_id="s0")
        finally:
            await conn.close()

    try:
        run_async(seed)
        yield url
    finally:
        pg_debian_server.drop_database(name)


async def _migrate_url(url: str, **bounds: float) -> list[str]:
    conn = await asyncpg.connect(url, timeout=10, server_settings={"application_name": MIGRATE_APP})
    try:
        return await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False, **bounds)
    finally:
        await conn.close()


async def _catalog(url: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        rows = [(r[0], r[1], r[2]) for r in await conn.fetch(_CATALOG_STATE)]
        if await conn.fetchval("SELECT to_regclass('retired_pod_gc_migrations')") is not None:
            rows += [("migration", r[0], r[1]) for r in await conn.fetch(_RECORDS)]
        return rows
    finally:
        await conn.close()


async def _sql(url: str, statement: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@dataclass
class Measured:
    """What the writers and the sampler saw."""

    write_latencies_s: list[float] = field(default_factory=list)
    lock_waits_s: dict[str, float] = field(default_factory=dict)
    """Per application_name, the longest a statement had been waiting on a lock when sampled."""
    blocked_by: set[tuple[str, str]] = field(default_factory=set)
    """(waiting application, blocking application) pairs seen."""
    held_pid: int = 0
    held_ended_at: float | None = None
    """When the writer transaction ended (the loop's clock)."""
    run_started_at: float = 0.0
    run_ended_at: float = 0.0


@contextlib.asynccontextmanager
async def held_writer(url: str, measured: Measured) -> AsyncIterator[asyncpg.Connection]:
    """A writer transaction left open: one row updated, not committed; rolled back on exit
    unless committed before."""
    conn = await asyncpg.connect(url, timeout=10, server_settings={"application_name": HELD_APP})
    try:
        measured.held_pid = conn.get_server_pid()
        await conn.execute("BEGIN")
        await conn.execute(
            "UPDATE sandbox_k8s_executions SET execution_state = 'held' WHERE pod_name = $1",
            HELD_POD,
        )
        try:
            yield conn
        finally:
            if conn.is_in_transaction():
                await conn.execute("ROLLBACK")
                measured.held_ended_at = clock.now()
    finally:
        await conn.close()


async def _end_after(conn: asyncpg.Connection, measured: Measured, hold_s: float) -> None:
    await anyio.sleep(hold_s)
    await conn.execute("COMMIT")
    measured.held_ended_at = clock.now()


async def _write_stream(url: str, measured: Measured, stop: anyio.Event, offset: int) -> None:
    """One-row writes of the other rows, one after another, each timed."""
    conn = await asyncpg.connect(url, timeout=10, server_settings={"application_name": STREAM_APP})
    try:
        i = offset
        while not stop.is_set():
            pod = f"space-sbx-s0-g{1 + i % ROWS}"
            started = clock.now()
            await conn.execute(
                "UPDATE sandbox_k8s_executions SET activation_attempt = activation_attempt + 1"
                " WHERE pod_name = $1",
                pod,
            )
            measured.write_latencies_s.append(clock.now() - started)
            i += 2
            await anyio.sleep(0.01)
    finally:
        await conn.close()


_LOCK_WAITERS = """
SELECT a.application_name,
       extract(epoch FROM clock_timestamp() - a.query_start)::float8 AS waited_s,
       ARRAY(SELECT b.application_name FROM pg_stat_activity b
             WHERE b.pid = ANY(pg_blocking_pids(a.pid))) AS blockers
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.wait_event_type = 'Lock' AND a.state = 'active'
"""


async def _sample_lock_waits(url: str, measured: Measured, stop: anyio.Event) -> None:
    conn = await asyncpg.connect(url, timeout=10, server_settings={"application_name": "sampler"})
    try:
        while not stop.is_set():
            for r in await conn.fetch(_LOCK_WAITERS):
                app = r["application_name"]
                measured.lock_waits_s[app] = max(measured.lock_waits_s.get(app, 0.0), r["waited_s"])
                measured.blocked_by.update((app, b) for b in r["blockers"])
            await anyio.sleep(0.02)
    finally:
        await conn.close()


async def _with_writers(
    url: str, *, hold_s: float, run: Callable[[], Awaitable[T]]
) -> tuple[T | LockNotGranted, Measured]:
    """``run()`` while the writer transaction is held (committed after ``hold_s``, or rolled
    back once ``run`` is done) and the stream writes; its result (or the LockNotGranted it
    raised) and what was measured."""
    measured = Measured()
    stop = anyio.Event()
    async with held_writer(url, measured) as held, anyio.create_task_group() as tg:
        tg.start_soon(_sample_lock_waits, url, measured, stop)
        for offset in range(2):
            tg.start_soon(_write_stream, url, measured, stop, offset)
        ender = anyio.CancelScope()

        async def end() -> None:
            with ender:
                await _end_after(held, measured, hold_s)

        tg.start_soon(end)
        await anyio.sleep(0.5)  # the stream writes, the transaction is open
        measured.run_started_at = clock.now()
        result: T | LockNotGranted
        try:
            result = await run()
        except LockNotGranted as exc:
            result = exc
        measured.run_ended_at = clock.now()
        await anyio.sleep(0.5)  # the stream goes on after migrate
        ender.cancel()
        stop.set()
    return result, measured


def _assert_writers_never_queued(measured: Measured) -> None:
    latencies = measured.write_latencies_s
    print(  # the figures, for the report (pytest -s)
        f"\nwrites {len(latencies)}, max latency {max(latencies):.3f}s, "
        f"max sampled lock wait {measured.lock_waits_s}, blocked_by {sorted(measured.blocked_by)}"
    )
    assert len(latencies) > 50, "the stream did not write throughout"
    assert max(latencies) < WRITE_BOUND_S, max(latencies)
    # The product's bound, on the server's clock: a write queued behind migrate's lock request
    # waits at most that request's lock_timeout.
    stream_wait = measured.lock_waits_s.get(STREAM_APP, 0.0)
    assert stream_wait < LOCK_TIMEOUT_S + LOCK_WAIT_TOLERANCE_S, measured.lock_waits_s
    # Evidence that the case happened: migrate waited for the held writer, and the stream
    # queued behind migrate's request.
    assert any((m, HELD_APP) in measured.blocked_by for m in MIGRATORS), measured.blocked_by
    assert any((STREAM_APP, m) in measured.blocked_by for m in MIGRATORS), measured.blocked_by


async def _install_case(url: str) -> None:
    """Install: the tables only."""


async def _reapply_case(url: str) -> None:
    """Re-apply: migrated, then the step's recorded checksum changed (an upgrade's new text)."""
    assert await _migrate_url(url) == [TRIGGER_STEP]
    await _sql(
        url,
        f"UPDATE retired_pod_gc_migrations SET sha256 = 'an earlier text' WHERE name = "
        f"'{TRIGGER_STEP}'",
    )


CASES = {"install": _install_case, "reapply": _reapply_case}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
async def test_migrate_behind_an_open_writer_applies_once_it_ends_and_never_queues_writers(
    tables_only: str, case: str
) -> None:
    await CASES[case](tables_only)
    result, measured = await _with_writers(
        tables_only,
        hold_s=HOLD_S,
        run=lambda: _migrate_url(tables_only, lock_timeout_s=LOCK_TIMEOUT_S, deadline_s=60.0),
    )
    assert result == [TRIGGER_STEP]
    _assert_writers_never_queued(measured)
    # Applied once the transaction ended, not before (it held a lock the step needs), and soon
    # after (the next attempt comes after at most the backoff's cap, 5 s).
    assert measured.held_ended_at is not None
    after_s = measured.run_ended_at - measured.held_ended_at
    print(
        f"migrate took {measured.run_ended_at - measured.run_started_at:.2f}s, ended "
        f"{after_s:.2f}s after the writer transaction"
    )
    assert 0 < after_s < 5.0 + 1.0
    conn = await asyncpg.connect(tables_only, timeout=10)
    try:
        assert [r["tgname"] for r in await conn.fetch(_TRIGGERS)] == [
            "retired_pod_gc_executions_deleted",
            "retired_pod_gc_executions_inserted",
            "retired_pod_gc_executions_updated",
        ]
        recorded = await conn.fetchval(
            "SELECT sha256 FROM retired_pod_gc_migrations WHERE name = $1", TRIGGER_STEP
        )
        assert recorded == Step(TRIGGER_STEP, render_trigger_sql(DEFAULT_CHANNEL)).sha256
    finally:
        await conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
async def test_migrate_past_its_deadline_stops_naming_the_holder_and_changes_nothing(
    tables_only: str, case: str, tmp_path: Path
) -> None:
    """As the Job runs it (the command, exit 3), with a deadline shorter than the hold."""
    await CASES[case](tables_only)
    before = await _catalog(tables_only)
    env = base_env(
        kubeconfig=tmp_path / "absent.yaml",
        database_url=tables_only,
        MIGRATE_DEADLINE_SECONDS=2,
        MIGRATE_LOCK_TIMEOUT_SECONDS=LOCK_TIMEOUT_S,
    )
    result, measured = await _with_writers(
        tables_only,
        hold_s=HOLD_S + 30,  # rolled back once migrate has stopped
        run=lambda: run_cli_async("migrate", env=env, timeout_s=60),
    )
    assert isinstance(result, CliResult)
    assert result.code == 3, result.stderr
    assert result.stdout == ""
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("retired-pod-gc: ")]
    print(f"\n{line}")
    assert "migrate stopped" in line and "ACCESS EXCLUSIVE on sandbox_k8s_executions" in line
    assert f"pid {measured.held_pid} (application_name '{HELD_APP}'" in line, line
    assert "nothing was changed" in line
    assert measured.held_ended_at is None or measured.held_ended_at > measured.run_ended_at
    _assert_writers_never_queued(measured)
    assert await _catalog(tables_only) == before


async def test_a_migrate_with_nothing_to_apply_takes_no_platform_lock(tables_only: str) -> None:
    """With a writer transaction holding a lock on the table, a no-change run returns at once
    (any lock on the table would have to wait for it: ACCESS EXCLUSIVE conflicts with it)."""
    assert await _migrate_url(tables_only) == [TRIGGER_STEP]
    before = await _catalog(tables_only)
    measured = Measured()
    async with held_writer(tables_only, measured):
        started = clock.now()
        applied = await _migrate_url(tables_only, lock_timeout_s=LOCK_TIMEOUT_S, deadline_s=30.0)
        elapsed_s = clock.now() - started
    assert applied == []
    assert elapsed_s < LOCK_TIMEOUT_S, elapsed_s
    assert await _catalog(tables_only) == before


async def test_the_migration_lock_is_not_waited_for_forever_either(tables_only: str) -> None:
    """Another run holding the migration lock: this one stops at its deadline naming it."""
    other = await asyncpg.connect(
        tables_only, timeout=10, server_settings={"application_name": "other-migrate"}
    )
    try:
        async with other.transaction():
            await other.execute("SELECT pg_advisory_xact_lock(x'727067636D696772'::bigint)")
            with pytest.raises(LockNotGranted) as caught:
                await _migrate_url(tables_only, lock_timeout_s=0.2, deadline_s=1.0)
            held_by = {h.pid: h.application_name for h in caught.value.holders}
            assert held_by == {other.get_server_pid(): "other-migrate"}
            assert "migration lock" in caught.value.lock
            assert caught.value.attempts >= 2
    finally:
        await other.close()
    assert await _catalog(tables_only) == []


# --- every step file: the locks it takes are the ones migrate takes up front ----------------

_OWN_LOCKS = """
SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND c.relname = ANY($1::text[])
"""


def _step_of(path: Path) -> Step:
    name = path.stem
    sql = render_trigger_sql(DEFAULT_CHANNEL) if name == TRIGGER_STEP else read_sql(name)
    return Step(name, sql)


@pytest.mark.parametrize("path", sorted(SQL_DIR.glob("*.sql")), ids=lambda p: p.stem)
async def test_each_step_locks_only_the_platform_tables_migrate_locks_up_front(
    tables_only: str, path: Path
) -> None:
    """Applied on the tables (and again, as a re-apply), a step's statements lock no platform
    table outside ``Step.tables``, which migrate locks first in ACCESS EXCLUSIVE (the strongest
    mode, so no statement can ask more of those). Over the files themselves, so a new step file
    is checked too."""
    step = _step_of(path)
    conn = await asyncpg.connect(tables_only, timeout=10)
    try:
        seen: set[tuple[str, str]] = set()
        for _ in range(2):
            async with conn.transaction():
                await conn.execute(step.sql)
                rows = await conn.fetch(_OWN_LOCKS, list(PLATFORM_TABLES))
                seen.update((r["relname"], r["mode"]) for r in rows)
        assert {table for table, _ in seen} <= set(step.tables), (seen, step.tables)
        if step.name == TRIGGER_STEP:
            # Applied again it drops existing triggers: why the up-front mode is the strongest.
            assert ("sandbox_k8s_executions", "AccessExclusiveLock") in seen
    finally:
        await conn.close()


def test_step_tables_ignore_comments_literals_and_function_bodies() -> None:
    sql = """
    -- sandboxes is mentioned here only
    /* and sandboxes here */
    CREATE OR REPLACE FUNCTION f() RETURNS trigger LANGUAGE plpgsql AS $fn$
    BEGIN PERFORM 1 FROM sandboxes; RETURN NULL; END $fn$;
    SELECT 'sandboxes';
    CREATE TRIGGER t AFTER UPDATE ON Sandbox_K8s_Executions FOR EACH ROW EXECUTE FUNCTION f();
    """
    assert Step("x", sql).tables == ("sandbox_k8s_executions",)
    assert Step("y", "CREATE INDEX i ON sandboxes (namespace)").tables == ("sandboxes",)
    assert Step("z", "CREATE TABLE sandboxes_archive (id text)").tables == ()
