"""What the retired-but-kept view knows: a retired row and since when, a kept pod, its severity."""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from service.classifier import classify
from service.domain import (
    Decision,
    ExecutionRow,
    ExecutionState,
    PodSnapshot,
    SkipReason,
    split_key,
)
from service.ports import RetiredRow

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


def severity_of(reason: SkipReason) -> str:
    """``warning`` for :data:`PERSON_REASONS`, ``info`` for the keep annotation, else ``none``."""
    if reason in PERSON_REASONS:
        return "warning"
    if reason is SkipReason.KEEP_ANNOTATION:
        return "info"
    return "none"


class Since(enum.StrEnum):
    """Where a kept pod's "since" comes from."""

    RETIRED_AT = "retired_at"
    NOTIFICATION = "notification"
    FIRST_SEEN = "first_seen"


@dataclass(frozen=True, slots=True)
class Retired:
    """A retired row known for a cached pod's key, and since when (on the event loop's clock)."""

    row: ExecutionRow
    since_s: float
    source: Since

    @staticmethod
    def known(
        retired: RetiredRow,
        old: Retired | None,
        notified_s: float | None,
        *,
        now_s: float,
        wall_clock: Callable[[], float],
    ) -> Retired:
        """``retired`` as known at ``now_s``: since its ``retired_at``, else since when it was
        known already in that state, else the notification's arrival, else now."""
        if retired.retired_at_s is not None:
            since = now_s - max(0.0, wall_clock() - retired.retired_at_s)
            return Retired(retired.row, since, Since.RETIRED_AT)
        if old is not None and old.row.state == retired.row.state:
            return Retired(retired.row, old.since_s, old.source)
        if notified_s is not None:
            return Retired(retired.row, notified_s, Since.NOTIFICATION)
        return Retired(retired.row, now_s, Since.FIRST_SEEN)


@dataclass(frozen=True, slots=True)
class KeptPod:
    """One retired-but-kept pod as the view shows it."""

    key: str
    uid: str
    reason: SkipReason
    rule: str
    row_state: ExecutionState
    since_s: float
    """On the event loop's clock."""
    source: Since

    @property
    def severity(self) -> str:
        return severity_of(self.reason)


def kept_decision(pod: PodSnapshot, row: ExecutionRow) -> Decision | None:
    """The classifier's decision on ``pod`` and its retired ``row`` when it keeps the pod."""
    decision = classify(pod, row)
    reason = decision.reason
    if reason is None or reason is SkipReason.NO_ROW or reason is SkipReason.ROW_ACTIVE:
        return None
    return decision


def by_namespace(keys: Iterable[str]) -> dict[str, list[str]]:
    """``keys`` grouped by namespace, in their order."""
    grouped: defaultdict[str, list[str]] = defaultdict(list)
    for key in keys:
        grouped[split_key(key)[0]].append(key)
    return grouped


def of_namespace(namespace: str, keys: Iterable[str]) -> list[str]:
    """The keys of ``namespace`` among ``keys`` (a copy: the caller may change their source)."""
    prefix = namespace + "/"
    return [key for key in keys if key.startswith(prefix)]
