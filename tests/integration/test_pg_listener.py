"""``RetirementListener`` end to end: trigger → NOTIFY → handler, and recovery from each
failure.

The three failure modes each have a test that fails without its recovery code:

* closed connection (``pg_terminate_backend``): the heartbeat is set to a minute, so only the
  termination listener can notice in time;
* server stop/start: the same, plus connect attempts that must be retried until it is back;
* silent death (a proxy that stops forwarding but keeps both sockets open): only the heartbeat
  can notice, and it must do so within interval + timeout.

Everything here runs on real time (it talks to PostgreSQL), on the event loop's clock, the
listener's one clock. The backoff tests read the delays the listener draws from its policy
(:class:`RecordingBackoff`) and check that it waited each one before the next attempt, from the
times the attempts reached a proxy: a lower bound, never a judgement by slack.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import anyio.lowlevel
import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from devtools.pg.throwaway import ThrowawayPostgres
from service.config import DatabaseSettings
from service.domain import ExecutionChange, ExecutionState
from service.kit import clock
from service.kit.backoff import Backoff
from service.kit.errors import Unavailable
from service.metrics import PgMetrics
from service.pg.errors import ListenerUnavailable
from service.pg.listener import BACKOFF_MAX_S, RetirementListener
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from service.pg.payload import parse_payload
from tests.pgfixtures import (
    NAMESPACE,
    db_settings,
    metric,
    payload_rows,
    probe_sender,
    seed_execution,
    seed_sandbox,
)

pytestmark = pytest.mark.anyio

POD = "space-sbx-s1-g1"


class RecordingHandler:
    """An ``ExecutionEventHandler`` that records what it is told."""

    def __init__(self) -> None:
        self.changes: list[ExecutionChange] = []
        self.batches: list[list[ExecutionChange]] = []
        self.missed = 0

    def executions_changed(self, changes: Sequence[ExecutionChange]) -> None:
        assert changes, "a handler is never handed an empty batch"
        self.changes.extend(changes)
        self.batches.append(list(changes))

    def notifications_missed(self) -> None:
        self.missed += 1


async def wait_for(predicate: Callable[[], bool], *, timeout_s: float, what: str) -> float:
    """Poll until ``predicate()``; return the seconds it took. Fails the test on timeout.

    Raises AssertionError rather than ``pytest.fail``: inside a task group the latter (a
    BaseException) would take down anyio's test runner and bury the real failure.
    """
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await anyio.sleep(0.01)
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def running(
    settings: DatabaseSettings,
    handler: RecordingHandler,
    registry: CollectorRegistry,
    *,
    probe_url: str | None = None,
) -> AsyncIterator[RetirementListener]:
    """A listener running on ``settings``; its delivery probes sent to ``probe_url`` (default:
    the listener's own URL), as the query pool would send them."""
    listener = RetirementListener(
        settings,
        metrics=PgMetrics(registry),
        probe=probe_sender(probe_url or settings.url),
        backoff=Backoff(initial_s=0.05, max_s=0.5, jitter=0.5),
        namespaces=(NAMESPACE,),
    )
    listener.add_handler(handler)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            await tg.start(listener.run)
        try:
            yield listener
        finally:
            tg.cancel_scope.cancel()


async def _listener_pid(conn: asyncpg.Connection) -> int:
    pid = await conn.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'retired-pod-gc-listener'"
        " AND datname = current_database()"
    )
    assert isinstance(pid, int)
    return pid


async def _retire(conn: asyncpg.Connection, pod: str = POD, state: str = "suspended") -> None:
    await conn.execute(
        "UPDATE sandbox_k8s_executions SET active = false, execution_state = $2,"
        " retired_at = now() WHERE pod_name = $1",
        pod,
        state,
    )


async def _assert_delivers(
    conn: asyncpg.Connection, handler: RecordingHandler, *, pod: str, state: str
) -> None:
    """A retirement committed now reaches the handler (the LISTEN is really in place)."""
    seen = len(handler.changes)
    await _retire(conn, pod, state)
    await wait_for(lambda: len(handler.changes) > seen, timeout_s=5, what="notification")
    change = handler.changes[-1]
    assert (change.pod_name, change.state, change.active) == (pod, ExecutionState(state), False)


async def test_notify_arrives_after_commit_and_not_before(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    await seed_execution(pg_conn, pod_name=POD, sandbox_id="s1", pod_kind="restore")
    handler, registry = RecordingHandler(), CollectorRegistry()
    listener = RetirementListener(
        db_settings(pg_url),
        metrics=PgMetrics(registry),
        probe=probe_sender(pg_url),
        namespaces=(NAMESPACE,),
    )
    listener.add_handler(handler)
    async with anyio.create_task_group() as tg:
        await tg.start(listener.run)
        assert listener.connected and handler.missed == 1
        assert metric(registry, "retired_pod_gc_listener_connected") == 1
        async with pg_conn.transaction():
            await pg_conn.execute(
                "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended'"
                " WHERE pod_name = $1",
                POD,
            )
            await anyio.sleep(0.3)
            assert handler.changes == []
            committing_at = clock.now()
        await wait_for(lambda: len(handler.changes) == 1, timeout_s=5, what="notification")
        seen_by = clock.now()
        change = handler.changes[0]
        # Stamped on the listener's clock (the event loop's) when it arrived, after the commit.
        assert committing_at <= change.received_at_s <= seen_by
        assert change == ExecutionChange(
            namespace=NAMESPACE,
            pod_name=POD,
            active=False,
            state=ExecutionState.SUSPENDED,
            deleted=False,
            received_at_s=change.received_at_s,
        )
        assert change.retired
        tg.cancel_scope.cancel()
    assert not listener.connected
    assert metric(registry, "retired_pod_gc_listener_connected") == 0
    assert metric(registry, "retired_pod_gc_notifications_total") == 1


async def test_inserts_and_deletes_reach_the_listener_only_for_inactive_executions(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    handler, registry = RecordingHandler(), CollectorRegistry()
    async with running(db_settings(pg_url), handler, registry) as listener:
        # An active execution inserted, changed and deleted: nothing that can start a clock.
        await seed_execution(pg_conn, pod_name=POD, sandbox_id="s1")
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET execution_state = 'activating' WHERE pod_name = $1",
            POD,
        )
        await pg_conn.execute("DELETE FROM sandbox_k8s_executions WHERE pod_name = $1", POD)
        await listener.sync()
        assert handler.changes == []
        # Inserted inactive, then neither active nor execution_state changed, then deleted.
        await seed_execution(
            pg_conn, pod_name=POD, sandbox_id="s1", execution_state="suspended", active=False
        )
        await wait_for(lambda: len(handler.changes) == 1, timeout_s=5, what="insert")
        inserted = handler.changes[0]
        assert (inserted.active, inserted.state, inserted.deleted) == (
            False,
            ExecutionState.SUSPENDED,
            False,
        )
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET activation_attempt = 5, generation = generation"
            " WHERE pod_name = $1",
            POD,
        )
        await pg_conn.execute("DELETE FROM sandbox_k8s_executions WHERE pod_name = $1", POD)
        await wait_for(lambda: len(handler.changes) == 2, timeout_s=5, what="delete")
        deleted = handler.changes[1]
        assert deleted.deleted and deleted.key == f"{NAMESPACE}/{POD}"
        assert deleted.active is None and not deleted.retired


