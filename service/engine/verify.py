"""Steps 7 and 9 of the pipeline (``engine/reconciler.py``): verification makes a ``Due`` key
``Verified`` (a fresh GET, a direct row re-read classified again, a round trip on the listener);
the final check makes it ``Checked`` (verified again while the re-read is older than
:data:`FINAL_CHECK_MAX_AGE_S`, then the clock and the activation, nothing awaited after it)."""

from __future__ import annotations

import logging

from service import checks
from service.classifier import classify
from service.config import Settings
from service.domain import ExecutionRow, Outcome, PodSnapshot
from service.engine.activation import Activation
from service.engine.gates import FAILURES, Failure, Gates, Held, describe, throttled_s, unauthorized
from service.engine.observation import ObservationClocks
from service.engine.results import INACTIVE_RESULT, ReconcileResult
from service.engine.stages import Checked, Due, Verified
from service.kit import clock
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import Undecodable
from service.kit.timeouts import fail_after
from service.metrics import EngineMetrics
from service.ports import ExecutionStore, NotificationBarrier, PodClient

logger = logging.getLogger(__name__)

FINAL_CHECK_MAX_AGE_S = 0.25
"""Invariant 1's bound: the DELETE (or dry-run report) is made at most this long after the final
row re-read began (older, and the verification is redone); room for a loaded machine."""
MAX_AGE_REVERIFICATIONS = 3
"""Re-verifications caused by age in one reconcile before it gives up (``stale``), so that a
starved loop does not spin on the API and database."""
STALE_REQUEUE_S = 1.0
"""A key that gave up as ``stale`` is looked at again this much later (its clock runs on)."""


