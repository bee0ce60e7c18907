"""Structured logging: one JSON object a line, with the reconcile id of the current reconcile.

The reconcile id lives in a context variable so that every log line emitted while one key is
reconciled carries it, whichever module logs. Secrets never reach a log line: callers log
masked values only (``config.mask_dsn``).
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
        rid = reconcile_id.get()
        if rid is not None:
            doc["reconcile_id"] = rid
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
        rid = reconcile_id.get()
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
