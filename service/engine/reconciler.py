"""The reconcile pipeline: observe → verify → act, each step written once.

A batch of keys is the general case (one key is a batch of one). :meth:`Reconciler.observe`
takes a batch to its clocks; every key it does not end with a result is *due* and goes on to
:meth:`Reconciler.act`, one at a time. Each step either lets a key go on or ends it with one
:class:`~service.engine.results.ReconcileResult`; going on, a key's stage is its type (a
:class:`Due` key is verified into a :class:`Verified`, the final check makes it :class:`Checked`,
and only a checked candidate is deleted or reported). The worker loop counts results and
applies them to the queue (``engine/controller.py``). The steps, in order
(docs/architecture.md, "The seven safety invariants and where each is enforced", says which
invariant each one keeps):

Observe (one row query for the whole batch):

1. the replica active (else ``inactive``, nothing counted), the key's namespace configured
   (else ``error``, never acted on), the cache of *that* namespace synced (relisting:
   ``cache_cold``, nothing observed), the pod cached (missing: clear the key's clock, ``gone``);
2. pod-only prefilter (skip: clear, ``skipped``, no database query);
3. batched row lookup (failure: clear, ``lookup_failed``; the database's shared backoff holds
   the batch while it gives no answer, see below);
4. classify (not reapable: clear, ``skipped``);
5. the observation clock on the pod UID, bracketed by ``begin``/``end`` (an event that cleared
   the key meanwhile: ``changed``; not yet continuously reapable for the threshold:
   ``too_young``, requeued for exactly the remaining time);
6. dry run, already reported for this UID: ``already_reported`` (no API call).

Verify and act (one due key):

7. verification: fresh GET of the pod (failure: ``error``, retried; a pod that does not decode
   clears its clock too) and a direct re-read of the row, classified again; the UID
   must be the observed one, the verdict unchanged and the resourceVersion the cached one (a
   newer version means events the watch has not delivered yet: wait for them); then a round
   trip on the notification listener (no retirement flip may still be in flight; failure:
   clear, ``lookup_failed``); the clock must still run past the threshold and the replica be
   active; else ``changed``;
8. live: the budget's turn — first come, first served, until a token is available now, nothing
   spent yet (none within ``budget_wait_s``: ``throttled``);
9. the final check: when more than :data:`FINAL_CHECK_MAX_AGE_S` has passed since the row
   re-read began — whatever aged it — step 7 again (at most :data:`MAX_AGE_REVERIFICATIONS`
   times, then ``stale``); then, with no await that suspends in between, the clock and the
   activation once more, the token (live), and the action;
10. dry run: report "would reap" once per UID; live: DELETE with preconditions {uid,
    resourceVersion of the fresh GET}: deleted → the verdict, 404 → ``gone``, 409 →
    ``conflict`` (looked at again shortly), throttled (429, or 503 with Retry-After) →
    ``throttled`` (after the Retry-After, the clock running on), refused (401: the API client has
    read the credentials again) → ``error``, at once; another failure (no answer, another status)
    → ``error`` (back off, or wait the server's Retry-After). The API client's request slot
    (``PodClient.delete_slot``) is held from before step 9 until the DELETE is sent.

A dependency that gives no answer is backed off from as one, not key by key: the row lookup
and re-read go through the database's :class:`~service.kit.gate.Gate`, the pod GET and DELETE
through the API server's. Once a call of a step finds its dependency unavailable (no answer, or
the step's timeout), that step of every key is held — not sent, the key requeued to the
dependency's next attempt time (``held``) — but for one probe a backoff step
(:func:`dependency_backoff`); the first answer releases every held key at once
(``engine/controller.py``). A held step counts as that step's failure: a held lookup or re-read
clears the clock as a failed one does (invariant 3).

Expected failures of the outside world arrive as :class:`~service.kit.errors.ExternalError`
(typed at the adapter edge) or as a timeout of the step's bound, and become typed results in
:func:`_bounded`. Anything else is a bug: it propagates to the worker loop, which logs and counts
it, and a bug never leads to a delete (every step before the DELETE has to return first).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from service import checks, logs
from service.classifier import classify, prefilter
from service.config import Settings
from service.domain import (
    DeleteResult,
    ExecutionRow,
    ExecutionState,
    PodSnapshot,
    ReconcileOutcome,
    Verdict,
    Waiting,
    split_key,
)
from service.engine.activation import Activation
from service.engine.budget import DeleteBudget, Turn
from service.engine.observation import ObservationClocks
from service.engine.results import INACTIVE_RESULT, ReconcileResult
from service.kit import clock
from service.kit.backoff import Backoff
from service.kit.causelog import CauseLog, cause_of
from service.kit.errors import ApiError, ExternalError, Unavailable, Undecodable
from service.kit.gate import Gate, Ticket
from service.kit.timeouts import fail_after
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

FINAL_CHECK_MAX_AGE_S = 0.25
"""Invariant 1's bound: the DELETE (or dry-run report) is made at most this long after the final
row re-read began, on the event loop's clock. Older, and the verification is redone. The row re-read
and notification sync take milliseconds; this leaves room for a loaded machine."""
DEPENDENCY_BACKOFF_INITIAL_S = 0.25
"""A dependency's first probe after the call that found it unavailable comes this long after."""
DEPENDENCY_BACKOFF_MAX_S = 5.0
"""Cap of the time between two probes of an unavailable dependency: a restored dependency is
found, and every held key released, within this (docs/operations.md,
"What the service does to a dependency that is down")."""
THROTTLED_REQUEUE_S = 1.0
"""When a throttled GET or DELETE (429) comes back without a Retry-After: the key is looked at
again this much later (its clock runs on)."""
MAX_AGE_REVERIFICATIONS = 3
"""Re-verifications caused by age in one reconcile before it gives up (``stale``) and requeues:
a loop starved for longer than the bound at every try must not spin on the API and database."""


