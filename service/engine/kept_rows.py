"""The retired rows the retired-but-kept view (``engine/kept.py``) knows, and its queries for them.

A known row carries since when it is retired, from the best source it had (:class:`Since`). A
query asks for the retired rows of one namespace's keys at once; a notification about a key
that arrives while a query is in flight is fresher than the query's answer for that key, so
every query notes the keys notified meanwhile and the view leaves their answers unapplied.
"""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from service.domain import ExecutionRow, split_key
from service.kit.causelog import CauseLog
from service.kit.errors import ExternalError
from service.metrics import KeptMetrics
from service.ports import RetiredRow, RetiredRowSource

# The view's lines keep the view's name.
logger = logging.getLogger("service.engine.kept")


class Since(enum.StrEnum):
    """Where a kept pod's "since" comes from."""

    RETIRED_AT = "retired_at"
    NOTIFICATION = "notification"
    FIRST_SEEN = "first_seen"


@dataclass(slots=True)
class Retired:
    """A retired row known for a cached pod's key, and since when."""

    row: ExecutionRow
    since_s: float
    """On the event loop's clock."""
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
            source = Since.RETIRED_AT
        elif old is not None and old.row.state == retired.row.state:
            since, source = old.since_s, old.source
        elif notified_s is not None:
            since, source = notified_s, Since.NOTIFICATION
        else:
            since, source = now_s, Since.FIRST_SEEN
        return Retired(retired.row, since, source)


def by_namespace(keys: Iterable[str]) -> dict[str, list[str]]:
    """``keys`` grouped by namespace, in their order."""
    grouped: defaultdict[str, list[str]] = defaultdict(list)
    for key in keys:
        grouped[split_key(key)[0]].append(key)
    return grouped


class RowQueries:
    """The view's row queries, each with the keys notified while it was in flight."""

    def __init__(self, rows: RetiredRowSource, metrics: KeptMetrics) -> None:
        self._rows = rows
        self._metrics = metrics
        self._inflight: dict[int, set[str]] = {}
        """The keys notified meanwhile, for each query in flight (by a number of its own: two
        empty sets are equal)."""
        self._queries = 0
        self._log = CauseLog("retired-but-kept row queries fail", logger)

    def notified(self, key: str) -> None:
        """A notification named ``key``: no query in flight now answers for it."""
        for touched in self._inflight.values():
            touched.add(key)

    async def query(
        self, namespace: str, keys: Sequence[str], *, kind: str
    ) -> tuple[dict[str, RetiredRow], set[str]] | None:
        """The retired rows of ``keys`` (one query) and the keys notified meanwhile; ``None``
        when the query failed (logged once a cause, counted)."""
        touched: set[str] = set()
        self._queries += 1
        token = self._queries
        self._inflight[token] = touched
        try:
            names = [split_key(key)[1] for key in keys]
            found = await self._rows.retired_rows(namespace, names, kind=kind)
        except ExternalError as exc:
            self._metrics.retired_kept_sweep_errors.inc()
            self._log.failed(f"{type(exc).__name__}: {exc}")
            return None
        finally:
            del self._inflight[token]
        self._log.ok()
        return found, touched
