"""``RetirementListener`` end to end: trigger → NOTIFY → handler, and recovery from each failure.

The three failure modes each have a test that fails without its recovery code:

* closed connection (``pg_terminate_backend``): the heartbeat is set to a minute, so only the
  termination listener can notice in time;
* server stop/start: the same, plus connect attempts that must be retried until it is back;
* silent death (a proxy that stops forwarding but keeps both sockets open): only the heartbeat
  can notice, and it must do so within interval + timeout.

Between attempts the listener waits on its injected clock: under a ``FakeClock`` each backoff is
a timer the test can read and fire.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from devtools.pg.throwaway import ThrowawayPostgres
from service.config import DatabaseSettings
from service.domain import ExecutionChange, ExecutionState
from service.kit.backoff import Backoff
from service.kit.clock import FakeClock
from service.kit.errors import Unavailable
from service.metrics import Metrics
from service.pg.errors import ListenerUnavailable
from service.pg.listener import BACKOFF_MAX_S, RetirementListener
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from tests.pgfixtures import NAMESPACE, db_settings, metric, seed_execution, seed_sandbox

pytestmark = pytest.mark.anyio

POD = "space-sbx-s1-g1"


class RecordingHandler:
    """An ``ExecutionEventHandler`` that records what it is told."""

    def __init__(self) -> None:
        self.changes: list[ExecutionChange] = []
        self.missed = 0

    def execution_changed(self, change: ExecutionChange) -> None:
        self.changes.append(change)

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
    settings: DatabaseSettings, handler: RecordingHandler, registry: CollectorRegistry
) -> AsyncIterator[RetirementListener]:
    listener = RetirementListener(
        settings,
        metrics=Metrics(registry),
        backoff=Backoff(initial_s=0.05, max_s=0.5, jitter=0.5),
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
    clock = FakeClock(start_s=1000.0)
    listener = RetirementListener(db_settings(pg_url), metrics=Metrics(registry), clock=clock)
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
            clock.advance(1000.0)
        await wait_for(lambda: len(handler.changes) == 1, timeout_s=5, what="notification")
        change = handler.changes[0]
        assert change == ExecutionChange(
            namespace=NAMESPACE,
            pod_name=POD,
            active=False,
            state=ExecutionState.SUSPENDED,
            deleted=False,
            received_at_s=2000.0,
        )
        assert change.retired
        tg.cancel_scope.cancel()
    assert not listener.connected
    assert metric(registry, "retired_pod_gc_listener_connected") == 0
    assert metric(registry, "retired_pod_gc_notifications_total") == 1


async def test_insert_delete_and_unrelated_updates(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    await seed_sandbox(pg_conn, "s1")
    handler, registry = RecordingHandler(), CollectorRegistry()
    async with running(db_settings(pg_url), handler, registry):
        await seed_execution(pg_conn, pod_name=POD, sandbox_id="s1")
        await wait_for(lambda: len(handler.changes) == 1, timeout_s=5, what="insert")
        inserted = handler.changes[0]
        assert (inserted.active, inserted.state, inserted.deleted) == (
            True,
            ExecutionState.ACTIVE,
            False,
        )
        # Neither active nor execution_state changes: no notification.
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
        async with running(settings, handler, registry) as listener:
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
            metrics=Metrics(registry),
            backoff=Backoff(initial_s=0.02, max_s=BACKOFF_MAX_S, jitter=0.5),
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
        async with running(settings, handler, registry) as listener:
            await listener.sync()
            assert proxy.stall_existing() == 1
            started = time.monotonic()
            with pytest.raises(ListenerUnavailable) as raised:
                await listener.sync()
            assert time.monotonic() - started < 2
            assert isinstance(raised.value, Unavailable)
            assert isinstance(raised.value.__cause__, TimeoutError)


async def test_sync_without_a_connection_raises_a_kit_unavailable() -> None:
    listener = RetirementListener(
        db_settings("postgresql://postgres@127.0.0.1:1/none"), metrics=Metrics(CollectorRegistry())
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


@contextlib.contextmanager
def _refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connect there is refused, and nobody else can
    take the port while the test runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def _next_timer(clock: FakeClock) -> float:
    """The delay of the next timer the listener sets on ``clock`` (it sets one after each failed
    attempt, once the real connect has failed)."""
    with anyio.fail_after(5):
        while (deadline := clock.next_deadline) is None:
            await anyio.sleep(0.005)
    return deadline - clock.monotonic()


async def test_reconnect_delays_follow_the_backoff_policy_on_the_injected_clock() -> None:
    clock, handler = FakeClock(), RecordingHandler()

    def policy() -> Backoff:
        return Backoff(initial_s=0.1, max_s=1.6, jitter=0.5, rng=random.Random(7))

    twin = policy()  # the same draws, in the same order, as the listener's
    with _refusing_port() as port:
        listener = RetirementListener(
            db_settings(f"postgresql://postgres@127.0.0.1:{port}/none", connect_timeout_s=2.0),
            metrics=Metrics(CollectorRegistry()),
            clock=clock,
            backoff=policy(),
        )
        listener.add_handler(handler)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.run)
            delays = []
            for failures in range(8):
                delay = await _next_timer(clock)
                assert delay == pytest.approx(twin.delay_s(failures), abs=1e-9)
                delays.append(delay)
                clock.advance(delay)
            tg.cancel_scope.cancel()
    assert not listener.connected and handler.missed == 0
    # Doubling from 0.1 s (equal jitter: each within [d/2, d]) up to the cap.
    for failures, delay in enumerate(delays):
        base = min(1.6, 0.1 * 2**failures)
        assert base / 2 <= delay <= base


async def test_a_successful_listen_resets_the_backoff(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    clock, handler = FakeClock(), RecordingHandler()

    def policy() -> Backoff:
        return Backoff(initial_s=0.1, max_s=30.0, jitter=0.5, rng=random.Random(11))

    twin = policy()
    port = int(pg_url.rsplit(":", 1)[1].split("/", 1)[0])
    async with StallableProxy(port) as proxy, anyio.create_task_group() as tg:
        proxy.pause_accepting()
        settings = db_settings(
            pg_url.replace(f":{port}/", f":{proxy.port}/"),
            connect_timeout_s=2.0,
            heartbeat_interval_s=3600.0,  # no heartbeat timer among the backoff timers
        )
        listener = RetirementListener(
            settings,
            metrics=Metrics(CollectorRegistry()),
            clock=clock,
            backoff=policy(),
        )
        listener.add_handler(handler)
        tg.start_soon(listener.run)
        for failures in range(3):
            delay = await _next_timer(clock)
            assert delay == pytest.approx(twin.delay_s(failures), abs=1e-9)
            if failures == 2:
                proxy.resume_accepting()
            clock.advance(delay)
        await wait_for(lambda: listener.connected, timeout_s=5, what="connected")
        assert handler.missed == 1
        assert await pg_conn.fetchval(
            "SELECT pg_terminate_backend($1)", await _listener_pid(pg_conn)
        )
        await wait_for(lambda: not listener.connected, timeout_s=5, what="the loss noticed")
        # Three failures before the success; after it, the count starts from zero again.
        assert await _next_timer(clock) == pytest.approx(twin.delay_s(0), abs=1e-9)
        tg.cancel_scope.cancel()


async def test_changes_of_namespaces_not_watched_are_counted_and_not_handed_on(
    pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    # One channel carries every namespace's changes; the listener hands on its namespaces' only.
    for sandbox, namespace in (("s1", NAMESPACE), ("s2", "tenant-b"), ("s3", "elsewhere")):
        await seed_sandbox(pg_conn, sandbox, namespace=namespace)
        await seed_execution(pg_conn, pod_name=f"space-sbx-{sandbox}-g1", sandbox_id=sandbox)
    handler, registry = RecordingHandler(), CollectorRegistry()
    listener = RetirementListener(
        db_settings(pg_url), metrics=Metrics(registry), namespaces=(NAMESPACE, "tenant-b")
    )
    listener.add_handler(handler)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            await tg.start(listener.run)
        # (The trigger fires on a change only: s3 is retired twice, in two states.)
        for sandbox, state in (("s3", "suspended"), ("s1", "suspended"), ("s3", "replaced")):
            await _retire(pg_conn, f"space-sbx-{sandbox}-g1", state)
        await _retire(pg_conn, "space-sbx-s2-g1")
        await wait_for(lambda: len(handler.changes) == 2, timeout_s=5, what="two notifications")
        # The sync round trip: every notification committed before it has been handled.
        await listener.sync()
        tg.cancel_scope.cancel()
    assert [(c.namespace, c.pod_name) for c in handler.changes] == [
        (NAMESPACE, "space-sbx-s1-g1"),
        ("tenant-b", "space-sbx-s2-g1"),
    ]
    assert metric(registry, "retired_pod_gc_notifications_total") == 4
    assert metric(registry, "retired_pod_gc_notifications_ignored_total") == 2
