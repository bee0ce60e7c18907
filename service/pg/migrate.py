"""Applying the versioned SQL under ``service/pg/sql`` (shipped as ``deploy/sql``).

Each file is one named step, recorded in ``retired_pod_gc_migrations`` with the SHA-256 of the
SQL as rendered (the channel name is part of it): a step whose record matches is skipped, so a
second run changes nothing, not even catalog rows; one whose rendered SQL differs is applied
again (every file is itself idempotent).

Never in the platform's writers' way (docs/operations.md, "migrate and the platform's writers"):
a run is a series of attempts, each one transaction that asks every lock with a short
``lock_timeout``: the migration's advisory lock, then, only when a step is to be applied, the
platform tables the steps change, all at once and in the strongest mode. A lock not granted in
time rolls the attempt back; it is tried again with the kit's backoff until the run's deadline,
then :class:`LockNotGranted` names the lock and the sessions holding it, nothing changed. A
writer therefore queues behind ``migrate`` for at most one ``lock_timeout``, and a run that
changes nothing takes no lock on a platform table.

A step the server refuses raises :class:`MigrationError` (nothing committed); no answer raises
the kit's ``Unavailable``: whether the run committed is then unknown, and running again is safe.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import asyncpg

from service.config import (
    DB_CONNECT_TIMEOUT_SECONDS,
    DB_STATEMENT_TIMEOUT_SECONDS,
    MIGRATE_DEADLINE_SECONDS,
    MIGRATE_LOCK_TIMEOUT_SECONDS,
)
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.pg.errors import DatabaseError, database_errors

logger = logging.getLogger(__name__)

DEFAULT_CHANNEL = "sandbox_execution_changed"
SCHEMA_STEP = "0001_dev_schema"
TRIGGER_STEP = "0003_notify_statement_trigger"
"""The trigger step; it drops 0002's per-row triggers, so a run never applies 0002."""
_TRIGGER_ARGUMENTS = 5
"""The channel literals of the trigger file's ``pg_notify`` calls."""
_CHANNEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_DEFAULT_CHANNEL_LITERAL = f"pg_notify('{DEFAULT_CHANNEL}', "
# Arbitrary but fixed: pg_advisory_xact_lock key shared by every migrating replica.
_LOCK_KEY = 0x72706763_6D696772  # "rpgcmigr"
MIGRATION_LOCK = "the migration lock (pg_advisory_xact_lock)"
"""How the advisory lock is named in messages."""
PLATFORM_TABLES = ("sandbox_k8s_executions", "sandboxes")
"""The platform's tables, locked in this order (one order for every run: no deadlock)."""
_TABLE_LOCK_MODE = "ACCESS EXCLUSIVE"
"""The strongest mode (``DROP TRIGGER`` takes it), so a step asks for nothing more once the table
is locked; every session holding any lock on the table conflicts with it.
tests/integration/test_pg_migrate_locks.py checks that no statement of ``sql/`` asks for more."""
_RETRYABLE = frozenset({"55P03", "40P01"})
"""lock_not_available (lock_timeout) and deadlock_detected: the attempt is tried again."""
_RETRY = Backoff(initial_s=0.25, max_s=5.0, jitter=0.5)
"""Between attempts: short at first (a writer transaction ends in milliseconds), at most 5 s, so
that the writers queued behind each failed request drain between two of them."""
# Outside a statement's own text: comments, string literals, quoted identifiers kept apart, and
# dollar-quoted bodies (a function body's queries take no lock when the function is created).
_NOT_STATEMENT_TEXT = re.compile(
    r"--[^\n]*|/\*.*?\*/|'(?:[^']|'')*'|(\$[A-Za-z_0-9]*\$).*?\1", re.DOTALL
)

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
class Holder:
    """A session holding a lock that ``migrate`` asked for, as ``pg_stat_activity`` shows it."""

    pid: int | None
    """``None``: a prepared transaction (``pg_prepared_xacts``), which has no session."""
    application_name: str
    user: str
    state: str
    transaction_age_s: float | None
    """Since its transaction began (``xact_start``); ``None`` outside a transaction."""
    modes: str
    """The modes it holds, comma-separated (``RowExclusiveLock``, ...)."""

    def describe(self) -> str:
        if self.pid is None:
            return f"a prepared transaction holding {self.modes} (see pg_prepared_xacts)"
        age = (
            "no transaction"
            if self.transaction_age_s is None
            else f"transaction open {self.transaction_age_s:.1f}s"
        )
        return (
            f"pid {self.pid} (application_name {self.application_name!r}, user "
            f"{self.user!r}, state {self.state or 'unknown'}, {age}, holding {self.modes})"
        )


