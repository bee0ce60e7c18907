"""Keys held by a dependency's shared backoff (the reconciler's gates, ``service/kit/gate.py``).

One held key, the *driver*, is requeued to the dependency's next attempt time, where it sends the
probe; the others only every :data:`HELD_RECHECK_S`; all are enqueued at once when it answers. So
an outage costs the workers one key a backoff step rather than every key.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

from service.engine.activation import Activation
from service.engine.workqueue import WorkQueue
from service.kit.gate import Gate

logger = logging.getLogger(__name__)

HELD_RECHECK_S = 60.0
"""A key held by a dependency that is down, but not its probe's driver, comes back this often
(a backstop: the dependency's first answer releases it at once)."""


class HeldKeys:
    """The keys each gate holds, and each one's driver."""

    def __init__(self, *, gates: Iterable[Gate], queue: WorkQueue, activation: Activation) -> None:
        self._queue = queue
        self._activation = activation
        self._gates = {gate.name: gate for gate in gates}
        self._held: dict[str, dict[str, None]] = {name: {} for name in self._gates}
        """Keys held by each dependency, released when it answers (a dict, for its order: a run
        does not depend on the string hash seed)."""
        self._drivers: dict[str, str | None] = dict.fromkeys(self._gates)
        """The held key requeued to each dependency's next attempt time (its probe's driver)."""
        for gate in self._gates.values():
            gate.on_open(functools.partial(self._release, gate.name))

    def clear(self) -> None:
        """Drop every held key, like queued keys (becoming active enqueues every candidate)."""
        for dependency in self._held:
            self._held[dependency] = {}
            self._drivers[dependency] = None

    def hold(self, key: str, dependency: str, wait_s: float) -> None:
        """Park ``key`` until ``dependency`` answers; the driver (the first key held, or the
        driver itself held again) comes back at the next attempt time."""
        self._held[dependency][key] = None
        driver = self._drivers[dependency]
        if driver is None or driver == key:
            self._drivers[dependency] = key
            self._queue.add_after(key, wait_s)
        else:
            self._queue.add_after(key, max(wait_s, HELD_RECHECK_S))

    def finished(self, key: str, held_by: str | None) -> None:
        """``key``'s reconcile ended (``held_by`` holding it now, if any): if it drove another
        dependency's probe, the next key that one holds, if it is still down, drives it."""
        for dependency, driver in self._drivers.items():
            if driver != key or dependency == held_by:
                continue
            self._drivers[dependency] = None
            held = self._held[dependency]
            held.pop(key, None)
            gate = self._gates[dependency]
            if held and gate.closed and self._activation.active:
                successor = next(iter(held))
                self._drivers[dependency] = successor
                self._queue.add_after(successor, gate.retry_in_s())

    def _release(self, dependency: str) -> None:
        """``dependency`` answers again: every key it held goes on the queue now."""
        held = self._held[dependency]
        self._held[dependency] = {}
        self._drivers[dependency] = None
        if held and self._activation.active:
            logger.debug("%s answers again: releasing %d held keys", dependency, len(held))
            self._queue.add(*held)
