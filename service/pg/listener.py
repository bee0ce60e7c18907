"""The LISTEN side of the change trigger: one dedicated connection, kept alive, reconnected.

:class:`RetirementListener` holds its own asyncpg connection (never a pooled one: a pool would
reset it and drop the LISTEN), parses each payload (:func:`parse_payload`: trigger 0003's
pods, its earlier groups and rows, or 0002's single change as a batch of one) into
:class:`service.domain.ExecutionChange` values
and hands them, as one unit, to every :class:`service.ports.ExecutionEventHandler` registered
with :meth:`~RetirementListener.add_handler`. Malformed or oversized payloads, and bad changes
inside a batch, are logged, counted (``notifications_malformed``) and skipped; the other changes
of the batch are handed over. It is also the reconciler's
:class:`service.ports.NotificationBarrier` (:meth:`~RetirementListener.sync`), so it is built
before its consumer and told about it afterwards.

The connection is opened by :func:`service.pg.connect.connect` (the listener's URL, read anew
for every connection; the primary only). It counts as connected only once it has proven
delivery: a NOTIFY on a channel of the listener's own, sent through the query pool (``probe``),
came back on the listening connection within ``heartbeat_timeout_s``. A LISTEN that succeeds
is no such proof: a transaction-mode pooler accepts it and then drops every notification. The
same probe runs every ``heartbeat_interval_s`` and is the barrier before a DELETE
(:meth:`~RetirementListener.sync`). It notices the three ways a connection dies:

* closed (server terminated the backend, network reset): asyncpg's termination listener;
* server restart or failover: the same, then connect attempts fail until a primary answers;
* silently dead or deaf (a black-holed network path, a frozen proxy, a pooler that drops
  notifications): the probe does not come back in time.

After every connection that proved delivery, the first included,
``handler.notifications_missed()`` is called: notifications sent while no connection listened
are lost, so the consumer must resync. Between attempts the listener backs off (the kit's
:class:`~service.kit.backoff.Backoff`, equal jitter) and logs a failure once per change of its
cause. Its waits (the backoff, the heartbeat period) and the bound of each network call run on
the event loop's clock (``service/kit/clock.py``).

Errors: :meth:`~RetirementListener.sync` raises
:class:`~service.pg.errors.ListenerUnavailable` (a kit ``Unavailable``) when it cannot vouch
for the notifications; :meth:`~RetirementListener.run` never raises for a failure of the
database (it reconnects), only for a bug.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import asyncpg
import msgspec
from anyio.abc import TaskStatus

from service import checks
from service.config import DatabaseSettings
from service.domain import ExecutionChange, parse_execution_state
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ExternalError, Unavailable
from service.kit.timeouts import fail_after
from service.metrics import Metrics
from service.pg.connect import connect
from service.pg.errors import ListenerUnavailable, database_errors, describe
from service.ports import ExecutionEventHandler

logger = logging.getLogger(__name__)

BACKOFF_INITIAL_S = 0.1
"""The delay after the first failed attempt (before jitter)."""
BACKOFF_MAX_S = 30.0
"""Cap of the delay between connection attempts after failures."""
BACKOFF_JITTER = 0.5
"""Equal jitter: each delay is uniform in [d/2, d], so that replicas cut off by the same server
restart do not reconnect in lockstep."""


MAX_PAYLOAD_BYTES = 8000
"""PostgreSQL refuses a NOTIFY payload of this many bytes or more, so a longer payload did not
come from the trigger: it is skipped whole (``oversized``)."""

_Op = Literal["insert", "update", "delete"]


class _Single(msgspec.Struct, forbid_unknown_fields=False):
    """Trigger 0002's payload: one change as an object."""

    op: _Op
    namespace: str
    pod_name: str
    active: bool | None = None
    execution_state: str | None = None


_Row = tuple[_Op, str, str, bool | None, str | None]
"""One change of a 0003 ``rows`` batch: [op, namespace, pod_name, active, execution_state]."""


class _Batch(msgspec.Struct, forbid_unknown_fields=False):
    """Trigger 0003's first payload: ``{"rows": [[op, namespace, pod_name, active, state], ...]}``."""

    rows: list[_Row]


class _LooseBatch(msgspec.Struct, forbid_unknown_fields=False):
    """A batch whose rows are decoded one by one (a bad row must not hide the others)."""

    rows: list[msgspec.Raw]


_Pods = tuple[_Op, bool | None, str | None, list[str]]
"""One group of a 0003 ``pods`` payload: [op, active, execution_state, [pod_name, ...]], each
name a change with the group's facts, of the pod of that name in every watched namespace."""
_PodsHead = tuple[_Op, bool | None, str | None]


