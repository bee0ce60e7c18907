"""The topology harness itself (devtools/pg/topology.py): PgBouncer in both pool modes, what a
transaction pooler does to LISTEN, a streaming hot standby, its promotion, and a killed primary."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

from devtools.pg.throwaway import ThrowawayPostgres
from devtools.pg.topology import (
    PoolMode,
    ThrowawayPgBouncer,
    ThrowawayStandby,
    kill,
    require_password,
)

pytestmark = pytest.mark.anyio
USERS = {"postgres": "bouncer-pw"}
CHANNEL = "harness_channel"
NOT_LINKED = "got packet 'A' from server when not linked"


@pytest.fixture(scope="module")
def server() -> Iterator[ThrowawayPostgres]:
    with ThrowawayPostgres() as pg:
        yield pg


@pytest.fixture(scope="module", params=["session", "transaction"])
def bouncer(
    request: pytest.FixtureRequest, server: ThrowawayPostgres
) -> Iterator[ThrowawayPgBouncer]:
    mode: PoolMode = request.param
    with ThrowawayPgBouncer(server, users=USERS, pool_mode=mode) as b:
        yield b


async def _connect(url: str) -> asyncpg.Connection:
    # No prepared statements kept: through a transaction pooler the next query may land on
    # another server connection.
    return await asyncpg.connect(url, timeout=10, statement_cache_size=0)


async def test_a_query_goes_through_pgbouncer(
    bouncer: ThrowawayPgBouncer, server: ThrowawayPostgres
) -> None:
    conn = await _connect(bouncer.url("postgres"))
    try:
        # The client talks to the pooler's port; the session it gets is the server's.
        assert conn.get_server_pid() != 0
        assert await conn.fetchval("SELECT inet_server_port()") == server.port
        assert await conn.fetchval("SELECT 40 + $1::int", 2) == 42
    finally:
        await conn.close()
    log = bouncer.log_text()
    assert "login attempt: db=postgres user=postgres" in log
    assert f"listening on 127.0.0.1:{bouncer.port}" in log


async def test_pgbouncer_refuses_a_wrong_password(bouncer: ThrowawayPgBouncer) -> None:
    wrong = bouncer.url("postgres").replace(":bouncer-pw@", ":wrong@")
    # PgBouncer answers a failed login itself (SQLSTATE 08P01, not the server's 28P01).
    with pytest.raises(asyncpg.PostgresError, match="password authentication failed"):
        await _connect(wrong)


async def _notify_arrives(listen_url: str, server: ThrowawayPostgres, timeout_s: float) -> bool:
    """LISTEN on ``listen_url``, NOTIFY from a direct session while the listener is idle."""
    received: asyncio.Queue[str] = asyncio.Queue()
    listener = await _connect(listen_url)
    sender = await asyncpg.connect(server.url, timeout=10)
    try:
        await listener.add_listener(CHANNEL, lambda *args: received.put_nowait(args[3]))
        await sender.execute(f"NOTIFY {CHANNEL}, 'ping'")
        try:
            payload = await asyncio.wait_for(received.get(), timeout=timeout_s)
        except TimeoutError:
            return False
        assert payload == "ping"
        return True
    finally:
        await sender.close()
        await listener.close()


async def test_listen_through_pgbouncer_session_mode_delivers(server: ThrowawayPostgres) -> None:
    with ThrowawayPgBouncer(server, users=USERS, pool_mode="session") as b:
        assert await _notify_arrives(b.url("postgres"), server, timeout_s=20)


async def test_listen_through_pgbouncer_transaction_mode_drops_the_notify(
    server: ThrowawayPostgres,
) -> None:
    with ThrowawayPgBouncer(server, users=USERS, pool_mode="transaction") as b:
        listen = asyncio.create_task(_notify_arrives(b.url("postgres"), server, timeout_s=20))
        # PgBouncer says why: the notification reached a server connection no client holds.
        for _ in range(400):
            if NOT_LINKED in b.log_text() or listen.done():
                break
            await asyncio.sleep(0.05)
        assert NOT_LINKED in b.log_text(), b.log_text()
        listen.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listen
        # And nothing came: a second look after the pooler dropped it.
        assert not await _notify_arrives(b.url("postgres"), server, timeout_s=1)


async def _fetchval(url: str, sql: str) -> object:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def _execute(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def test_require_password_makes_the_user_send_it(server: ThrowawayPostgres) -> None:
    await _execute(server.url, "CREATE ROLE harness_login LOGIN PASSWORD 'secret-1'")
    require_password(server, user="harness_login")
    base = server.url.replace("postgres@", "harness_login@")
    with pytest.raises(asyncpg.InvalidPasswordError):
        await _fetchval(base, "SELECT 1")
    with pytest.raises(asyncpg.InvalidPasswordError):
        await _fetchval(base.replace("harness_login@", "harness_login:wrong@"), "SELECT 1")
    assert (
        await _fetchval(base.replace("harness_login@", "harness_login:secret-1@"), "SELECT 1") == 1
    )
    # Other users still log in as before (trust).
    assert await _fetchval(server.url, "SELECT 1") == 1


async def test_standby_replays_is_in_recovery_then_promoted_after_the_primary_is_killed() -> None:
    with ThrowawayPostgres() as primary:
        await _execute(primary.url, "CREATE TABLE t (v int); INSERT INTO t VALUES (1)")
        with ThrowawayStandby(primary) as standby:
            assert standby.port != primary.port
            assert standby.in_recovery()
            assert await _fetchval(standby.url, "SELECT pg_is_in_recovery()") is True
            await _fetchval(primary.url, "INSERT INTO t VALUES (2)")
            standby.wait_replayed(primary)
            assert await _fetchval(standby.url, "SELECT array_agg(v ORDER BY v) FROM t") == [1, 2]
            with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
                await _fetchval(standby.url, "INSERT INTO t VALUES (3)")

            kill(primary)
            assert not primary.running
            with pytest.raises(OSError):
                await _fetchval(primary.url, "SELECT 1")
            standby.promote()
            assert not standby.in_recovery()
            await _fetchval(standby.url, "INSERT INTO t VALUES (3)")
            assert await _fetchval(standby.url, "SELECT array_agg(v ORDER BY v) FROM t") == [
                1,
                2,
                3,
            ]


async def test_a_detached_standby_never_sees_later_commits() -> None:
    with ThrowawayPostgres() as primary:
        await _execute(primary.url, "CREATE TABLE t (v int); INSERT INTO t VALUES (1)")
        with ThrowawayStandby(primary) as standby:
            standby.wait_replayed(primary)
            standby.detach()
            assert standby.in_recovery()
            await _fetchval(primary.url, "INSERT INTO t VALUES (2)")
            kill(primary)
            standby.promote()
            # Promotion ends recovery: what the standby has now is all it will ever have.
            assert await _fetchval(standby.url, "SELECT array_agg(v ORDER BY v) FROM t") == [1]
