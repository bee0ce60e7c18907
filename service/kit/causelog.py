"""A recurring failure logged once per change of its cause, not once per retry.

The same cause (:func:`cause_of`) is the failure's kind, not its instance: the root of the
exception's ``__cause__`` chain, as its type and message with every number and quoted string
replaced (an answer of a server: its type and HTTP status). A key, a count or an address never
makes a new cause, while a refused connection, a timeout and a 503 are three. The line shows the
first failure of the cause in full.

Right after a recovery, requests sent before it still fail while new ones work: a failure with
the cause that cleared less than :data:`HOLD_S` ago is counted but not logged while something
worked within the last :data:`SETTLE_S`. A failure that persists that long is logged again, so a
second outage is never silent; a flickering one costs at most two lines every :data:`HOLD_S`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable

from service.kit import clock
from service.kit.errors import ApiError

HOLD_S = 300.0
"""How long after a cause cleared the same cause is logged again only once it persists."""
SETTLE_S = 10.0
"""Within :data:`HOLD_S`, a failure is logged only when nothing worked for this long."""

_VARIABLE = re.compile(r"\"[^\"]*\"|'[^']*'|\d+")


def cause_of(exc: BaseException) -> str:
    """The cause of ``exc`` as :class:`CauseLog` compares causes (see the module docstring)."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    kind = type(root).__name__
    if isinstance(root, ApiError):
        return f"{kind} {root.status}"
    text = _VARIABLE.sub("#", str(root))
    return f"{kind}: {text}" if text else kind


class CauseLog:
    """Every failure is counted: a line for a new cause says how many the previous one had, the
    line that says it works again how many there were. Each line carries ``failing`` (what),
    ``cause`` (``None`` once it works) and ``failures`` as extra fields."""

    def __init__(
        self, what: str, log: logging.Logger, *, now: Callable[[], float] = clock.now
    ) -> None:
        self._what = what
        self._log = log
        self._now = now
        self._last: str | None = None
        """The cause last logged, while it has not worked since."""
        self._latest: str | None = None
        self._failures = 0
        """Failures since the last time it worked."""
        self._since_line = 0
        """Failures since the last line."""
        self._worked_at = -math.inf
        self._cleared: tuple[str, float] | None = None
        """The cause of the last "works again" line, and when it was written."""

    def failed(self, cause: str, detail: str | None = None) -> None:
        """One failure. ``cause`` is what is compared (:func:`cause_of` for an exception);
        ``detail``, shown instead of it when a line is written, may name the instance."""
        self._failures += 1
        self._since_line += 1
        self._latest = detail or cause
        if cause == self._last:
            return
        if self._last is None and self._cleared is not None and self._cleared[0] == cause:
            now = self._now()
            if now - self._cleared[1] < HOLD_S and now - self._worked_at < SETTLE_S:
                return  # a straggler of the outage that just ended, or a flicker: counted
        shown = self._latest
        extra = {"failing": self._what, "cause": cause, "failures": self._failures}
        if self._last is None:
            self._log.warning("%s: %s", self._what, shown, extra=extra)
        else:
            self._log.warning(
                "%s: %s (the cause changed after %d failures)",
                self._what,
                shown,
                self._since_line - 1,
                extra=extra,
            )
        self._last = cause
        self._since_line = 1

    def ok(self) -> None:
        """It worked."""
        cleared = self._cleared
        self._latest = None
        if self._last is None and cleared is None:
            self._failures = self._since_line = 0  # the usual case: no clock read
            return
        now = self._now()
        self._worked_at = now
        if self._last is not None:
            self._log.info(
                "%s: works again after %d failures",
                self._what,
                self._failures,
                extra={"failing": self._what, "cause": None, "failures": self._failures},
            )
            self._cleared = (self._last, now)
            self._last = None
        elif cleared is not None and now - cleared[1] >= HOLD_S:
            self._cleared = None
        self._failures = self._since_line = 0

    @property
    def cause(self) -> str | None:
        """The latest failure (its detail), ``None`` once it worked since."""
        return self._latest

    @property
    def failures(self) -> int:
        """Failures since the last time it worked."""
        return self._failures
