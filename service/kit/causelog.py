"""A recurring failure logged once per change of its cause, not once per retry."""

from __future__ import annotations

import logging


class CauseLog:
    """Logs a recurring failure once per change of its cause (and once when it clears), so a
    connection retried for an hour with a wrong password logs one line, not thousands."""

    def __init__(self, what: str, log: logging.Logger) -> None:
        self._what = what
        self._log = log
        self._last: str | None = None

    def failed(self, cause: str) -> None:
        if cause != self._last:
            self._log.warning("%s: %s", self._what, cause)
            self._last = cause

    def ok(self) -> None:
        if self._last is not None:
            self._log.info("%s: works again", self._what)
            self._last = None

    @property
    def cause(self) -> str | None:
        """The failure last logged, ``None`` when the last attempt worked."""
        return self._last