class _PodGroups(msgspec.Struct, forbid_unknown_fields=False):
    """Trigger 0003's payload: ``{"pods": [[op, active, state, [pod_name, ...]], ...]}``."""

    pods: list[_Pods]


class _LoosePodGroups(msgspec.Struct, forbid_unknown_fields=False):
    """A ``pods`` payload decoded group by group and name by name."""

    pods: list[msgspec.Raw]


_Group = tuple[_Op, str, bool | None, str | None, list[str]]
"""One group of 0003's earlier ``groups`` payload: [op, namespace, active, execution_state,
[pod_name, ...]], each name a change with the group's facts."""
_Head = tuple[_Op, str, bool | None, str | None]


class _Groups(msgspec.Struct, forbid_unknown_fields=False):
    """Trigger 0003's earlier payload: ``{"groups": [[op, namespace, active, state, [pod_name,
    ...]], ...]}``."""

    groups: list[_Group]


class _LooseGroups(msgspec.Struct, forbid_unknown_fields=False):
    """A ``groups`` payload decoded group by group and name by name (a bad name must not hide
    the others, nor a bad group the other groups)."""

    groups: list[msgspec.Raw]


_pods_decoder = msgspec.json.Decoder(_PodGroups)
_loose_pods_decoder = msgspec.json.Decoder(_LoosePodGroups)
_loose_pods_group_decoder = msgspec.json.Decoder(
    tuple[msgspec.Raw, msgspec.Raw, msgspec.Raw, list[msgspec.Raw]]
)
_pods_head_decoder = msgspec.json.Decoder(_PodsHead)
_groups_decoder = msgspec.json.Decoder(_Groups)
_batch_decoder = msgspec.json.Decoder(_Batch)
_single_decoder = msgspec.json.Decoder(_Single)
_loose_groups_decoder = msgspec.json.Decoder(_LooseGroups)
_loose_decoder = msgspec.json.Decoder(_LooseBatch)
_row_decoder = msgspec.json.Decoder(_Row)
_loose_group_decoder = msgspec.json.Decoder(
    tuple[msgspec.Raw, msgspec.Raw, msgspec.Raw, msgspec.Raw, list[msgspec.Raw]]
)
_head_decoder = msgspec.json.Decoder(_Head)
_name_decoder = msgspec.json.Decoder(str)


@dataclass(frozen=True, slots=True)
class ParsedPayload:
    """What one notification payload says: its valid changes, in payload order, and how many
    parts were skipped (``malformed``: the whole payload counts as one, else each bad change:
    a bad row, a bad name, each name of a group whose facts are bad, or a group that is not one)."""

    changes: list[ExecutionChange]
    malformed: int = 0
    problem: str = ""
    """Why something was skipped (for the log), empty when nothing was."""


def parse_payload(
    payload: str, *, received_at_s: float, namespaces: Sequence[str]
) -> ParsedPayload:
    """The changes a trigger payload describes, in any of its shapes: 0003's ``pods``, its
    earlier ``groups`` and ``rows``, or 0002's single object (a batch of one), so that a
    listener keeps working while the trigger is upgraded. A ``pods`` change names no namespace:
    it is the change of the pod of that name in each of ``namespaces`` (the watched ones), one
    change each; the other shapes name theirs.

    Never raises: a payload that is none of these shapes, or longer than PostgreSQL allows, is
    skipped whole; inside a payload, each change that is not valid (wrong arity or types, an
    unknown op, an empty namespace or pod name) is skipped alone.
    """
    if len(payload) >= MAX_PAYLOAD_BYTES or len(payload.encode()) >= MAX_PAYLOAD_BYTES:
        return ParsedPayload([], 1, "oversized")
    changes: list[ExecutionChange] = []
    total = 0
    try:
        pods = _pods_decoder.decode(payload).pods
    except msgspec.DecodeError:
        pass
    else:
        for op, active, state, names in pods:
            total += len(names)
            for namespace in namespaces:
                _add_group(changes, (op, namespace, active, state), names, received_at_s)
        return _outcome(changes, total, len(namespaces))
    try:
        groups = _groups_decoder.decode(payload).groups
    except msgspec.DecodeError:
        pass
    else:
        for op, namespace, active, state, names in groups:
            total += len(names)
            _add_group(changes, (op, namespace, active, state), names, received_at_s)
        return _outcome(changes, total)
    try:
        rows = _batch_decoder.decode(payload).rows
    except msgspec.DecodeError:
        pass
    else:
        changes = [c for row in rows if (c := _change(row, received_at_s)) is not None]
        return _outcome(changes, len(rows))
    try:
        single = _single_decoder.decode(payload)
    except msgspec.DecodeError:
        return _parse_loosely(payload, received_at_s, namespaces)
    change = _change(
        (single.op, single.namespace, single.pod_name, single.active, single.execution_state),
        received_at_s,
    )
    if change is None:
        return ParsedPayload([], 1, "empty namespace or pod name")
    return ParsedPayload([change])


