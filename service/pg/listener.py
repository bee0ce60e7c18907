"""The LISTEN side of the change trigger: one dedicated connection, kept alive, reconnected.

:class:`RetirementListener` holds its own connection (never a pooled one: a pool would reset it
and drop the LISTEN), decodes each payload (``service/pg/payload.py``; bad parts are logged,
counted and skipped) and hands the changes, as one unit, to every registered
``ports.ExecutionEventHandler``. It is also the reconciler's ``ports.NotificationBarrier``
(:meth:`~RetirementListener.sync`).

A connection counts as connected only once it has proven delivery: a NOTIFY on a channel of the
listener's own, sent through the query pool, came back on the listening connection within
``heartbeat_timeout_s`` (a LISTEN through a transaction-mode pooler succeeds, then drops every
notification). The same probe runs every ``heartbeat_interval_s``, so a closed connection, a
failover and a silently dead or deaf one (a black-holed path, a frozen proxy) are each noticed.
After every connection that proved delivery, ``notifications_missed()`` tells the handlers to
resync. Between attempts the listener backs off (the kit's ``Backoff``, equal jitter) and logs a
failure once per change of its cause.

Errors: :meth:`~RetirementListener.sync` raises :class:`~service.pg.errors.ListenerUnavailable`
when it cannot vouch for the notifications; :meth:`~RetirementListener.run` never raises for a
failure of the database (it reconnects), only for a bug.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable

import anyio
import asyncpg
from anyio.abc import TaskStatus

from service import checks
from service.config import DatabaseSettings
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ExternalError, Unavailable
from service.kit.timeouts import fail_after
from service.metrics import PgMetrics
from service.pg.connect import connect
from service.pg.errors import ListenerUnavailable, database_errors, describe
from service.pg.payload import parse_payload
from service.ports import ExecutionEventHandler

logger = logging.getLogger(__name__)

BACKOFF_MAX_S = 30.0
"""Cap of the delay between connection attempts after failures."""


def default_backoff() -> Backoff:
    """The reconnect policy: 0.1 s doubling up to :data:`BACKOFF_MAX_S`, equal jitter (each
    delay uniform in [d/2, d], so replicas cut off by one restart do not reconnect in lockstep)."""
    return Backoff(initial_s=0.1, max_s=BACKOFF_MAX_S, jitter=0.5)


class _ConnectionLost(Unavailable):
    """Internal: the watch loop noticed the connection is gone (message says how)."""


ProbeSender = Callable[[str, str], Awaitable[float]]
"""A committed ``pg_notify(channel, payload)`` through the pool (``PgExecutionStore.notify``)."""

UNDELIVERED = (
    "notifications are not delivered: a NOTIFY sent through the query pool did not reach the "
    "listening connection within {timeout:g}s. Likely causes: the listener's URL goes through "
    "a transaction-mode pooler (PgBouncer pool_mode=transaction) or a proxy that drops "
    "asynchronous messages, or it reaches another server or database than the query pool. "
    "Fix: set LISTENER_DATABASE_URL to the primary, directly or through a session-mode pool "
    "(docs/operations.md, Database topologies). Nothing is deleted until delivery is proven"
)


class _Round:
    """One delivery probe that every caller waiting on it shares."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: str | None = None


