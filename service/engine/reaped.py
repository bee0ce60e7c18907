"""The info-level record of deletes and dry-run reports: one summary line an interval.

Each one is an Event on the pod and an outcome in the metrics; its own log line is debug
(``engine/delete.py``). At info, :class:`ReapTally` logs at most one line every
:data:`SUMMARY_INTERVAL_S` (and one on shutdown), e.g. ``deleted 300 pods in the last 60s
(terminal_retired 250, replaced_never_started 50; namespace sandboxes 300)``.
"""

from __future__ import annotations

import logging
from collections import Counter

import anyio
from anyio.abc import TaskStatus

from service.kit import clock

logger = logging.getLogger(__name__)

SUMMARY_INTERVAL_S = 60.0
NAMESPACES_NAMED = 5
"""Namespaces are named with their counts when at most this many had deletes; else counted."""


class ReapTally:
    """Counts deletes (or dry-run reports) by verdict and namespace, and logs them summarised."""

    def __init__(self, *, dry_run: bool, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self._dry_run = dry_run
        self.interval_s = interval_s
        self._verdicts: Counter[str] = Counter()
        self._namespaces: Counter[str] = Counter()
        self._since_s: float | None = None
        """Since when it counts: the last summary, else :meth:`run`'s start, else the first
        delete (event-loop time; built before the loop runs)."""

    @property
    def unsummarised(self) -> int:
        """Deletes (or reports) counted since the last summary line."""
        return self._verdicts.total()

    def add(self, verdict: str, namespace: str) -> None:
        """One delete (or dry-run report): counted only."""
        if self._since_s is None:
            self._since_s = clock.now()
        self._verdicts[verdict] += 1
        self._namespaces[namespace] += 1

    def summarise(self) -> str | None:
        """Log what was counted since the last summary in one info line and start counting
        afresh; returns the line (``None`` when there was nothing to log)."""
        now = clock.now()
        total = self._verdicts.total()
        if not total:
            self._since_s = now
            return None
        since_s = self._since_s if self._since_s is not None else now
        verdicts = ", ".join(f"{v} {n}" for v, n in sorted(self._verdicts.items()))
        names = ", ".join(f"{ns} {n}" for ns, n in sorted(self._namespaces.items()))
        count = len(self._namespaces)
        where = f"namespace{'' if count == 1 else 's'} {names}"
        where = where if count <= NAMESPACES_NAMED else f"{count} namespaces"
        what = "dry run: would have deleted" if self._dry_run else "deleted"
        line = (
            f"{what} {total} pod{'' if total == 1 else 's'} in the last "
            f"{now - since_s:.0f}s ({verdicts}; {where})"
        )
        logger.info(
            "%s",
            line,
            extra={"reaped": total, "verdicts": dict(self._verdicts), "dry_run": self._dry_run},
        )
        self._verdicts.clear()
        self._namespaces.clear()
        self._since_s = now
        return line

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Summarise every ``interval_s`` until cancelled."""
        self._since_s = clock.now()
        task_status.started()
        while True:
            await anyio.sleep(self.interval_s)
            self.summarise()