def dependency_backoff() -> Backoff:
    """The shared backoff from an unavailable dependency (one probe a step)."""
    return Backoff(
        initial_s=DEPENDENCY_BACKOFF_INITIAL_S, max_s=DEPENDENCY_BACKOFF_MAX_S, jitter=0.2
    )


@dataclass(frozen=True, slots=True)
class Held:
    """A step not sent: its dependency's shared backoff holds it for ``wait_s``."""

    dependency: str
    wait_s: float


class StepFailed(Exception):
    """An expected failure of a step's call (an :class:`ExternalError` or the step's timeout);
    the cause is chained (``__cause__``)."""


async def _bounded(what: str, timeout_s: float, call: Awaitable[T]) -> T:
    """``call`` within ``timeout_s``; expected failures become :class:`StepFailed`, and
    everything else (a bug) propagates unchanged."""
    try:
        with fail_after(timeout_s):
            return await call
    except (ExternalError, TimeoutError) as exc:
        raise StepFailed(f"{what}: {type(exc).__name__}: {exc}") from exc


def _no_answer(exc: StepFailed) -> bool:
    """Whether the dependency gave no answer (what closes its gate)."""
    return isinstance(exc.__cause__, Unavailable | TimeoutError)


def _retry_after(exc: StepFailed) -> float | None:
    cause = exc.__cause__
    return cause.retry_after_s if isinstance(cause, ApiError) else None


def _throttled(exc: StepFailed) -> float | None:
    """How long the API server asked to wait when it throttled the call (a 429, or a 503 with
    Retry-After: the request was not processed); ``None`` when it did not."""
    cause = exc.__cause__
    if not isinstance(cause, ApiError):
        return None
    if cause.status == 429 or (cause.status == 503 and cause.retry_after_s is not None):
        return cause.retry_after_s if cause.retry_after_s is not None else THROTTLED_REQUEUE_S
    return None


