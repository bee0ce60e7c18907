"""Retired but kept: which cached pods have a retired execution row yet are not deleted, why, and
since when (docs/architecture.md, "Retired but kept").

The controller deletes two safe shapes and keeps every other pod, by design; some of those kept
pods are the platform's leaks that only a person can fix (a Running pod of a retired execution,
a half-started or half-stopped sandbox, a keep annotation nobody removed). :class:`KeptPods`
knows them, beside the engine and without touching it: it deletes nothing, changes no verdict,
and the reconcile pipeline never consults it.

A pod is *retired but kept* when it is cached, its execution row (found as the reconciler finds
it: its namespace, its pod name, a Kubernetes-managed sandbox) is inactive, and the pure
classifier's verdict on (pod, row) is a skip (:func:`service.classifier.classify`, called, never
restated): its reason is the classifier's. A pod whose row is active or that has no row is never
one. It is fed by three sources:

- **the listener's notifications** (:meth:`executions_changed`): a re-activation (or a deleted
  row) removes the pod at once; an inactive row makes the pod a *suspect*, confirmed by one
  batched row query for every suspect of a namespace that arrived meanwhile (the notification
  names neither the sandbox nor the row's identity, so it is never taken for the row);
- **the informer's cache** (:meth:`pod_changed`): a pod whose retired row is known is classified
  again, with no query, whenever it changes; a deleted pod leaves;
- **a periodic sweep**: every ``period_s`` (the resync period) per namespace, ONE row query for
  the inactive rows among the names of every cached pod of the namespace, whatever their
  number. It finds what no notification named (a pod created for a retired row, a notification
  lost while the listener was down) and forgets the rows that are no longer retired.

"Since when" is the row's ``retired_at``, else the notification's arrival, else when the pod was
first seen retired (:class:`Since`). Gauges per reason (count and oldest age) are refreshed every
tick; a pod kept longer than ``bound_s`` gets one ``RetiredPodKept`` Event through the recorder,
at most one a pod UID per :data:`EVENT_INTERVAL_S`, and only after its row was read again and
found still retired.

Only the leader keeps this view (one replica's queries and Events, not every replica's); losing
the lease empties it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
from anyio.abc import TaskStatus

from service.classifier import classify
from service.domain import (
    ExecutionChange,
    ExecutionRow,
    ExecutionState,
    PodSnapshot,
    SkipReason,
    split_key,
)
from service.engine.activation import Activation
from service.kit import clock
from service.kit.causelog import CauseLog
from service.kit.errors import ExternalError
from service.metrics import KEPT_REASONS, Metrics
from service.ports import KeptRecorder, KeptReport, PodCache, RetiredRow, RetiredRowSource

logger = logging.getLogger(__name__)

PERSON_REASONS: frozenset[SkipReason] = frozenset(
    {
        SkipReason.POD_RUNNING,
        SkipReason.PENDING_WITH_IP,
        SkipReason.TERMINAL_CONTAINER_NOT_TERMINATED,
        SkipReason.UNKNOWN_STATE,
        SkipReason.ROW_INCONSISTENT,
    }
)
"""The reasons that need a person (the alert ``RetiredPodGcRetiredPodsKept`` at warning); the
keep annotation is alerted at a lower severity, the other reasons are shown, not alerted."""

EVENT_INTERVAL_S = 86400.0
"""At most one ``RetiredPodKept`` Event a pod UID in this long."""
TICK_S = 5.0
"""Longest period of the gauges' refresh and the Events' check (shorter for a short bound)."""
CONFIRM_COALESCE_S = 0.2
"""How long the first suspect of a burst waits for more: notifications of one writer's burst
are confirmed by one query a namespace, not one each."""
WAIT_S = 0.5
"""How often a sweep that waits for the leadership or a synced cache looks again."""
SWEEP_RETRY_S = 30.0
"""After a failed sweep, when it is tried again (or a resync period, when that is shorter)."""
QUERY_RETRY_S = 5.0
"""After a failed confirmation query, when the suspects are asked about again."""


class Since(enum.StrEnum):
    """Where a kept pod's "since" comes from."""

    RETIRED_AT = "retired_at"
    NOTIFICATION = "notification"
    FIRST_SEEN = "first_seen"