class LockNotGranted(MigrationError):
    """A lock not granted before the run's deadline (the run stopped, nothing changed): ``lock``
    names it (:data:`MIGRATION_LOCK` or ``<mode> on <tables>``); ``holders`` are the sessions that
    held a conflicting lock when the last attempt gave up (empty when they had ended by then)."""

    def __init__(
        self, *, lock: str, holders: tuple[Holder, ...], attempts: int, waited_s: float
    ) -> None:
        named = "; ".join(h.describe() for h in holders) or "none left when it was looked up"
        super().__init__(
            f"{lock} not granted within {waited_s:.1f}s ({attempts} attempts, each with a short "
            f"lock_timeout); nothing was changed; held by: {named}"
        )
        self.lock = lock
        self.holders = holders
        self.attempts = attempts
        self.waited_s = waited_s


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    sql: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def tables(self) -> tuple[str, ...]:
        """The platform tables its statements name (comments, literals and function bodies
        left out), in :data:`PLATFORM_TABLES` order."""
        text = _NOT_STATEMENT_TEXT.sub(" ", self.sql).lower()
        return tuple(t for t in PLATFORM_TABLES if re.search(rf"(?<![\w$]){t}(?![\w$])", text))


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
    lock_timeout_s: float = MIGRATE_LOCK_TIMEOUT_SECONDS.default,
    deadline_s: float = MIGRATE_DEADLINE_SECONDS.default,
    statement_timeout_s: float = DB_STATEMENT_TIMEOUT_SECONDS.default,
) -> list[str]:
    """Apply the trigger (and, with ``with_schema``, the dev schema); return the steps applied
    (none: everything was in place). A connection opened from a URL is closed afterwards; no
    attempt starts after ``deadline_s``. Raises :class:`LockNotGranted`, :class:`MigrationError`
    or ``Unavailable`` (see the module docstring)."""
    planned = steps(channel=channel, with_schema=with_schema)
    bounds = _Bounds(
        lock_timeout_s=lock_timeout_s,
        deadline_s=deadline_s,
        statement_timeout_s=statement_timeout_s,
    )
    if isinstance(conn_or_url, str):
        with database_errors():
            try:
                conn = await asyncpg.connect(conn_or_url, timeout=connect_timeout_s)
            except TimeoutError as exc:
                raise TimeoutError(f"no connection within {connect_timeout_s:g}s") from exc
        try:
            return await _apply(conn, planned, bounds)
        finally:
            await conn.close(timeout=connect_timeout_s)
    return await _apply(conn_or_url, planned, bounds)


@dataclass(frozen=True, slots=True)
class _Bounds:
    lock_timeout_s: float = MIGRATE_LOCK_TIMEOUT_SECONDS.default
    deadline_s: float = MIGRATE_DEADLINE_SECONDS.default
    statement_timeout_s: float = DB_STATEMENT_TIMEOUT_SECONDS.default

    def settings_sql(self) -> str:
        """The attempt's bounds, for its transaction only. ``idle_in_transaction_session_timeout``
        too: a client that vanishes without a reset while its attempt holds a table lock would
        otherwise keep the writers out until TCP keepalive noticed."""
        lock_ms = max(1, round(self.lock_timeout_s * 1000))
        statement_ms = max(1, round(self.statement_timeout_s * 1000))
        return (
            f"SET LOCAL lock_timeout = {lock_ms}; "
            f"SET LOCAL statement_timeout = {statement_ms}; "
            f"SET LOCAL idle_in_transaction_session_timeout = {statement_ms}"
        )


@dataclass(frozen=True, slots=True)
class _Asked:
    """The lock an attempt was asking for when it gave up."""

    lock: str
    tables: tuple[str, ...] = ()
    """Empty: the migration lock."""


class _NotGranted(Exception):
    def __init__(self, asked: _Asked, cause: asyncpg.PostgresError) -> None:
        super().__init__(str(cause))
        self.asked = asked


