"""The reconcile pipeline: observe → verify → act, each step written once.

A batch of keys is the general case (one key is a batch of one). :meth:`Reconciler.observe`
takes a batch to its clocks with one row query; every key it does not end with a result is
*due* and goes on to :meth:`Reconciler.act`, one at a time. Each step lets a key go on, its stage
its type (``engine/stages.py``), or ends it with one ``ReconcileResult``, which the worker loop
counts and applies (``engine/controller.py``). docs/architecture.md, "The seven safety invariants
and where each is enforced", says which invariant each step keeps.

Observe: 1. the replica active (else ``inactive``, nothing counted), the key's namespace
configured (else ``error``), that namespace's cache synced (else ``cache_cold``, nothing
observed), the pod cached (else ``gone``); 2. the pod-only prefilter (``skipped``); 3. the batched
row lookup (``lookup_failed``); 4. classify (``skipped``); 5. the observation clock on the pod
UID, bracketed by ``begin``/``end`` (cleared meanwhile: ``changed``; not yet reapable for the
threshold: ``too_young``, requeued for the remaining time); 6. dry run, reported before:
``already_reported``. An ``error``, ``gone``, ``skipped`` or ``lookup_failed`` clears the clock.

Act: 7. verification (``engine/verify.py``); 8. live, the budget's turn, nothing spent yet
(``throttled``); 9. the final check (``engine/verify.py``), then, with no await that suspends in
between, the token and 10. the DELETE with preconditions, or the dry-run report
(``engine/delete.py``). The API client's request slot is held from before step 9 until the DELETE
is sent.

A dependency that gives no answer holds that step of every key (``engine/gates.py``); a held
lookup or re-read clears the clock as a failed one does (invariant 3). Anything but an expected
failure is a bug: it propagates to the worker loop, and never leads to a delete.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from service import checks, logs
from service.classifier import classify, prefilter
from service.config import Settings
from service.domain import ExecutionRow, Mode, Outcome, PodSnapshot, Waiting, split_key
from service.engine.activation import Activation
from service.engine.budget import DeleteBudget, Turn
from service.engine.delete import Deleter
from service.engine.gates import FAILURES, Gates, Held, dependency_backoff, describe
from service.engine.observation import ObservationClocks
from service.engine.results import INACTIVE_RESULT, ReconcileResult
from service.engine.stages import Due
from service.engine.verify import Verifier
from service.kit import clock
from service.kit.backoff import Backoff
from service.kit.causelog import CauseLog, cause_of
from service.kit.gate import Gate
from service.kit.timeouts import fail_after
from service.metrics import EngineMetrics
from service.ports import ExecutionStore, NotificationBarrier, PodCache, PodClient, ReapRecorder

logger = logging.getLogger(__name__)

BUDGET_RETRY_MIN_S = 1.0
"""Least delay of a key that got no turn at the budget in time (else: when a token is due)."""


@dataclass(slots=True)
class Observed:
    """Observation of a batch: each key is in exactly one of ``results`` and ``due``."""

    results: dict[str, ReconcileResult] = field(default_factory=dict)
    due: list[Due] = field(default_factory=list)


class Reconciler:
    """Observes batches of keys and acts on their due keys (see the module docstring)."""

    def __init__(
        self,
        *,
        settings: Settings,
        cache: PodCache,
        pods: PodClient,
        store: ExecutionStore,
        clocks: ObservationClocks,
        budget: DeleteBudget,
        activation: Activation,
        metrics: EngineMetrics,
        barrier: NotificationBarrier,
        recorder: ReapRecorder | None = None,
        gate_backoff: Backoff | None = None,
    ) -> None:
        self._settings = settings
        self._cache = cache
        self._pods = pods
        self._store = store
        self._clocks = clocks
        self._budget = budget
        self._activation = activation
        self._db_timeout_s = settings.database.statement_timeout_s
        # The wait for a turn at the budget: a third of the reconcile's bound, so the final
        # check and the DELETE still fit in it.
        self._budget_wait_s = settings.reconcile_timeout_s / 3
        self._gates = Gates(
            metrics, gate_backoff if gate_backoff is not None else dependency_backoff()
        )
        self._verifier = Verifier(
            settings=settings,
            pods=pods,
            store=store,
            barrier=barrier,
            clocks=clocks,
            activation=activation,
            metrics=metrics,
            gates=self._gates,
        )
        self._deleter = Deleter(
            pods=pods,
            clocks=clocks,
            metrics=metrics,
            gates=self._gates,
            api_timeout_s=settings.kube.api_timeout_s,
            recorder=recorder,
        )
        self._lookup_failures = CauseLog("row lookups fail, clocks cleared", logger)
        self._observe_timeouts = CauseLog("observing batches times out", logger)
        self._act_timeouts = CauseLog("reconciles of due pods time out", logger)
        self.mode = Mode.DRY_RUN if settings.dry_run else Mode.LIVE
        """The ``mode`` label of the outcome metric."""
        self._namespaces = frozenset(settings.kube.namespaces)
        metrics.bind_namespaces(settings.kube.namespaces)

    @property
    def gates(self) -> tuple[Gate, ...]:
        """The dependencies' shared backoffs (held keys are released when one opens)."""
        return self._gates.all

    async def observe(self, keys: Sequence[str]) -> Observed:
        """Steps 1-6 for a batch, with one row query; bounded by ``RECONCILE_TIMEOUT_SECONDS``."""
        observed = Observed()
        if not self._activation.active:
            observed.results = dict.fromkeys(keys, INACTIVE_RESULT)
            return observed
        ready: list[str] = []
        # Whether each namespace of the batch is watched and synced, asked once a namespace.
        synced: dict[str, bool] = {}
        for key in keys:
            namespace = key.partition("/")[0]
            ok = synced.get(namespace)
            if ok is None:
                ok = synced[namespace] = namespace in self._namespaces and checks.cache_synced(
                    self._cache, namespace
                )
            if ok:
                ready.append(key)
            elif namespace not in self._namespaces:
                # No cache and no row lookup covers it: never acted on (a malformed key too).
                observed.results[key] = self._not_watched(key)
            else:
                observed.results[key] = ReconcileResult.done(Outcome.CACHE_COLD)
        if not ready:
            return observed
        keys = ready
        self._clocks.begin(keys)
        try:
            with fail_after(self._settings.reconcile_timeout_s):
                await self._observe(keys, observed)
            self._observe_timeouts.ok()
        except TimeoutError as exc:
            failed = self._timed_out(self._observe_timeouts, exc, f"observing {len(keys)} keys")
            for key in keys:
                observed.results.setdefault(key, failed)
            observed.due = []
        finally:
            self._clocks.end(keys)
        return observed

    async def _observe(self, keys: Sequence[str], observed: Observed) -> None:
        results = observed.results
        candidates: list[tuple[str, PodSnapshot]] = []
        get = self._cache.get
        for key in keys:
            pod = get(key)
            if pod is None:
                self._clocks.clear_key(key)
                results[key] = ReconcileResult.done(Outcome.GONE)
                continue
            skip = prefilter(pod)
            if skip is None:
                candidates.append((key, pod))
            else:
                self._clocks.clear_key(key)
                results[key] = ReconcileResult.skipped(skip.reason)
        if not candidates:
            return
        rows = await self._rows([key for key, _ in candidates])
        if isinstance(rows, ReconcileResult):
            # Not looked up: a gap in the observation (invariant 3).
            for key, _ in candidates:
                self._clocks.clear_key(key)
                results[key] = rows
            return
        now = clock.now()
        threshold_s = self._settings.threshold_s
        clocks = self._clocks
        for key, pod in candidates:
            decision = classify(pod, rows.get(key))
            verdict = decision.verdict
            if verdict is None:
                clocks.clear_key(key)
                results[key] = ReconcileResult.skipped(decision.reason)
                continue
            elapsed = clocks.observe(pod.uid, key, verdict, now)
            if elapsed is None:
                with logs.reconciling(key):
                    logger.debug(
                        "state changed during the reconcile; clock not started", extra={"key": key}
                    )
                results[key] = ReconcileResult.done(Outcome.CHANGED)
            elif not checks.observed_long_enough(elapsed, threshold_s):
                results[key] = ReconcileResult.requeue_after(
                    Outcome.TOO_YOUNG, threshold_s - elapsed
                )
            elif self._settings.dry_run and self._clocks.was_reported(pod.uid):
                results[key] = ReconcileResult.done(Outcome.ALREADY_REPORTED)
            else:
                with logs.reconciling(key):
                    logger.debug(
                        "reapable (%s) for %.0fs; verifying", verdict, elapsed, extra={"key": key}
                    )
                observed.due.append(Due(key, pod, verdict))

    async def _rows(self, keys: list[str]) -> dict[str, ExecutionRow] | ReconcileResult:
        """Step 3 through the database's gate: the rows, or the batch's result if failed or held."""
        gate = self._gates.database
        try:
            rows = await self._gates.call(
                gate, self._db_timeout_s, lambda: self._lookup(keys), keys=len(keys)
            )
        except FAILURES as exc:
            text = describe("row lookup", exc)
            self._lookup_failures.failed(cause_of(exc), text)
            logger.debug("row lookup of %d keys failed, clocks cleared: %s", len(keys), text)
            return self._gates.failed(gate, exc, Outcome.LOOKUP_FAILED)
        if isinstance(rows, Held):
            return rows.result(Outcome.LOOKUP_FAILED)
        self._lookup_failures.ok()
        return rows

    async def _lookup(self, keys: list[str]) -> dict[str, ExecutionRow]:
        return await self._store.lookup_many(keys)

    def _not_watched(self, key: str) -> ReconcileResult:
        """A key outside the configured namespaces (or malformed): dropped, never acted on."""
        with logs.reconciling(key):
            try:
                namespace, _ = split_key(key)
            except ValueError as exc:
                # Expected, so no traceback.
                logger.error("dropping a malformed work-queue key: %s", exc)  # noqa: TRY400
            else:
                logger.error("dropping a key of namespace %s, which is not configured", namespace)
        self._clocks.clear_key(key)
        return ReconcileResult.done(Outcome.ERROR)

    async def act(self, due: Due) -> ReconcileResult:
        """Steps 7-10 for one due key; bounded by ``RECONCILE_TIMEOUT_SECONDS``."""
        try:
            with fail_after(self._settings.reconcile_timeout_s):
                result = await self._act(due)
        except TimeoutError as exc:
            return self._timed_out(self._act_timeouts, exc, "reconcile", {"key": due.key})
        self._act_timeouts.ok()
        return result

    def _timed_out(
        self, log: CauseLog, exc: TimeoutError, what: str, extra: dict[str, str] | None = None
    ) -> ReconcileResult:
        """A step past ``RECONCILE_TIMEOUT_SECONDS``: logged once a cause, the key backs off."""
        bound_s = self._settings.reconcile_timeout_s
        log.failed(cause_of(exc), f"the bound is {bound_s:.1f}s")
        logger.debug("%s timed out after %.1fs", what, bound_s, extra=extra)
        return ReconcileResult.backoff(Outcome.ERROR)

    async def _act(self, due: Due) -> ReconcileResult:
        # Verified before waiting for a delete token, so only verified candidates wait in line.
        self._clocks.set_waiting(due.pod.uid, None)
        verified = await self._verifier.verify(due)
        if isinstance(verified, ReconcileResult):
            return verified
        if not checks.deletes_allowed(self._settings.dry_run):
            checked = await self._verifier.final_check(verified)
            if isinstance(checked, ReconcileResult):
                return checked
            return self._deleter.report_dry_run(checked)
        turn: Turn | None = None
        uid = due.pod.uid
        self._clocks.set_waiting(uid, Waiting.BUDGET)
        with anyio.move_on_after(self._budget_wait_s):
            turn = await self._budget.turn()
        if turn is None:
            delay_s = max(self._budget.retry_after_s(), BUDGET_RETRY_MIN_S)
            logger.debug(
                "no turn at the delete budget in time; retrying in %.1fs",
                delay_s,
                extra={"key": due.key},
            )
            return ReconcileResult.requeue_after(Outcome.THROTTLED, delay_s)
        self._clocks.set_waiting(uid, None)
        try:
            async with self._pods.delete_slot():
                checked = await self._verifier.final_check(verified)
                if isinstance(checked, ReconcileResult):
                    return checked  # the turn passes to the next candidate; no token spent
                # The token last: ``take`` never suspends, so the grant time is the moment the
                # DELETE below is handed to the API client.
                await turn.take()
                return await self._deleter.delete(checked)
        finally:
            turn.release()