class RetirementListener:
    """See the module docstring. ``probe`` sends the delivery probes (through the query pool);
    ``namespaces`` are the watched sandbox namespaces (a payload's name is a change in each);
    ``probe_channel`` is the probes' (by default the process's own: no other replica listens)."""

    def __init__(
        self,
        settings: DatabaseSettings,
        *,
        metrics: PgMetrics,
        probe: ProbeSender,
        backoff: Backoff | None = None,
        namespaces: Iterable[str],
        probe_channel: str | None = None,
    ) -> None:
        self._settings = settings
        self._namespaces = tuple(dict.fromkeys(namespaces))
        self._channel = settings.notify_channel
        self._handlers: list[ExecutionEventHandler] = []
        self._metrics = metrics
        self._attempts = Attempts(backoff or default_backoff())
        self._connected = False
        self._ever_connected = False
        self._conn: asyncpg.Connection | None = None
        self._lost: anyio.Event | None = None
        """Set when the current connection is gone or failed to deliver a probe."""
        self._lost_reason = ""
        self._send_probe = probe
        self._probe_channel = probe_channel or f"retired_pod_gc_probe_{secrets.token_hex(8)}"
        self._probes_sent = 0
        self._probes_arrived = 0
        self._probe_arrival = anyio.Event()
        self._queued: _Round | None = None
        self._probe_lock = anyio.Lock()
        self._failures = CauseLog("notify listener", logger)
        self._problem: str | None = "not connected yet"

    @property
    def connected(self) -> bool:
        """True while a connection is up, LISTENing, and has proven that notifications arrive."""
        return self._connected

    @property
    def problem(self) -> str | None:
        """Why the listener cannot vouch for the notifications (readiness); ``None``: it can."""
        return None if self._connected else self._problem

    def add_handler(self, handler: ExecutionEventHandler) -> None:
        """Hand every change to ``handler`` from now on. Added while a connection listens, it is
        told ``notifications_missed()`` at once: it missed whatever was handed over before."""
        self._handlers.append(handler)
        if self._connected:
            handler.notifications_missed()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; started after the first connection that proved delivery."""
        started = False
        while True:
            conn: asyncpg.Connection | None = None
            try:
                with database_errors():
                    conn = await connect(
                        self._settings,
                        metrics=self._metrics,
                        application_name="retired-pod-gc-listener",
                    )
                    lost = self._lost = anyio.Event()
                    self._lost_reason = ""
                    self._conn = conn
                    conn.add_termination_listener(lambda _conn, ended=lost: ended.set())
                    with fail_after(self._settings.statement_timeout_s):
                        await conn.add_listener(self._channel, self._on_notification)
                        await conn.add_listener(self._probe_channel, self._on_probe)
                try:
                    await self._prove()
                except ListenerUnavailable as exc:
                    raise _ConnectionLost(str(exc)) from None
                self._on_connected()
                self._attempts.reset()
                if not started:
                    started = True
                    task_status.started()
                await self._watch(conn, lost)
            except ExternalError as exc:
                self._on_failure(exc)
            finally:
                if self._connected:
                    self._connected = False
                    self._metrics.listener_connected.set(0)
                self._conn = None
                self._lost = None
                if conn is not None:
                    # terminate() is synchronous: no await, so it also runs under cancellation.
                    conn.terminate()
            await anyio.sleep(self._attempts.next_delay())

    def _on_failure(self, exc: ExternalError) -> None:
        cause = str(exc) if isinstance(exc, _ConnectionLost) else describe(exc)
        self._problem = cause
        if self._connected:
            # A connection that worked and ended: logged each time (not a retry's repeat).
            logger.warning("notify listener connection lost: %s", cause)
            self._failures.ok()
        else:
            self._metrics.listener_connect_failures.inc()
            self._failures.failed(cause_of(exc), cause)

    def _on_connected(self) -> None:
        if self._ever_connected:
            self._metrics.listener_reconnects.inc()
            logger.info("notify listener reconnected on channel %s", self._channel)
        else:
            logger.info("notify listener connected on channel %s", self._channel)
        self._failures.ok()
        self._ever_connected = True
        self._connected = True
        self._problem = None
        self._metrics.listener_connected.set(1)
        for handler in self._handlers:
            handler.notifications_missed()

    async def _watch(self, conn: asyncpg.Connection, lost: anyio.Event) -> None:
        s = self._settings
        while True:
            await clock.wait_until(lost, clock.now() + s.heartbeat_interval_s)
            if lost.is_set() or conn.is_closed():
                raise _ConnectionLost(self._lost_reason or "connection closed")
            try:
                await self._prove()
            except ListenerUnavailable as exc:
                raise _ConnectionLost(str(exc)) from None

    async def sync(self) -> None:
        """``ports.NotificationBarrier``: a NOTIFY on the listener's own channel, sent through the
        query pool after the call began, came back on the listening connection. The server
        delivers a listening backend's notifications in commit order and asyncpg runs their
        callbacks in arrival order, so the probe's arrival comes after every earlier commit's.
        Concurrent callers share one probe sent after all of them arrived; a probe that fails
        makes the listener reconnect."""
        if not self._connected:
            # The cause is the listener's own log line and the readiness body's.
            raise ListenerUnavailable("the notify listener is not connected")
        await self._prove()

    async def _prove(self) -> None:
        """Join the next probe round (or send it when nobody is); raise when it failed."""
        round_ = self._queued
        if round_ is None:
            round_ = self._queued = _Round()
        async with self._probe_lock:
            if not round_.done:
                # Sent from here on: a caller arriving now needs a later probe.
                if self._queued is round_:
                    self._queued = None
                round_.error = await self._round_trip()
                round_.done = True
        if round_.error is not None:
            raise ListenerUnavailable(round_.error)

    async def _round_trip(self) -> str | None:
        """One probe: sent through the pool, awaited on the listening connection. The reason
        it failed, ``None`` when it arrived in time."""
        conn, lost, timeout_s = self._conn, self._lost, self._settings.heartbeat_timeout_s
        if conn is None or lost is None or lost.is_set() or conn.is_closed():
            return "the notify listener is not connected"
        self._probes_sent += 1
        seq = self._probes_sent
        sent = False
        try:
            with fail_after(timeout_s):
                usage = await self._send_probe(self._probe_channel, str(seq))
                sent = True
                self._metrics.notify_queue_usage.set(usage)
                while not checks.probe_delivered(self._probes_arrived, seq) and not lost.is_set():
                    await self._probe_arrival.wait()
        except TimeoutError:
            pass
        except ExternalError as exc:
            return self._undelivered(f"the delivery probe could not be sent: {describe(exc)}")
        if lost.is_set():
            return f"notify listener: {self._lost_reason or 'connection closed'}"
        if checks.probe_delivered(self._probes_arrived, seq):
            self._metrics.listener_delivery_ok.set(1)
            return None
        if not sent:
            return self._undelivered(f"the delivery probe was not sent within {timeout_s:g}s")
        reason = self._undelivered(UNDELIVERED.format(timeout=timeout_s))
        # The connection cannot vouch for anything any more: reconnect.
        self._lost_reason = reason
        lost.set()
        return reason

    def _undelivered(self, reason: str) -> str:
        self._metrics.listener_delivery_ok.set(0)
        self._metrics.listener_delivery_failures.inc()
        return reason

    def _on_probe(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            seq = int(payload)
        except ValueError:
            return
        if seq > self._probes_arrived:
            self._probes_arrived = seq
            arrival, self._probe_arrival = self._probe_arrival, anyio.Event()
            arrival.set()

    def _on_notification(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        self._metrics.notifications.inc()
        parsed = parse_payload(payload, received_at_s=clock.now(), namespaces=self._namespaces)
        if parsed.malformed:
            self._metrics.notifications_malformed.inc(parsed.malformed)
            logger.warning(
                "malformed notification on %s, %d parts skipped (%s): %.200r",
                self._channel,
                parsed.malformed,
                parsed.problem,
                payload,
            )
        if parsed.changes:
            for handler in self._handlers:
                handler.executions_changed(parsed.changes)
