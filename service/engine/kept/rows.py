"""The retired-but-kept view's row queries.

A query asks for the retired rows of one namespace's keys at once; a notification about a key
that arrives while a query is in flight is fresher than the query's answer for that key, so
every query notes the keys notified meanwhile and the view leaves their answers unapplied.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from service.domain import split_key
from service.kit.causelog import CauseLog
from service.kit.errors import ExternalError
from service.metrics import Metrics
from service.ports import RetiredRow, RetiredRowSource

logger = logging.getLogger(__name__)


class RowQueries:
    """The view's row queries, each with the keys notified while it was in flight."""

    def __init__(self, rows: RetiredRowSource, metrics: Metrics) -> None:
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
