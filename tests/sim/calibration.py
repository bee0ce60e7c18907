"""Calibration: the two races the fault campaign found, reverted one at a time (in memory only).

Each entry undoes one fix the way :mod:`tests.chaos.removals` removes a check (the named check
replaced, restored afterwards); ``python -m tests.sim --calibrate`` counts how many seeds the
simulator needs to find each (docs/reliability.md, "Deterministic simulation").

- ``relisting_cache``: the reconciler observes while the cache relists (``checks.cache_synced``,
  the guard of ``Reconciler.observe``, step 1, from "Never start a clock from a relisting
  cache", ba92296): a clock started from the stale snapshot of a relisting cache covers the
  states the relist collapses;
- ``notification_barrier``: no round trip on the listener after the final re-read (the
  ``NotificationBarrier`` of ``Verifier.verify``, from 246dc60): a flip committed before the
  re-read whose notification is still in flight goes unseen. It is the ``notification_sync``
  removal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from service import checks
from tests.chaos.removals import REMOVALS, replaced

REVERTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    # Every watched namespace taken as synced: a relisting cache's stale snapshot is judged.
    "relisting_cache": lambda: replaced(checks, "cache_synced", lambda _cache, _namespace: True),
    "notification_barrier": REMOVALS["notification_sync"],
}
