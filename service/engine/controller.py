"""The event side of the engine and the worker loop.

:class:`Controller` is the informer's ``PodEventHandler`` and the listener's
``ExecutionEventHandler``. Each callback, synchronously on the event loop, stops the observation
clocks its event ends the moment it arrives (invariant 3 of docs/architecture.md: the queue
deduplicates keys and a reconcile classifies only the latest state, so a state between two
reconciles would otherwise go unseen), then enqueues the key if it passes the prefilter. A
notification is a batch: its clocks are cleared together, then its keys enqueued.

Workers take keys in batches (a share of what is ready, at most ``LOOKUP_BATCH_SIZE``): the
reconciler observes the batch with one row query and acts on each key that is due. The worker
loop (:meth:`Controller.process`) is the one place that counts outcomes and that catches broad
exceptions; cancellation always propagates.

Nothing is processed while inactive (disabled, or not the leader): keys handed out meanwhile are
dropped, and becoming active starts from empty clocks and enqueues every cached candidate.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import assert_never

import anyio
from anyio.abc import TaskStatus

from service import checks, logs
from service.classifier import prefilter
from service.domain import ExecutionChange, Mode, Outcome, PodSnapshot, Verdict
from service.engine.activation import Activation
from service.engine.held import HeldKeys
from service.engine.observation import ObservationClocks
from service.engine.reaped import ReapTally
from service.engine.reconciler import Reconciler
from service.engine.results import INACTIVE_RESULT, Action, ReconcileResult
from service.engine.workqueue import WorkQueue
from service.kit import clock
from service.metrics import EngineMetrics
from service.ports import PodCache

logger = logging.getLogger(__name__)

MIN_BATCH = 250
"""Fewest keys a worker takes (when that many are ready): a batch costs one row query, and the
lookup pool has a few connections (``DB_POOL_SIZE``), so much smaller parts would mostly wait
for a connection while each still pays its own round trip."""
_REAPED = frozenset(Outcome(verdict) for verdict in Verdict)
"""Outcomes of a delete (live) or a dry-run report: a reapable verdict."""


class Controller:
    """The event handlers and the worker loop (see the module docstring)."""

    def __init__(
        self,
        *,
        cache: PodCache,
        queue: WorkQueue,
        reconciler: Reconciler,
        clocks: ObservationClocks,
        activation: Activation,
        metrics: EngineMetrics,
        batch_size: int = 1,
    ) -> None:
        self._cache = cache
        self._queue = queue
        self._reconciler = reconciler
        self._clocks = clocks
        self._activation = activation
        self._metrics = metrics
        self._batch_size = batch_size
        self._workers = 1
        self._held = HeldKeys(gates=reconciler.gates, queue=queue, activation=activation)
        self.reaped = ReapTally(dry_run=reconciler.mode is Mode.DRY_RUN)
        """Deletes (or reports) at info, one summary line an interval (``engine/reaped.py``)."""
        self.reconciles_done = 0
        """Reconciles finished and counted (the watchdog's measure of progress)."""

    @property
    def active(self) -> bool:
        return self._activation.active

    def set_leader(self, leader: bool) -> None:
        """The leader elector's ``on_change``: start empty and catch up, or stop acting."""
        if leader == self._activation.leader:
            return
        was_active = self._activation.active
        self._activation.set_leader(leader)
        # Either way the clocks restart: a new leader has not been watching (invariant 3).
        self._clocks.clear_all()
        self._held.clear()
        if self._activation.active and not was_active:
            logger.info("active: enqueueing every cached candidate")
            self.resync()
        elif was_active and not self._activation.active:
            logger.info("inactive: clocks cleared; nothing is deleted or reported")

    def pod_changed(self, old: PodSnapshot | None, new: PodSnapshot | None) -> None:
        candidate = new is not None and prefilter(new) is None
        self._clear_for_pod_event(old, new, candidate=candidate)
        if new is None or not candidate or not self._activation.active:
            return
        # While a (re)list fills the namespace's cache nothing of it is enqueued: its end
        # (cache_synced) enqueues every candidate, and reconciles would only slow it down.
        if self._cache.namespace_synced(new.namespace):
            self._queue.add(new.key)

    def _clear_for_pod_event(
        self, old: PodSnapshot | None, new: PodSnapshot | None, *, candidate: bool
    ) -> None:
        """The clocks a pod event stops (invariant 3): a deleted pod's, a replaced UID's, one
        whose state changed, and the key's when the pod is no ``candidate`` (prefilter)."""
        if new is None:
            if old is not None:
                self._clocks.forget_pod(old.uid, old.key)
            return
        key = new.key
        if old is not None and old.uid != new.uid:
            self._clocks.forget_pod(old.uid, key)
        elif old is not None and checks.pod_state_changed(old, new):
            # Whether the pod stayed reapable depends on the row as well, and a reconcile may
            # never see this state (it reads the latest one): the observation restarts here.
            self._clocks.clear(new.uid)
        if not candidate or self._clocks.uid_for(key) not in (None, new.uid):
            self._clocks.clear_key(key)

    def cache_cold(self, namespace: str) -> None:
        logger.info("pod cache of namespace %s cold: clearing its observation clocks", namespace)
        self._clocks.clear_namespace(namespace)

    def cache_synced(self, namespace: str) -> None:
        self._clocks.retain_reported(
            pod.uid for pod in (self._cache.get(k) for k in list(self._cache.keys())) if pod
        )
        self.resync(namespace)

    def executions_changed(self, changes: Sequence[ExecutionChange]) -> None:
        # Invariant 3: every clock of the batch stops before anything is enqueued.
        for key in checks.keys_cleared_by(changes):
            self._clocks.clear_key(key)
        if self._activation.active:
            # Only keys with a cached pod: a change names a pod name in every watched namespace
            # (service/pg/listener.py), and a pod not cached yet is enqueued by its own event.
            get = self._cache.get
            self._queue.add(*(change.key for change in changes if get(change.key) is not None))
        received_at_s = min(
            (c.received_at_s for c in changes if c.retired and c.received_at_s > 0), default=None
        )
        if received_at_s is not None:
            self._metrics.retirement_to_enqueue.observe(max(0.0, clock.now() - received_at_s))

    def notifications_missed(self) -> None:
        logger.info("notifications may have been missed: clearing clocks and resyncing")
        self._clocks.clear_all()
        self.resync()

    def resync(self, namespace: str | None = None) -> int:
        """Enqueue every cached candidate (of ``namespace``, or of all); returns how many."""
        if not self._activation.active:
            return 0
        prefix = "" if namespace is None else namespace + "/"
        get = self._cache.get
        keys = [k for k in list(self._cache.keys()) if k.startswith(prefix)]
        candidates = [k for k in keys if (pod := get(k)) is not None and prefilter(pod) is None]
        self._queue.add(*candidates)
        return len(candidates)

    async def run_workers(
        self, n: int, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run ``n`` workers until the queue shuts down (or this task is cancelled)."""
        self._workers = n
        async with anyio.create_task_group() as tg:
            for index in range(n):
                tg.start_soon(self._worker, index, name=f"reconcile-worker-{index}")
            task_status.started()

    async def run_resync(
        self, period_s: float, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The backstop: enqueue every cached candidate every ``period_s`` (until cancelled)."""
        task_status.started()
        while not self._queue.shutting_down:
            await anyio.sleep(period_s)
            logger.debug("resync enqueued %d keys", self.resync())

    async def stop(self, timeout_s: float) -> bool:
        """Stop taking work; wait up to ``timeout_s`` for in-flight reconciles. True if drained."""
        drained = await self._queue.shut_down_with_drain(timeout_s)
        if not drained:
            logger.warning("in-flight reconciles did not finish within %.1fs", timeout_s)
        self.reaped.summarise()
        return drained

    async def _worker(self, index: int) -> None:
        get_batch, size = self._queue.get_batch, self._batch_size
        while (keys := await get_batch(size, shares=self._workers, least=MIN_BATCH)) is not None:
            await self.process(keys)

    async def process(self, keys: Sequence[str]) -> dict[str, ReconcileResult]:
        """The worker loop's body (controller-runtime's ``reconcileHandler``): observe the batch,
        act on each due key, and :meth:`_finish` each key as soon as its result is known; a key
        left unfinished (shutdown, cancellation) is released. A step that raises is a bug: a
        batch whose observation raised is taken again one key at a time, so that one key's bug
        backs off that key alone, its clock cleared. A bug never deletes."""
        results: dict[str, ReconcileResult] = {}
        try:
            await self._process(keys, results)
        finally:
            self._queue.done(*(key for key in keys if key not in results))
        return results

    async def _process(self, keys: Sequence[str], results: dict[str, ReconcileResult]) -> None:
        started = clock.now()
        if not self._activation.active:
            self._finish(dict.fromkeys(keys, INACTIVE_RESULT), started, results)
            return
        with logs.batch(keys):
            try:
                observed = await self._reconciler.observe(keys)
            except Exception:
                if len(keys) == 1:
                    self._bug(keys[0], started, results)
                    return
                logger.exception("observing %d keys raised (a bug); one by one now", len(keys))
                self._metrics.reconcile_bugs.inc()
                for key in keys:
                    await self._process([key], results)
                return
            self._finish(observed.results, started, results)
            # A due key's reconcile is the batch's observation and its own action, not the
            # actions of the due keys before it.
            observing_s = clock.now() - started
            for due in observed.due:
                if self._queue.shutting_down:
                    return  # the rest are dropped like queued keys (a restart relists)
                key_started = clock.now() - observing_s
                with logs.reconciling(due.key):
                    try:
                        result = await self._reconciler.act(due)
                    except Exception:
                        self._bug(due.key, key_started, results)
                    else:
                        self._finish({due.key: result}, key_started, results)

    def _bug(self, key: str, started: float, results: dict[str, ReconcileResult]) -> None:
        logger.exception("reconcile of %r raised (a bug); clock cleared, backing off", key)
        self._metrics.reconcile_bugs.inc()
        self._clocks.clear_key(key)
        self._finish({key: ReconcileResult.backoff(Outcome.ERROR)}, started, results)

    def _finish(
        self,
        finished: dict[str, ReconcileResult],
        started: float,
        results: dict[str, ReconcileResult],
    ) -> None:
        """Apply each result of keys that finished together to the queue (as controller-runtime
        does), mark them done and count them: the one place that does any of these."""
        for key, result in finished.items():
            if result.outcome in _REAPED:
                self.reaped.add(result.outcome, key.partition("/")[0])
            match result.action:
                case Action.DONE:
                    self._queue.forget(key)
                case Action.REQUEUE_AFTER if result.held_by is not None:
                    self._queue.forget(key)
                    self._held.hold(key, result.held_by, result.requeue_after_s)
                case Action.REQUEUE_AFTER:
                    self._queue.forget(key)
                    self._queue.add_after(key, result.requeue_after_s)
                case Action.BACKOFF:
                    self._queue.add_rate_limited(key)
                case _:
                    assert_never(result.action)
            self._held.finished(key, result.held_by)
        self._queue.done(*finished)
        results.update(finished)
        self._count(finished.values(), clock.now() - started)

    def _count(self, results: Iterable[ReconcileResult], duration_s: float) -> None:
        """Count results that share one duration (a batch's observation ends many keys at
        once), one update per distinct result rather than per key: B2b (benchmarks/NOTES.md)
        ends 10,000 keys in a handful of distinct results."""
        counted = 0
        for result, count in Counter(results).items():
            if not result.counted:
                continue
            counted += count
            self._metrics.outcome(self._reconciler.mode, result.outcome, count)
            if result.skip_reason is not None:
                self._metrics.skip(str(result.skip_reason), count)
            if result.failed:
                self._metrics.reconcile_errors.inc(count)
        self._metrics.reconcile_duration.observe(duration_s, counted)
        self.reconciles_done += counted
