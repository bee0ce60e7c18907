"""What one key's reconcile ends in: one :class:`ReconcileResult` (controller-runtime's Result),
which the worker loop (``engine/controller.py``) counts and applies to the work queue."""

from __future__ import annotations

import enum

import msgspec

from service.domain import Outcome, SkipReason


class Action(enum.StrEnum):
    """What the worker loop does with the key afterwards."""

    DONE = "done"
    """Forget the key's backoff; nothing scheduled (events bring it back)."""
    REQUEUE_AFTER = "requeue_after"
    """Forget the backoff and add the key again after ``requeue_after_s``."""
    BACKOFF = "backoff"
    """A transient failure: requeue with the key's exponential backoff."""


class ReconcileResult(msgspec.Struct, frozen=True, gc=False):
    """One key's result (frozen)."""

    action: Action
    outcome: Outcome
    requeue_after_s: float = 0.0
    skip_reason: SkipReason | None = None
    """Why the pod is not reapable, for ``skipped`` (counted by reason)."""
    held_by: str | None = None
    """The dependency (a gate's name, ``service/kit/gate.py``) whose shared backoff holds the
    key: it is requeued to the dependency's next attempt time, and at once when it answers."""

    @staticmethod
    def done(outcome: Outcome) -> ReconcileResult:
        return ReconcileResult(Action.DONE, outcome)

    @staticmethod
    def requeue_after(outcome: Outcome, delay_s: float) -> ReconcileResult:
        return ReconcileResult(Action.REQUEUE_AFTER, outcome, max(0.0, delay_s))

    @staticmethod
    def backoff(outcome: Outcome) -> ReconcileResult:
        return ReconcileResult(Action.BACKOFF, outcome)

    @staticmethod
    def held(outcome: Outcome, dependency: str, wait_s: float) -> ReconcileResult:
        return ReconcileResult(Action.REQUEUE_AFTER, outcome, max(0.0, wait_s), held_by=dependency)

    @staticmethod
    def skipped(reason: SkipReason | None) -> ReconcileResult:
        """Not reapable (``reason`` is counted beside the outcome)."""
        return ReconcileResult(Action.DONE, Outcome.SKIPPED, skip_reason=reason)

    @staticmethod
    def retry(retry_after_s: float | None) -> ReconcileResult:
        """An API error: wait as long as the server asked (Retry-After), else back off."""
        if retry_after_s is None:
            return ReconcileResult.backoff(Outcome.ERROR)
        return ReconcileResult.requeue_after(Outcome.ERROR, retry_after_s)

    @property
    def counted(self) -> bool:
        """Whether the outcome metric counts it (an inactive replica counts nothing)."""
        return self.outcome is not Outcome.INACTIVE

    @property
    def failed(self) -> bool:
        """Whether it counts as a reconcile error (backoff, or an error with a Retry-After)."""
        held = self.held_by is not None
        return self.action is Action.BACKOFF or self.outcome is Outcome.ERROR or held


INACTIVE_RESULT = ReconcileResult.done(Outcome.INACTIVE)