def _outcome(changes: list[ExecutionChange], total: int, each: int = 1) -> ParsedPayload:
    """``changes`` found among ``total`` parts, ``each`` changes a valid part (a ``pods`` name
    is one a watched namespace): the others are bad (an empty batch is one)."""
    if not changes:
        return ParsedPayload([], max(1, total), "no valid change in the batch")
    bad = total - len(changes) // max(1, each)
    return ParsedPayload(changes, bad, f"{bad} invalid changes in the batch" if bad else "")


def _add_group(
    changes: list[ExecutionChange],
    head: _Head,
    names: Iterable[str],
    received_at_s: float,
) -> None:
    """Append a change for each valid name of a group: empty namespaces and names are not
    changes; a delete says nothing of active or state. The group's facts are worked out once:
    a mass retirement's payload is one group of hundreds of names."""
    op, namespace, active, state = head
    if not namespace:
        return
    deleted = op == "delete"
    if deleted:
        active, parsed = None, None
    else:
        parsed = None if state is None else parse_execution_state(state)
    append = changes.append
    for name in names:
        if name:
            append(ExecutionChange(namespace, name, active, parsed, deleted, received_at_s))


def _parse_loosely(payload: str, received_at_s: float, namespaces: Sequence[str]) -> ParsedPayload:
    """A payload of a batch shape that did not decode as a whole: its parts one by one."""
    try:
        raw_pods = _loose_pods_decoder.decode(payload).pods
    except msgspec.DecodeError:
        pass
    else:
        return _parse_groups_loosely(
            raw_pods, _loose_pods_group_decoder, _pods_head_decoder, received_at_s, namespaces
        )
    try:
        raw_groups = _loose_groups_decoder.decode(payload).groups
    except msgspec.DecodeError:
        return _parse_rows_one_by_one(payload, received_at_s)
    return _parse_groups_loosely(
        raw_groups, _loose_group_decoder, _head_decoder, received_at_s, None
    )


def _parse_groups_loosely(
    raw_groups: list[msgspec.Raw],
    group_decoder: msgspec.json.Decoder[Any],
    head_decoder: msgspec.json.Decoder[Any],
    received_at_s: float,
    namespaces: Sequence[str] | None,
) -> ParsedPayload:
    """Groups one by one, then each group's head and names: ``pods`` groups (``namespaces``
    given: their heads name none) or ``groups`` (``None``: each head names its namespace)."""
    changes: list[ExecutionChange] = []
    total = 0
    for raw in raw_groups:
        try:
            *raw_head, raw_names = group_decoder.decode(raw)
        except msgspec.DecodeError:
            total += 1  # not a group: one bad part
            continue
        total += len(raw_names)
        try:
            head = head_decoder.decode(b"[" + b",".join(raw_head) + b"]")
        except msgspec.DecodeError:
            continue  # every name of the group is bad with it
        names = []
        for raw_name in raw_names:
            try:
                names.append(_name_decoder.decode(raw_name))
            except msgspec.DecodeError:
                continue
        if namespaces is None:
            _add_group(changes, head, names, received_at_s)
        else:
            op, active, state = head
            for namespace in namespaces:
                _add_group(changes, (op, namespace, active, state), names, received_at_s)
    return _outcome(changes, total, 1 if namespaces is None else len(namespaces))


def _parse_rows_one_by_one(payload: str, received_at_s: float) -> ParsedPayload:
    try:
        raw_rows = _loose_decoder.decode(payload).rows
    except msgspec.DecodeError:
        return ParsedPayload([], 1, "not a change payload")
    changes: list[ExecutionChange] = []
    for raw in raw_rows:
        try:
            row = _row_decoder.decode(raw)
        except msgspec.DecodeError:
            continue
        if (change := _change(row, received_at_s)) is not None:
            changes.append(change)
    return _outcome(changes, len(raw_rows))


def _change(row: _Row, received_at_s: float) -> ExecutionChange | None:
    """One change of a ``rows`` batch or 0002's object (``None`` when it is not valid): a group
    of one name, so that :func:`_add_group` alone says what a change's facts mean."""
    op, namespace, pod_name, active, state = row
    one: list[ExecutionChange] = []
    _add_group(one, (op, namespace, active, state), (pod_name,), received_at_s)
    return one[0] if one else None


