"""Execution rows from PostgreSQL: the ``ExecutionStore`` adapter.

One query asks for a batch of keys' pod names as an array, joined to ``sandboxes`` and scoped to
the configured sandbox namespaces and to Kubernetes-managed sandboxes; a row answers only the key
its namespace and pod name make up (:meth:`PgExecutionStore._query`), so a row of another
namespace with the same pod name never authorizes a delete. A row with a NULL where a value is
required is counted, logged and treated as absent (:func:`decode_row`: never reaped).

Errors (``service/pg/errors.py``): a failed query raises ``Unavailable`` (no answer;
``StoreClosed`` once :meth:`PgExecutionStore.aclose` has begun) or ``DatabaseError`` (the server
answered with an error); any other exception (a bug) reaches the caller as raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import anyio
import asyncpg

from service.config import DatabaseSettings
from service.domain import ExecutionRow, parse_execution_state, parse_pod_kind
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ExternalError
from service.kit.timeouts import fail_after
from service.metrics import PgMetrics
from service.pg.connect import pool_connector, pool_options
from service.pg.errors import DatabaseError, StoreClosed, database_errors, describe
from service.ports import RetiredRow

logger = logging.getLogger(__name__)

MANAGED_BY_KUBERNETES = "kubernetes"

LOOKUP_SQL = """
SELECT e.pod_name, s.namespace, e.sandbox_id, e.generation, e.activation_attempt,
       e.pod_kind, e.execution_state, e.active
FROM sandbox_k8s_executions AS e
JOIN sandboxes AS s ON s.id = e.sandbox_id
WHERE e.pod_name = ANY($1::text[])
  AND s.namespace = ANY($2::text[])
  AND s.managed_by = $3
