"""Structured logging: one JSON object a line, with the reconcile id of the current reconcile.

The reconcile id lives in one context variable, :data:`reconcile_id`, set by the worker loop for
each reconcile (``engine/controller.py``). A log record factory installed when this module is
imported copies it onto every record as it is created — whichever module logs (the store, the
pod client, the engine), and whichever handler formats it later — as the ``reconcile_id``
attribute. Secrets never reach a log line: callers log masked values only (``config.mask_dsn``).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

reconcile_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "reconcile_id", default=None
)

_base_factory = logging.getLogRecordFactory()


def _record_with_reconcile_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
    record = _base_factory(*args, **kwargs)
    rid = reconcile_id.get()
    if rid is not None:
        record.reconcile_id = rid
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
        return f"{line} [reconcile {rid}]" if rid is not None else line


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
