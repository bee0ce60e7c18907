"""When the service's final row re-reads ran, as PostgreSQL itself recorded them.

The campaign's server logs every statement with its duration (``log_min_duration_statement =
0``) under a prefix carrying the epoch time in milliseconds, the database and the application
name (:data:`SERVER_SETTINGS`). For the extended protocol the server logs parse, bind and
execute separately; a SELECT's snapshot is taken at bind, so the **start of the bind** (the log
time minus the logged duration) is the earliest instant the re-read's answer can describe: every
commit before it is visible to the re-read. That is the evidence the checker judges invariant 1
against — the database's clock, not the service's word.

PostgreSQL writes each message with its DETAIL lines in one ``write`` to a file opened for
appending, so the lines of concurrent backends never interleave inside a message.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from pathlib import Path

from service.pg.store import FRESH_SQL

SERVER_SETTINGS = {
    "log_min_duration_statement": "0",
    "log_line_prefix": "%n [%d] %a: ",
}
SERVICE_APPLICATION = "retired-pod-gc"
"""The store's connections (the listener's have their own name)."""
RESOLUTION_S = 0.001
"""``%n`` has millisecond resolution: a bind start is known to within this."""

_MARKER = FRESH_SQL.split("*/", 1)[0] + "*/"
_HEAD = re.compile(r"^(\d+\.\d{3}) \[([^\]]*)\] ([^:]*): ([A-Z]+):  (.*)$")
_BIND = re.compile(r"^duration: ([0-9.]+) ms  bind [^:]*: (.*)$")
_PARAM1 = re.compile(r"\$1 = '\{([^']*)\}'")
"""The re-read's first parameter: the pod names asked for, an array (``{name,...}``; pod names
need no quoting in it)."""


class StatementLog:
    """Reads the server log incrementally; answers "when did the last re-read of a pod begin"."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        # (database, pod name) -> sorted bind start times of final re-reads
        self._rereads: dict[tuple[str, str], list[float]] = defaultdict(list)

    def _read(self) -> None:
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        pending: tuple[str, float] | None = None  # (database, bind start) awaiting its DETAIL
        for raw in data[:cut].decode(errors="replace").splitlines():
            head = _HEAD.match(raw)
            if head is None:
                continue  # a continuation line of a multi-line statement
            logged_s, database, application, level, text = head.groups()
            if application != SERVICE_APPLICATION:
                pending = None
                continue
            if level == "LOG":
                bind = _BIND.match(text)
                pending = None
                if bind is not None and bind.group(2).startswith(_MARKER):
                    pending = (database, float(logged_s) - float(bind.group(1)) / 1000)
            elif level == "DETAIL" and pending is not None:
                param = _PARAM1.search(text)
                if param is not None:
                    for name in param.group(1).split(","):
                        bisect.insort(self._rereads[(pending[0], name)], pending[1])
                pending = None

    def last_reread_before(self, database: str, pod_name: str, t: float) -> float | None:
        """Start of the last final re-read of ``pod_name`` that began before ``t``."""
        self._read()
        starts = self._rereads.get((database, pod_name), [])
        i = bisect.bisect_left(starts, t) - 1
        return starts[i] if i >= 0 else None