def _unauthorized(exc: StepFailed) -> bool:
    """The API server refused the credentials (the API client has read them again already and
    logged the refusal once)."""
    cause = exc.__cause__
    return isinstance(cause, ApiError) and cause.status == 401


@dataclass(frozen=True, slots=True)
class Due:
    """A key observed continuously reapable for the threshold: it goes on to verification
    (:meth:`Reconciler._verify`), the only way to a :class:`Verified`."""

    key: str
    pod: PodSnapshot
    """The cached snapshot that was observed."""
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class Verified:
    """A due key that step 7 vouched for; only the final check (:meth:`Reconciler._final_check`)
    takes it on, to a :class:`Checked`."""

    due: Due
    pod: PodSnapshot
    """The fresh GET (its UID and resourceVersion go into the DELETE preconditions)."""
    row: ExecutionRow | None
    """The final re-read."""
    rule: str
    reread_at_s: float
    """Event-loop time at which the final row re-read began."""


@dataclass(frozen=True, slots=True)
class Checked:
    """A verified key that passed the final check (step 9), nothing awaited since: the only
    thing the DELETE (:meth:`Reconciler._delete`) and the dry-run report take."""

    verified: Verified
    reapable_for_s: float
    """Seconds continuously reapable at the final check."""

    @property
    def key(self) -> str:
        return self.verified.due.key

    @property
    def verdict(self) -> Verdict:
        return self.verified.due.verdict


