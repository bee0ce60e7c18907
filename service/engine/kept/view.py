"""The retired-but-kept view (the package docstring says what it knows, and how)."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

import anyio
from anyio.abc import TaskStatus

from service.domain import ExecutionChange, PodSnapshot, SkipReason, split_key
from service.engine.activation import Activation
from service.engine.kept.events import KeptEvents
from service.engine.kept.model import KeptPod, Retired, by_namespace, kept_decision, of_namespace
from service.kit import clock
from service.kit.causelog import CauseLog
from service.kit.errors import ExternalError
from service.metrics import KEPT_REASONS, KeptMetrics
from service.ports import KeptRecorder, PodCache, RetiredRow, RetiredRowSource

logger = logging.getLogger(__name__)

Answer = tuple[dict[str, RetiredRow], set[str]]
"""A row query's answer: the retired rows found, and the keys notified while it was in flight."""

TICK_S = 5.0
"""Longest period of the gauges' refresh and the Events' check (shorter for a short bound)."""
CONFIRM_COALESCE_S = 0.2
"""How long the first suspect of a burst waits for more (one query a namespace, not one each)."""
WAIT_S = 0.5
"""How often a sweep that waits for the leadership or a synced cache looks again."""
SWEEP_RETRY_S = 30.0
"""After a failed sweep, when it is tried again (or a resync period, when that is shorter)."""
QUERY_RETRY_S = 5.0
"""After a failed confirmation query, when the suspects are asked about again."""


class KeptPods:
    """The retired-but-kept view: a pod and an execution event handler, and :meth:`run`."""

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
        self._rows = rows
        self._inflight: dict[int, set[str]] = {}
        """Keys notified meanwhile, per query in flight (by a number: two empty sets are equal)."""
        self._tokens = itertools.count()
        self._query_log = CauseLog("retired-but-kept row queries fail", logger)
        self._events = KeptEvents(recorder, bound_s)
        self._wake = anyio.Event()
        self._was_leader = False
        self._sweeps: dict[str, float] = {}
        """When each namespace's last sweep that answered began (loop clock)."""
        metrics.retired_kept_bound.set(bound_s)

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

    def last_sweep(self, namespace: str) -> float | None:
        """When ``namespace``'s last sweep that answered began (loop clock): every pod cached
        then and unchanged since is known. ``None`` before the first (and after a clear)."""
        return self._sweeps.get(namespace)

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
        for key in of_namespace(namespace, self._retired):
            if self._cache.get(key) is None:
                self._forget(key)

    def executions_changed(self, changes: Sequence[ExecutionChange]) -> None:
        if not self.active:
            return
        woke = False
        get = self._cache.get
        for change in changes:
            key = change.key
            for touched in self._inflight.values():
                touched.add(key)  # no query in flight now answers for it
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

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The sweeps (one task a namespace), the confirmation of suspects and the tick."""
        async with anyio.create_task_group() as tg:
            for namespace in self._namespaces:
                tg.start_soon(self._sweep_loop, namespace, name=f"kept-sweep-{namespace}")
            tg.start_soon(self._confirm_loop, name="kept-confirm")
            task_status.started()
            while True:
                await self.tick()
                await anyio.sleep(max(0.05, min(TICK_S, self.bound_s / 4)))

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
        """ONE row query for the inactive rows among every cached pod of ``namespace``, which are
        then known retired or not. True when the query answered."""
        started = clock.now()
        keys = of_namespace(namespace, self._cache.keys())
        answer = await self._query(namespace, keys, kind="kept_sweep")
        if answer is None:
            return False
        # Work in proportion to the retired rows, not to the cache.
        self._apply([*of_namespace(namespace, self._retired), *answer[0]], answer)
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
            # A key notified meanwhile that is a suspect again takes this answer all the same
            # (its new notification is confirmed by the next query).
            found, touched = answer
            self._apply(keys, (found, touched - self._suspects.keys()), suspects)
        return ok

    async def _query(self, namespace: str, keys: Sequence[str], *, kind: str) -> Answer | None:
        """The retired rows of ``keys`` (one query) and the keys notified meanwhile, if the query
        answered (a failure is logged once a cause, and counted) and this replica still leads."""
        touched: set[str] = set()
        token = next(self._tokens)
        self._inflight[token] = touched
        try:
            names = [split_key(key)[1] for key in keys]
            found = await self._rows.retired_rows(namespace, names, kind=kind)
        except ExternalError as exc:
            self._metrics.retired_kept_sweep_errors.inc()
            self._query_log.failed(f"{type(exc).__name__}: {exc}")
            return None
        finally:
            del self._inflight[token]
        self._query_log.ok()
        return (found, touched) if self.active else None

    def _apply(
        self, keys: Iterable[str], answer: Answer, notified: Mapping[str, float] | None = None
    ) -> list[str]:
        """A query's answer for ``keys``, the one place it is applied: a key notified while the
        query was in flight is left to its (fresher) notification; any other is known retired
        when the answer has its row, else forgotten. Returns the keys known retired."""
        found, touched = answer
        known = []
        for key in dict.fromkeys(keys):
            if key in touched:
                continue
            retired = found.get(key)
            if retired is None:
                self._forget(key)
            else:
                self._know(key, retired, None if notified is None else notified[key])
                known.append(key)
        return known

    def _know(self, key: str, retired: RetiredRow, notified_s: float | None) -> None:
        """``key``'s row is retired: remember it (since when, by the best source) and classify."""
        pod = self._cache.get(key)
        if pod is None:
            self._forget(key)
            return
        old = self._retired.get(key)
        now_s = clock.now()
        self._retired[key] = Retired.known(
            retired, old, notified_s, now_s=now_s, wall_clock=self._wall_clock
        )
        self._evaluate(key, pod)

    def _evaluate(self, key: str, pod: PodSnapshot) -> None:
        """The classifier's verdict on the pod and its retired row: a skip is a kept pod."""
        retired = self._retired[key]
        decision = kept_decision(pod, retired.row)
        if decision is None or decision.reason is None:
            self._set(key, None)
            return
        state, since_s, source = retired.row.state, retired.since_s, retired.source
        kept = KeptPod(key, pod.uid, decision.reason, decision.rule, state, since_s, source)
        self._set(key, kept)

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
            self._kept.pop(key, None)
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
            oldest[kept.reason] = max(oldest.get(kept.reason, 0.0), now - kept.since_s)
        for reason in KEPT_REASONS:
            self._metrics.retired_kept_oldest.labels(reason=reason).set(
                round(max(0.0, oldest.get(reason, 0.0)), 3)
            )

    async def _record_due(self) -> None:
        """An Event for each pod kept longer than the bound and not evented for a day, once its
        row was read again (one query a namespace) and the pod still classifies as kept."""
        due = self._events.due(self._kept.values(), clock.now())
        for namespace, keys in by_namespace(k.key for k in due).items():
            answer = await self._query(namespace, keys, kind="kept_event")
            if answer is None:
                continue
            offset = self._wall_clock() - clock.now()  # loop clock to Unix time
            now = clock.now()
            for key in self._apply(keys, answer):
                kept = self._kept.get(key)
                pod = self._cache.get(key)
                if kept is not None and pod is not None and pod.uid == kept.uid:
                    self._events.record(kept, pod, now_s=now, wall_offset_s=offset)
