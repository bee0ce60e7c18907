"""The stages of a due key, as types: :class:`Due` → :class:`Verified` (``engine/verify.py``) →
:class:`Checked` (the final check), and only a checked candidate is deleted or reported
(``engine/delete.py``); mypy rejects any other order (``tests/unit/test_stage_types.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from service.domain import ExecutionRow, PodSnapshot, Verdict


@dataclass(frozen=True, slots=True)
class Due:
    """A key observed continuously reapable for the threshold."""

    key: str
    pod: PodSnapshot
    """The cached snapshot that was observed."""
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class Verified:
    """A due key that the verification vouched for."""

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
    """A verified key that passed the final check, nothing awaited since."""

    verified: Verified
    reapable_for_s: float
    """Seconds continuously reapable at the final check."""

    @property
    def key(self) -> str:
        return self.verified.due.key

    @property
    def verdict(self) -> Verdict:
        return self.verified.due.verdict
