"""A dependency's shared backoff: when it gives no answer, every caller backs off as one.

A :class:`Gate` stands in front of one dependency (the database, the API server). While it is
open, every attempt goes through. An attempt that finds the dependency unavailable closes it;
from then on one attempt at a time, the *probe*, goes out, no sooner than the next attempt time,
which the kit's :class:`~service.kit.backoff.Backoff` moves on after each failed probe, and
every other caller is held (:meth:`Gate.admit` says for how long). The first attempt that gets
an answer opens the gate, resets the backoff and calls the :meth:`Gate.on_open` listeners, so
held callers come back at once. An outage costs about one attempt per backoff step, whatever the
number of callers. Attempts in flight when the gate closes end as they end: only the probe's
failure moves the backoff on, and any success opens the gate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from service.kit import clock
from service.kit.backoff import Backoff


@dataclass(frozen=True, slots=True)
class Ticket:
    """One admitted attempt; report its end to the gate exactly once (:meth:`Gate.failed`,
    :meth:`Gate.succeeded` or :meth:`Gate.abandoned`)."""

    probe: bool
    """Whether this attempt is the closed gate's probe."""


_OPEN = Ticket(probe=False)


class Gate:
    """See the module docstring. Synchronous; time is the kit's clock."""

    def __init__(self, name: str, backoff: Backoff) -> None:
        self.name = name
        self._backoff = backoff
        self._failures = 0
        """Failed probes (and the failure that closed the gate) since it was last open."""
        self._next_at = -math.inf
        self._probing = False
        self._listeners: list[Callable[[], None]] = []
        self._on_change: list[Callable[[bool], None]] = []

    @property
    def closed(self) -> bool:
        return self._failures > 0

    @property
    def failures(self) -> int:
        return self._failures

    def on_open(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` each time the gate opens again."""
        self._listeners.append(listener)

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(closed)`` each time the gate closes or opens."""
        self._on_change.append(listener)

    def admit(self) -> Ticket | float:
        """A :class:`Ticket` to attempt now (the gate is open, or this is its probe), or the
        seconds until the next attempt time (> 0; a probe in flight counts as one more step)."""
        if not self.closed:
            return _OPEN
        now = clock.now()
        if self._probing or now < self._next_at:
            wait_s = self._next_at - now
            return wait_s if wait_s > 0 else self._backoff.delay_s(self._failures)
        self._probing = True
        return Ticket(probe=True)

    def retry_in_s(self) -> float:
        """Seconds until the next attempt time (0 while open)."""
        if not self.closed:
            return 0.0
        return max(0.0, self._next_at - clock.now())

    def failed(self, ticket: Ticket) -> None:
        """``ticket``'s attempt got no answer."""
        if ticket.probe:
            self._probing = False
        elif self.closed:
            return  # in flight when the gate closed: its step is already counted
        was_closed = self.closed
        self._next_at = clock.now() + self._backoff.delay_s(self._failures)
        self._failures += 1
        if not was_closed:
            for change in self._on_change:
                change(True)

    def succeeded(self, ticket: Ticket) -> None:
        """``ticket``'s attempt got an answer: open the gate (waking the held callers)."""
        if ticket.probe:
            self._probing = False
        if not self.closed:
            return
        self._failures = 0
        self._next_at = -math.inf
        for change in self._on_change:
            change(False)
        for listener in self._listeners:
            listener()

    def abandoned(self, ticket: Ticket) -> None:
        """``ticket``'s attempt ended without telling (cancelled, or a bug): a probe's slot is
        given back, and the next attempt time stays."""
        if ticket.probe:
            self._probing = False
