"""One key's reconcile: from the cached pod to a verified, preconditioned DELETE (or a report).

Steps (DESIGN "Shape of the service"), each ending in exactly one :class:`ReconcileResult`:

1. a synced cache (relisting: ``cache_cold``, nothing observed); the cached pod (missing:
   clear the key's clock, ``gone``);
2. pod-only prefilter (skip: clear, ``skipped``, no database query);
3. batched row lookup (failure: clear, ``lookup_failed``, back off);
4. classify (not reapable: clear, ``skipped``);
5. observation clock on the pod UID (not yet continuously reapable for the threshold:
   ``too_young``, requeued for exactly the remaining time);
6. dry run already reported for this UID: ``already_reported`` (no API call);
7. verification: fresh GET of the pod and a direct re-read of the row, classified again; the UID
   must be the observed one, the verdict unchanged and the resourceVersion the cached one (a
   newer version means events the watch has not delivered yet: wait for them); then a round
   trip on the notification listener (no retirement flip may still be in flight; failure:
   clear, ``lookup_failed``); the clock must still be running past the threshold (an event may
   have cleared it meanwhile) and the replica still active; else ``changed``;
8. live: the budget's turn — first come, first served, until a token is available now, nothing
   spent yet (none within ``budget_wait_s``: ``throttled``);
9. the age of the final check: when more than :data:`FINAL_CHECK_MAX_AGE_S` has passed since
   the row re-read began — whatever aged it: the notification sync, the wait for the turn, a
   starved event loop — step 7 again (at most :data:`MAX_AGE_REVERIFICATIONS` times, then
   ``stale``, looked at again shortly; a failed check passes the turn on unspent); then, with no
   await that suspends in between, the clock and the activation are checked once more, the
   token is taken (live) and the action is taken;
10. dry run: report "would reap" once per UID; live: DELETE with preconditions {uid,
   resourceVersion of the fresh GET}: deleted → the verdict, 404 → ``gone``, 409 → ``conflict``
   (looked at again shortly), other errors → ``error`` (back off, or wait the server's
   Retry-After).

Tokens are spent on DELETEs that are sent, at the moment they are handed to the API client (so
the budget's pacing bounds the send times themselves; ``engine/budget.py``). Invariant 1 is
judged at the final re-read, and the DELETE is handed to the API client at most
:data:`FINAL_CHECK_MAX_AGE_S` after that re-read began (on the injected clock). The pod side
needs no such bound: the DELETE's resourceVersion precondition pins the pod to the fresh GET.
Dry run takes no token (it sends nothing) but obeys the same bound before it reports.

Expected failures of the outside world are converted into :class:`ExternalCallError` in one
helper and become typed outcomes; anything else propagates to the worker loop, the one place
that catches broad exceptions.
"""

from __future__ import annotations

import collections
import contextvars
import enum
import itertools
import logging
import time
from collections.abc import Awaitable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from service.classifier import classify, prefilter
from service.config import Settings
from service.domain import (
    Decision,
    DeleteResult,
    ExecutionRow,
    ExecutionState,
    PodSnapshot,
    ReconcileOutcome,
    SkipReason,
    Verdict,
    split_key,
)
from service.engine.activation import Activation
from service.engine.budget import DeleteBudget, Turn
from service.engine.observation import ObservationClocks
from service.kit.clock import Clock
from service.kit.errors import ApiError
from service.metrics import Metrics
from service.ports import (
    ExecutionStore,
    NotificationBarrier,
    PodCache,
    PodClient,
    ReapRecorder,
    ReapReport,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

current_reconcile_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "current_reconcile_id", default=None
)
"""The id of the reconcile running in this task (for log filters of adapters it calls)."""

_ids = itertools.count(1)
FINAL_CHECK_MAX_AGE_S = 0.25
"""Invariant 1's bound: the DELETE (or dry-run report) is made at most this long after the final
row re-read began, on the injected clock. Older, and the verification is redone. The row re-read
and notification sync take milliseconds; this leaves room for a loaded machine."""
MAX_AGE_REVERIFICATIONS = 3
"""Re-verifications caused by age in one reconcile before it gives up (``stale``) and requeues:
a loop starved for longer than the bound at every try must not spin on the API and database."""