def default_backoff() -> Backoff:
    """The reconnect policy: BACKOFF_INITIAL_S doubling up to BACKOFF_MAX_S, equal jitter."""
    return Backoff(initial_s=BACKOFF_INITIAL_S, max_s=BACKOFF_MAX_S, jitter=BACKOFF_JITTER)


class _ConnectionLost(Unavailable):
    """Internal: the watch loop noticed the connection is gone (message says how)."""


ProbeSender = Callable[[str, str], Awaitable[float]]
"""Sends ``pg_notify(channel, payload)`` on a connection other than the listener's and returns
once it is committed, answering ``pg_notification_queue_usage()``
(:meth:`service.pg.store.PgExecutionStore.notify`)."""

UNDELIVERED = (
    "notifications are not delivered: a NOTIFY sent through the query pool did not reach the "
    "listening connection within {timeout:g}s. Likely causes: the listener's URL goes through "
    "a transaction-mode pooler (PgBouncer pool_mode=transaction) or a proxy that drops "
    "asynchronous messages, or it reaches another server or database than the query pool. "
    "Fix: set LISTENER_DATABASE_URL to the primary, directly or through a session-mode pool "
    "(docs/operations.md, Database topologies). Nothing is deleted until delivery is proven"
)


@dataclass(slots=True)
class _Round:
    """One delivery probe that every caller waiting on it shares."""

    done: bool = False
    error: str | None = None


def new_probe_channel() -> str:
    """A channel of this process's own for the delivery probes (no other replica listens)."""
    return f"retired_pod_gc_probe_{secrets.token_hex(8)}"


class RetirementListener:
    """LISTEN on the notify channel until cancelled; see the module docstring.

    ``probe`` sends the delivery probes (through the query pool); ``backoff`` is the reconnect
    policy (default :func:`default_backoff`); ``namespaces`` the watched sandbox namespaces (a
    change naming no namespace is one change in each; one naming another is counted and
    ignored); ``probe_channel`` the channel of
    its probes (default: :func:`new_probe_channel`).
    """

    def __init__(
        self,
        settings: DatabaseSettings,
        *,
        metrics: Metrics,
        probe: ProbeSender,
        backoff: Backoff | None = None,
        namespaces: Iterable[str],
        probe_channel: str | None = None,
    ) -> None:
        self._settings = settings
        self._namespaces = tuple(dict.fromkeys(namespaces))
        """The sandbox namespaces whose changes are handed on: a change that names no namespace
        (0003's ``pods``) is one change in each; one that names another namespace is counted
        and ignored."""
        self._watched = frozenset(self._namespaces)
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
        self._probe_channel = probe_channel or new_probe_channel()
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
    def channel(self) -> str:
        return self._channel

    @property
    def problem(self) -> str | None:
        """Why the listener cannot vouch for the notifications (readiness), ``None`` while it
        can."""
        return None if self._connected else self._problem

    def add_handler(self, handler: ExecutionEventHandler) -> None:
        """Hand every change to ``handler`` from now on. Added while a connection listens, it is
        told ``notifications_missed()`` at once: it missed whatever was handed over before."""
        self._handlers.append(handler)
        if self._connected:
            handler.notifications_missed()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled. ``task_status.started()`` after the first connection that
        proved delivery."""
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
                    conn.add_termination_listener(_setter(lost))
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
        # Whatever was sent while nobody listened is gone: the consumers must resync.
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
        """Proof that every notification committed before the call has been handed to the
        handlers: a NOTIFY on the listener's own channel, sent through the query pool after the
        call began, came back on the listening connection. The server delivers a listening
        backend's notifications in commit order and asyncpg runs their callbacks in arrival
        order, so the probe's arrival comes after every earlier commit's. Concurrent callers
        share one probe sent after all of them arrived. Raises
        :class:`~service.pg.errors.ListenerUnavailable` when the listener is not connected or the
        probe cannot be sent or does not arrive in time (the listener then reconnects)."""
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
        changes = parsed.changes
        # One channel carries every namespace's changes; only the watched ones matter (a
        # change of the earlier shapes names its namespace).
        watched = [c for c in changes if c.namespace in self._watched]
        if len(watched) < len(changes):
            self._metrics.notifications_ignored.inc(len(changes) - len(watched))
        changes = watched
        if changes:
            for handler in self._handlers:
                handler.executions_changed(changes)


def _setter(event: anyio.Event) -> Callable[[object], None]:
    def on_terminated(_conn: object) -> None:
        event.set()

    return on_terminated