class Verifier:
    """Steps 7 and 9 for one due key at a time."""

    def __init__(
        self,
        *,
        settings: Settings,
        pods: PodClient,
        store: ExecutionStore,
        barrier: NotificationBarrier,
        clocks: ObservationClocks,
        activation: Activation,
        metrics: EngineMetrics,
        gates: Gates,
    ) -> None:
        self._settings = settings
        self._pods = pods
        self._store = store
        self._barrier = barrier
        self._clocks = clocks
        self._activation = activation
        self._metrics = metrics
        self._gates = gates
        self._get_failures = CauseLog("fresh pod GETs fail", logger)
        self._reread_failures = CauseLog("row re-reads fail, clocks cleared", logger)
        self._sync_failures = CauseLog(
            "could not sync change notifications, clocks of due pods cleared", logger
        )

    async def verify(self, due: Due) -> Verified | ReconcileResult:
        """Step 7: fresh GET, direct row re-read, classify again, notification sync, clock."""
        key, pod, verdict = due.key, due.pod, due.verdict
        fresh = await self._get(due)
        if isinstance(fresh, ReconcileResult):
            return fresh
        reread_at_s = clock.now()
        fresh_row = await self._reread(due)
        if isinstance(fresh_row, ReconcileResult):
            return fresh_row

        again = classify(fresh, fresh_row)
        same_uid = checks.uid_unchanged(pod, fresh)
        same_verdict = checks.verdict_unchanged(verdict, again)
        if same_verdict and not checks.resource_version_unchanged(pod, fresh):
            # The pod changed in ways the watch has not delivered yet (perhaps a non-reapable
            # state): its event is on the way and enqueues the key again.
            logger.debug(
                "pod resourceVersion %s is ahead of the cache (%s); waiting for its events",
                fresh.resource_version,
                pod.resource_version,
                extra={"key": key},
            )
            return ReconcileResult.done(Outcome.CHANGED)
        if not same_uid or not same_verdict:
            self._clocks.clear(pod.uid)
            logger.debug(
                "changed before acting: uid %s -> %s, now %s (%s)",
                pod.uid,
                fresh.uid,
                again.label,
                again.rule,
                extra={"key": key},
            )
            return ReconcileResult.done(Outcome.CHANGED)

        synced = await self._sync(key)
        if synced is not None:
            return synced
        elapsed = self._still_due(due, clock.now())
        if isinstance(elapsed, ReconcileResult):
            return elapsed
        return Verified(due, fresh, fresh_row, again.rule, reread_at_s)

    async def _get(self, due: Due) -> PodSnapshot | ReconcileResult:
        pod = due.pod
        try:
            fresh = await self._gates.call(
                self._gates.api,
                self._settings.kube.api_timeout_s,
                lambda: self._pods.get_pod(pod.namespace, pod.name),
            )
        except FAILURES as exc:
            return self._get_failed(due.key, exc)
        if isinstance(fresh, Held):
            return fresh.result(Outcome.ERROR)
        self._get_failures.ok()
        if fresh is None:
            self._clocks.clear_key(due.key)
            return ReconcileResult.done(Outcome.GONE)
        return fresh

    def _get_failed(self, key: str, exc: Failure) -> ReconcileResult:
        text = describe("pod GET", exc)
        extra = {"key": key}
        throttled = throttled_s(exc)
        if throttled is not None:
            # Retried by the API client already: back after the Retry-After, the clock on.
            logger.debug("fresh pod GET throttled: %s", text, extra=extra)
            return ReconcileResult.requeue_after(Outcome.THROTTLED, throttled)
        if unauthorized(exc):
            logger.debug("fresh pod GET refused: %s", text, extra=extra)
            return ReconcileResult.backoff(Outcome.ERROR)
        if isinstance(exc, Undecodable):
            # The pod as the server has it now cannot be read: a gap in its observation.
            self._clocks.clear_key(key)
            self._get_failures.failed(cause_of(exc), f"{key} undecodable, clock cleared: {text}")
            logger.debug("fresh pod GET undecodable, clock cleared: %s", text, extra=extra)
        else:
            self._get_failures.failed(cause_of(exc), text)
            logger.debug("fresh pod GET failed: %s", text, extra=extra)
        return self._gates.api_failed(exc)

    async def _reread(self, due: Due) -> ExecutionRow | ReconcileResult | None:
        """The direct re-read of the row; a failed or held one clears the clock (invariant 3)."""
        database = self._gates.database
        try:
            row = await self._gates.call(
                database,
                self._settings.database.statement_timeout_s,
                lambda: self._store.read_fresh(due.pod.key),
            )
        except FAILURES as exc:
            self._clocks.clear_key(due.key)
            text = describe("row re-read", exc)
            self._reread_failures.failed(cause_of(exc), text)
            logger.debug("row re-read failed, clock cleared: %s", text, extra={"key": due.key})
            return self._gates.failed(database, exc, Outcome.LOOKUP_FAILED)
        if isinstance(row, Held):
            self._clocks.clear_key(due.key)
            return row.result(Outcome.LOOKUP_FAILED)
        self._reread_failures.ok()
        return row

    async def _sync(self, key: str) -> ReconcileResult | None:
        """A round trip on the notification listener; ``None`` once it is back."""
        # A row that flipped active and back between the lookup and the re-read shows only in
        # its notifications: none may still be in flight (a stalled listener fails this).
        try:
            with fail_after(self._settings.database.statement_timeout_s):
                await checks.sync_notifications(self._barrier)
        except FAILURES as exc:
            self._clocks.clear_key(key)
            text = describe("notification sync", exc)
            self._sync_failures.failed(cause_of(exc), text)
            logger.debug(
                "could not sync change notifications, clock cleared: %s", text, extra={"key": key}
            )
            return ReconcileResult.backoff(Outcome.LOOKUP_FAILED)
        self._sync_failures.ok()
        return None

    async def final_check(self, verified: Verified) -> Checked | ReconcileResult:
        """Step 9: a verification at most :data:`FINAL_CHECK_MAX_AGE_S` old (verified again if
        older), then the clock and the activation once more. Nothing awaits after the last age
        check, so the caller acts on the result before any other task runs."""
        due = verified.due
        reverified = 0
        while True:
            now = clock.now()
            age_s = now - verified.reread_at_s
            if age_s <= FINAL_CHECK_MAX_AGE_S:
                break
            if reverified == MAX_AGE_REVERIFICATIONS:
                logger.debug(
                    "final check still %.3fs old after %d re-verifications",
                    age_s,
                    reverified,
                    extra={"key": due.key},
                )
                return ReconcileResult.requeue_after(Outcome.STALE, STALE_REQUEUE_S)
            reverified += 1
            self._metrics.final_check_reverifications.inc()
            logger.debug(
                "final check %.3fs old (bound %.2fs); verifying again",
                age_s,
                FINAL_CHECK_MAX_AGE_S,
                extra={"key": due.key},
            )
            again = await self.verify(due)
            if isinstance(again, ReconcileResult):
                return again
            verified = again
        elapsed = self._still_due(due, now)
        if isinstance(elapsed, ReconcileResult):
            return elapsed
        self._metrics.final_check_age.observe(age_s)
        return Checked(verified, elapsed)

    def _still_due(self, due: Due, now: float) -> float | ReconcileResult:
        """Seconds ``due``'s UID has been continuously reapable at ``now``, if past the threshold
        and this replica still active; else the result that ends the reconcile."""
        elapsed = self._clocks.elapsed(due.pod.uid, now)
        if elapsed is None or not checks.observed_long_enough(elapsed, self._settings.threshold_s):
            logger.debug("clock cleared while verifying; not acting", extra={"key": due.key})
            return ReconcileResult.done(Outcome.CHANGED)
        if not self._activation.active:
            logger.debug("no longer active; not acting", extra={"key": due.key})
            return INACTIVE_RESULT
        return elapsed