class Action(enum.StrEnum):
    """What the worker loop does with the key afterwards (controller-runtime's Result)."""

    DONE = "done"
    """Forget the key's backoff; nothing scheduled (events bring it back)."""
    REQUEUE_AFTER = "requeue_after"
    """Forget the backoff and add the key again after ``requeue_after_s``."""
    BACKOFF = "backoff"
    """A transient failure: requeue with the key's exponential backoff."""


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    action: Action
    outcome: str
    """The outcome label (a verdict or a :class:`ReconcileOutcome`), or ``inactive``."""
    requeue_after_s: float = 0.0
    reconcile_id: str = ""

    @staticmethod
    def done(outcome: str, rid: str = "") -> ReconcileResult:
        return ReconcileResult(Action.DONE, outcome, reconcile_id=rid)

    @staticmethod
    def requeue_after(outcome: str, delay_s: float, rid: str = "") -> ReconcileResult:
        return ReconcileResult(Action.REQUEUE_AFTER, outcome, max(0.0, delay_s), rid)

    @staticmethod
    def backoff(outcome: str, rid: str = "") -> ReconcileResult:
        return ReconcileResult(Action.BACKOFF, outcome, reconcile_id=rid)


@dataclass(frozen=True, slots=True)
class _Verified:
    """The outcome of a successful verification."""

    pod: PodSnapshot
    """The fresh GET (its UID and resourceVersion go into the DELETE preconditions)."""
    row: ExecutionRow | None
    """The final re-read."""
    decision: Decision
    reread_at_s: float
    """Injected-clock time at which the final row re-read began."""


INACTIVE = "inactive"
"""Outcome of a reconcile that found the replica disabled or not leader (nothing counted)."""


class ExternalCallError(Exception):
    """An API or database call failed or timed out; the cause is chained (``__cause__``)."""


async def _bounded(what: str, timeout_s: float, call: Awaitable[T]) -> T:
    try:
        with anyio.fail_after(timeout_s):
            return await call
    except Exception as exc:  # an adapter's failure of any kind becomes one typed error
        raise ExternalCallError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _retry_after(cause: BaseException | None) -> float | None:
    return cause.retry_after_s if isinstance(cause, ApiError) else None