async def _apply(
    conn: asyncpg.Connection, planned: list[Step], bounds: _Bounds | None = None
) -> list[str]:
    bounds = bounds or _Bounds()
    started = clock.now()
    deadline = started + bounds.deadline_s
    attempts = Attempts(_RETRY)
    while True:
        try:
            applied = await _attempt(conn, planned, bounds)
            break
        except _NotGranted as exc:
            refused = exc
        holders = await _holders(conn, refused.asked)
        shown = [h.describe() for h in holders]
        count = attempts.failures + 1
        if clock.now() >= deadline:
            err = LockNotGranted(
                lock=refused.asked.lock,
                holders=holders,
                attempts=count,
                waited_s=clock.now() - started,
            )
            logger.error("migrate stopped: %s", err, extra={"lock": err.lock, "holders": shown})
            raise err from refused
        delay_s = min(attempts.next_delay(), max(0.0, deadline - clock.now()))
        logger.warning(
            "migrate: %s not granted within lock_timeout (held by: %s); attempt %d rolled back, "
            "the next in %.2fs",
            refused.asked.lock,
            "; ".join(shown) or "none left",
            count,
            delay_s,
            extra={"lock": refused.asked.lock, "holders": shown},
        )
        await clock.sleep_until(clock.now() + delay_s)
    for name in applied:
        logger.info("migration step applied: %s", name)
    if not applied:
        logger.info("migrations: nothing to apply")
    return applied


async def _attempt(conn: asyncpg.Connection, planned: list[Step], bounds: _Bounds) -> list[str]:
    """One attempt, one transaction (see the module docstring); raises :class:`_NotGranted` when a
    lock was not granted within the lock_timeout (the transaction rolled back)."""
    applied: list[str] = []
    asked = _Asked(MIGRATION_LOCK)
    try:
        with database_errors():
            async with conn.transaction():
                await conn.execute(bounds.settings_sql())
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
                pending = [s for s in planned if recorded.get(s.name) != s.sha256]
                if not pending:
                    return []
                tables = await _existing(conn, (t for s in pending for t in s.tables))
                if tables:
                    asked = _Asked(f"{_TABLE_LOCK_MODE} on {', '.join(tables)}", tables)
                    await conn.execute(f"LOCK TABLE {', '.join(tables)} IN {_TABLE_LOCK_MODE} MODE")
                asked = _Asked("a lock one of the steps asked for")
                for step in pending:
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
        cause = exc.__cause__
        if exc.sqlstate in _RETRYABLE and isinstance(cause, asyncpg.PostgresError):
            raise _NotGranted(asked, cause) from cause
        raise MigrationError(f"migration failed: {exc}") from exc
    return applied


async def _existing(conn: asyncpg.Connection, tables: Iterable[str]) -> tuple[str, ...]:
    """Those of ``tables`` that exist (a step may create them), in :data:`PLATFORM_TABLES` order."""
    named = set(tables)
    wanted = [t for t in PLATFORM_TABLES if t in named]
    if not wanted:
        return ()
    rows = await conn.fetch(
        "SELECT t FROM unnest($1::text[]) AS t WHERE to_regclass(t) IS NOT NULL", wanted
    )
    found = {r["t"] for r in rows}
    return tuple(t for t in wanted if t in found)


_HOLDERS = """
SELECT l.pid, coalesce(a.application_name, '') AS application_name,
       coalesce(a.usename::text, '') AS "user", coalesce(a.state, '') AS state,
       extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS transaction_age_s,
       string_agg(DISTINCT l.mode, ',') AS modes
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.granted
  AND l.pid IS DISTINCT FROM pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND CASE WHEN cardinality($1::text[]) > 0
           THEN l.locktype = 'relation'
                AND l.relation = ANY(ARRAY(SELECT to_regclass(t)::oid FROM unnest($1::text[]) t))
           ELSE l.locktype = 'advisory' AND l.classid = $2 AND l.objid = $3 AND l.objsubid = 1
      END
GROUP BY 1, 2, 3, 4, 5
ORDER BY transaction_age_s DESC NULLS LAST, l.pid
"""
"""The sessions holding a lock that conflicts with the one asked: any lock on the tables (the
mode asked conflicts with every mode), or the migration lock."""


async def _holders(conn: asyncpg.Connection, asked: _Asked) -> tuple[Holder, ...]:
    """Who holds ``asked`` now (after the attempt's rollback); empty when it cannot be told (a
    lock a step asked for is not known by name)."""
    if asked.lock != MIGRATION_LOCK and not asked.tables:
        return ()
    high, low = divmod(_LOCK_KEY, 1 << 32)
    with database_errors():
        rows = await conn.fetch(_HOLDERS, list(asked.tables), high, low)
    return tuple(Holder(**r) for r in rows)
