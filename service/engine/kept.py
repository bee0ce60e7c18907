"""Retired but kept: which cached pods have a retired execution row yet are not deleted, why, and
since when (docs/architecture.md, "Retired but kept").

The controller keeps every pod but two safe shapes; some kept pods are leaks only a person can
fix (a Running pod of a retired execution, a half-started sandbox, a forgotten keep annotation).
:class:`KeptPods` knows them beside the engine: it deletes nothing, and the pipeline never
consults it. A pod is kept when it is cached, its row (found as the reconciler finds it) is
inactive, and the classifier's verdict on the two is a skip, whose reason it shows.

The view is fed by the listener's notifications (a re-activation removes the pod at once; an
inactive row makes it a suspect, confirmed by one row query per namespace), by the informer's
cache (a pod whose retired row is known is classified again when it changes), and by a sweep of
each namespace every ``period_s``: one row query for all its cached pods, which finds what no
notification named. Gauges per reason are refreshed every tick; a pod kept longer than
``bound_s`` gets a ``RetiredPodKept`` Event once its row was read again
(``engine/kept_events.py``). Only the leader keeps the view; losing the lease empties it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
from anyio.abc import TaskStatus

from service.classifier import classify
from service.domain import ExecutionChange, ExecutionState, PodSnapshot, SkipReason
from service.engine.activation import Activation
from service.engine.kept_events import KeptEvents
from service.engine.kept_rows import Retired, RowQueries, Since, by_namespace
from service.kit import clock
from service.metrics import KEPT_REASONS, KeptMetrics
from service.ports import KeptRecorder, PodCache, RetiredRow, RetiredRowSource

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
        metrics: KeptMetrics,
        period_s: float,
        bound_s: float,
        recorder: KeptRecorder | None = None,
        wall_clock: Callable[[], float] = time.time,  # noqa: TID251 (retired_at is wall time)
    ) -> None:
        self._cache = cache
        self._namespaces = tuple(namespaces)
        self._activation = activation
        self._metrics = metrics
        self.period_s = period_s
        self.bound_s = bound_s
        self._wall_clock = wall_clock
        self._retired: dict[str, Retired] = {}
        """Retired rows of cached pods, by key (kept or not: a reapable pod's too)."""
        self._kept: dict[str, KeptPod] = {}
        self._counts: Counter[SkipReason] = Counter()
        self._suspects: dict[str, float] = {}
        """Keys a notification said are inactive, with its arrival, until a query confirms."""
        self._queries = RowQueries(rows, metrics)
        self._events = KeptEvents(recorder, bound_s)
        self._wake = anyio.Event()
        self._was_leader = False
        self._sweeps: dict[str, float] = {}
        """When each namespace's last sweep that answered began (loop clock)."""
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
                self._events.forget(old.uid)
                self._set(old.key, None)
            return
        if new.key in self._retired:
            if old is not None and old.uid != new.uid:
                self._events.forget(old.uid)
            self._evaluate(new.key, new)

    def cache_cold(self, namespace: str) -> None:
        """Nothing: the view keeps what it knows until the cache says otherwise."""

    def cache_synced(self, namespace: str) -> None:
        """A relist may have dropped pods without a delete event: forget keys not cached."""
        for key in _of_namespace(namespace, self._retired):
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
            self._queries.notified(key)
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
        if leader and self._events.recorder is not None:
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
        keys = _of_namespace(namespace, self._cache.keys())
        answer = await self._query(namespace, keys, kind="kept_sweep")
        if answer is None:
            return False
        found, touched = answer
        # Work in proportion to the retired rows, not to the cache: a key known retired that
        # the answer lacks is active or gone (or no longer cached); a key notified meanwhile is
        # left to its notification, fresher than this answer.
        for key in _of_namespace(namespace, self._retired):
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
        ok = True
        for namespace, keys in by_namespace(suspects).items():
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
        """The retired rows of ``keys`` and the keys notified meanwhile, if the query answered
        and this replica still leads."""
        answer = await self._queries.query(namespace, keys, kind=kind)
        return answer if self.active else None

    # -------------------------------------------------------------------- the state

    def _know(self, key: str, retired: RetiredRow, notified_s: float | None) -> None:
        """``key``'s row is retired: remember it (since when, by the best source) and classify."""
        pod = self._cache.get(key)
        if pod is None:
            self._forget(key)
            return
        self._retired[key] = Retired.known(
            retired,
            self._retired.get(key),
            notified_s,
            now_s=clock.now(),
            wall_clock=self._wall_clock,
        )
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
        self._events.clear()
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

    async def _record_due(self) -> None:
        """An Event for each pod kept longer than the bound and not evented for a day, once its
        row was read again (one query a namespace) and the pod still classifies as kept."""
        due = self._events.due(self._kept.values(), clock.now())
        for namespace, keys in by_namespace(k.key for k in due).items():
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
                if kept is not None and pod is not None and pod.uid == kept.uid:
                    self._events.record(kept, pod, now_s=now, wall_offset_s=offset)


def _of_namespace(namespace: str, keys: Iterable[str]) -> list[str]:
    """The keys of ``namespace`` among ``keys`` (a copy: the caller may change their source)."""
    prefix = namespace + "/"
    return [key for key in keys if key.startswith(prefix)]


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
