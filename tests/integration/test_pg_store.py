"""``PgExecutionStore`` against a real server: scoping, batching, decoding, errors.

Errors: every expected failure of the database leaves the store as a kit error (``Unavailable``
when there was no answer, ``DatabaseError`` when the server answered with one), never as
asyncpg's or the socket's own exception; a bug (here: an argument asyncpg cannot encode) is not
a failure of the database and leaves as it was raised.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from devtools.pg.throwaway import ThrowawayPostgres
from service.domain import ExecutionRow, ExecutionState, PodKind
from service.kit.errors import ExternalError, Unavailable
from service.metrics import PgMetrics
from service.pg.errors import DRIVER_ERRORS, DatabaseError, StoreClosed
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from service.pg.store import LOOKUP_SQL, PgExecutionStore
from tests.pgfixtures import (
    NAMESPACE,
    db_settings,
    metric,
    seed_execution,
    seed_executions,
    seed_sandbox,
)

pytestmark = pytest.mark.anyio

BATCH = "retired_pod_gc_row_queries_total"


def _store(
    url: str,
    registry: CollectorRegistry,
    *,
    namespaces: tuple[str, ...] = (NAMESPACE,),
    **overrides: object,
) -> PgExecutionStore:
    return PgExecutionStore(
        db_settings(url, **overrides), namespaces=namespaces, metrics=PgMetrics(registry)
    )


def key(name: str, namespace: str = NAMESPACE) -> str:
    """The pod key the store is asked with."""
    return f"{namespace}/{name}"


def keys(names: list[str]) -> list[str]:
    return [key(n) for n in names]


async def lookup(store: PgExecutionStore, pod_key: Any) -> ExecutionRow | None:
    """One key's row through the batch lookup (a batch of one)."""
    return (await store.lookup_many([pod_key])).get(pod_key)


async def _server_lookup_calls(conn: asyncpg.Connection) -> int:
    """How many times this database ran the lookup statement (pg_stat_statements)."""
    calls = await conn.fetchval(
        """
        SELECT coalesce(sum(calls), 0)::int FROM pg_stat_statements
        WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND query LIKE '%WHERE e.pod_name = ANY($1::text[])%'
        """
    )
    assert isinstance(calls, int)
    return calls


async def test_lookup_is_scoped_to_namespace_and_kubernetes_managed_sandboxes(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "ours")
    await seed_sandbox(pg_conn, "other-ns", namespace="elsewhere")
    await seed_sandbox(pg_conn, "vm-only", managed_by="firecracker-direct")
    await seed_execution(
        pg_conn,
        pod_name="space-sbx-ours-g2",
        sandbox_id="ours",
        generation=2,
        activation_attempt=3,
        pod_kind="restore",
        execution_state="suspended",
        active=False,
    )
    await seed_execution(pg_conn, pod_name="space-sbx-other-ns-g1", sandbox_id="other-ns")
    await seed_execution(pg_conn, pod_name="space-sbx-vm-only-g1", sandbox_id="vm-only")
    registry = CollectorRegistry()
    async with _store(pg_url, registry) as store:
        expected = ExecutionRow(
            pod_name="space-sbx-ours-g2",
            namespace=NAMESPACE,
            sandbox_id="ours",
            generation=2,
            activation_attempt=3,
            pod_kind=PodKind.RESTORE,
            state=ExecutionState.SUSPENDED,
            active=False,
            kubernetes_managed=True,
        )
        assert await lookup(store, key("space-sbx-ours-g2")) == expected
        assert await store.read_fresh(key("space-sbx-ours-g2")) == expected
        for absent in ("space-sbx-other-ns-g1", "space-sbx-vm-only-g1", "space-sbx-missing-g1"):
            assert await lookup(store, key(absent)) is None
            assert await store.read_fresh(key(absent)) is None
        many = await store.lookup_many(
            keys(["space-sbx-ours-g2", "space-sbx-other-ns-g1", "space-sbx-vm-only-g1", "nope"])
        )
        assert many == {key("space-sbx-ours-g2"): expected}
    assert metric(registry, BATCH, kind="fresh") == 4