@dataclass(slots=True)
class _Retired:
    """A retired row known for a cached pod's key, and since when."""

    row: ExecutionRow
    since_s: float
    """On the event loop's clock."""
    source: Since


@dataclass(frozen=True, slots=True)
class KeptPod:
    """One retired-but-kept pod as the view shows it."""

    key: str
    uid: str
    reason: SkipReason
    rule: str
    row_state: ExecutionState
    since_s: float
    """On the event loop's clock (:meth:`KeptPods.wall_offset` maps it onto Unix time)."""
    source: Since

    @property
    def severity(self) -> str:
        """The alert's severity for this reason: ``warning`` (a person must act), ``info`` (the
        keep annotation) or ``none`` (shown, not alerted)."""
        return severity_of(self.reason)


def severity_of(reason: SkipReason) -> str:
    """``warning`` for :data:`PERSON_REASONS`, ``info`` for the keep annotation, else ``none``
    (deploy/monitoring's alert ``RetiredPodGcRetiredPodsKept`` says the same)."""
    if reason in PERSON_REASONS:
        return "warning"
    if reason is SkipReason.KEEP_ANNOTATION:
        return "info"
    return "none"


class KeptPods:
    """The retired-but-kept view: a ``PodEventHandler`` and an ``ExecutionEventHandler`` (it is
    added to the informer and the listener beside the controller), and :meth:`run`."""

    def __init__(
        self,
        *,
        cache: PodCache,
        rows: RetiredRowSource,
        namespaces: Sequence[str],
        activation: Activation,
        metrics: Metrics,
        period_s: float,
        bound_s: float,
        recorder: KeptRecorder | None = None,
        wall_clock: Callable[[], float] = time.time,  # noqa: TID251 (retired_at is wall time)
    ) -> None:
        self._cache = cache
        self._rows = rows
        self._namespaces = tuple(namespaces)
        self._activation = activation
        self._metrics = metrics
        self.period_s = period_s
        self.bound_s = bound_s
        self._recorder = recorder
        self._wall_clock = wall_clock
        self._retired: dict[str, _Retired] = {}
        """Retired rows of cached pods, by key (kept or not: a reapable pod's too)."""
        self._kept: dict[str, KeptPod] = {}
        self._counts: Counter[SkipReason] = Counter()
        self._suspects: dict[str, float] = {}
        """Keys a notification said are inactive, with its arrival, until a query confirms."""
        self._inflight: dict[int, set[str]] = {}
        """For each row query in flight (by a number of its own: two empty sets are equal), the
        keys a notification named meanwhile (its answer for them may be older than the
        notification: not applied)."""
        self._queries = 0
        self._evented: dict[str, float] = {}
        """When each pod UID's Event was recorded."""
        self._wake = anyio.Event()
        self._was_leader = False
        self._sweeps: dict[str, float] = {}
        """When each namespace's last sweep that answered began (loop clock)."""
        self._log = CauseLog("retired-but-kept row queries fail", logger)
        metrics.retired_kept_bound.set(bound_s)

    # -------------------------------------------------------------------------------- view

    @property
    def active(self) -> bool:
        """Only the leader keeps the view."""
        return self._activation.leader

    def kept(self) -> list[KeptPod]:
        """Every retired-but-kept pod, the longest kept first."""
        return sorted(self._kept.values(), key=lambda k: (k.since_s, k.key))

    def get(self, key: str) -> KeptPod | None:
        return self._kept.get(key)

    def __len__(self) -> int:
        return len(self._kept)

    def wall_offset(self) -> float:
        """What to add to the loop's clock for Unix time, now."""
        return self._wall_clock() - clock.now()

    def last_sweep(self, namespace: str) -> float | None:
        """When ``namespace``'s last sweep that answered began (loop clock): every pod cached
        then and unchanged since is known. ``None`` before the first (and after a clear)."""
        return self._sweeps.get(namespace)

    # ------------------------------------------------------------------ PodEventHandler

    def pod_changed(self, old: PodSnapshot | None, new: PodSnapshot | None) -> None:
        if new is None:
            if old is not None:
                # The row stays known until the next sweep (which forgets keys not cached): a
                # pod recreated under the name of a retired row is classified at once.
                self._evented.pop(old.uid, None)
                self._set(old.key, None)
            return
        if new.key in self._retired:
            if old is not None and old.uid != new.uid:
                self._evented.pop(old.uid, None)
            self._evaluate(new.key, new)

    def cache_cold(self, namespace: str) -> None:
        """Nothing: the view keeps what it knows until the cache says otherwise."""

    def cache_synced(self, namespace: str) -> None:
        """A relist may have dropped pods without a delete event: forget keys not cached."""
        prefix = namespace + "/"
        for key in [k for k in self._retired if k.startswith(prefix)]:
            if self._cache.get(key) is None:
                self._forget(key)

    # ------------------------------------------------------------ ExecutionEventHandler

    def executions_changed(self, changes: Sequence[ExecutionChange]) -> None:
        if not self.active:
            return
        woke = False
        get = self._cache.get
        for change in changes:
            key = change.key
            for touched in self._inflight.values():
                touched.add(key)
            if change.deleted or change.active is True:
                # Re-activated (or gone): never reported from this moment.
                self._suspects.pop(key, None)
                self._forget(key)
            elif get(key) is not None:
                received = change.received_at_s or clock.now()
                self._suspects.setdefault(key, received)
                woke = True
        if woke:
            self._wake.set()

    def notifications_missed(self) -> None:
        """Nothing at once: the next sweep (at most a resync period away) finds what was
        missed, and a query per reconnect would break the sweep's bound."""

    # ---------------------------------------------------------------------- tasks

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The sweeps (one task a namespace), the confirmation of suspects and the tick."""
        async with anyio.create_task_group() as tg:
            for namespace in self._namespaces:
                tg.start_soon(self._sweep_loop, namespace, name=f"kept-sweep-{namespace}")
            tg.start_soon(self._confirm_loop, name="kept-confirm")
            task_status.started()
            await self._tick_loop()

    def tick_s(self) -> float:
        return max(0.05, min(TICK_S, self.bound_s / 4))

    async def _tick_loop(self) -> None:
        while True:
            await self.tick()
            await anyio.sleep(self.tick_s())

    async def tick(self) -> None:
        """Follow the leadership, refresh the age gauges and write the Events that are due."""
        leader = self.active
        if not leader and self._was_leader:
            self.clear()
        self._was_leader = leader
        self._publish_ages()
        if leader and self._recorder is not None:
            await self._record_due()

    async def _sweep_loop(self, namespace: str) -> None:
        while True:
            if not (self.active and self._cache.namespace_synced(namespace)):
                await anyio.sleep(WAIT_S)
            elif await self.sweep(namespace):
                await anyio.sleep(self.period_s)
            else:
                await anyio.sleep(min(self.period_s, SWEEP_RETRY_S))

    async def sweep(self, namespace: str) -> bool:
        """ONE row query for the inactive rows among every cached pod of ``namespace``; then
        every cached pod of the namespace is known retired or not. True when the query
        answered."""
        started = clock.now()
        prefix = namespace + "/"
        keys = [key for key in list(self._cache.keys()) if key.startswith(prefix)]
        answer = await self._query(namespace, keys, kind="kept_sweep")
        if answer is None:
            return False
        found, touched = answer
        # Work in proportion to the retired rows, not to the cache: a key known retired that
        # the answer lacks is active or gone (or no longer cached); a key notified meanwhile is
        # left to its notification, fresher than this answer.
        for key in [k for k in self._retired if k.startswith(prefix)]:
            if key not in found and key not in touched:
                self._forget(key)
        for key, retired in found.items():
            if key not in touched:
                self._know(key, retired, None)
        self._sweeps[namespace] = started
        self._metrics.retired_kept_sweep_duration.observe(clock.now() - started)
        return True

    async def _confirm_loop(self) -> None:
        while True:
            if not self._suspects:
                self._wake = anyio.Event()
                await self._wake.wait()
                await anyio.sleep(CONFIRM_COALESCE_S)
            if not await self.confirm():
                await anyio.sleep(QUERY_RETRY_S)

    async def confirm(self) -> bool:
        """One row query a namespace for the suspects of that namespace. True when every query
        answered (the suspects of one that failed wait for the next try)."""
        suspects, self._suspects = self._suspects, {}
        by_namespace: defaultdict[str, list[str]] = defaultdict(list)
        for key in suspects:
            by_namespace[split_key(key)[0]].append(key)
        ok = True
        for namespace, keys in by_namespace.items():
            answer = await self._query(namespace, keys, kind="kept_confirm")
            if answer is None:
                ok = False
                for key in keys:
                    self._suspects.setdefault(key, suspects[key])
                continue
            found, touched = answer
            for key in keys:
                if key in touched and key not in self._suspects:
                    continue  # re-activated meanwhile
                retired = found.get(key)
                if retired is None:
                    self._forget(key)
                else:
                    self._know(key, retired, suspects[key])
        return ok

    async def _query(
        self, namespace: str, keys: Sequence[str], *, kind: str
    ) -> tuple[dict[str, RetiredRow], set[str]] | None:
        """The retired rows of ``keys`` (one query) and the keys notified meanwhile; ``None``
        when the query failed (logged once a cause, counted)."""
        touched: set[str] = set()
        self._queries += 1
        token = self._queries
        self._inflight[token] = touched
        try:
            names = [split_key(key)[1] for key in keys]
            found = await self._rows.retired_rows(namespace, names, kind=kind)
        except ExternalError as exc:
            self._metrics.retired_kept_sweep_errors.inc()
            self._log.failed(f"{type(exc).__name__}: {exc}")
            return None
        finally:
            del self._inflight[token]
        self._log.ok()
        if not self.active:
            return None
        return found, touched

    # -------------------------------------------------------------------- the state

    def _know(self, key: str, retired: RetiredRow, notified_s: float | None) -> None:
        """``key``'s row is retired: remember it (since when, by the best source) and classify."""
        pod = self._cache.get(key)
        if pod is None:
            self._forget(key)
            return
        now = clock.now()
        old = self._retired.get(key)
        if retired.retired_at_s is not None:
            since = now - max(0.0, self._wall_clock() - retired.retired_at_s)
            source = Since.RETIRED_AT
        elif old is not None and old.row.state == retired.row.state:
            since, source = old.since_s, old.source
        elif notified_s is not None:
            since, source = notified_s, Since.NOTIFICATION
        else:
            since, source = now, Since.FIRST_SEEN
        self._retired[key] = _Retired(retired.row, since, source)
        self._evaluate(key, pod)

    def _evaluate(self, key: str, pod: PodSnapshot) -> None:
        """The classifier's verdict on the pod and its retired row: a skip is a kept pod."""
        retired = self._retired[key]
        decision = classify(pod, retired.row)
        reason = decision.reason
        if reason is None or reason is SkipReason.NO_ROW or reason is SkipReason.ROW_ACTIVE:
            self._set(key, None)
            return
        self._set(
            key,
            KeptPod(
                key=key,
                uid=pod.uid,
                reason=reason,
                rule=decision.rule,
                row_state=retired.row.state,
                since_s=retired.since_s,
                source=retired.source,
            ),
        )

    def _forget(self, key: str) -> None:
        self._retired.pop(key, None)
        self._set(key, None)

    def _set(self, key: str, kept: KeptPod | None) -> None:
        old = self._kept.get(key)
        if old is not None:
            self._counts[old.reason] -= 1
            if old.reason is not (kept.reason if kept else None):
                self._gauge(old.reason)
        if kept is None:
            if old is not None:
                del self._kept[key]
            return
        self._kept[key] = kept
        self._counts[kept.reason] += 1
        self._gauge(kept.reason)

    def _gauge(self, reason: SkipReason) -> None:
        self._metrics.retired_kept_pods.labels(reason=str(reason)).set(self._counts[reason])

    def clear(self) -> None:
        """Forget everything (leadership lost): the gauges read zero."""
        self._retired.clear()
        self._kept.clear()
        self._suspects.clear()
        self._counts.clear()
        self._evented.clear()
        self._sweeps.clear()
        for reason in KEPT_REASONS:
            self._metrics.retired_kept_pods.labels(reason=reason).set(0)
        self._publish_ages()

    def _publish_ages(self) -> None:
        now = clock.now()
        oldest: dict[str, float] = {}
        for kept in self._kept.values():
            reason = str(kept.reason)
            age = now - kept.since_s
            if age > oldest.get(reason, -1.0):
                oldest[reason] = age
        for reason in KEPT_REASONS:
            self._metrics.retired_kept_oldest.labels(reason=reason).set(
                round(max(0.0, oldest.get(reason, 0.0)), 3)
            )

    # --------------------------------------------------------------------- Events

    def _due(self, now: float) -> list[KeptPod]:
        horizon = now - EVENT_INTERVAL_S
        for uid in [u for u, at in self._evented.items() if at <= horizon]:
            del self._evented[uid]
        return [
            k
            for k in self._kept.values()
            if now - k.since_s >= self.bound_s and k.uid not in self._evented
        ]

    async def _record_due(self) -> None:
        """An Event for each pod kept longer than the bound and not evented for a day, once its
        row was read again (one query a namespace) and the pod still classifies as kept."""
        recorder = self._recorder
        due = self._due(clock.now())
        if not due or recorder is None:
            return
        by_namespace: defaultdict[str, list[str]] = defaultdict(list)
        for entry in due:
            by_namespace[split_key(entry.key)[0]].append(entry.key)
        for namespace, keys in by_namespace.items():
            answer = await self._query(namespace, keys, kind="kept_event")
            if answer is None:
                continue
            found, touched = answer
            offset = self.wall_offset()
            now = clock.now()
            for key in keys:
                retired = found.get(key)
                if key in touched or retired is None:
                    if retired is None and key not in touched:
                        self._forget(key)
                    continue
                self._know(key, retired, None)
                kept = self._kept.get(key)
                pod = self._cache.get(key)
                if kept is None or pod is None or pod.uid != kept.uid:
                    continue
                if now - kept.since_s < self.bound_s or kept.uid in self._evented:
                    continue
                self._evented[kept.uid] = now
                recorder.record_kept(
                    KeptReport(
                        pod=pod,
                        reason=str(kept.reason),
                        rule=kept.rule,
                        row_state=kept.row_state,
                        since_s=kept.since_s + offset,
                        since_source=str(kept.source),
                        kept_for_s=now - kept.since_s,
                    )
                )


def kept_entries(
    kept: Iterable[KeptPod], *, now_s: float, wall_offset_s: float
) -> list[dict[str, object]]:
    """The kept pods as ``/debug/pending`` lists them (``since`` in UTC)."""
    return [
        {
            "key": k.key,
            "uid": k.uid,
            "reason": str(k.reason),
            "severity": k.severity,
            "row_state": str(k.row_state),
            "since": datetime.fromtimestamp(k.since_s + wall_offset_s, UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ"
            ),
            "since_source": str(k.source),
            "kept_for_s": round(now_s - k.since_s, 3),
            "rule": k.rule,
        }
        for k in kept
    ]
