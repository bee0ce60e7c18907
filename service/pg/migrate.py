"""Applying the versioned SQL under ``service/pg/sql`` (shipped as ``deploy/sql``).

Each file is one named step. A step is recorded in ``retired_pod_gc_migrations`` with the
SHA-256 of the SQL as rendered (the channel name is part of it); a step whose record matches is
skipped, so running ``migrate`` twice changes nothing, not even catalog rows. A step whose
rendered SQL differs (a new version of the file, another channel) is applied again: every file
is itself idempotent. The whole run is one transaction under an advisory lock, so two replicas
migrating at once serialise. A step the server refuses raises :class:`MigrationError` (nothing of
the run committed); a database that gives no answer raises the kit's ``Unavailable``
(``service/pg/errors.py``): whether the run committed is then unknown, and running again is safe.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import re
from dataclasses import dataclass

import asyncpg

from service.config import DB_CONNECT_TIMEOUT_SECONDS
from service.pg.errors import DatabaseError, database_errors

logger = logging.getLogger(__name__)

DEFAULT_CHANNEL = "sandbox_execution_changed"
SCHEMA_STEP = "0001_dev_schema"
TRIGGER_STEP = "0003_notify_statement_trigger"
"""The trigger step. It supersedes ``0002_notify_trigger`` (whose per-row triggers it drops), so a
run never applies 0002: a database that has 0002 recorded gets 0003 applied over it."""
_TRIGGER_ARGUMENTS = 5
"""The channel literals in the trigger file: one pg_notify call per trigger event for a one-row
statement, and two in the loop that sends every other statement's payloads."""
_CHANNEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_DEFAULT_CHANNEL_LITERAL = f"pg_notify('{DEFAULT_CHANNEL}', "
# Arbitrary but fixed: pg_advisory_xact_lock key shared by every migrating replica.
_LOCK_KEY = 0x72706763_6D696772  # "rpgcmigr"

_RECORD_TABLE = """
CREATE TABLE IF NOT EXISTS retired_pod_gc_migrations (
    name        text PRIMARY KEY,
    sha256      text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)
"""


class MigrationError(RuntimeError):
    """A step failed; nothing of the run was committed."""


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    sql: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def read_sql(name: str) -> str:
    """The text of ``sql/<name>.sql`` inside the package."""
    return importlib.resources.files("service.pg").joinpath("sql", f"{name}.sql").read_text("utf-8")


def render_trigger_sql(channel: str) -> str:
    """The trigger file with ``channel`` as the NOTIFY channel of its ``pg_notify`` calls."""
    if not _CHANNEL.fullmatch(channel):
        raise ValueError(f"notify channel must be an SQL identifier, got {channel!r}")
    sql = read_sql(TRIGGER_STEP)
    if sql.count(_DEFAULT_CHANNEL_LITERAL) != _TRIGGER_ARGUMENTS:
        raise MigrationError(
            f"{TRIGGER_STEP}.sql: expected {_TRIGGER_ARGUMENTS} channel literals to substitute"
        )
    # The identifier regex admits no quote, so the literal needs no escaping.
    return sql.replace(_DEFAULT_CHANNEL_LITERAL, f"pg_notify('{channel}', ")


def steps(*, channel: str, with_schema: bool) -> list[Step]:
    """The steps a run applies, in order."""
    out: list[Step] = []
    if with_schema:
        out.append(Step(SCHEMA_STEP, read_sql(SCHEMA_STEP)))
    out.append(Step(TRIGGER_STEP, render_trigger_sql(channel)))
    return out


async def migrate(
    conn_or_url: asyncpg.Connection | str,
    *,
    channel: str,
    with_schema: bool,
    connect_timeout_s: float = DB_CONNECT_TIMEOUT_SECONDS.default,
) -> list[str]:
    """Apply the trigger (and, with ``with_schema``, the dev schema); return the steps applied.

    An empty list means everything was already in place. Given a URL, the connection is opened
    within ``connect_timeout_s`` (``DB_CONNECT_TIMEOUT_SECONDS``) and closed afterwards. Raises
    :class:`MigrationError` or ``Unavailable`` (see the module docstring).
    """
    planned = steps(channel=channel, with_schema=with_schema)
    if isinstance(conn_or_url, str):
        with database_errors():
            try:
                conn = await asyncpg.connect(conn_or_url, timeout=connect_timeout_s)
            except TimeoutError as exc:
                raise TimeoutError(f"no connection within {connect_timeout_s:g}s") from exc
        try:
            return await _apply(conn, planned)
        finally:
            await conn.close(timeout=connect_timeout_s)
    return await _apply(conn_or_url, planned)


async def _apply(conn: asyncpg.Connection, planned: list[Step]) -> list[str]:
    applied: list[str] = []
    try:
        with database_errors():
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
                exists = await conn.fetchval(
                    "SELECT to_regclass('retired_pod_gc_migrations') IS NOT NULL"
                )
                if not exists:
                    await conn.execute(_RECORD_TABLE)
                recorded: dict[str, str] = {
                    r["name"]: r["sha256"]
                    for r in await conn.fetch("SELECT name, sha256 FROM retired_pod_gc_migrations")
                }
                for step in planned:
                    if recorded.get(step.name) == step.sha256:
                        continue
                    await conn.execute(step.sql)
                    await conn.execute(
                        """
                        INSERT INTO retired_pod_gc_migrations (name, sha256) VALUES ($1, $2)
                        ON CONFLICT (name)
                        DO UPDATE SET sha256 = EXCLUDED.sha256, applied_at = now()
                        """,
                        step.name,
                        step.sha256,
                    )
                    applied.append(step.name)
    except DatabaseError as exc:
        raise MigrationError(f"migration failed: {exc}") from exc
    for name in applied:
        logger.info("migration step applied: %s", name)
    if not applied:
        logger.info("migrations: nothing to apply")
    return applied
