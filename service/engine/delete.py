"""Step 10 of the pipeline (``engine/reconciler.py``): the action on a checked candidate.

Live, the DELETE with preconditions {uid, resourceVersion} from the fresh GET; in dry run, "would
reap" once per UID. Either is handed to the recorder.
"""

from __future__ import annotations

import logging

from service.domain import DeleteResult, ExecutionState, Outcome
from service.engine.gates import FAILURES, Failure, Gates, Held, describe, throttled_s, unauthorized
from service.engine.observation import ObservationClocks
from service.engine.results import ReconcileResult
from service.engine.stages import Checked
from service.kit.causelog import CauseLog, cause_of
from service.metrics import EngineMetrics
from service.ports import PodClient, ReapRecorder, ReapReport

logger = logging.getLogger(__name__)

CONFLICT_REQUEUE_S = 1.0
"""A DELETE refused by its preconditions (409): the pod changed since the fresh GET; the key is
looked at again this much later, when the change's event has arrived."""


class Deleter:
    """Step 10: the DELETE, or the dry-run report."""

    def __init__(
        self,
        *,
        pods: PodClient,
        clocks: ObservationClocks,
        metrics: EngineMetrics,
        gates: Gates,
        api_timeout_s: float,
        recorder: ReapRecorder | None,
    ) -> None:
        self._pods = pods
        self._clocks = clocks
        self._metrics = metrics
        self._gates = gates
        self._api_timeout_s = api_timeout_s
        self._recorder = recorder
        self._delete_failures = CauseLog("DELETEs fail", logger)

    def report_dry_run(self, checked: Checked) -> ReconcileResult:
        """Dry run: "would reap", once per UID."""
        if not self._clocks.mark_reported(checked.verified.due.pod.uid):
            return ReconcileResult.done(Outcome.ALREADY_REPORTED)
        return self._reaped(checked, dry_run=True)

    async def delete(self, checked: Checked) -> ReconcileResult:
        """Live: the DELETE with preconditions from the fresh GET."""
        verified = checked.verified
        fresh = verified.pod
        extra = {"key": checked.key}
        try:
            outcome = await self._gates.call(
                self._gates.api,
                self._api_timeout_s,
                lambda: self._pods.delete_pod(
                    fresh.namespace,
                    fresh.name,
                    uid=fresh.uid,
                    resource_version=fresh.resource_version,
                ),
            )
        except FAILURES as exc:
            return self._failed(checked, exc)
        if isinstance(outcome, Held):
            # The API server stopped answering since the fresh GET: nothing sent.
            return outcome.result(Outcome.ERROR)
        self._delete_failures.ok()
        self._count(checked, str(outcome.result))
        match outcome.result:
            case DeleteResult.DELETED:
                self._clocks.clear(verified.due.pod.uid)
                return self._reaped(checked, dry_run=False)
            case DeleteResult.GONE:
                self._clocks.clear(verified.due.pod.uid)
                logger.debug("DELETE found the pod already gone (404)", extra=extra)
                return ReconcileResult.done(Outcome.GONE)
            case DeleteResult.CONFLICT:
                logger.debug("DELETE preconditions failed (409): %s", outcome.message, extra=extra)
                return ReconcileResult.requeue_after(Outcome.CONFLICT, CONFLICT_REQUEUE_S)

    def _failed(self, checked: Checked, exc: Failure) -> ReconcileResult:
        """No answer or an unexpected one: the clock runs on; the key is verified afresh later."""
        text = describe("pod DELETE", exc)
        extra = {"key": checked.key}
        throttled = throttled_s(exc)
        if throttled is not None:
            # Not sent again by the API client: the key comes back after the Retry-After.
            self._count(checked, Outcome.THROTTLED)
            logger.debug("DELETE throttled: %s", text, extra=extra)
            return ReconcileResult.requeue_after(Outcome.THROTTLED, throttled)
        self._count(checked, Outcome.ERROR)
        if unauthorized(exc):
            # The credentials were read again: the next attempt verifies afresh and uses them.
            logger.debug("DELETE refused: %s; verifying again", text, extra=extra)
            return ReconcileResult.requeue_after(Outcome.ERROR, 0.0)
        self._delete_failures.failed(cause_of(exc), text)
        logger.debug("DELETE failed: %s", text, extra=extra)
        return self._gates.api_failed(exc)

    def _count(self, checked: Checked, result: str) -> None:
        namespace = checked.verified.pod.namespace
        self._metrics.deletes.labels(sandbox_namespace=namespace, result=result).inc()

    def _reaped(self, checked: Checked, *, dry_run: bool) -> ReconcileResult:
        """A delete or dry-run report: its debug line (at info, one summary line an interval,
        ``engine/reaped.py``), the recorder's report (enqueued only; never awaits), the result."""
        verified = checked.verified
        logger.debug(
            "dry run: would reap %s as %s after %.0fs: %s"
            if dry_run
            else "deleted %s as %s after %.0fs: %s",
            checked.key,
            checked.verdict,
            checked.reapable_for_s,
            verified.rule,
            extra={"key": checked.key, "uid": verified.pod.uid, "verdict": str(checked.verdict)},
        )
        if self._recorder is not None:
            row = verified.row
            self._recorder.record(
                ReapReport(
                    pod=verified.pod,
                    verdict=checked.verdict,
                    rule=verified.rule,
                    reapable_for_s=checked.reapable_for_s,
                    row_state=row.state if row is not None else ExecutionState.UNKNOWN,
                    dry_run=dry_run,
                )
            )
        return ReconcileResult.done(Outcome(checked.verdict))