async def test_malformed_payloads_are_counted_and_skipped(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    await seed_execution(pg_conn, pod_name=POD, sandbox_id="s1")
    handler, registry = RecordingHandler(), CollectorRegistry()
    garbage = ["", "garbage", "null", "[]", "{}", '{"op":"insert","namespace":"n"}', "{" * 100]
    async with running(db_settings(pg_url), handler, registry) as listener:
        for payload in garbage:
            await pg_conn.execute("SELECT pg_notify($1, $2)", DEFAULT_CHANNEL, payload)
        await _assert_delivers(pg_conn, handler, pod=POD, state="replaced")
        assert len(handler.changes) == 1
        assert metric(registry, "retired_pod_gc_notifications_malformed_total") == len(garbage)
        assert metric(registry, "retired_pod_gc_notifications_total") == len(garbage) + 1
        assert listener.connected
        assert metric(registry, "retired_pod_gc_listener_reconnects_total") == 0


async def test_recovers_after_backend_is_terminated(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    await seed_execution(pg_conn, pod_name=POD, sandbox_id="s1")
    handler, registry = RecordingHandler(), CollectorRegistry()
    # A heartbeat a minute apart: only the termination listener can notice within the test.
    settings = db_settings(pg_url, heartbeat_interval_s=60.0)
    async with running(settings, handler, registry) as listener:
        pid = await _listener_pid(pg_conn)
        assert await pg_conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        await wait_for(lambda: handler.missed == 2, timeout_s=5, what="reconnect")
        await wait_for(lambda: listener.connected, timeout_s=5, what="connected")
        assert await _listener_pid(pg_conn) != pid
        assert metric(registry, "retired_pod_gc_listener_reconnects_total") == 1
        await _assert_delivers(pg_conn, handler, pod=POD, state="cancelled")


async def test_recovers_after_server_stop_and_start() -> None:
    # Its own server: restarting the session's would disturb other tests.
    with ThrowawayPostgres() as pg:
        await migrate(pg.url, channel=DEFAULT_CHANNEL, with_schema=True)
        conn = await asyncpg.connect(pg.url)
        try:
            await seed_sandbox(conn, "s1")
            await seed_execution(conn, pod_name=POD, sandbox_id="s1")
        finally:
            await conn.close()
        handler, registry = RecordingHandler(), CollectorRegistry()
        settings = db_settings(pg.url, heartbeat_interval_s=60.0, connect_timeout_s=1.0)
        async with running(settings, handler, registry) as listener:
            assert handler.missed == 1
            pg.restart()
            await wait_for(lambda: handler.missed == 2, timeout_s=10, what="reconnect")
            assert listener.connected
            assert metric(registry, "retired_pod_gc_listener_reconnects_total") == 1
            conn = await asyncpg.connect(pg.url)
            try:
                await _assert_delivers(conn, handler, pod=POD, state="stopped")
            finally:
                await conn.close()


class StallableProxy:
    """A TCP proxy whose existing connections can be black-holed while staying open."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._conns: list[dict[str, object]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._refuse = False
        self.port = 0
        self.accepted_at: list[float] = []
        """The event loop's time of every connection accepted (refused ones included)."""

    async def __aenter__(self) -> StallableProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in self._conns:
            for w in c["writers"]:  # type: ignore[attr-defined]
                w.close()
        await self._server.wait_closed()

    def pause_accepting(self) -> None:
        """Refuse new connections (accepted then closed at once) until resumed."""
        self._refuse = True

    def resume_accepting(self) -> None:
        self._refuse = False

    def stall_existing(self) -> int:
        """Stop forwarding on every open connection (data read is dropped); sockets stay open."""
        for c in self._conns:
            c["stalled"] = True
        return len(self._conns)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted_at.append(clock.now())
        if self._refuse:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        conn: dict[str, object] = {"stalled": False, "writers": [writer, up_writer]}
        self._conns.append(conn)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pump(conn, src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, conn: dict[str, object], src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await src.read(65536):
                if not conn["stalled"]:
                    dst.write(data)
                    await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not conn["stalled"]:
                dst.close()


async def test_silently_dead_connection_is_detected_by_heartbeat_within_bound(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    await seed_execution(pg_conn, pod_name=POD, sandbox_id="s1")
    port = int(pg_url.rsplit(":", 1)[1].split("/", 1)[0])
    interval_s, timeout_s = 0.2, 0.3
    async with StallableProxy(port) as proxy:
        via_proxy = pg_url.replace(f":{port}/", f":{proxy.port}/")
        settings = db_settings(
            via_proxy, heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s
        )
        handler, registry = RecordingHandler(), CollectorRegistry()
        async with running(settings, handler, registry, probe_url=pg_url) as listener:
            # Heartbeats pass through a healthy proxy without any reconnect.
            await anyio.sleep(interval_s * 3)
            assert handler.missed == 1
            assert proxy.stall_existing() == 1
            took_s = await wait_for(lambda: handler.missed == 2, timeout_s=5, what="detection")
            # interval + timeout, plus one backoff (<= 0.05 s) and connect time.
            assert took_s <= interval_s + timeout_s + 0.5
            assert listener.connected
            assert metric(registry, "retired_pod_gc_listener_reconnects_total") == 1
            await _assert_delivers(pg_conn, handler, pod=POD, state="failed")


async def test_run_retries_until_the_first_connection_succeeds(pg_url: str) -> None:
    # The proxy accepts and at once closes every connection at first: the listener's first
    # attempts fail, and it must keep trying until one succeeds.
    handler, registry = RecordingHandler(), CollectorRegistry()
    port = int(pg_url.rsplit(":", 1)[1].split("/", 1)[0])
    async with StallableProxy(port) as proxy, anyio.create_task_group() as tg:
        proxy.pause_accepting()
        settings = db_settings(
            pg_url.replace(f":{port}/", f":{proxy.port}/"), connect_timeout_s=1.0
        )
        listener = RetirementListener(
            settings,
            metrics=PgMetrics(registry),
            probe=probe_sender(pg_url),
            backoff=Backoff(initial_s=0.02, max_s=BACKOFF_MAX_S, jitter=0.5),
            namespaces=(NAMESPACE,),
        )
        listener.add_handler(handler)
        tg.start_soon(listener.run)
        await anyio.sleep(0.3)
        assert not listener.connected and handler.missed == 0
        proxy.resume_accepting()
        await wait_for(lambda: listener.connected, timeout_s=5, what="first connect")
        assert handler.missed == 1
        assert metric(registry, "retired_pod_gc_listener_reconnects_total") == 0
        tg.cancel_scope.cancel()


async def test_sync_hands_over_every_committed_notification_before_returning(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    names = [f"space-sbx-b{i}-g1" for i in range(20)]
    for i, name in enumerate(names):
        await seed_sandbox(pg_conn, f"b{i}")
        await seed_execution(pg_conn, pod_name=name, sandbox_id=f"b{i}")
    handler, registry = RecordingHandler(), CollectorRegistry()
    async with running(db_settings(pg_url), handler, registry) as listener:
        for _ in range(5):
            seen = len(handler.changes)
            async with pg_conn.transaction():
                for name in names:
                    await _retire(pg_conn, name)
            # No waiting or polling: sync alone must have delivered all 20.
            await listener.sync()
            assert len(handler.changes) - seen == len(names)
            await pg_conn.execute(
                "UPDATE sandbox_k8s_executions SET active = true, execution_state = 'active'"
            )
            await listener.sync()
            assert len(handler.changes) - seen == 2 * len(names)


async def test_sync_refuses_when_the_connection_is_silently_stalled(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    port = int(pg_url.rsplit(":", 1)[1].split("/", 1)[0])
    async with StallableProxy(port) as proxy:
        via_proxy = pg_url.replace(f":{port}/", f":{proxy.port}/")
        # A long heartbeat interval: only sync itself can notice the stall here.
        settings = db_settings(via_proxy, heartbeat_interval_s=60, heartbeat_timeout_s=0.3)
        handler, registry = RecordingHandler(), CollectorRegistry()
        async with running(settings, handler, registry, probe_url=pg_url) as listener:
            await listener.sync()
            assert proxy.stall_existing() == 1
            with pytest.raises(ListenerUnavailable) as raised:
                await listener.sync()
            assert isinstance(raised.value, Unavailable)
            assert "notifications are not delivered" in str(raised.value)
            assert metric(registry, "retired_pod_gc_listener_delivery_ok") == 0
            assert metric(registry, "retired_pod_gc_listener_delivery_failures_total") == 1


async def test_sync_without_a_connection_raises_a_kit_unavailable() -> None:
    url = "postgresql://postgres@127.0.0.1:1/none"
    listener = RetirementListener(
        db_settings(url),
        metrics=PgMetrics(CollectorRegistry()),
        probe=probe_sender(url),
        namespaces=(NAMESPACE,),
    )
    with pytest.raises(Unavailable) as raised:
        await listener.sync()
    assert isinstance(raised.value, ListenerUnavailable)


async def test_each_handler_gets_every_change_and_one_added_while_listening_is_told_it_missed(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    await seed_execution(pg_conn, pod_name=POD, sandbox_id="s1")
    first, late, registry = RecordingHandler(), RecordingHandler(), CollectorRegistry()
    async with running(db_settings(pg_url), first, registry) as listener:
        assert (first.missed, late.missed) == (1, 0)
        listener.add_handler(late)
        # Whatever was handed over before, the late handler never saw: it must resync at once.
        assert (first.missed, late.missed) == (1, 1)
        await _retire(pg_conn, POD, "suspended")
        await listener.sync()
        assert [c.pod_name for c in first.changes] == [POD]
        assert late.changes == first.changes


class RecordingBackoff(Backoff):
    """The listener's backoff policy, recording every delay it hands out, in order."""

    __slots__ = ("drawn",)

    def __init__(self, *, initial_s: float, max_s: float, jitter: float, rng: random.Random):
        super().__init__(initial_s=initial_s, max_s=max_s, jitter=jitter, rng=rng)
        self.drawn: list[float] = []

    def delay_s(self, failures: int) -> float:
        delay = Backoff.delay_s(self, failures)
        self.drawn.append(delay)
        return delay


TIMER_EARLY_S = time.get_clock_info("monotonic").resolution
"""How early asyncio may run a timer: up to its clock's resolution before the deadline (it runs
every timer due within one resolution of now)."""


def _waited_each_delay(attempts_at: Sequence[float], delays: Sequence[float]) -> None:
    """Every attempt came at least the delay drawn after the one before it had failed (which
    was after it reached the proxy): the listener waited each delay it drew."""
    for k, delay in enumerate(delays[: len(attempts_at) - 1]):
        assert attempts_at[k + 1] - attempts_at[k] >= delay - TIMER_EARLY_S, (k, delay)


async def test_reconnect_delays_follow_the_backoff_policy() -> None:
    handler = RecordingHandler()

    def policy() -> RecordingBackoff:
        return RecordingBackoff(initial_s=0.1, max_s=1.6, jitter=0.5, rng=random.Random(7))

    twin, backoff = policy(), policy()  # the same draws, in the same order
    async with StallableProxy(upstream_port=0) as proxy:
        proxy.pause_accepting()  # every connect reaches it and is closed at once
        url = f"postgresql://postgres@127.0.0.1:{proxy.port}/none"
        listener = RetirementListener(
            db_settings(url, connect_timeout_s=2.0),
            metrics=PgMetrics(CollectorRegistry()),
            probe=probe_sender(url),
            backoff=backoff,
            namespaces=(NAMESPACE,),
        )
        listener.add_handler(handler)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.run)
            await wait_for(lambda: len(backoff.drawn) >= 6, timeout_s=30, what="six failures")
            tg.cancel_scope.cancel()
    assert not listener.connected and handler.missed == 0
    delays = backoff.drawn
    assert delays == [twin.delay_s(k) for k in range(len(delays))]
    # Doubling from 0.1 s (equal jitter: each within [d/2, d]) up to the cap.
    for failures, delay in enumerate(delays):
        base = min(1.6, 0.1 * 2**failures)
        assert base / 2 <= delay <= base
    assert len(proxy.accepted_at) >= len(delays)
    _waited_each_delay(proxy.accepted_at, delays)


async def test_a_successful_listen_resets_the_backoff(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    handler = RecordingHandler()

    def policy() -> RecordingBackoff:
        return RecordingBackoff(initial_s=0.1, max_s=30.0, jitter=0.5, rng=random.Random(11))

    twin, backoff = policy(), policy()
    port = int(pg_url.rsplit(":", 1)[1].split("/", 1)[0])
    async with StallableProxy(port) as proxy, anyio.create_task_group() as tg:
        proxy.pause_accepting()
        settings = db_settings(
            pg_url.replace(f":{port}/", f":{proxy.port}/"),
            connect_timeout_s=2.0,
            heartbeat_interval_s=3600.0,  # no heartbeat among the waits
        )
        listener = RetirementListener(
            settings,
            metrics=PgMetrics(CollectorRegistry()),
            probe=probe_sender(settings.url),
            backoff=backoff,
            namespaces=(NAMESPACE,),
        )
        listener.add_handler(handler)
        tg.start_soon(listener.run)
        await wait_for(lambda: len(backoff.drawn) == 3, timeout_s=30, what="three failures")
        proxy.resume_accepting()
        await wait_for(lambda: listener.connected, timeout_s=10, what="connected")
        assert handler.missed == 1
        refused = list(proxy.accepted_at[:4])
        assert await pg_conn.fetchval(
            "SELECT pg_terminate_backend($1)", await _listener_pid(pg_conn)
        )
        await wait_for(lambda: not listener.connected, timeout_s=5, what="the loss noticed")
        await wait_for(lambda: len(backoff.drawn) == 4, timeout_s=5, what="the next delay")
        tg.cancel_scope.cancel()
    # Three failures before the success; after it, the count starts from zero again.
    assert backoff.drawn == [twin.delay_s(0), twin.delay_s(1), twin.delay_s(2), twin.delay_s(0)]
    _waited_each_delay(refused, backoff.drawn[:3])


# ------------------------------------------------------------- trigger 0003: batches


class RawPayloads(list[str]):
    """Every payload on the default channel, as the server sent it (a plain LISTEN)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        super().__init__()
        self._conn = conn

    async def drain(self) -> None:
        """Return once every notification committed so far is here: the server sends what it
        has queued for a listening connection before it answers a query on it."""
        await self._conn.fetchval("SELECT 1")
        await anyio.lowlevel.checkpoint()


@contextlib.asynccontextmanager
async def raw_payloads(url: str) -> AsyncIterator[RawPayloads]:
    conn = await asyncpg.connect(url)
    got = RawPayloads(conn)
    try:
        await conn.add_listener(DEFAULT_CHANNEL, lambda _c, _p, _ch, payload: got.append(payload))
        yield got
    finally:
        await conn.close()


async def _seed_many(
    conn: asyncpg.Connection, count: int, *, prefix: str = "m", active: bool = True
) -> list[str]:
    await conn.execute(
        "INSERT INTO sandboxes SELECT $1 || i, $2, 'kubernetes' FROM generate_series(1, $3) i",
        prefix,
        NAMESPACE,
        count,
    )
    await conn.execute(
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt, pod_name,"
        " pod_kind, execution_state, active)"
        " SELECT $1 || i, 1, 0, 'space-sbx-' || $1 || i || '-g1', 'create',"
        " CASE WHEN $3 THEN 'active' ELSE 'suspended' END, $3"
        " FROM generate_series(1, $2) i",
        prefix,
        count,
        active,
    )
    return [f"space-sbx-{prefix}{i}-g1" for i in range(1, count + 1)]


def _rows(payloads: Sequence[str]) -> list[list[object]]:
    return [row for payload in payloads for row in payload_rows(payload)]


async def test_a_10000_row_statement_is_several_notifications_each_below_the_limit(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    names = await _seed_many(pg_conn, 10_000)
    handler, registry = RecordingHandler(), CollectorRegistry()
    async with (
        raw_payloads(pg_url) as payloads,
        running(db_settings(pg_url), handler, registry) as listener,
    ):
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced',"
            " retired_at = now()"
        )
        await listener.sync()
        await payloads.drain()
    sizes = [len(p.encode()) for p in payloads]
    # Far fewer notifications than rows, and none near PostgreSQL's limit.
    assert 2 <= len(payloads) <= 10_000 // 50
    assert max(sizes) < 8000
    assert sorted(r[1] for r in _rows(payloads)) == sorted(names)  # type: ignore[type-var]
    # The listener hands each notification over as one batch, every row of it.
    assert len(handler.batches) == len(payloads)
    assert sorted(c.pod_name for c in handler.changes) == sorted(names)
    assert all(c.retired and c.state is ExecutionState.REPLACED for c in handler.changes)
    assert metric(registry, "retired_pod_gc_notifications_total") == len(payloads)
    assert metric(registry, "retired_pod_gc_notifications_malformed_total") == 0


def _can_start_or_stop_a_clock(old: tuple[bool, str] | None, new: tuple[bool, str] | None) -> bool:
    """The data contract's notify set (docs/architecture.md): a change of an execution that is
    inactive before or after it, that inserts, deletes, or changes `active` or the state."""
    if old is None or new is None:
        return not (old or new)[0]  # type: ignore[index]
    return (not old[0] or not new[0]) and old != new


_KINDS = list(itertools.product([True, False], [True, False], [False, True]))
"""Every UPDATE of one execution: (active before, active after, state changed)."""


async def _seed_kinds(conn: asyncpg.Connection, per_kind: int) -> dict[str, tuple[bool, str]]:
    """``per_kind`` executions for each of :data:`_KINDS`, each active as the kind starts;
    returns each pod's (active, state)."""
    rows = {
        f"space-sbx-c{k}x{i}-g1": (before, "active" if before else "suspended")
        for k, (before, _, _) in enumerate(_KINDS)
        for i in range(per_kind)
    }
    await conn.execute(
        "INSERT INTO sandboxes SELECT 'c' || u.i, $2, 'kubernetes'"
        " FROM unnest($1::text[]) WITH ORDINALITY AS u(pod, i)",
        list(rows),
        NAMESPACE,
    )
    await conn.execute(
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active)"
        " SELECT 'c' || u.i, 1, 0, u.pod, 'create', u.state, u.active"
        " FROM unnest($1::text[], $2::text[], $3::bool[])"
        " WITH ORDINALITY AS u(pod, state, active, i)",
        list(rows),
        [state for _, state in rows.values()],
        [active for active, _ in rows.values()],
    )
    return rows


def _after(pod: str, before: tuple[bool, str]) -> tuple[bool, str]:
    _, after, state_changed = _KINDS[int(pod.removeprefix("space-sbx-c").split("x")[0])]
    return after, before[1] + "-2" if state_changed else before[1]


async def test_exactly_the_changes_that_can_start_or_stop_a_clock_are_reported(
    planner_url: str,
) -> None:
    # On the session's server and on Debian's PostgreSQL 15 with its defaults.
    pg_url, pg_conn = planner_url, await asyncpg.connect(planner_url)
    try:
        await _exactly_the_changes_that_can_start_or_stop_a_clock_are_reported(pg_url, pg_conn)
    finally:
        await pg_conn.close()


async def _exactly_the_changes_that_can_start_or_stop_a_clock_are_reported(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # Every kind of UPDATE (active before and after, state changed or not), through one
    # statement of many rows (the general query) and through one-row statements (the short
    # path), then deletes and inserts of active and inactive executions, each both ways.
    rows = await _seed_kinds(pg_conn, 40)
    update = (
        "UPDATE sandbox_k8s_executions SET activation_attempt = activation_attempt + 1,"
        " active = u.active, execution_state = u.state"
        " FROM unnest($1::text[], $2::bool[], $3::text[]) AS u(pod, active, state)"
        " WHERE pod_name = u.pod"
    )
    after = {pod: _after(pod, before) for pod, before in rows.items()}
    expected = sorted(
        ["update", pod, *after[pod]]
        for pod, before in rows.items()
        if _can_start_or_stop_a_clock(before, after[pod])
    )
    assert 0 < len(expected) < len(rows)
    async with raw_payloads(pg_url) as payloads:
        await payloads.drain()
        payloads.clear()
        await pg_conn.execute(
            update,
            list(after),
            [a for a, _ in after.values()],
            [st for _, st in after.values()],
        )
        await payloads.drain()
        assert sorted(_rows(payloads)) == expected  # type: ignore[type-var]
        # Back, one row a statement: the same rule through the short path.
        payloads.clear()
        for pod, (active, state) in rows.items():
            await pg_conn.execute(update, [pod], [active], [state])
        await payloads.drain()
        assert all(len(payload_rows(p)) == 1 for p in payloads)
        assert sorted(_rows(payloads)) == sorted(  # type: ignore[type-var]
            ["update", pod, *before]
            for pod, before in rows.items()
            if _can_start_or_stop_a_clock(after[pod], before)
        )
        # Statements that change neither column send nothing.
        payloads.clear()
        await pg_conn.execute("UPDATE sandbox_k8s_executions SET generation = generation + 1")
        await pg_conn.execute("UPDATE sandbox_k8s_executions SET active = active")
        await pg_conn.execute("DELETE FROM sandbox_k8s_executions WHERE false")
        await payloads.drain()
        assert payloads == []
        # Deletes: only of inactive executions; many at once and one at a time.
        pods = list(rows)
        for chosen in (pods[: len(pods) // 2], pods[len(pods) // 2 :]):
            payloads.clear()
            if chosen is pods[: len(pods) // 2]:
                await pg_conn.execute(
                    "DELETE FROM sandbox_k8s_executions WHERE pod_name = ANY($1)", chosen
                )
            else:
                for pod in chosen:
                    await pg_conn.execute(
                        "DELETE FROM sandbox_k8s_executions WHERE pod_name = $1", pod
                    )
            await payloads.drain()
            assert sorted(_rows(payloads)) == sorted(  # type: ignore[type-var]
                ["delete", pod, *rows[pod]]
                for pod in chosen
                if _can_start_or_stop_a_clock(rows[pod], None)
            )
        # Inserts: only of inactive executions, both ways.
        for one_by_one in (False, True):
            await pg_conn.execute("DELETE FROM sandbox_k8s_executions")
            await payloads.drain()
            payloads.clear()
            if one_by_one:
                for pod, (active, state) in rows.items():
                    await pg_conn.execute(
                        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation,"
                        " pod_name, pod_kind, execution_state, active)"
                        " SELECT 'c1', 1, $1, 'create', $2, $3",
                        pod,
                        state,
                        active,
                    )
            else:
                await pg_conn.execute(
                    "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, pod_name,"
                    " pod_kind, execution_state, active)"
                    " SELECT 'c1', 1, u.pod, 'create', u.state, u.active"
                    " FROM unnest($1::text[], $2::text[], $3::bool[]) AS u(pod, state, active)",
                    list(rows),
                    [state for _, state in rows.values()],
                    [active for active, _ in rows.values()],
                )
            await payloads.drain()
            assert sorted(_rows(payloads)) == sorted(  # type: ignore[type-var]
                ["insert", pod, *row]
                for pod, row in rows.items()
                if _can_start_or_stop_a_clock(None, row)
            )


async def test_every_statement_of_a_transaction_sends_its_own_changes(planner_url: str) -> None:
    # One call of the trigger's function per row its WHEN lets through; the statement's first
    # call sends the statement, the others count down (the SQL file's "Row level, one call a
    # statement"). So a statement whose calls are miscounted would swallow the next statement's
    # changes, or send its own twice. On both servers.
    conn = await asyncpg.connect(planner_url)
    try:
        names = await _seed_many(conn, 12, prefix="t")
        await conn.execute(
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended'"
            " WHERE pod_name = ANY($1)",
            names[8:10],
        )
        retire = (
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = $2"
            " WHERE pod_name = ANY($1)"
        )
        async with raw_payloads(planner_url) as payloads:
            await payloads.drain()
            payloads.clear()
            async with conn.transaction():
                # Two retired, one re-activated, one active changed: three calls of four rows,
                # neither side inactive in every row (the count pairs old and new by place).
                await conn.execute(
                    "UPDATE sandbox_k8s_executions SET"
                    " active = CASE WHEN pod_name = $2 THEN active ELSE NOT active END,"
                    " execution_state = CASE WHEN pod_name = $2 THEN 'activating'"
                    " WHEN active THEN 'replaced' ELSE 'active' END"
                    " WHERE pod_name = ANY($1)",
                    [*names[0:2], names[8], names[10]],
                    names[10],
                )
                await conn.execute(
                    "UPDATE sandbox_k8s_executions SET execution_state = 'activating'"
                    " WHERE pod_name = $1",
                    names[2],
                )
                await conn.execute(retire, [names[3]], "suspended")
                with contextlib.suppress(RuntimeError):
                    async with conn.transaction():
                        await conn.execute(retire, names[4:6], "cancelled")
                        raise RuntimeError("rolled back")
                await conn.execute(retire, names[6:8], "stopped")
                await seed_execution(
                    conn,
                    pod_name="space-sbx-t99-g1",
                    sandbox_id="t1",
                    execution_state="suspended",
                    active=False,
                )
            await payloads.drain()
        assert sorted(_rows(payloads)) == sorted(  # type: ignore[type-var]
            [
                ["update", names[0], False, "replaced"],
                ["update", names[1], False, "replaced"],
                ["update", names[8], True, "active"],
                ["update", names[3], False, "suspended"],
                ["update", names[6], False, "stopped"],
                ["update", names[7], False, "stopped"],
                ["insert", "space-sbx-t99-g1", False, "suspended"],
            ]
        )
    finally:
        await conn.close()


async def test_an_upsert_sends_both_its_inserts_and_its_updates(planner_url: str) -> None:
    # INSERT ... ON CONFLICT DO UPDATE fires the INSERT and the UPDATE triggers in one statement,
    # their calls interleaved row by row: each event's calls count apart.
    conn = await asyncpg.connect(planner_url)
    try:
        names = await _seed_many(conn, 4, prefix="u")
        new = [f"space-sbx-u{i}-g2" for i in range(1, 5)]
        async with raw_payloads(planner_url) as payloads:
            await payloads.drain()
            payloads.clear()
            await conn.execute(
                "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, pod_name, pod_kind,"
                " execution_state, active)"
                " SELECT 'u1', 2, u.pod, 'create', 'replaced', false"
                " FROM unnest($1::text[]) AS u(pod)"
                " ON CONFLICT (pod_name) DO UPDATE"
                " SET active = false, execution_state = 'replaced'",
                [p for pair in zip(names, new, strict=True) for p in pair],
            )
            await payloads.drain()
        expected = [["update", name, False, "replaced"] for name in names] + [
            ["insert", name, False, "replaced"] for name in new
        ]
        assert sorted(_rows(payloads)) == sorted(expected)  # type: ignore[type-var]
    finally:
        await conn.close()


async def test_a_statement_run_by_another_trigger_of_the_table_sends_its_changes_too(
    planner_url: str,
) -> None:
    # A trigger of the table's owner that, for each row retired as 'replaced', retires the next
    # execution too: its statements run inside the calls of the outer statement's trigger, and
    # each statement's calls count apart (by the trigger depth).
    conn = await asyncpg.connect(planner_url)
    try:
        names = await _seed_many(conn, 6, prefix="n")
        await conn.execute(
            """
            CREATE FUNCTION owners_cascade() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                UPDATE sandbox_k8s_executions SET active = false, execution_state = 'cancelled'
                 WHERE pod_name = replace(NEW.pod_name, '-g1', '-g2');
                RETURN NULL;
            END $$;
            CREATE TRIGGER owners_cascade AFTER UPDATE ON sandbox_k8s_executions
                FOR EACH ROW WHEN (NEW.execution_state = 'replaced')
                EXECUTE FUNCTION owners_cascade();
            """
        )
        cascaded = [name.replace("-g1", "-g2") for name in names[:3]]
        await conn.executemany(
            "UPDATE sandbox_k8s_executions SET pod_name = $2 WHERE pod_name = $1",
            list(zip(names[3:], cascaded, strict=True)),
        )
        async with raw_payloads(planner_url) as payloads:
            await payloads.drain()
            payloads.clear()
            await conn.execute(
                "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced'"
                " WHERE pod_name = ANY($1)",
                names[:3],
            )
            await payloads.drain()
        expected = [["update", name, False, "replaced"] for name in names[:3]] + [
            ["update", name, False, "cancelled"] for name in cascaded
        ]
        assert sorted(_rows(payloads)) == sorted(expected)  # type: ignore[type-var]
    finally:
        await conn.close()


async def test_worst_case_rows_never_reach_the_payload_limit(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # Texts longer than the cut and made of characters JSON escapes to 6 bytes (\u0001), of
    # 2-byte escapes ("), of multibyte characters, mixed with ordinary rows and many of them:
    # the trigger must never build a payload of 8000 bytes or more (pg_notify would raise and
    # abort this statement), and every row must arrive, cut as 0002 cut it.
    rng = random.Random(21)
    alphabets = ["\x01", '"', "\\", "é", "\u20ac", "\U0001f600", "a", '\x01a"é']
    specs: list[tuple[str, str, str]] = []
    for i in range(400):

        def text(n: int) -> str:
            alphabet = rng.choice(alphabets)
            return "".join(rng.choice(alphabet) for _ in range(n))

        long_ns, long_pod = rng.random() < 0.5, rng.random() < 0.5
        namespace = text(rng.choice([300, 253, 600])) if long_ns else NAMESPACE
        pod = f"p{i:04d}" + (text(rng.choice([249, 300, 1000])) if long_pod else "")
        state = text(rng.choice([64, 65, 200])) if rng.random() < 0.5 else "replaced"
        specs.append((namespace, pod, state))
    specs += [(NAMESPACE, f"space-sbx-n{i}-g1", "replaced") for i in range(3000)]
    async with raw_payloads(pg_url) as payloads:
        async with pg_conn.transaction():
            await pg_conn.executemany(
                "INSERT INTO sandboxes VALUES ($1, $2, 'kubernetes')",
                [(f"w{i}", ns) for i, (ns, _, _) in enumerate(specs)],
            )
            await pg_conn.execute(
                "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
                " pod_name, pod_kind, execution_state, active)"
                " SELECT 'w' || (u.i - 1), 1, 0, u.pod, 'create', u.state, false"
                " FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(pod, state, i)",
                [pod for _, pod, _ in specs],
                [state for _, _, state in specs],
            )
        await payloads.drain()
    sizes = [len(p.encode()) for p in payloads]
    assert max(sizes) < 8000
    assert len(payloads) < len(specs) / 10
    rows = _rows(payloads)
    expected = sorted(["insert", pod[:253], False, st[:64]] for _, pod, st in specs)
    assert sorted(rows) == expected  # type: ignore[type-var]
    # The listener parses every one of them.
    for payload in payloads:
        parsed = parse_payload(payload, received_at_s=0, namespaces=(NAMESPACE,))
        assert parsed.malformed == 0 and parsed.changes
    # The worst row alone, through the one-row path of each trigger event.
    worst_ns, worst_pod, worst_state = "\x01" * 600, "\x01" * 1000, "\x01" * 200
    async with raw_payloads(pg_url) as payloads:
        await pg_conn.execute("INSERT INTO sandboxes VALUES ('worst', $1, 'kubernetes')", worst_ns)
        await pg_conn.execute(
            "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
            " pod_name, pod_kind, execution_state, active) VALUES ('worst', 1, 0, $1, 'create',"
            " $2, false)",
            worst_pod,
            worst_state,
        )
        for active in (True, False):
            await pg_conn.execute(
                "UPDATE sandbox_k8s_executions SET active = $1 WHERE sandbox_id = 'worst'", active
            )
        await pg_conn.execute("DELETE FROM sandbox_k8s_executions WHERE sandbox_id = 'worst'")
        await payloads.drain()
    # The bound, exactly reached (`true` is a byte shorter than `false`).
    assert [len(p.encode()) for p in payloads] == [1937, 1936, 1937, 1937]
    assert [payload_rows(p) for p in payloads] == [
        [["insert", worst_pod[:253], False, worst_state[:64]]],
        [["update", worst_pod[:253], True, worst_state[:64]]],
        [["update", worst_pod[:253], False, worst_state[:64]]],
        [["delete", worst_pod[:253], False, worst_state[:64]]],
    ]


async def _insert_spread(
    conn: asyncpg.Connection,
    rows: Sequence[tuple[str, str, str]],
    *,
    prefix: str,
    active: bool = True,
) -> None:
    """One sandbox and one execution per (namespace, pod_name, state), in one INSERT; each
    execution ``active`` as given."""
    await conn.execute(
        "INSERT INTO sandboxes SELECT $1 || u.i, u.ns, 'kubernetes'"
        " FROM unnest($2::text[]) WITH ORDINALITY AS u(ns, i)",
        prefix,
        [ns for ns, _, _ in rows],
    )
    await conn.execute(
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active)"
        " SELECT $1 || u.i, 1, 0, u.pod, 'create', u.state, $4"
        " FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS u(pod, state, i)",
        prefix,
        [pod for _, pod, _ in rows],
        [state for _, _, state in rows],
        active,
    )


async def test_a_statement_of_many_small_groups_packs_them(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # Every row its own state, so its own group: the groups are packed many to a payload.
    spread = [(f"tenant-{i}", f"space-sbx-t{i}-g1", f"state-{i}") for i in range(2000)]
    await _insert_spread(pg_conn, spread, prefix="t")
    async with raw_payloads(pg_url) as payloads:
        await payloads.drain()
        payloads.clear()
        await pg_conn.execute("UPDATE sandbox_k8s_executions SET active = false")
        await payloads.drain()
    assert max(len(p.encode()) for p in payloads) < 8000
    assert len(payloads) <= 2000 // 50
    assert sorted(_rows(payloads)) == sorted(  # type: ignore[type-var]
        ["update", pod, False, state] for _, pod, state in spread
    )


async def test_slices_that_escaping_makes_too_long_go_name_by_name(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # A group's names are cut into slices sized for texts that need no escaping. Here one group
    # of names without a quote, one with a quote in every other name (its slices come out a
    # little longer, still within the limit) and one with a quote in each name and one of
    # names that are mostly 6-byte escapes (their slices would pass the limit: those names go
    # one piece each). Through an INSERT (inactive), a re-activation, a retirement and a DELETE
    # of all of them at once.
    def name(i: int, kind: str) -> str:
        if kind == "plain":
            return f"space-sbx-q{i:05d}-g1"
        if kind == "some-quotes":
            return f'space-sbx-q{i:05d}-g"' if i % 2 else f"space-sbx-q{i:05d}-g1"
        if kind == "quotes":
            return f'space-sbx-q{i:05d}-g"'
        return f"q{i:05d}" + "\x01" * 247

    kinds = ["plain", "some-quotes", "quotes", "escapes"]
    spread = [
        (NAMESPACE, name(i, kind), kind)
        for n, kind in enumerate(kinds)
        for i in range(n * 1000, n * 1000 + 700)
    ]
    async with raw_payloads(pg_url) as payloads:
        await payloads.drain()
        payloads.clear()
        await _insert_spread(pg_conn, spread, prefix="q", active=False)
        for active in (True, False):
            await pg_conn.execute(
                "UPDATE sandbox_k8s_executions SET active = $1 WHERE sandbox_id LIKE 'q%'",
                active,
            )
        await pg_conn.execute("DELETE FROM sandbox_k8s_executions WHERE sandbox_id LIKE 'q%'")
        await payloads.drain()
    assert max(len(p.encode()) for p in payloads) < 8000
    expected = [
        [op, pod[:253], active, state]
        for op, active in (
            ("insert", False),
            ("update", True),
            ("update", False),
            ("delete", False),
        )
        for _, pod, state in spread
    ]
    assert sorted(_rows(payloads)) == sorted(expected)  # type: ignore[type-var]
    # The plain names go about 370 a payload; the escaped ones (1,500 bytes each) 5 a payload.
    assert len(payloads) <= 4 * (3 * 700 // 300 + 700 // 4)


@pytest.mark.parametrize(
    "odd",
    ['a"b', "a\\b", "a\x1fb", "a\nb", "\u00e9" * 254, "x" * 300],
    ids=["quote", "backslash", "control", "newline", "multibyte-over-the-cut", "over-the-cut"],
)
async def test_one_odd_text_among_plain_rows_of_a_statement_arrives_as_it_is(
    pg_url: str, pg_conn: asyncpg.Connection, odd: str
) -> None:
    # The trigger cuts a group's names into slices sized for texts that need no escaping, and
    # measures each slice's piece; one text needing JSON escaping (or a cut) among 500 plain
    # rows must still arrive exactly,
    # through every event: an INSERT, an UPDATE and a DELETE of many inactive rows at once.
    names = [f"space-sbx-o{i}-g1" for i in range(500)]
    pods = [*names[:250], f"p-{odd}", *names[250:]]
    await pg_conn.execute(
        "INSERT INTO sandboxes SELECT 'o' || i, $1, 'kubernetes' FROM generate_series(0, 500) i",
        NAMESPACE,
    )
    async with raw_payloads(pg_url) as payloads:
        await payloads.drain()
        payloads.clear()
        await pg_conn.execute(
            "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
            " pod_name, pod_kind, execution_state, active)"
            " SELECT 'o' || (u.i - 1), 1, 0, u.pod, 'create', 'suspended', false"
            " FROM unnest($1::text[]) WITH ORDINALITY AS u(pod, i)",
            pods,
        )
        await pg_conn.execute("UPDATE sandbox_k8s_executions SET execution_state = 'replaced'")
        await pg_conn.execute("DELETE FROM sandbox_k8s_executions")
        await payloads.drain()
    assert len(payloads) >= 3
    assert max(len(p.encode()) for p in payloads) < 8000
    rows = _rows(payloads)
    expected = (
        [["insert", pod[:253], False, "suspended"] for pod in pods]
        + [["update", pod[:253], False, "replaced"] for pod in pods]
        + [["delete", pod[:253], False, "replaced"] for pod in pods]
    )
    assert sorted(rows) == sorted(expected)  # type: ignore[type-var]


async def test_bad_parts_of_a_payload_and_payloads_of_another_shape_are_counted_and_skipped(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # A bad name hides neither its group's other names nor the other groups; a group whose facts
    # are bad loses its names (each counted), a non-group counts once. A payload of another shape
    # (0002's object, 0003's earlier `rows` and `groups`: no shipped trigger sends them) or one
    # too long is skipped whole and counted once.
    handler, registry = RecordingHandler(), CollectorRegistry()
    pods = json.dumps(
        {
            "pods": [
                ["update", False, "replaced", ["d", "", 7]],
                ["delete", None, None, ["e"]],
                ["truncate", None, None, ["f", "g"]],
                "junk",
                ["insert", True, "active", ["h"]],
            ]
        }
    )
    single = json.dumps(
        {
            "op": "update",
            "namespace": NAMESPACE,
            "pod_name": "a",
            "active": False,
            "execution_state": "suspended",
        }
    )
    rows = json.dumps({"rows": [["update", NAMESPACE, "b", False, "replaced"]]})
    groups = json.dumps({"groups": [["update", NAMESPACE, False, "replaced", ["c"]]]})
    async with running(db_settings(pg_url), handler, registry) as listener:
        for payload in (single, rows, pods, groups, "x" * 8000):
            await pg_conn.execute("SELECT pg_notify($1, $2)", DEFAULT_CHANNEL, payload[:7999])
        await listener.sync()
    assert [[c.pod_name for c in b] for b in handler.batches] == [["d", "e", "h"]]
    assert handler.changes[0].retired and handler.changes[1].deleted
    assert handler.changes[2].active is True and not handler.changes[2].retired
    # Two bad names, two names of a bad group and one non-group; three payloads of another
    # shape; and the junk payload.
    assert metric(registry, "retired_pod_gc_notifications_malformed_total") == 9
    assert metric(registry, "retired_pod_gc_notifications_total") == 5


async def test_a_one_row_statement_says_what_the_same_row_says_in_a_batch(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # One-row statements take the trigger's short path; the payload must be the general path's.
    names = await _seed_many(pg_conn, 3, prefix="o")
    weird = 'space-sbx-"\\\x01é-g1'
    await pg_conn.execute(
        "UPDATE sandbox_k8s_executions SET pod_name = $1 WHERE pod_name = $2", weird, names[2]
    )
    names[2] = weird
    async with raw_payloads(pg_url) as payloads:
        await payloads.drain()
        payloads.clear()
        retire = (
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced'"
            " WHERE pod_name = ANY($1)"
        )
        reactivate = (
            "UPDATE sandbox_k8s_executions SET active = true, execution_state = 'active'"
            " WHERE pod_name = ANY($1)"
        )
        for name in names:
            await pg_conn.execute(retire, [name])
        await payloads.drain()
        alone = [payload_rows(p) for p in payloads]
        payloads.clear()
        await pg_conn.execute(reactivate, names)
        await pg_conn.execute(retire, names)
        await payloads.drain()
        together = payload_rows(payloads[-1])
    assert alone == [[r] for r in sorted(together, key=lambda r: names.index(str(r[1])))]
    assert together[0][0] == "update"
    assert [a[0][1] for a in alone] == names
    # One group: the three share op, active and state.
    assert len(json.loads(payloads[-1])["pods"]) == 1


@pytest.mark.parametrize("rows", [1, 2])
async def test_an_update_of_the_key_itself_reports_the_old_row_deleted_and_the_new_inserted(
    rows: int, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    names = await _seed_many(pg_conn, rows, prefix=f"k{rows}", active=False)
    async with raw_payloads(pg_url) as payloads:
        await payloads.drain()
        payloads.clear()
        ids = await pg_conn.fetch(
            "SELECT id FROM sandbox_k8s_executions WHERE pod_name = ANY($1) ORDER BY id", names
        )
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET id = id + 1000000 WHERE pod_name = ANY($1)", names
        )
        await payloads.drain()
        reported = sorted(_rows(payloads))  # type: ignore[type-var]
    assert len(ids) == rows
    assert reported == sorted(
        [op, name, False, "suspended"] for name in names for op in ("delete", "insert")
    )


async def test_a_change_is_handed_on_in_every_watched_namespace(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # The trigger's payload names pods, not namespaces (pod_name is unique): each change is the
    # change of that name in every watched namespace, whatever namespace its sandbox row says;
    # the service checks the pod's namespace against the row's when it reads the row.
    spread = [("b1", NAMESPACE), ("b2", "tenant-b"), ("b3", "elsewhere")]
    for sandbox, namespace in spread:
        await seed_sandbox(pg_conn, sandbox, namespace=namespace)
        await seed_execution(pg_conn, pod_name=f"space-sbx-{sandbox}-g1", sandbox_id=sandbox)
    handler, registry = RecordingHandler(), CollectorRegistry()
    listener = RetirementListener(
        db_settings(pg_url),
        metrics=PgMetrics(registry),
        probe=probe_sender(pg_url),
        namespaces=(NAMESPACE, "tenant-b"),
    )
    listener.add_handler(handler)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            await tg.start(listener.run)
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced'"
        )
        await _retire(pg_conn, "space-sbx-b1-g1", "suspended")
        await listener.sync()
        tg.cancel_scope.cancel()
    pods = [f"space-sbx-{sandbox}-g1" for sandbox, _ in spread]
    assert len(handler.batches) == 2
    assert sorted((c.namespace, c.pod_name) for c in handler.batches[0]) == sorted(
        (namespace, pod) for namespace in (NAMESPACE, "tenant-b") for pod in pods
    )
    assert [(c.namespace, c.pod_name, c.state) for c in handler.batches[1]] == [
        (NAMESPACE, "space-sbx-b1-g1", ExecutionState.SUSPENDED),
        ("tenant-b", "space-sbx-b1-g1", ExecutionState.SUSPENDED),
    ]
    assert metric(registry, "retired_pod_gc_notifications_total") == 2