class _Log(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Adds the reconcile id and key to every record of one reconcile."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        kwargs["extra"] = {**(kwargs.get("extra") or {}), **(self.extra or {})}
        return msg, kwargs


class Reconciler:
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
        clock: Clock,
        metrics: Metrics,
        api_timeout_s: float | None = None,
        db_timeout_s: float | None = None,
        budget_wait_s: float | None = None,
        conflict_requeue_s: float = 1.0,
        barrier: NotificationBarrier | None = None,
        recorder: ReapRecorder | None = None,
    ) -> None:
        self._settings = settings
        self._cache = cache
        self._pods = pods
        self._store = store
        self._clocks = clocks
        self._budget = budget
        self._activation = activation
        self._clock = clock
        self._metrics = metrics
        self._api_timeout_s = (
            api_timeout_s if api_timeout_s is not None else settings.kube.api_timeout_s
        )
        self._db_timeout_s = (
            db_timeout_s if db_timeout_s is not None else settings.database.statement_timeout_s
        )
        self._budget_wait_s = (
            budget_wait_s if budget_wait_s is not None else settings.reconcile_timeout_s / 3
        )
        self._conflict_requeue_s = conflict_requeue_s
        self._barrier = barrier
        self._recorder = recorder
        self._mode = "dry_run" if settings.dry_run else "live"

    @property
    def mode(self) -> str:
        return self._mode

    async def reconcile(self, key: str) -> ReconcileResult:
        rid = f"{next(_ids):x}"
        token = current_reconcile_id.set(rid)
        log = _Log(logger, {"reconcile_id": rid, "key": key})
        started = time.perf_counter()
        try:
            if not self._activation.active:
                return ReconcileResult.done(INACTIVE, rid)
            self._clocks.begin(key)
            try:
                with anyio.fail_after(self._settings.reconcile_timeout_s):
                    return await self._reconcile(key, rid, log)
            except TimeoutError:
                log.warning("reconcile timed out after %.1fs", self._settings.reconcile_timeout_s)
                return self._result_backoff(ReconcileOutcome.ERROR, rid)
            finally:
                self._clocks.end(key)
        finally:
            self._metrics.reconcile_duration.observe(time.perf_counter() - started)
            current_reconcile_id.reset(token)

    async def observe_batch(self, keys: Sequence[str]) -> dict[str, ReconcileResult | None]:
        """Steps 1-6 for many keys with one row query: a burst (a mass retirement, a resync)
        starts its clocks without one reconcile, one lookup future and one timeout per key.

        Each key's result is what :meth:`reconcile` would return for it up to the clock, or
        ``None`` when the key is due (past the threshold and not yet reported): nothing is ever
        acted on here, the caller runs :meth:`reconcile` for it, every step of it. The clocks
        are bracketed with ``begin``/``end`` as in :meth:`reconcile`, and started only from the
        rows this query read.
        """
        rid = f"{next(_ids):x}"
        token = current_reconcile_id.set(rid)
        started = time.perf_counter()
        results: dict[str, ReconcileResult | None] = {}
        try:
            if not self._activation.active:
                results.update(dict.fromkeys(keys, ReconcileResult.done(INACTIVE, rid)))
                return results
            if not self._cache.synced:
                # As in reconcile: nothing is observed from a relisting cache.
                for key in keys:
                    results[key] = self._result_done(ReconcileOutcome.CACHE_COLD, rid)
                return results
            for key in keys:
                self._clocks.begin(key)
            try:
                await self._observe_batch(keys, rid, results)
            finally:
                for key in keys:
                    self._clocks.end(key)
            return results
        finally:
            duration_s = time.perf_counter() - started
            for key in keys:
                if results.get(key) is not None:  # a due key is counted by its reconcile
                    self._metrics.reconcile_duration.observe(duration_s)
            current_reconcile_id.reset(token)

    async def _observe_batch(
        self, keys: Sequence[str], rid: str, results: dict[str, ReconcileResult | None]
    ) -> None:
        outcomes: collections.Counter[str] = collections.Counter()
        skips: collections.Counter[SkipReason] = collections.Counter()

        def skip(key: str, decision: Decision) -> None:
            self._clocks.clear_key(key)
            if decision.reason is not None:
                skips[decision.reason] += 1
            outcomes[ReconcileOutcome.SKIPPED] += 1
            results[key] = ReconcileResult.done(str(ReconcileOutcome.SKIPPED), rid)

        candidates: list[tuple[str, PodSnapshot]] = []
        rows: dict[str, ExecutionRow] = {}
        for key in keys:
            pod = self._cache.get(key)
            if pod is None:
                # A malformed key, too: the full reconcile reports it as it always does.
                results[key] = None
                continue
            early = prefilter(pod)
            if early is not None:
                skip(key, early)
            else:
                candidates.append((key, pod))
        if candidates:
            try:
                rows = await _bounded(
                    "row lookup",
                    self._db_timeout_s,
                    self._store.lookup_many([pod.name for _, pod in candidates]),
                )
            except ExternalCallError as exc:
                # DESIGN invariant 3: a failed lookup is a gap in the observation.
                logger.warning(
                    "row lookup of %d keys failed, clocks cleared: %s",
                    len(candidates),
                    exc,
                    extra={"reconcile_id": rid},
                )
                for key, _ in candidates:
                    self._clocks.clear_key(key)
                    results[key] = ReconcileResult.backoff(str(ReconcileOutcome.LOOKUP_FAILED), rid)
                outcomes[ReconcileOutcome.LOOKUP_FAILED] += len(candidates)
                candidates = []
        now = self._clock.monotonic()
        threshold_s = self._settings.threshold_s
        dry_run = self._settings.dry_run
        for key, pod in candidates:
            decision = classify(pod, rows.get(pod.name))
            verdict = decision.verdict
            if verdict is None:
                skip(key, decision)
                continue
            elapsed = self._clocks.observe(pod.uid, key, verdict, now)
            if elapsed is None:
                outcomes[ReconcileOutcome.CHANGED] += 1
                results[key] = ReconcileResult.done(str(ReconcileOutcome.CHANGED), rid)
            elif elapsed < threshold_s:
                outcomes[ReconcileOutcome.TOO_YOUNG] += 1
                results[key] = ReconcileResult.requeue_after(
                    str(ReconcileOutcome.TOO_YOUNG), threshold_s - elapsed, rid
                )
            elif dry_run and self._clocks.was_reported(pod.uid):
                outcomes[ReconcileOutcome.ALREADY_REPORTED] += 1
                results[key] = ReconcileResult.done(str(ReconcileOutcome.ALREADY_REPORTED), rid)
            else:
                results[key] = None
        for outcome, count in outcomes.items():
            self._metrics.outcome(self._mode, str(outcome), count)
        for reason, count in skips.items():
            self._metrics.skips.labels(reason=str(reason)).inc(count)

    async def _reconcile(self, key: str, rid: str, log: _Log) -> ReconcileResult:
        try:
            namespace, name = split_key(key)
        except ValueError as exc:
            log.error("dropping a malformed work-queue key: %s", exc)  # noqa: TRY400 (expected)
            return self._result_done(ReconcileOutcome.ERROR, rid)

        if not self._cache.synced:
            # A relist collapses the states it skipped: a clock started now, from a snapshot the
            # relist may be about to replace with the same state at a newer version, would
            # cover a non-reapable state it never saw. Synced, every candidate is enqueued.
            return self._result_done(ReconcileOutcome.CACHE_COLD, rid)

        pod = self._cache.get(key)
        if pod is None:
            self._clocks.clear_key(key)
            return self._result_done(ReconcileOutcome.GONE, rid)

        early = prefilter(pod)
        if early is not None:
            return self._skip(key, early, rid, log)

        try:
            row = await _bounded("row lookup", self._db_timeout_s, self._store.lookup(pod.name))
        except ExternalCallError as exc:
            # DESIGN invariant 3: a failed lookup is a gap in the observation.
            self._clocks.clear_key(key)
            log.warning("row lookup failed, clock cleared: %s", exc)
            return self._result_backoff(ReconcileOutcome.LOOKUP_FAILED, rid)

        decision = classify(pod, row)
        if decision.verdict is None:
            return self._skip(key, decision, rid, log)
        verdict = decision.verdict

        now = self._clock.monotonic()
        elapsed = self._clocks.observe(pod.uid, key, verdict, now)
        if elapsed is None:
            # A clearing event arrived while we read; what we read may predate it. The event
            # enqueued the key again, so the next reconcile starts the clock afresh.
            log.info("state changed during the reconcile; clock not started")
            return self._result_done(ReconcileOutcome.CHANGED, rid)
        remaining_s = self._settings.threshold_s - elapsed
        if remaining_s > 0:
            log.debug("%s for %.1fs of %.1fs", verdict, elapsed, self._settings.threshold_s)
            return self._result_requeue(ReconcileOutcome.TOO_YOUNG, remaining_s, rid)

        dry_run = self._settings.dry_run
        if dry_run and self._clocks.was_reported(pod.uid):
            return self._result_done(ReconcileOutcome.ALREADY_REPORTED, rid)

        # Verify against the server and the database before waiting for a delete token, so
        # that only verified candidates wait in the budget's line.
        checked = await self._verify(key, pod, verdict, rid, log)
        if isinstance(checked, ReconcileResult):
            return checked

        if dry_run:
            final = await self._final_check(key, pod, verdict, checked, rid=rid, log=log)
            if isinstance(final, ReconcileResult):
                return final
            checked, elapsed_now = final
            if not self._clocks.mark_reported(pod.uid):
                return self._result_done(ReconcileOutcome.ALREADY_REPORTED, rid)
            log.info(
                "dry run: would reap %s as %s after %.0fs: %s",
                key,
                verdict,
                elapsed_now,
                checked.decision.rule,
                extra={"uid": checked.pod.uid, "verdict": str(verdict)},
            )
            self._report(checked, verdict, elapsed_now, dry_run=True)
            return self._result_done(verdict, rid)

        turn: Turn | None = None
        with anyio.move_on_after(self._budget_wait_s):
            turn = await self._budget.turn()
        if turn is None:
            delay_s = max(self._budget.retry_after_s(), self._conflict_requeue_s)
            log.info("no turn at the delete budget in time; retrying in %.1fs", delay_s)
            return self._result_requeue(ReconcileOutcome.THROTTLED, delay_s, rid)
        try:
            final = await self._final_check(key, pod, verdict, checked, rid=rid, log=log)
            if isinstance(final, ReconcileResult):
                return final  # the turn passes to the next candidate; no token spent
            # The token last: ``take`` never suspends, so the grant time is the moment the
            # DELETE below is handed to the API client.
            await turn.take()
        finally:
            turn.release()
        checked, elapsed_now = final
        fresh, again = checked.pod, checked.decision

        try:
            outcome = await _bounded(
                "pod DELETE",
                self._api_timeout_s,
                self._pods.delete_pod(
                    namespace,
                    name,
                    uid=fresh.uid,
                    resource_version=fresh.resource_version,
                ),
            )
        except ExternalCallError as exc:
            self._metrics.deletes.labels(result=str(DeleteResult.ERROR)).inc()
            log.warning("DELETE failed: %s", exc)
            return self._result_backoff(ReconcileOutcome.ERROR, rid)
        self._metrics.deletes.labels(result=str(outcome.result)).inc()
        match outcome.result:
            case DeleteResult.DELETED:
                self._clocks.clear(pod.uid)
                log.info(
                    "deleted %s as %s after %.0fs: %s",
                    key,
                    verdict,
                    elapsed_now,
                    again.rule,
                    extra={"uid": fresh.uid, "verdict": str(verdict)},
                )
                self._report(checked, verdict, elapsed_now, dry_run=False)
                return self._result_done(verdict, rid)
            case DeleteResult.GONE:
                self._clocks.clear(pod.uid)
                log.info("DELETE found the pod already gone (404)")
                return self._result_done(ReconcileOutcome.GONE, rid)
            case DeleteResult.CONFLICT:
                log.info("DELETE preconditions failed (409): %s", outcome.message)
                return self._result_requeue(
                    ReconcileOutcome.CONFLICT, self._conflict_requeue_s, rid
                )
            case DeleteResult.ERROR:
                log.warning("DELETE answered %s: %s", outcome.status, outcome.message)
                return self._result_retry(outcome.retry_after_s, rid)

    async def _final_check(
        self,
        key: str,
        pod: PodSnapshot,
        verdict: Verdict,
        checked: _Verified,
        *,
        rid: str,
        log: _Log,
    ) -> tuple[_Verified, float] | ReconcileResult:
        """Step 9: a verification at most :data:`FINAL_CHECK_MAX_AGE_S` old (verified again
        if older), then the clock and the activation once more; returns the verification and
        the seconds the pod has been reapable. Nothing awaits after the last age check, so the
        caller acts on what this returns before any other task runs."""
        reverified = 0
        while (age_s := (now := self._clock.monotonic()) - checked.reread_at_s) > (
            FINAL_CHECK_MAX_AGE_S
        ):
            if reverified == MAX_AGE_REVERIFICATIONS:
                log.info("final check still %.3fs old after %d re-verifications", age_s, reverified)
                return self._result_requeue(ReconcileOutcome.STALE, self._conflict_requeue_s, rid)
            reverified += 1
            self._metrics.final_check_reverifications.inc()
            log.info(
                "final check %.3fs old (bound %.2fs); verifying again", age_s, FINAL_CHECK_MAX_AGE_S
            )
            again = await self._verify(key, pod, verdict, rid, log)
            if isinstance(again, ReconcileResult):
                return again
            checked = again
        # An event that cleared the clock, or a lost lease, during the checks above is seen now.
        elapsed_now = self._due(pod.uid, now, rid, log)
        if isinstance(elapsed_now, ReconcileResult):
            return elapsed_now
        self._metrics.final_check_age.observe(age_s)
        return checked, elapsed_now

    async def _verify(
        self, key: str, pod: PodSnapshot, verdict: Verdict, rid: str, log: _Log
    ) -> _Verified | ReconcileResult:
        """Fresh GET, direct row re-read, classify again, notification sync, clock re-check.

        Returns what was verified, and when the re-read began, when the pod may be acted on,
        else the result that ends the reconcile.
        """
        try:
            fresh = await _bounded(
                "pod GET", self._api_timeout_s, self._pods.get_pod(pod.namespace, pod.name)
            )
        except ExternalCallError as exc:
            log.warning("fresh pod GET failed: %s", exc)
            return self._result_retry(_retry_after(exc.__cause__), rid)
        if fresh is None:
            self._clocks.clear_key(key)
            return self._result_done(ReconcileOutcome.GONE, rid)
        reread_at_s = self._clock.monotonic()
        try:
            fresh_row = await _bounded(
                "row re-read", self._db_timeout_s, self._store.read_fresh(pod.name)
            )
        except ExternalCallError as exc:
            self._clocks.clear_key(key)
            log.warning("row re-read failed, clock cleared: %s", exc)
            return self._result_backoff(ReconcileOutcome.LOOKUP_FAILED, rid)

        again = classify(fresh, fresh_row)
        if (
            fresh.uid == pod.uid
            and again.verdict is verdict
            and (fresh.resource_version != pod.resource_version)
        ):
            # The pod changed in ways the watch has not delivered yet: what happened in
            # between (perhaps a non-reapable state) is unknown. Its event is on the way and
            # enqueues the key again (clearing the clock first if it shows a non-reapable
            # state); act only on a pod the cache has seen up to this version.
            log.info(
                "pod resourceVersion %s is ahead of the cache (%s); waiting for its events",
                fresh.resource_version,
                pod.resource_version,
            )
            return self._result_done(ReconcileOutcome.CHANGED, rid)
        if fresh.uid != pod.uid or again.verdict is not verdict:
            self._clocks.clear(pod.uid)
            log.info(
                "changed before acting: uid %s -> %s, now %s (%s)",
                pod.uid,
                fresh.uid,
                again.label,
                again.rule,
            )
            return self._result_done(ReconcileOutcome.CHANGED, rid)

        if self._barrier is not None:
            # A row that flipped active and back between the lookup and the re-read shows only
            # in its notifications: make sure none is still in flight before trusting the
            # clock (a stalled listener fails this, and the clock restarts).
            try:
                await _bounded("notification sync", self._db_timeout_s, self._barrier.sync())
            except ExternalCallError as exc:
                self._clocks.clear_key(key)
                log.warning("could not sync change notifications, clock cleared: %s", exc)
                return self._result_backoff(ReconcileOutcome.LOOKUP_FAILED, rid)

        # The re-reads take time: an event may have cleared the clock, or leadership may have
        # been lost, meanwhile (checked here so that no such candidate waits for the budget).
        due = self._due(pod.uid, self._clock.monotonic(), rid, log)
        if isinstance(due, ReconcileResult):
            return due
        return _Verified(fresh, fresh_row, again, reread_at_s)

    def _due(self, uid: str, now: float, rid: str, log: _Log) -> float | ReconcileResult:
        """Seconds ``uid`` has been continuously reapable at ``now`` if it is past the threshold
        and this replica still active; else the result that ends the reconcile. Synchronous."""
        elapsed = self._clocks.elapsed(uid, now)
        if elapsed is None or elapsed < self._settings.threshold_s:
            log.info("clock cleared while verifying; not acting")
            return self._result_done(ReconcileOutcome.CHANGED, rid)
        if not self._activation.active:
            log.info("no longer active; not acting")
            return ReconcileResult.done(INACTIVE, rid)
        return elapsed

    # ---------------------------------------------------------------- helpers

    def _report(
        self, checked: _Verified, verdict: Verdict, elapsed_s: float, *, dry_run: bool
    ) -> None:
        """Hand the delete or dry-run report to the recorder (enqueues only; never awaits)."""
        if self._recorder is None:
            return
        self._recorder.record(
            ReapReport(
                pod=checked.pod,
                verdict=verdict,
                rule=checked.decision.rule,
                reapable_for_s=elapsed_s,
                row_state=checked.row.state if checked.row is not None else ExecutionState.UNKNOWN,
                dry_run=dry_run,
            )
        )

    def _skip(self, key: str, decision: Decision, rid: str, log: _Log) -> ReconcileResult:
        self._clocks.clear_key(key)
        if decision.reason is not None:
            self._metrics.skips.labels(reason=str(decision.reason)).inc()
        log.debug("skipped: %s (%s)", decision.label, decision.rule)
        return self._result_done(ReconcileOutcome.SKIPPED, rid)

    def _count(self, outcome: str) -> None:
        self._metrics.outcome(self._mode, str(outcome))

    def _result_done(self, outcome: str, rid: str) -> ReconcileResult:
        self._count(outcome)
        return ReconcileResult.done(str(outcome), rid)

    def _result_requeue(self, outcome: str, delay_s: float, rid: str) -> ReconcileResult:
        self._count(outcome)
        return ReconcileResult.requeue_after(str(outcome), delay_s, rid)

    def _result_retry(self, retry_after_s: float | None, rid: str) -> ReconcileResult:
        """An API error: wait as long as the server asked (Retry-After), else back off."""
        if retry_after_s is None:
            return self._result_backoff(ReconcileOutcome.ERROR, rid)
        self._metrics.reconcile_errors.inc()
        return self._result_requeue(ReconcileOutcome.ERROR, retry_after_s, rid)

    def _result_backoff(self, outcome: str, rid: str) -> ReconcileResult:
        self._count(outcome)
        return ReconcileResult.backoff(str(outcome), rid)