async def test_a_row_of_another_namespace_never_answers_for_a_pod_of_the_same_name(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # Two sandbox namespaces. The one row of this pod name belongs to a sandbox of tenant-b
    # (retired: it would authorize a delete). A pod of the same name in NAMESPACE must find no
    # row, by any read: were the row matched by name alone, it could delete the wrong pod.
    await seed_sandbox(pg_conn, "shared", namespace="tenant-b")
    await seed_execution(
        pg_conn,
        pod_name="space-sbx-shared-g1",
        sandbox_id="shared",
        execution_state="suspended",
        active=False,
    )
    await seed_sandbox(pg_conn, "far", namespace="unwatched")
    await seed_execution(
        pg_conn,
        pod_name="space-sbx-far-g1",
        sandbox_id="far",
        execution_state="suspended",
        active=False,
    )
    registry = CollectorRegistry()
    async with _store(pg_url, registry, namespaces=(NAMESPACE, "tenant-b")) as store:
        ours, theirs = key("space-sbx-shared-g1"), key("space-sbx-shared-g1", "tenant-b")
        assert await lookup(store, ours) is None
        assert await store.read_fresh(ours) is None
        assert await store.lookup_many([ours]) == {}
        row = await lookup(store, theirs)
        assert row is not None and (row.namespace, row.active) == ("tenant-b", False)
        assert await store.read_fresh(theirs) == row
        assert await store.lookup_many([ours, theirs]) == {theirs: row}
        # A namespace not configured has no row, and costs no query.
        queries = metric(registry, BATCH, kind="batch") + metric(registry, BATCH, kind="fresh")
        far = key("space-sbx-far-g1", "unwatched")
        assert await lookup(store, far) is None
        assert await store.read_fresh(far) is None
        assert await store.lookup_many([far, "malformed"]) == {}
        assert metric(registry, BATCH, kind="batch") + metric(registry, BATCH, kind="fresh") == (
            queries
        )


async def test_thousand_names_resolve_in_one_query(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    names = await seed_executions(pg_conn, [f"s{i:04d}" for i in range(1000)])
    registry = CollectorRegistry()
    async with _store(pg_url, registry, batch_max_size=1000) as store:
        calls_before = await _server_lookup_calls(pg_conn)
        rows = await store.lookup_many(keys(names))
        assert set(rows) == set(keys(names))
        assert all(r.state is ExecutionState.SUSPENDED and not r.active for r in rows.values())
        assert metric(registry, BATCH, kind="batch") == 1
        assert await _server_lookup_calls(pg_conn) - calls_before == 1


async def test_a_lookup_of_many_keys_is_split_into_batches_of_the_batch_size(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    names = await seed_executions(pg_conn, [f"b{i:03d}" for i in range(100)])
    registry = CollectorRegistry()
    async with _store(pg_url, registry, batch_max_size=30) as store:
        calls_before = await _server_lookup_calls(pg_conn)
        rows = await store.lookup_many(keys(names) + keys(names))  # each key asked twice
        assert sorted(rows) == sorted(keys(names))
        # ceil(100 / 30) = 4 queries, none above the batch bound.
        assert metric(registry, BATCH, kind="batch") == 4
        assert await _server_lookup_calls(pg_conn) - calls_before == 4


async def test_names_with_quotes_and_unicode_round_trip(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    odd = ["it's", 'say "hi"', "back\\slash", "ünïcødé-名前-🚀", "semi;colon--", "x' OR '1'='1"]
    for i, name in enumerate(odd):
        await seed_sandbox(pg_conn, f"odd{i}")
        await seed_execution(pg_conn, pod_name=name, sandbox_id=f"odd{i}")
    registry = CollectorRegistry()
    async with _store(pg_url, registry) as store:
        rows = await store.lookup_many(keys([*odd, "it", "名前"]))
        assert sorted(rows) == sorted(keys(odd))
        for name in odd:
            row = await lookup(store, key(name))
            assert row is not None and row.pod_name == name
            fresh = await store.read_fresh(key(name))
            assert fresh is not None and fresh.pod_name == name


async def test_a_name_holding_a_comma_is_asked_for_whole(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # The pod names travel as an array: a name is never split into parts, whatever it holds
    # (no Kubernetes name holds a comma; a row that does answers only its own name).
    joined = "left,right"
    for i, name in enumerate([joined, "left", "right"]):
        await seed_sandbox(pg_conn, f"sep{i}")
        await seed_execution(pg_conn, pod_name=name, sandbox_id=f"sep{i}")
    registry = CollectorRegistry()
    async with _store(pg_url, registry) as store:
        row = await lookup(store, key(joined))
        assert row is not None and row.pod_name == joined
        assert list(await store.lookup_many(keys([joined]))) == [key(joined)]
        assert sorted(await store.lookup_many(keys(["left", "right"]))) == keys(["left", "right"])
        assert await store.read_fresh(key(joined)) == row


async def test_a_key_answers_only_to_the_row_whose_namespace_and_name_make_it_up(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # A key is split at its first '/': the parts of a key that is not exactly "namespace/name"
    # must not find the row they would name on their own.
    await seed_sandbox(pg_conn, "whole")
    await seed_execution(pg_conn, pod_name="pod", sandbox_id="whole")
    registry = CollectorRegistry()
    async with _store(pg_url, registry) as store:
        odd = [f"{NAMESPACE}/pod/extra", f"{NAMESPACE}/", f"{NAMESPACE}/pod ", f"{NAMESPACE}//pod"]
        assert await store.lookup_many(odd) == {}
        for one in odd:
            assert await lookup(store, one) is None
            assert await store.read_fresh(one) is None
        row = await store.read_fresh(key("pod"))
        assert row is not None and await store.lookup_many([*odd, key("pod")]) == {key("pod"): row}


async def test_malformed_row_is_counted_and_treated_as_absent(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # Production's schema may allow NULLs the dev schema forbids.
    await pg_conn.execute("ALTER TABLE sandbox_k8s_executions ALTER generation DROP NOT NULL")
    await seed_sandbox(pg_conn, "good")
    await seed_sandbox(pg_conn, "bad")
    await seed_execution(pg_conn, pod_name="good-pod", sandbox_id="good")
    await seed_execution(pg_conn, pod_name="bad-pod", sandbox_id="bad")
    await pg_conn.execute(
        "UPDATE sandbox_k8s_executions SET generation = NULL WHERE pod_name = 'bad-pod'"
    )
    registry = CollectorRegistry()
    async with _store(pg_url, registry) as store:
        assert set(await store.lookup_many(keys(["good-pod", "bad-pod"]))) == {key("good-pod")}
        assert await lookup(store, key("bad-pod")) is None
        assert await store.read_fresh(key("bad-pod")) is None
    assert metric(registry, "retired_pod_gc_rows_malformed_total") == 3


async def test_a_failed_query_raises_one_external_error_and_the_store_recovers(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    names = await seed_executions(pg_conn, ["l1", "l2", "l3"])
    registry = CollectorRegistry()
    async with _store(pg_url, registry, statement_timeout_s=0.3) as store:
        # An exclusive lock held elsewhere makes the lookup outlive its statement timeout.
        async with pg_conn.transaction():
            await pg_conn.execute("LOCK TABLE sandbox_k8s_executions IN ACCESS EXCLUSIVE MODE")
            with anyio.fail_after(5), pytest.raises(ExternalError) as raised:
                await store.lookup_many(keys(names))
        # The server's statement timeout (a DatabaseError) or the client's (Unavailable),
        # whichever came first: one failed query for the three keys.
        assert isinstance(raised.value, Unavailable | DatabaseError)
        assert metric(registry, "retired_pod_gc_row_query_errors_total") == 1
        assert metric(registry, BATCH, kind="batch") == 1
        # The store recovers once the lock is gone.
        row = await lookup(store, key(names[0]))
        assert row is not None


@contextlib.contextmanager
def _refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connect there is refused, and nobody else can
    take the port while the test runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _reads(store: PgExecutionStore, pod_key: Any) -> dict[str, Callable[[], Awaitable[object]]]:
    """Each read of the store, by name (the batch lookup, the fresh read)."""
    return {
        "lookup_many": lambda: store.lookup_many([pod_key]),
        "read_fresh": lambda: store.read_fresh(pod_key),
    }


async def test_a_refused_connection_raises_unavailable_not_the_socket_error() -> None:
    registry = CollectorRegistry()
    with _refusing_port() as port:
        url = f"postgresql://postgres@127.0.0.1:{port}/none"
        async with _store(url, registry, connect_timeout_s=1.0) as store:
            assert await store.ping() is False
            assert metric(registry, "retired_pod_gc_database_up") == 0
            for what, read in _reads(store, key("x")).items():
                with pytest.raises(Unavailable) as raised:
                    await read()
                assert not isinstance(raised.value, DRIVER_ERRORS), what
                assert isinstance(raised.value.__cause__, ConnectionRefusedError), what
    assert metric(registry, "retired_pod_gc_row_query_errors_total") == 2


async def test_reads_raise_unavailable_once_the_server_is_stopped() -> None:
    # Its own server: stopping the session's would disturb other tests.
    with ThrowawayPostgres() as pg:
        await migrate(pg.url, channel=DEFAULT_CHANNEL, with_schema=True)
        conn = await asyncpg.connect(pg.url)
        try:
            await seed_sandbox(conn, "s1")
            await seed_execution(conn, pod_name="space-sbx-s1-g1", sandbox_id="s1")
        finally:
            await conn.close()
        registry = CollectorRegistry()
        async with _store(pg.url, registry, connect_timeout_s=1.0) as store:
            # Every read works first, so the pool holds a live connection when the server goes.
            for read in _reads(store, key("space-sbx-s1-g1")).values():
                assert await read()
            pg.stop()
            for what, read in _reads(store, key("space-sbx-s1-g1")).items():
                with pytest.raises(Unavailable) as raised:
                    await read()
                assert not isinstance(raised.value, DRIVER_ERRORS), what
                assert isinstance(raised.value.__cause__, DRIVER_ERRORS), what
            assert await store.ping() is False
    assert metric(registry, "retired_pod_gc_row_query_errors_total") == 2


async def test_an_error_the_server_answers_with_raises_database_error_with_its_sqlstate(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    await seed_execution(pg_conn, pod_name="space-sbx-s1-g1", sandbox_id="s1")
    await pg_conn.execute("ALTER TABLE sandbox_k8s_executions RENAME TO executions_elsewhere")
    registry = CollectorRegistry()
    async with _store(pg_url, registry) as store:
        for what, read in _reads(store, key("space-sbx-s1-g1")).items():
            with pytest.raises(DatabaseError) as raised:
                await read()
            assert not isinstance(raised.value, Unavailable), what
            assert raised.value.sqlstate == "42P01", what  # undefined_table
            assert isinstance(raised.value.__cause__, asyncpg.UndefinedTableError), what
        # The server answers SELECT 1: the database is reachable, whatever the reads hit.
        assert await store.ping() is True
    assert metric(registry, "retired_pod_gc_row_query_errors_total") == 2


async def test_an_argument_that_is_not_a_key_is_a_bug_and_propagates_as_raised(
    pg_url: str,
) -> None:
    registry = CollectorRegistry()
    async with _store(pg_url, registry) as store:
        for what, read in _reads(store, 12345).items():
            # Not a string: splitting it into namespace and name fails before anything is
            # sent, and that is a bug of the caller, not a kit error.
            with pytest.raises(AttributeError) as raised:
                await read()
            assert not isinstance(raised.value, ExternalError), what
        # The store still works afterwards.
        assert await store.lookup_many([key("absent")]) == {}
    assert metric(registry, "retired_pod_gc_row_query_errors_total") == 0


async def test_ping_reports_a_reachable_database(pg_url: str) -> None:
    up = CollectorRegistry()
    async with _store(pg_url, up) as store:
        assert await store.ping() is True
        assert metric(up, "retired_pod_gc_database_up") == 1


async def test_reads_after_close_raise_store_closed(pg_url: str) -> None:
    store = _store(pg_url, CollectorRegistry())
    await store.start()
    assert await store.lookup_many([key("before-close")]) == {}
    await store.aclose()
    for read in _reads(store, key("after-close")).values():
        with pytest.raises(StoreClosed):
            await read()


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
async def test_batched_lookup_uses_the_pod_name_index(
    planner_url: str, plan_cache_mode: str
) -> None:
    # A table of production's order of size, asked for a burst's batch of keys. The store's
    # statements are prepared: after a few runs the server may plan them once for any
    # parameters (a generic plan), which must find the keys through the index too. On the
    # session's server and on Debian's PostgreSQL 15 with its defaults (planner_url).
    pg_conn = await asyncpg.connect(planner_url, timeout=10)
    try:
        await _assert_lookup_uses_the_index(pg_conn, plan_cache_mode)
    finally:
        await pg_conn.close(timeout=5)


async def _assert_lookup_uses_the_index(pg_conn: asyncpg.Connection, plan_cache_mode: str) -> None:
    await pg_conn.execute(
        "INSERT INTO sandboxes (id, namespace, managed_by)"
        f" SELECT 'i' || n, '{NAMESPACE}', 'kubernetes' FROM generate_series(1, 100000) AS n"
    )
    await pg_conn.execute(
        """
        INSERT INTO sandbox_k8s_executions
            (sandbox_id, generation, activation_attempt, pod_name, pod_kind, execution_state,
             active)
            SELECT 'i' || n, 1, 0, 'space-sbx-i' || n || '-g1', 'create', 'active', true
            FROM generate_series(1, 100000) AS n
        """
    )
    await pg_conn.execute("ANALYZE")
    await pg_conn.execute(f"SET plan_cache_mode = {plan_cache_mode}")
    asked = keys([f"space-sbx-i{n}-g1" for n in range(1, 100000, 400)])
    plan = await pg_conn.fetchval(
        f"EXPLAIN (FORMAT JSON) {LOOKUP_SQL}",
        [name.partition("/")[2] for name in asked],
        [NAMESPACE],
        "kubernetes",
    )
    text = json.dumps(json.loads(plan))
    assert '"Index Name": "sandbox_k8s_executions_pod_name_key"' in text
    assert '"Seq Scan"' not in text


async def test_a_caller_giving_up_hands_its_pooled_connection_back(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    await seed_execution(pg_conn, pod_name="space-sbx-s1-g1", sandbox_id="s1")
    registry = CollectorRegistry()
    # One connection in the pool: one the cancelled lookup kept would starve every later read.
    async with _store(pg_url, registry, pool_size=1, statement_timeout_s=5.0) as store:
        async with pg_conn.transaction():
            await pg_conn.execute("LOCK TABLE sandbox_k8s_executions IN ACCESS EXCLUSIVE MODE")
            with anyio.move_on_after(0.2) as gave_up:
                await store.lookup_many([key("space-sbx-s1-g1")])
            assert gave_up.cancelled_caught
        with anyio.fail_after(5):
            rows = await store.lookup_many([key("space-sbx-s1-g1")])
            assert set(rows) == {key("space-sbx-s1-g1")}
            assert await store.read_fresh(key("space-sbx-s1-g1")) == rows[key("space-sbx-s1-g1")]
        assert metric(registry, "retired_pod_gc_row_query_errors_total") == 0