@dataclass(slots=True)
class Observed:
    """Observation of a batch: each key is in exactly one of ``results`` and ``due``."""

    results: dict[str, ReconcileResult] = field(default_factory=dict)
    due: list[Due] = field(default_factory=list)


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
        metrics: Metrics,
        api_timeout_s: float | None = None,
        db_timeout_s: float | None = None,
        budget_wait_s: float | None = None,
        barrier: NotificationBarrier,
        conflict_requeue_s: float = 1.0,
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
        backoff = gate_backoff if gate_backoff is not None else dependency_backoff()
        self.database_gate = Gate("database", backoff)
        self.api_gate = Gate("api_server", backoff)
        for gate in self.gates:
            gate.on_change(metrics.dependency_backoff.labels(dependency=gate.name).set)
        # Each recurring failure is logged once per change of its cause, with a count; the
        # per-batch and per-key lines are debug (their outcomes are counted in the metrics).
        self._sync_failures = CauseLog(
            "could not sync change notifications, clocks of due pods cleared", logger
        )
        self._lookup_failures = CauseLog("row lookups fail, clocks cleared", logger)
        self._observe_timeouts = CauseLog("observing batches times out", logger)
        self._get_failures = CauseLog("fresh pod GETs fail", logger)
        self._reread_failures = CauseLog("row re-reads fail, clocks cleared", logger)
        self._act_timeouts = CauseLog("reconciles of due pods time out", logger)
        self._delete_failures = CauseLog("DELETEs fail", logger)
        self._recorder = recorder
        self.mode = "dry_run" if settings.dry_run else "live"
        """The ``mode`` label of the outcome metric."""
        self._namespaces = frozenset(settings.kube.namespaces)
        metrics.bind_namespaces(settings.kube.namespaces)

    @property
    def gates(self) -> tuple[Gate, ...]:
        """The dependencies' shared backoffs (the controller releases held keys when one
        opens)."""
        return (self.database_gate, self.api_gate)

    async def _gated(
        self,
        gate: Gate,
        what: str,
        timeout_s: float,
        call: Callable[[], Awaitable[T]],
        *,
        keys: int = 1,
    ) -> T | Held:
        """``call()`` within ``timeout_s`` through ``gate`` (``keys`` keys wait on it): held
        while the dependency is backed off from; a failure raises :class:`StepFailed` as
        :func:`_bounded` does, and no answer closes the gate."""
        ticket = gate.admit()
        if not isinstance(ticket, Ticket):
            self._metrics.dependency_held.labels(dependency=gate.name).inc(keys)
            return Held(gate.name, ticket)
        try:
            result = await _bounded(what, timeout_s, call())
        except StepFailed as exc:
            self._report(gate, ticket, answered=not _no_answer(exc))
            raise
        except BaseException:
            gate.abandoned(ticket)  # cancelled, or a bug
            raise
        self._report(gate, ticket, answered=True)
        return result

    @staticmethod
    def _failed(gate: Gate, exc: StepFailed, outcome: str) -> ReconcileResult | None:
        """The result of a key whose step got no answer while ``gate`` is closed (held to its
        next attempt time); ``None`` for any other failure."""
        if _no_answer(exc) and gate.closed:
            return ReconcileResult.held(outcome, gate.name, gate.retry_in_s())
        return None

    @staticmethod
    def _held(held: Held, outcome: str) -> ReconcileResult:
        return ReconcileResult.held(outcome, held.dependency, held.wait_s)

    def _report(self, gate: Gate, ticket: Ticket, *, answered: bool) -> None:
        if ticket.probe:
            self._metrics.dependency_probes.labels(
                dependency=gate.name, result="answered" if answered else "failed"
            ).inc()
        if answered:
            gate.succeeded(ticket)
        else:
            gate.failed(ticket)

    # ================================================================= observe

    async def observe(self, keys: Sequence[str]) -> Observed:
        """Steps 1-6 for a batch, with one row query; bounded by ``RECONCILE_TIMEOUT_SECONDS``."""
        observed = Observed()
        if not self._activation.active:
            observed.results = dict.fromkeys(keys, INACTIVE_RESULT)
            return observed
        ready: list[str] = []
        # Whether each namespace of the batch is watched and its cache synced, asked once a
        # namespace.
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
                # Judged by the cache of the key's own namespace only. A relist collapses the
                # states it skipped: a clock started now, from a snapshot the relist may be
                # about to replace with the same state at a newer version, would cover a
                # non-reapable state it never saw. Synced, every candidate is enqueued.
                observed.results[key] = ReconcileResult.done(ReconcileOutcome.CACHE_COLD)
        if not ready:
            return observed
        keys = ready
        self._clocks.begin(keys)
        try:
            with fail_after(self._settings.reconcile_timeout_s):
                await self._observe(keys, observed)
            self._observe_timeouts.ok()
        except TimeoutError as exc:
            self._observe_timeouts.failed(
                cause_of(exc), f"the bound is {self._settings.reconcile_timeout_s:.1f}s"
            )
            logger.debug(
                "observing %d keys timed out after %.1fs",
                len(keys),
                self._settings.reconcile_timeout_s,
            )
            for key in keys:
                observed.results.setdefault(key, ReconcileResult.backoff(ReconcileOutcome.ERROR))
            observed.due = []
        finally:
            self._clocks.end(keys)
        return observed

    async def _observe(self, keys: Sequence[str], observed: Observed) -> None:
        results = observed.results
        # The cached pods that passed the prefilter, under their keys (a cached pod's key is
        # the one it is cached under).
        candidates: list[tuple[str, PodSnapshot]] = []
        get = self._cache.get
        for key in keys:
            pod = get(key)
            if pod is None:
                results[key] = self._gone(key)
                continue
            skip = prefilter(pod)
            if skip is None:
                candidates.append((key, pod))
            else:
                self._clocks.clear_key(key)
                results[key] = ReconcileResult.skipped(skip.reason)
        if not candidates:
            return
        gate = self.database_gate
        try:
            rows = await self._gated(
                gate,
                "row lookup",
                self._db_timeout_s,
                lambda: self._lookup([key for key, _ in candidates]),
                keys=len(candidates),
            )
        except StepFailed as exc:
            # A failed lookup is a gap in the observation (invariant 3).
            self._lookup_failures.failed(cause_of(exc), str(exc))
            logger.debug("row lookup of %d keys failed, clocks cleared: %s", len(candidates), exc)
            result = self._failed(gate, exc, ReconcileOutcome.LOOKUP_FAILED)
            for key, _ in candidates:
                self._clocks.clear_key(key)
                results[key] = result or ReconcileResult.backoff(ReconcileOutcome.LOOKUP_FAILED)
            return
        if isinstance(rows, Held):
            # Not looked up: as much a gap in the observation as a failed lookup.
            held = self._held(rows, ReconcileOutcome.LOOKUP_FAILED)
            for key, _ in candidates:
                self._clocks.clear_key(key)
                results[key] = held
            return
        self._lookup_failures.ok()
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
                # A clearing event arrived while we read; what we read may predate it. The event
                # enqueued the key again, so the next reconcile starts the clock afresh.
                with logs.reconciling(key):
                    logger.debug(
                        "state changed during the reconcile; clock not started", extra={"key": key}
                    )
                results[key] = ReconcileResult.done(ReconcileOutcome.CHANGED)
            elif not checks.observed_long_enough(elapsed, threshold_s):
                results[key] = ReconcileResult.requeue_after(
                    ReconcileOutcome.TOO_YOUNG, threshold_s - elapsed
                )
            elif self._settings.dry_run and self._clocks.was_reported(pod.uid):
                results[key] = ReconcileResult.done(ReconcileOutcome.ALREADY_REPORTED)
            else:
                with logs.reconciling(key):
                    logger.debug(
                        "reapable (%s) for %.0fs; verifying", verdict, elapsed, extra={"key": key}
                    )
                observed.due.append(Due(key, pod, verdict))

    async def _lookup(self, keys: list[str]) -> dict[str, ExecutionRow]:
        """The batch's rows by pod key (step 3)."""
        return await self._store.lookup_many(keys)

    def _not_watched(self, key: str) -> ReconcileResult:
        """A key outside the configured namespaces (or malformed): dropped, never acted on."""
        with logs.reconciling(key):
            try:
                namespace, _ = split_key(key)
            except ValueError as exc:
                logger.error("dropping a malformed work-queue key: %s", exc)  # noqa: TRY400 (expected)
            else:
                logger.error("dropping a key of namespace %s, which is not configured", namespace)
        self._clocks.clear_key(key)
        return ReconcileResult.done(ReconcileOutcome.ERROR)

    def _gone(self, key: str) -> ReconcileResult:
        self._clocks.clear_key(key)
        return ReconcileResult.done(ReconcileOutcome.GONE)

    # =========================================================== verify and act

    async def act(self, due: Due) -> ReconcileResult:
        """Steps 7-10 for one due key; bounded by ``RECONCILE_TIMEOUT_SECONDS``."""
        try:
            with fail_after(self._settings.reconcile_timeout_s):
                result = await self._act(due)
        except TimeoutError as exc:
            self._act_timeouts.failed(
                cause_of(exc), f"the bound is {self._settings.reconcile_timeout_s:.1f}s"
            )
            logger.debug(
                "reconcile timed out after %.1fs",
                self._settings.reconcile_timeout_s,
                extra={"key": due.key},
            )
            return ReconcileResult.backoff(ReconcileOutcome.ERROR)
        self._act_timeouts.ok()
        return result

    async def _act(self, due: Due) -> ReconcileResult:
        # Verified before waiting for a delete token, so only verified candidates wait in line.
        self._clocks.set_waiting(due.pod.uid, None)
        verified = await self._verify(due)
        if isinstance(verified, ReconcileResult):
            return verified
        if not checks.deletes_allowed(self._settings.dry_run):
            checked = await self._final_check(verified)
            if isinstance(checked, ReconcileResult):
                return checked
            return self._report_dry_run(checked)
        turn: Turn | None = None
        uid = due.pod.uid
        self._clocks.set_waiting(uid, Waiting.BUDGET)
        with anyio.move_on_after(self._budget_wait_s):
            turn = await self._budget.turn()
        if turn is None:
            delay_s = max(self._budget.retry_after_s(), self._conflict_requeue_s)
            logger.debug(
                "no turn at the delete budget in time; retrying in %.1fs",
                delay_s,
                extra={"key": due.key},
            )
            return ReconcileResult.requeue_after(ReconcileOutcome.THROTTLED, delay_s)
        self._clocks.set_waiting(uid, None)
        try:
            # The API client's request slot is taken before the final check, so the DELETE
            # after it never waits for one (the GETs of a re-verification use it too).
            async with self._pods.delete_slot():
                checked = await self._final_check(verified)
                if isinstance(checked, ReconcileResult):
                    return checked  # the turn passes to the next candidate; no token spent
                # The token last: ``take`` never suspends, so the grant time is the moment the
                # DELETE below is handed to the API client.
                await turn.take()
                return await self._delete(checked)
        finally:
            turn.release()

    async def _verify(self, due: Due) -> Verified | ReconcileResult:
        """Step 7: fresh GET, direct row re-read, classify again, notification sync, clock."""
        key, pod, verdict = due.key, due.pod, due.verdict
        extra = {"key": key}
        try:
            fresh = await self._gated(
                self.api_gate,
                "pod GET",
                self._api_timeout_s,
                lambda: self._pods.get_pod(pod.namespace, pod.name),
            )
        except StepFailed as exc:
            throttled_s = _throttled(exc)
            if throttled_s is not None:
                # The API client retried it within its timeout already; the key comes back
                # after the server's Retry-After, its clock running on.
                logger.debug("fresh pod GET throttled: %s", exc, extra=extra)
                return ReconcileResult.requeue_after(ReconcileOutcome.THROTTLED, throttled_s)
            if _unauthorized(exc):
                logger.debug("fresh pod GET refused: %s", exc, extra=extra)
                return ReconcileResult.backoff(ReconcileOutcome.ERROR)
            if isinstance(exc.__cause__, Undecodable):
                # The pod as the server has it now cannot be read: a gap in its observation.
                self._clocks.clear_key(key)
                self._get_failures.failed(cause_of(exc), f"{key} undecodable, clock cleared: {exc}")
                logger.debug("fresh pod GET undecodable, clock cleared: %s", exc, extra=extra)
            else:
                self._get_failures.failed(cause_of(exc), str(exc))
                logger.debug("fresh pod GET failed: %s", exc, extra=extra)
            held_result = self._failed(self.api_gate, exc, ReconcileOutcome.ERROR)
            return held_result or ReconcileResult.retry(_retry_after(exc))
        if isinstance(fresh, Held):
            return self._held(fresh, ReconcileOutcome.ERROR)
        self._get_failures.ok()
        if fresh is None:
            self._clocks.clear_key(key)
            return ReconcileResult.done(ReconcileOutcome.GONE)
        reread_at_s = clock.now()
        try:
            fresh_row = await self._gated(
                self.database_gate,
                "row re-read",
                self._db_timeout_s,
                lambda: self._store.read_fresh(pod.key),
            )
        except StepFailed as exc:
            self._clocks.clear_key(key)
            self._reread_failures.failed(cause_of(exc), str(exc))
            logger.debug("row re-read failed, clock cleared: %s", exc, extra=extra)
            held_result = self._failed(self.database_gate, exc, ReconcileOutcome.LOOKUP_FAILED)
            return held_result or ReconcileResult.backoff(ReconcileOutcome.LOOKUP_FAILED)
        if isinstance(fresh_row, Held):
            self._clocks.clear_key(key)
            return self._held(fresh_row, ReconcileOutcome.LOOKUP_FAILED)
        self._reread_failures.ok()

        again = classify(fresh, fresh_row)
        same_uid = checks.uid_unchanged(pod, fresh)
        same_verdict = checks.verdict_unchanged(verdict, again)
        if same_verdict and not checks.resource_version_unchanged(pod, fresh):
            # The pod changed in ways the watch has not delivered yet: what happened in
            # between (perhaps a non-reapable state) is unknown. Its event is on the way and
            # enqueues the key again (clearing the clock first if it shows a non-reapable
            # state); act only on a pod the cache has seen up to this version.
            logger.debug(
                "pod resourceVersion %s is ahead of the cache (%s); waiting for its events",
                fresh.resource_version,
                pod.resource_version,
                extra=extra,
            )
            return ReconcileResult.done(ReconcileOutcome.CHANGED)
        if not same_uid or not same_verdict:
            self._clocks.clear(pod.uid)
            logger.debug(
                "changed before acting: uid %s -> %s, now %s (%s)",
                pod.uid,
                fresh.uid,
                again.label,
                again.rule,
                extra=extra,
            )
            return ReconcileResult.done(ReconcileOutcome.CHANGED)

        # A row that flipped active and back between the lookup and the re-read shows only in
        # its notifications: make sure none is still in flight before trusting the clock (a
        # stalled listener fails this, and the clock restarts).
        try:
            await _bounded(
                "notification sync", self._db_timeout_s, checks.sync_notifications(self._barrier)
            )
        except StepFailed as exc:
            self._clocks.clear_key(key)
            # Once per cause: a listener that cannot prove delivery fails every due key.
            self._sync_failures.failed(cause_of(exc), str(exc))
            logger.debug("could not sync change notifications, clock cleared: %s", exc, extra=extra)
            return ReconcileResult.backoff(ReconcileOutcome.LOOKUP_FAILED)
        self._sync_failures.ok()

        # The re-reads take time: an event may have cleared the clock, or leadership may have
        # been lost, meanwhile (checked here so that no such candidate waits for the budget).
        elapsed = self._still_due(due, clock.now())
        if isinstance(elapsed, ReconcileResult):
            return elapsed
        return Verified(due, fresh, fresh_row, again.rule, reread_at_s)

    async def _final_check(self, verified: Verified) -> Checked | ReconcileResult:
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
                return ReconcileResult.requeue_after(
                    ReconcileOutcome.STALE, self._conflict_requeue_s
                )
            reverified += 1
            self._metrics.final_check_reverifications.inc()
            logger.debug(
                "final check %.3fs old (bound %.2fs); verifying again",
                age_s,
                FINAL_CHECK_MAX_AGE_S,
                extra={"key": due.key},
            )
            again = await self._verify(due)
            if isinstance(again, ReconcileResult):
                return again
            verified = again
        # An event that cleared the clock, or a lost lease, during the checks above is seen now.
        elapsed = self._still_due(due, now)
        if isinstance(elapsed, ReconcileResult):
            return elapsed
        self._metrics.final_check_age.observe(age_s)
        return Checked(verified, elapsed)

    def _still_due(self, due: Due, now: float) -> float | ReconcileResult:
        """The seconds ``due``'s UID has been continuously reapable at ``now``, if past the
        threshold and this replica still active; else the result that ends the reconcile.
        Synchronous."""
        elapsed = self._clocks.elapsed(due.pod.uid, now)
        if elapsed is None or not checks.observed_long_enough(elapsed, self._settings.threshold_s):
            logger.debug("clock cleared while verifying; not acting", extra={"key": due.key})
            return ReconcileResult.done(ReconcileOutcome.CHANGED)
        if not self._activation.active:
            logger.debug("no longer active; not acting", extra={"key": due.key})
            return INACTIVE_RESULT
        return elapsed

    def _report_dry_run(self, checked: Checked) -> ReconcileResult:
        """Step 10, dry run: "would reap", once per UID."""
        verified = checked.verified
        if not self._clocks.mark_reported(verified.due.pod.uid):
            return ReconcileResult.done(ReconcileOutcome.ALREADY_REPORTED)
        logger.debug(  # at info, one summary line an interval (engine/reaped.py)
            "dry run: would reap %s as %s after %.0fs: %s",
            checked.key,
            checked.verdict,
            checked.reapable_for_s,
            verified.rule,
            extra={"key": checked.key, "uid": verified.pod.uid, "verdict": str(checked.verdict)},
        )
        self._record(checked, dry_run=True)
        return ReconcileResult.done(checked.verdict)

    async def _delete(self, checked: Checked) -> ReconcileResult:
        """Step 10, live: the DELETE with preconditions from the fresh GET."""
        verified = checked.verified
        fresh = verified.pod
        key = checked.key
        extra = {"key": key}
        try:
            outcome = await self._gated(
                self.api_gate,
                "pod DELETE",
                self._api_timeout_s,
                lambda: self._pods.delete_pod(
                    fresh.namespace,
                    fresh.name,
                    uid=fresh.uid,
                    resource_version=fresh.resource_version,
                ),
            )
        except StepFailed as exc:
            # No answer or an unexpected one: the clock runs on, and the key is verified again
            # (fresh GET first) when it comes back.
            throttled_s = _throttled(exc)
            if throttled_s is not None:
                # Not sent again by the API client (nothing may delay a DELETE after its final
                # check): the key comes back after the server's Retry-After.
                self._metrics.deletes.labels(
                    sandbox_namespace=fresh.namespace, result="throttled"
                ).inc()
                logger.debug("DELETE throttled: %s", exc, extra=extra)
                return ReconcileResult.requeue_after(ReconcileOutcome.THROTTLED, throttled_s)
            self._metrics.deletes.labels(sandbox_namespace=fresh.namespace, result="error").inc()
            if _unauthorized(exc):
                # The API client has read the credentials again: the next attempt verifies the
                # pod afresh and its DELETE carries them (at most one refused DELETE).
                logger.debug("DELETE refused: %s; verifying again", exc, extra=extra)
                return ReconcileResult.requeue_after(ReconcileOutcome.ERROR, 0.0)
            self._delete_failures.failed(cause_of(exc), str(exc))
            logger.debug("DELETE failed: %s", exc, extra=extra)
            held_result = self._failed(self.api_gate, exc, ReconcileOutcome.ERROR)
            return held_result or ReconcileResult.retry(_retry_after(exc))
        if isinstance(outcome, Held):
            # The API server stopped answering since the fresh GET: nothing sent.
            return self._held(outcome, ReconcileOutcome.ERROR)
        self._delete_failures.ok()
        self._metrics.deletes.labels(
            sandbox_namespace=fresh.namespace, result=str(outcome.result)
        ).inc()
        match outcome.result:
            case DeleteResult.DELETED:
                self._clocks.clear(verified.due.pod.uid)
                logger.debug(  # at info, one summary line an interval (engine/reaped.py)
                    "deleted %s as %s after %.0fs: %s",
                    key,
                    checked.verdict,
                    checked.reapable_for_s,
                    verified.rule,
                    extra={"key": key, "uid": fresh.uid, "verdict": str(checked.verdict)},
                )
                self._record(checked, dry_run=False)
                return ReconcileResult.done(checked.verdict)
            case DeleteResult.GONE:
                self._clocks.clear(verified.due.pod.uid)
                logger.debug("DELETE found the pod already gone (404)", extra=extra)
                return ReconcileResult.done(ReconcileOutcome.GONE)
            case DeleteResult.CONFLICT:
                logger.debug("DELETE preconditions failed (409): %s", outcome.message, extra=extra)
                return ReconcileResult.requeue_after(
                    ReconcileOutcome.CONFLICT, self._conflict_requeue_s
                )

    def _record(self, checked: Checked, *, dry_run: bool) -> None:
        """Hand the delete or dry-run report to the recorder (enqueues only; never awaits)."""
        if self._recorder is None:
            return
        verified = checked.verified
        self._recorder.record(
            ReapReport(
                pod=verified.pod,
                verdict=checked.verdict,
                rule=verified.rule,
                reapable_for_s=checked.reapable_for_s,
                row_state=verified.row.state
                if verified.row is not None
                else ExecutionState.UNKNOWN,
                dry_run=dry_run,
            )
        )
