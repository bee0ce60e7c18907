"""A model of the database behind the product's real PostgreSQL adapter code.

The seam is the ``asyncpg`` module: :func:`connect` (the listener's own connection) and
:func:`create_pool` (the store's pool) are swapped in for ``asyncpg.connect`` and
``asyncpg.create_pool`` while a seed runs, so ``PgExecutionStore`` (its micro-batcher, its
store-owned query tasks, ``decode_row``, the error edge of ``service/pg/errors.py``) and
``RetirementListener`` (connect, LISTEN, the delivery probes, reconnect with backoff, payload
parsing, ``sync()``) run unchanged. Failures are raised as asyncpg raises them
(``ConnectionDoesNotExistError``, ``ConnectionRefusedError``, a server error with a severity,
``TimeoutError`` for ``timeout=``), so the product's mapping to kit errors is exercised too.

:class:`Database` is the server: rows and the sandboxes they join, transactions applied at their
COMMIT, and every NOTIFY queued at its COMMIT, in commit order, to every connection that
listens on its channel: the trigger's (only for the changes that can start or stop a clock,
:func:`trigger_notifies`), and the listener's delivery probes (``pg_notify`` on the
listener's own channel, committed by a pooled connection: :data:`NOTIFY_SQL`, answered at the
instant it reaches the model, so it is ordered with the writers' commits by that instant). A
listening connection's answers and notifications come back through one FIFO pipe (the socket),
so a probe committed after a change arrives after that change's notification — the property
``RetirementListener.sync()`` relies on. A stalled pipe holds everything back (a black-holed
proxy); a killed backend ends the connection (``pg_terminate_backend``); a restart kills every
backend and refuses connections for a while.

A listening connection may also *drop* its notifications (:attr:`ListenConn.drops`): what a
transaction-mode pooler does (PgBouncer logs ``got packet 'A' from server when not linked``):
the connection stays up, its LISTEN succeeded and its queries are answered, but every
notification the server sends it from then on is lost on the way, for the rest of the
connection's life. The world makes one connection drop from some instant on, or sends every
listener connection opened during a window through such a pooler
(:meth:`Database.drop_notifications`, :attr:`Database.pooler_until`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec

from service.pg.store import FRESH_SQL, LOOKUP_SQL, MANAGED_BY_KUBERNETES, RETIRED_SQL
from tests.chaos.model import NAMESPACE, RowTruth
from tests.sim.net import Call, Net

_encode = msgspec.json.encode


def _lost() -> BaseException:
    return asyncpg.exceptions.ConnectionDoesNotExistError(
        "connection was closed in the middle of operation"
    )


def _server_error() -> BaseException:
    exc = asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout")
    exc.severity = "ERROR"  # sent by the server (asyncpg's own errors carry none)
    return exc


@dataclass(slots=True)
class Reread:
    time: float
    name: str


NOTIFY_SQL = "SELECT pg_notify($1, $2), pg_notification_queue_usage()"
"""The delivery probe's statement (``PgExecutionStore.notify``): a NOTIFY committed by a pooled
connection, answered with the notification queue's usage (0 here: the model's queue never
fills)."""

TRIGGER_CHANNEL = "sandbox_execution_changed"
"""The channel the trigger notifies on (``NOTIFY_CHANNEL``'s default; :attr:`Database.channel`)."""


def trigger_notifies(old: RowTruth | None, new: RowTruth | None) -> bool:
    """Whether trigger 0003 reports one row's change (``old`` before the commit, ``new`` after;
    ``None``: no row): only a change that can start or stop an observation clock
    (docs/architecture.md, "The change notifications"). An insert or a delete of an
    inactive row; an update of a row inactive before or after it (a retirement, a re-activation,
    a state change while inactive) that changes ``active`` or ``execution_state``. Inserts,
    deletes and changes of active rows send nothing. The model keys rows by pod name, so a
    change of ``pod_name`` is what the trigger reports it as: the old name's row deleted and the
    new name's inserted. The one rule of the model; the mutation check replaces it by this name
    (``tests/chaos/removals.py``, ``TRIGGER_REMOVALS``)."""
    if old is None:
        return new is not None and not new.active
    if new is None:
        return not old.active
    return (not old.active or not new.active) and (
        old.active != new.active or old.state != new.state
    )


class Database:
    def __init__(self, net: Net) -> None:
        self.net = net
        self.trace = net.trace
        self.rows: dict[str, RowTruth] = {}
        self.channel = TRIGGER_CHANNEL
        """The channel the trigger's notifications go out on."""
        self.listening: dict[ListenConn, None] = {}
        """The connections that LISTEN on some channel. Dicts, not sets, everywhere the models
        iterate: insertion order, not addresses."""
        self.pooler_until = 0.0
        """Listener connections opened before this instant go through a transaction-mode pooler
        (they drop every notification, for their whole life)."""
        self.conns: dict[Conn, None] = {}
        self.down_until = 0.0
        self.rereads: dict[str, list[float]] = {}
        """Server time of every final re-read (``FRESH_SQL``) of a row, by pod name."""
        self.listener_connects: list[float] = []
        self.on_commit: Callable[[str, RowTruth | None], None] = lambda name, row: None
        self._pid = 100
        self.batch_rows = 1
        """At most this many names a payload (trigger 0003's ``pods``; the real trigger's bound
        is in bytes, about 370 plain names)."""

    # -- the writers' side -----------------------------------------------------------------

    def commit(self, changes: dict[str, RowTruth | None], *, silent: bool = False) -> None:
        """One transaction, committed now; the trigger's notifications go out in this order
        (none when ``silent``: a writer that bypasses the trigger)."""
        reported: list[list[Any]] = []
        for name, new in changes.items():
            old = self.rows.get(name)
            if new is None:
                self.rows.pop(name, None)
                op = "delete"
                shown = old
            else:
                self.rows[name] = new
                op = "insert" if old is None else "update"
                shown = new
            self.on_commit(name, new)
            if shown is not None and not silent and trigger_notifies(old, new):
                reported.append([op, name, shown.active, shown.state])
        payloads = self._payloads(reported)
        self.trace(
            "pg COMMIT "
            + " ".join(
                f"{n}={'-' if r is None else ('active' if r.active else r.state)}"
                for n, r in changes.items()
            )
            + (" silent" if silent else "")
        )
        for payload in payloads:
            self._notify(self.channel, payload)

    def notify(self, channel: str, payload: str) -> None:
        """``pg_notify(channel, payload)`` in a transaction of its own, committed now."""
        self.trace(f"pg COMMIT NOTIFY {channel} {payload}")
        self._notify(channel, payload)

    def _notify(self, channel: str, payload: str) -> None:
        for conn in list(self.listening):
            conn.send_notification(channel, payload)

    def _payloads(self, reported: list[list[Any]]) -> list[str]:
        """The NOTIFY payloads of one commit's changes, as trigger 0003 sends them."""
        n = self.batch_rows
        # As trigger 0003: the changes grouped by (op, active, state), no namespace, the order
        # of the commit lost but for the groups' first appearance; each payload at most n names.
        groups: dict[tuple[Any, ...], list[str]] = {}
        for op, name, active, state in reported:
            groups.setdefault((op, active, state), []).append(name)
        payloads: list[str] = []
        part: list[list[Any]] = []
        room = n
        for head, names in groups.items():
            for i in range(0, len(names), n):
                chunk = names[i : i + n]
                if len(chunk) > room:
                    payloads.append(_encode({"pods": part}).decode())
                    part, room = [], n
                part.append([*head, chunk])
                room -= len(chunk)
        if part:
            payloads.append(_encode({"pods": part}).decode())
        return payloads

    def kill(self, app: str) -> None:
        """``pg_terminate_backend`` of every connection of ``app`` ('' for all)."""
        self.trace(f"pg kill {app or 'all'}")
        for conn in list(self.conns):
            if not app or conn.app == app:
                conn.server_close()

    def restart(self, down_s: float) -> None:
        self.kill("")
        self.down_until = self.net.loop.time() + down_s
        self.trace(f"pg restart, down {down_s:.3f}s")

    def drop_notifications(self) -> None:
        """Every listening connection drops the notifications sent to it from now on, for the
        rest of its life (its pooler no longer links it to the backend that LISTENs)."""
        for conn in self.listening:
            if not conn.drops:
                conn.drops = True
                self.trace(f"pg listener {conn.pid} drops notifications")

    def stall_listeners(self) -> None:
        for conn in self.listening:
            conn.stalled = True

    def unstall(self) -> None:
        for conn in list(self.conns):
            if isinstance(conn, ListenConn) and conn.stalled:
                conn.unstall()

    # -- queries ---------------------------------------------------------------------------

    def run(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """``LOOKUP_SQL`` (or ``FRESH_SQL``): the rows of the pod names asked for, each with its
        columns (``COLUMNS``)."""
        if sql == RETIRED_SQL:
            return self._retired(args)
        assert sql in (LOOKUP_SQL, FRESH_SQL), f"a statement the model does not know: {sql!r}"
        asked, namespaces, managed = args
        assert managed == MANAGED_BY_KUBERNETES
        now = self.net.loop.time()
        fresh = sql == FRESH_SQL
        names = sorted(set(asked))
        if fresh:
            for name in names:
                self.rereads.setdefault(name, []).append(now)
        out = []
        for name in names:
            row = self.rows.get(name)
            if row is None or not row.managed or NAMESPACE not in namespaces:
                continue
            out.append(
                (
                    name,
                    NAMESPACE,
                    row.sandbox_id,
                    row.generation,
                    0,
                    row.pod_kind,
                    row.state,
                    row.active,
                )
            )
        self.trace(f"pg {'REREAD' if fresh else 'LOOKUP'} {','.join(names)} -> {len(out)}")
        return out

    def _retired(self, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """``RETIRED_SQL``: the inactive rows among the names asked for, of the namespace, with
        ``retired_at`` (the model keeps none: NULL)."""
        asked, namespace, managed = args
        assert managed == MANAGED_BY_KUBERNETES
        out = []
        for name in sorted(set(asked)):
            row = self.rows.get(name)
            if row is None or not row.managed or row.active or namespace != NAMESPACE:
                continue
            out.append(
                (
                    name,
                    NAMESPACE,
                    row.sandbox_id,
                    row.generation,
                    0,
                    row.pod_kind,
                    row.state,
                    row.active,
                    None,
                )
            )
        self.trace(f"pg RETIRED {len(set(asked))} names -> {len(out)}")
        return out

    def next_pid(self) -> int:
        self._pid += 1
        return self._pid


class Conn:
    """A server connection (a backend) as the client holds it."""

    app = "retired-pod-gc"

    def __init__(self, db: Database) -> None:
        self.db = db
        self.net = db.net
        self.pid = db.next_pid()
        self.server_closed = False
        self.client_closed = False
        self.calls: dict[Call, None] = {}
        db.conns[self] = None

    def is_closed(self) -> bool:
        return self.client_closed

    def server_close(self) -> None:
        """The backend is gone; the client learns it when the connection reset reaches it."""
        if self.server_closed:
            return
        self.server_closed = True
        self.db.conns.pop(self, None)
        self._reset_reaches_client()

    def _reset_reaches_client(self) -> None:
        self.net.at(self.net.latency(), self._client_lost)

    def _client_lost(self) -> None:
        self.client_closed = True
        for call in list(self.calls):
            call.fail(_lost(), 0.0)
        self.calls.clear()

    def terminate(self) -> None:
        self.client_closed = True
        self.server_closed = True
        self.db.conns.pop(self, None)
        for call in list(self.calls):
            call.fail(_lost(), 0.0)
        self.calls.clear()

    def _fault(self) -> str | None:
        net = self.net
        armed = net.take_armed("pg")
        if armed is not None:
            fault: str = armed
            return fault
        if net.fails():
            r = net.rng.random()
            return "reset" if r < 0.4 else "error" if r < 0.7 else "slow"
        return None

    async def _request(
        self, timeout: float | None, at_server: Callable[[Call], None], extra_s: float = 0.0
    ) -> Any:
        if self.client_closed:
            raise asyncpg.exceptions.InterfaceError("connection is closed")
        net = self.net
        call = Call(net, timeout)
        self.calls[call] = None
        fault = self._fault()
        up = net.latency() + extra_s + (net.rng.uniform(0.5, 3.0) if fault == "slow" else 0.0)

        def arrive() -> None:
            if self.server_closed:
                return  # nobody answers; the reset tells the client
            if fault == "reset":
                net.trace(f"pg {self.app} reset")
                self.server_close()
                return
            if fault == "error":
                net.trace(f"pg {self.app} error")
                call.fail(_server_error())
                return
            at_server(call)

        net.at(up, arrive)
        try:
            return await call.wait()
        finally:
            self.calls.pop(call, None)


class PoolConn(Conn):
    async def fetch(self, sql: str, *args: Any, timeout: float | None = None) -> list[Any]:
        db = self.db
        if sql == NOTIFY_SQL:

            def at_server(call: Call) -> None:
                channel, payload = args
                db.notify(channel, payload)
                call.answer([(None, 0.0)])

        else:

            def at_server(call: Call) -> None:
                call.answer(db.run(sql, args))

        result: list[Any] = await self._request(timeout, at_server)
        return result


class Pool:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.idle: list[PoolConn] = []
        self.closed = False

    async def acquire(self) -> PoolConn:
        if self.closed:
            raise asyncpg.exceptions.InterfaceError("pool is closed")
        while self.idle:
            conn = self.idle.pop()
            if not conn.is_closed():
                return conn
        await _connect_round_trip(self.db, None)
        return PoolConn(self.db)

    async def release(self, conn: PoolConn, *, timeout: float | None = None) -> None:
        if not conn.is_closed() and not self.closed:
            self.idle.append(conn)

    async def close(self) -> None:
        self.terminate()

    def terminate(self) -> None:
        self.closed = True
        for conn in self.idle:
            conn.terminate()
        self.idle.clear()


async def _connect_round_trip(db: Database, timeout: float | None) -> None:
    net = db.net
    call = Call(net, timeout)
    fault = net.take_armed("connect") if net.faults_on else None

    def arrive() -> None:
        if net.loop.time() < db.down_until or fault == "refused" or net.fails():
            call.fail(ConnectionRefusedError(111, "Connection refused"))
        else:
            call.answer(None)

    net.at(net.latency(), arrive)
    await call.wait()


class ListenConn(Conn):
    """The listener's connection: replies and notifications through one FIFO pipe."""

    app = "retired-pod-gc-listener"

    def __init__(self, db: Database, *, drops: bool = False) -> None:
        super().__init__(db)
        self.stalled = False
        self.drops = drops
        """Every notification the server sends this connection is lost on the way (a
        transaction-mode pooler between them); replies still come back."""
        self.channels: dict[str, None] = {}
        """The channels the backend LISTENs on (server side)."""
        self._items: deque[tuple[float, str, Any]] = deque()
        self._last_at = 0.0
        self._listeners: dict[str, Callable[..., object]] = {}
        self._on_terminated: list[Callable[[object], object]] = []

    # -- the pipe (server -> client) -------------------------------------------------------

    def pipe(self, kind: str, payload: Any) -> None:
        loop = self.net.loop
        at = max(self._last_at, loop.time() + self.net.latency())
        self._last_at = at
        self._items.append((at, kind, payload))
        if not self.stalled:
            loop.call_at(at, self._pump)

    def send_notification(self, channel: str, payload: str) -> None:
        """The server sends a notification of ``channel`` (when this backend listens on it)."""
        if channel not in self.channels:
            return
        if self.drops:
            self.net.trace(f"pg listener {self.pid} lost {_shown(self.db, channel, payload)}")
            return
        self.pipe("notify", (channel, payload))

    def unstall(self) -> None:
        self.stalled = False
        loop = self.net.loop
        now = loop.time()
        self._last_at = max(self._last_at, now)
        self._items = deque((max(at, now), kind, p) for at, kind, p in self._items)
        for at, _, _ in self._items:
            loop.call_at(at, self._pump)
        self.net.trace("pg listener unstalled")

    def _pump(self) -> None:
        loop = self.net.loop
        now = loop.time()
        items = self._items
        while items and not self.stalled and items[0][0] <= now:
            _, kind, payload = items.popleft()
            if self.client_closed:
                continue
            if kind == "notify":
                channel, text = payload
                callback = self._listeners.get(channel)
                if callback is not None:
                    # As asyncpg: a plain callback is scheduled, not called, from the protocol.
                    loop.call_soon(callback, self, self.pid, channel, text)
                self.net.trace(f"pg listener got {_shown(self.db, channel, text)}")
            elif kind == "reply":
                call, value = payload
                call.deliver(value)
            elif kind == "closed":
                self._client_lost()

    def _reset_reaches_client(self) -> None:
        self.db.listening.pop(self, None)
        self.pipe("closed", None)

    def _client_lost(self) -> None:
        if self.client_closed:
            return
        super()._client_lost()
        loop = self.net.loop
        for callback in self._on_terminated:
            loop.call_soon(callback, self)

    def terminate(self) -> None:
        self.db.listening.pop(self, None)
        super().terminate()

    # -- asyncpg.Connection ----------------------------------------------------------------

    def add_termination_listener(self, callback: Callable[[object], object]) -> None:
        self._on_terminated.append(callback)

    async def add_listener(self, channel: str, callback: Callable[..., object]) -> None:
        def at_server(call: Call) -> None:
            self.channels[channel] = None
            self.db.listening[self] = None
            self.pipe("reply", (call, None))

        await self._request(None, at_server)
        # As asyncpg: the callback is registered once the LISTEN has returned (a notification
        # that reached the client before then finds none and is not handed on).
        self._listeners[channel] = callback


def _shown(db: Database, channel: str, payload: str) -> str:
    """A notification as the trace shows it: the trigger's by its payload, others by channel."""
    return payload if channel == db.channel else f"{channel} {payload}"


# -- the asyncpg module functions, as the product calls them ---------------------------------


class Asyncpg:
    """``connect`` and ``create_pool`` bound to one seed's :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def connect(self, dsn: str, *, timeout: float | None = None, **_: Any) -> ListenConn:
        db = self.db
        await _connect_round_trip(db, timeout)
        now = db.net.loop.time()
        pooled = now < db.pooler_until
        conn = ListenConn(db, drops=pooled)
        db.listener_connects.append(now)
        db.trace(f"pg listener connected{' through a transaction pooler' if pooled else ''}")
        return conn

    async def create_pool(self, dsn: str | None, **_: Any) -> Pool:
        """The store's pool (its ``connect=`` callback is not called: the pool's connections are
        the model's)."""
        return Pool(self.db)
