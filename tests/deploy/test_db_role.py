"""deploy/db-role/role.sql on a real PostgreSQL: the controller reads and listens, nothing more.

The schema and trigger come from deploy/sql (what production installs); the queries are the
service's own (``service.pg.store.LOOKUP_SQL``, ``service.pg.cancel.retire_for_cancel``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from devtools.pg.throwaway import ThrowawayPostgres, run_async
from service.pg.cancel import retire_for_cancel
from service.pg.store import LOOKUP_SQL, MANAGED_BY_KUBERNETES
from tests.deploy.support import DEPLOY

ROLE_SQL = DEPLOY / "db-role" / "role.sql"
DATABASE = "space"
POD = "space-sbx-sb1-g1"


def as_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port}"))


async def _prepare(admin_url: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        for path in sorted((DEPLOY / "sql").glob("*.sql")):
            await conn.execute(path.read_text(encoding="utf-8"))
        # Twice: the file must be idempotent (re-run after an upgrade).
        await conn.execute(ROLE_SQL.read_text(encoding="utf-8"))
        await conn.execute(ROLE_SQL.read_text(encoding="utf-8"))
        await conn.execute(
            "INSERT INTO sandboxes VALUES ('sb1', 'sandboxes', 'kubernetes');"
            "INSERT INTO sandbox_k8s_executions"
            " (sandbox_id, generation, activation_attempt, pod_name, pod_kind,"
            " execution_state, active)"
            f" VALUES ('sb1', 1, 3, '{POD}', 'create', 'active', true)"
        )
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    """Superuser URL of a database with the schema, the trigger, the roles and one active row."""
    with ThrowawayPostgres() as pg:
        url = pg.create_database(DATABASE)
        run_async(lambda: _prepare(url))
        yield url


async def connect(url: str, user: str) -> asyncpg.Connection:
    return await asyncpg.connect(as_user(url, user), timeout=10)


@pytest.mark.anyio
async def test_controller_role_runs_the_service_lookup(database_url: str) -> None:
    conn = await connect(database_url, "retired_pod_gc")
    try:
        rows = await conn.fetch(LOOKUP_SQL, [POD], ["sandboxes"], MANAGED_BY_KUBERNETES)
    finally:
        await conn.close()
    assert [r["pod_name"] for r in rows] == [POD]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE sandbox_k8s_executions SET active = false",
        "DELETE FROM sandbox_k8s_executions",
        "INSERT INTO sandboxes VALUES ('x', 'sandboxes', 'kubernetes')",
        "UPDATE sandboxes SET managed_by = 'x'",
        "TRUNCATE sandbox_k8s_executions",
    ],
)
async def test_controller_role_cannot_write(database_url: str, statement: str) -> None:
    conn = await connect(database_url, "retired_pod_gc")
    try:
        # Read-only by default...
        with pytest.raises(asyncpg.exceptions.ReadOnlySQLTransactionError):
            await conn.execute(statement)
        # ...and without the privilege even when a session turns that off.
        await conn.execute("SET default_transaction_read_only = off")
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
            await conn.execute(statement)
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_controller_role_listens_to_the_trigger(database_url: str) -> None:
    listener = await connect(database_url, "retired_pod_gc")
    admin = await asyncpg.connect(database_url)
    received: asyncio.Queue[str] = asyncio.Queue()
    try:
        await listener.add_listener(
            "sandbox_execution_changed", lambda _c, _pid, _ch, payload: received.put_nowait(payload)
        )
        await admin.execute(
            "UPDATE sandbox_k8s_executions SET execution_state = 'replaced', active = false"
            " WHERE pod_name = $1",
            POD,
        )
        payload = await asyncio.wait_for(received.get(), timeout=10)
        await admin.execute(
            "UPDATE sandbox_k8s_executions SET execution_state = 'active', active = true"
            " WHERE pod_name = $1",
            POD,
        )
    finally:
        await listener.close()
        await admin.close()
    assert POD in payload and "replaced" in payload


@pytest.mark.anyio
async def test_controller_role_has_no_elevated_attributes(database_url: str) -> None:
    admin = await asyncpg.connect(database_url)
    try:
        rows = await admin.fetch(
            "SELECT rolname, rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls,"
            " rolcanlogin FROM pg_roles WHERE rolname LIKE 'retired_pod_gc%' ORDER BY rolname"
        )
    finally:
        await admin.close()
    logins = {r["rolname"] for r in rows if r["rolcanlogin"]}
    assert logins == {"retired_pod_gc", "retired_pod_gc_operator"}
    for row in rows:
        assert not any(
            row[k]
            for k in ("rolsuper", "rolcreatedb", "rolcreaterole", "rolreplication", "rolbypassrls")
        )


@pytest.mark.anyio
async def test_operator_role_runs_the_fenced_cancel_and_nothing_wider(database_url: str) -> None:
    conn = await connect(database_url, "retired_pod_gc_operator")
    admin = await asyncpg.connect(database_url)
    try:
        result = await retire_for_cancel(
            conn,
            namespaces=("sandboxes",),
            sandbox_id="sb1",
            generation=1,
            activation_attempt=3,
            timeout_s=10,
        )
        assert result.retired_now and result.state == "cancelled" and result.active is False
        for statement in (
            "UPDATE sandbox_k8s_executions SET generation = 2",
            "UPDATE sandbox_k8s_executions SET pod_name = 'other'",
            "DELETE FROM sandbox_k8s_executions",
            "INSERT INTO sandboxes VALUES ('x', 'sandboxes', 'kubernetes')",
            "UPDATE sandboxes SET namespace = 'x'",
        ):
            with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await admin.execute(
            "UPDATE sandbox_k8s_executions SET execution_state = 'active', active = true,"
            " retired_at = NULL WHERE pod_name = $1",
            POD,
        )
        await conn.close()
        await admin.close()


def test_role_sql_sets_no_password() -> None:
    text = ROLE_SQL.read_text(encoding="utf-8")
    code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
    assert "PASSWORD" not in code.upper()
    assert Path(ROLE_SQL).is_file()