"""

INVALID_STATEMENT_NAME = "26000"
"""SQLSTATE of "prepared statement ... does not exist": what a statement cached on one server
meets when a transaction-mode pooler lends the next query another."""

FRESH_SQL = "/* retired-pod-gc: final re-read */" + LOOKUP_SQL
"""The final re-read before a delete: the lookup's query, marked for the server's log."""

COLUMNS = (
    "pod_name",
    "namespace",
    "sandbox_id",
    "generation",
    "activation_attempt",
    "pod_kind",
    "execution_state",
    "active",
)
"""The columns :data:`LOOKUP_SQL` selects, in order, as :func:`decode_row` unpacks them."""


def decode_row(record: Sequence[Any]) -> ExecutionRow | None:
    """One joined row, its :data:`COLUMNS` in that order, as the domain type; ``None`` when a
    required column is NULL or mistyped (each one's exact type is checked: ``bool`` is not an
    ``int`` here, and a NULL is never a ``str``)."""
    pod_name, namespace, sandbox_id, generation, attempt, pod_kind, state, active = record[
        : len(COLUMNS)
    ]
    if (
        type(pod_name) is not str
        or type(namespace) is not str
        or type(sandbox_id) is not str
        or type(generation) is not int
        or type(attempt) is not int
        or type(active) is not bool
        or pod_kind is None
        or state is None
    ):
        return None
    return ExecutionRow(
        pod_name=pod_name,
        namespace=namespace,
        sandbox_id=sandbox_id,
        generation=generation,
        activation_attempt=attempt,
        pod_kind=parse_pod_kind(pod_kind),
        state=parse_execution_state(state),
        active=active,
        # The query only returns rows of Kubernetes-managed sandboxes.
        kubernetes_managed=True,
    )


class PgExecutionStore:
    """``ports.ExecutionStore`` over an asyncpg pool. Use ``async with`` or start()/aclose()."""

    def __init__(
        self, settings: DatabaseSettings, *, namespaces: Iterable[str], metrics: PgMetrics
    ) -> None:
        self._settings = settings
        self._namespaces = frozenset(namespaces)
        """The sandbox namespaces: a key of any other namespace has no row, without a query."""
        self._namespace_list = sorted(self._namespaces)
        self._metrics = metrics
        self._pool: asyncpg.Pool | None = None
        self._closed = False
        self._ping_log = CauseLog("database ping failed", logger)
        self._query_log = CauseLog("execution-row queries fail", logger)

    async def start(self) -> None:
        """Create the pool. Connections open lazily, so a database that is down does not fail
        the start; :meth:`ping` reports it and lookups raise ``Unavailable``."""
        if self._pool is not None:
            return
        s = self._settings
        self._pool = await asyncpg.create_pool(
            None,
            min_size=0,
            max_size=s.pool_size,
            command_timeout=s.statement_timeout_s,
            reset=_keep_session,
            connect=pool_connector(s, metrics=self._metrics),
            **pool_options(s, "retired-pod-gc"),
        )
        self._closed = False

    async def aclose(self) -> None:
        """Close the pool; later reads raise ``StoreClosed``. Idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        with anyio.CancelScope(shield=True):
            if pool is not None:
                with anyio.move_on_after(self._settings.connect_timeout_s) as scope:
                    await pool.close()
                if scope.cancelled_caught:
                    pool.terminate()

    async def __aenter__(self) -> PgExecutionStore:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def lookup_many(self, keys: Sequence[str]) -> dict[str, ExecutionRow]:
        self._open_pool()
        unique = list(dict.fromkeys(keys))
        size = max(1, self._settings.batch_max_size)
        out: dict[str, ExecutionRow] = {}
        for i in range(0, len(unique), size):
            out.update(await self._query(unique[i : i + size], kind="batch"))
        return out

    async def read_fresh(self, key: str) -> ExecutionRow | None:
        rows = await self._query([key], kind="fresh", sql=FRESH_SQL)
        return rows.get(key)

    async def ping(self) -> bool:
        """Readiness: ``SELECT 1`` on a pooled connection in time; sets ``database_up``."""
        ok = False
        if self._pool is not None:
            try:
                with database_errors():
                    rows = await self._fetch(self._pool, "SELECT 1")
                ok = len(rows) == 1 and rows[0][0] == 1
            except ExternalError as exc:
                self._ping_log.failed(cause_of(exc), describe(exc))
            else:
                self._ping_log.ok()
        self._metrics.database_up.set(1 if ok else 0)
        return ok

    @property
    def problem(self) -> str | None:
        """Why the last ping failed (``None`` after one that worked)."""
        return self._ping_log.cause

    async def notify(self, channel: str, payload: str) -> float:
        """``pg_notify(channel, payload)`` on a pooled connection, committed when it returns;
        answers ``pg_notification_queue_usage()`` (the notify listener's delivery probe)."""
        pool = self._pool
        if pool is None:
            raise StoreClosed("store closed")
        with database_errors():
            rows = await self._fetch(
                pool, "SELECT pg_notify($1, $2), pg_notification_queue_usage()", channel, payload
            )
        return float(rows[0][1])

    async def retired_rows(
        self, namespace: str, names: Sequence[str], *, kind: str = "kept_sweep"
    ) -> dict[str, RetiredRow]:
        """``ports.RetiredRowSource`` (:data:`RETIRED_SQL`); a namespace not configured, or no
        names, costs no query. Raises as :meth:`lookup_many`."""
        self._open_pool()
        if namespace not in self._namespaces or not names:
            return {}
        records = await self._rows(kind, RETIRED_SQL, list(names), namespace)
        out: dict[str, RetiredRow] = {}
        for record in records:
            row = decode_row(record)
            if row is None:
                self._metrics.rows_malformed.inc()
            elif row.namespace == namespace and not row.active:
                retired_at = record[len(COLUMNS)]
                out[row.key] = RetiredRow(
                    row, float(retired_at) if isinstance(retired_at, float | int) else None
                )
        return out

    def _open_pool(self) -> asyncpg.Pool:
        if self._closed:
            raise StoreClosed("store closed")
        if self._pool is None:
            raise RuntimeError("PgExecutionStore used before start()")
        return self._pool

    async def _fetch(self, pool: asyncpg.Pool, sql: str, *args: Any) -> list[Any]:
        """One statement on a pooled connection, the wait for the connection and the statement
        bounded by one scope; giving the connection back is never abandoned (a release cut off
        here would go on alone, its failure an exception nobody retrieves)."""
        s = self._settings
        conn: asyncpg.pool.PoolConnectionProxy[Any] | None = None
        try:
            with fail_after(s.connect_timeout_s) as bound:
                conn = await pool.acquire()
                bound.deadline = asyncio.get_running_loop().time() + s.statement_timeout_s + 1.0
                return list(await conn.fetch(sql, *args, timeout=s.statement_timeout_s))
        finally:
            if conn is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        with database_errors():
                            await pool.release(conn, timeout=s.statement_timeout_s)
                    except ExternalError as exc:  # asyncpg has terminated the connection
                        logger.debug("pooled connection dropped on release: %s", exc)

    async def _rows(
        self, kind: str, sql: str, names: list[str], namespaces: list[str] | str
    ) -> list[Any]:
        """One row query of ``kind`` (``row_queries{kind}``) for the pod ``names`` in
        ``namespaces``; a failure is counted, logged once per cause and raised."""
        pool = self._open_pool()
        self._metrics.row_queries.labels(kind=kind).inc()
        try:
            with database_errors():
                records = await self._fetch(pool, sql, names, namespaces, MANAGED_BY_KUBERNETES)
        except ExternalError as exc:
            self._metrics.row_query_errors.inc()
            cause = describe(exc)
            if (
                isinstance(exc, DatabaseError)
                and exc.sqlstate == INVALID_STATEMENT_NAME
                and not self._settings.transaction_pooler
            ):
                cause += (
                    " (a prepared statement vanished: the URL goes through a transaction-mode "
                    "pooler; set DB_TRANSACTION_POOLER=true)"
                )
            self._query_log.failed(cause_of(exc), cause)
            raise
        self._query_log.ok()
        return records

    async def _query(
        self, keys: list[str], *, kind: str, sql: str = LOOKUP_SQL
    ) -> dict[str, ExecutionRow]:
        """Rows by pod key: a key of a namespace not configured costs no query; a row is kept
        under the key its namespace and pod name make up, when that key was asked for."""
        self._open_pool()
        asked = {key for key in keys if key.partition("/")[0] in self._namespaces}
        if not asked:
            return {}
        names = [key.partition("/")[2] for key in asked]
        out: dict[str, ExecutionRow] = {}
        for record in await self._rows(kind, sql, names, self._namespace_list):
            row = decode_row(record)
            if row is None:
                self._metrics.rows_malformed.inc()
                logger.warning(
                    "malformed execution row skipped (treated as absent): pod_name=%r",
                    record[0],
                )
            elif row.key in asked:
                out[row.key] = row
        return out


RETIRED_SQL = """/* retired-pod-gc: retired but kept */
SELECT e.pod_name, s.namespace, e.sandbox_id, e.generation, e.activation_attempt,
       e.pod_kind, e.execution_state, e.active,
       extract(epoch FROM e.retired_at)::float8 AS retired_at_s
FROM sandbox_k8s_executions AS e
JOIN sandboxes AS s ON s.id = e.sandbox_id
WHERE e.pod_name = ANY($1::text[])
  AND NOT e.active
  AND s.namespace = $2
  AND s.managed_by = $3
"""
"""The retired-but-kept sweep: the inactive rows among the pod names of one namespace's cache, in
one statement whatever their number (only retired rows come back: as small as the leak)."""


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """The pool's reset on release: nothing (the pool's queries leave no session state behind,
    and the default reset, ``RESET ALL``, ..., would be a round trip per query for nothing)."""
