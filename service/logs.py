"""Structured logging: one JSON object a line, with the reconcile id of the current reconcile.

The worker loop opens a :func:`batch` for the keys it took and enters :func:`reconciling` a key
around what it does for that key alone. A log record factory installed on import copies both ids
onto every record, whichever module logs, as the ``reconcile_id`` and ``batch_id`` attributes.
Secrets never reach a log line: callers log masked values only (``service.kit.dsn.mask_dsn``).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

reconcile_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "reconcile_id", default=None
)
"""The id of the key's reconcile being run (``None`` outside one)."""
batch_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("batch_id", default=None)
"""The id of the worker's batch being run (``None`` outside one)."""


class _Batch:
    """The reconcile ids of one batch's keys, made the first time a key asks for its own."""

    __slots__ = ("_next", "id", "ids")

    def __init__(self, batch: str) -> None:
        self.id = batch
        self.ids: dict[str, str] = {}
        self._next = itertools.count(1)

    def id_of(self, key: str) -> str:
        rid = self.ids.get(key)
        if rid is None:
            rid = self.ids[key] = f"{self.id}.{next(self._next)}"
        return rid


_batch: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("_batch", default=None)
_batch_ids = itertools.count(1)


@contextlib.contextmanager
def batch(keys: Sequence[str]) -> Iterator[None]:
    """A worker's batch of ``keys``: a new batch id, and a reconcile id for each key when
    :func:`reconciling` asks. A batch of one key is that key's reconcile for its whole extent."""
    current = _Batch(f"{next(_batch_ids):x}")
    tokens = (_batch.set(current), batch_id.set(current.id))
    rid_token = reconcile_id.set(current.id_of(keys[0])) if len(keys) == 1 else None
    try:
        yield
    finally:
        if rid_token is not None:
            reconcile_id.reset(rid_token)
        batch_id.reset(tokens[1])
        _batch.reset(tokens[0])


@contextlib.contextmanager
def reconciling(key: str) -> Iterator[None]:
    """What runs inside is ``key``'s reconcile: its log lines carry the key's reconcile id (the
    same one for its observation and its action). Outside a :func:`batch`, a batch of one."""
    current = _batch.get()
    if current is None:
        with batch([key]):
            yield
        return
    token = reconcile_id.set(current.id_of(key))
    try:
        yield
    finally:
        reconcile_id.reset(token)


_base_factory = logging.getLogRecordFactory()


def _record_with_reconcile_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
    record = _base_factory(*args, **kwargs)
    rid = reconcile_id.get()
    if rid is not None:
        record.reconcile_id = rid
    bid = batch_id.get()
    if bid is not None:
        record.batch_id = bid
    return record


if getattr(_base_factory, "__name__", "") != _record_with_reconcile_id.__name__:
    logging.setLogRecordFactory(_record_with_reconcile_id)


# Attributes every LogRecord has; anything else was passed through ``extra=`` and is emitted.
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys() | {"message", "asctime", "taskName"}
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "reconcile_id", None)
        if rid is not None:
            return f"{line} [reconcile {rid}]"
        bid = getattr(record, "batch_id", None)
        return f"{line} [batch {bid}]" if bid is not None else line


def setup(level: str = "info", fmt: str = "json") -> None:
    """Configure the root logger once, writing to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The Kubernetes client and aiohttp are chatty at debug level and may echo headers.
    for noisy in ("kubernetes_asyncio", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
