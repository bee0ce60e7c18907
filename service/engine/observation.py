"""Observation clocks: since when has each pod UID been seen, continuously, in a reapable shape.

One clock per pod UID (a recreated pod is a new UID and starts from zero), indexed by work-queue
key so that events that carry only a key (row notifications) can clear it; monotonic seconds on
the engine clock. "Continuously" is judged at event time (invariant 3 of docs/architecture.md):
a clearing between :meth:`begin` and :meth:`end` makes :meth:`observe` return ``None``, and a
change of verdict restarts the clock.

Beside each clock: what its pod waits for past the threshold (read by ``GET /debug/pending``),
and the dry-run "reported" set (one report per UID: it survives clock clears, and is pruned
when the pod goes away).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from service.domain import Verdict, Waiting
from service.kit import clock
from service.metrics import EngineMetrics


class Observation(msgspec.Struct, frozen=True, gc=False):
    """One running clock (a msgspec Struct, untracked by the garbage collector: one a pod)."""

    uid: str
    key: str
    verdict: Verdict
    since_s: float
    """Monotonic time the UID was first seen reapable in this shape (continuously since)."""


class ObservationClocks:
    def __init__(self, *, metrics: EngineMetrics | None = None) -> None:
        self._by_uid: dict[str, Observation] = {}
        self._uid_by_key: dict[str, str] = {}
        self._inflight: dict[str, bool] = {}
        """key -> "a clearing event arrived since begin(key)"."""
        self._reported: set[str] = set()
        self._waiting: dict[str, Waiting] = {}
        """uid -> what it waits for past the threshold, when not verification."""
        if metrics is not None:
            metrics.tracked_clocks.set_function(lambda: len(self._by_uid))
            metrics.oldest_clock.set_function(self._oldest_now)

    def begin(self, keys: Iterable[str]) -> None:
        """A reconcile of ``keys`` starts reading state (the queue runs one per key at a time)."""
        for key in keys:
            self._inflight[key] = False

    def end(self, keys: Iterable[str]) -> None:
        """The reconcile of ``keys`` that :meth:`begin` bracketed has observed them."""
        for key in keys:
            self._inflight.pop(key, None)

    def observe(self, uid: str, key: str, verdict: Verdict, now: float) -> float | None:
        """Record that ``uid`` is reapable as ``verdict`` now; return seconds continuously so, or
        ``None`` when a clearing event for ``key`` arrived since :meth:`begin`."""
        if self._inflight.get(key, False):
            return None
        current = self._by_uid.get(uid)
        if current is not None and current.key == key and current.verdict is verdict:
            return now - current.since_s
        previous_uid = self._uid_by_key.get(key)
        if previous_uid is not None and previous_uid != uid:
            self._by_uid.pop(previous_uid, None)
            self._waiting.pop(previous_uid, None)
        if current is not None and current.key != key:
            self._uid_by_key.pop(current.key, None)
        self._waiting.pop(uid, None)
        self._by_uid[uid] = Observation(uid=uid, key=key, verdict=verdict, since_s=now)
        self._uid_by_key[key] = uid
        return 0.0

    def elapsed(self, uid: str, now: float) -> float | None:
        """Seconds ``uid`` has been continuously reapable, ``None`` when no clock runs."""
        current = self._by_uid.get(uid)
        return None if current is None else now - current.since_s

    def _oldest_now(self) -> float:
        """:meth:`oldest_s` as the scrape reads it, on the event loop's clock (0 read outside the
        loop: a test's, after the service stopped)."""
        try:
            now = clock.now()
        except RuntimeError:  # no running event loop
            return 0.0
        return self.oldest_s(now)

    def oldest_s(self, now: float) -> float:
        return max((now - o.since_s for o in self._by_uid.values()), default=0.0)

    def uid_for(self, key: str) -> str | None:
        return self._uid_by_key.get(key)

    def set_waiting(self, uid: str, waiting: Waiting | None) -> None:
        """Record what ``uid`` waits for past the threshold (``None``: verification); only
        while its clock runs."""
        if waiting is None or uid not in self._by_uid:
            self._waiting.pop(uid, None)
        else:
            self._waiting[uid] = waiting

    def running(self) -> list[tuple[Observation, Waiting | None]]:
        """Every running clock with what it waits for past the threshold, if recorded."""
        return [(o, self._waiting.get(uid)) for uid, o in self._by_uid.items()]

    def running_uid(self, uid: str) -> list[tuple[Observation, Waiting | None]]:
        """``uid``'s clock as :meth:`running` lists it (empty when none runs)."""
        current = self._by_uid.get(uid)
        return [] if current is None else [(current, self._waiting.get(uid))]

    def clear(self, uid: str) -> None:
        """Stop ``uid``'s clock (it stopped classifying as reapable, or its pod changed)."""
        current = self._by_uid.pop(uid, None)
        if current is None:
            return
        self._waiting.pop(uid, None)
        if self._uid_by_key.get(current.key) == uid:
            del self._uid_by_key[current.key]
        if current.key in self._inflight:
            self._inflight[current.key] = True

    def clear_key(self, key: str) -> None:
        """Stop the clock of whatever UID ``key`` tracks, and invalidate an in-flight observe."""
        if key in self._inflight:
            self._inflight[key] = True
        uid = self._uid_by_key.pop(key, None)
        if uid is not None:
            self._by_uid.pop(uid, None)
            self._waiting.pop(uid, None)

    def clear_all(self) -> None:
        """Forget every clock (cold cache, missed notifications, leadership change)."""
        self._by_uid.clear()
        self._uid_by_key.clear()
        self._waiting.clear()
        self._invalidate("")

    def clear_namespace(self, namespace: str) -> None:
        """Forget every clock of ``namespace``'s pods (that namespace's cache went cold)."""
        prefix = namespace + "/"
        for uid in [u for u, o in self._by_uid.items() if o.key.startswith(prefix)]:
            del self._by_uid[uid]
            self._waiting.pop(uid, None)
        for key in [k for k in self._uid_by_key if k.startswith(prefix)]:
            del self._uid_by_key[key]
        self._invalidate(prefix)

    def _invalidate(self, prefix: str) -> None:
        for key in self._inflight:
            if key.startswith(prefix):
                self._inflight[key] = True

    def forget_pod(self, uid: str, key: str) -> None:
        """The pod is gone: drop its clock and its dry-run report mark."""
        self.clear(uid)
        if self._uid_by_key.get(key) == uid:
            self.clear_key(key)
        elif key in self._inflight:
            self._inflight[key] = True
        self._reported.discard(uid)

    def mark_reported(self, uid: str) -> bool:
        """True the first time ``uid`` is marked (so it is reported); False afterwards."""
        if uid in self._reported:
            return False
        self._reported.add(uid)
        return True

    def was_reported(self, uid: str) -> bool:
        return uid in self._reported

    def retain_reported(self, uids: Iterable[str]) -> None:
        """Keep report marks only for ``uids`` (the cached pods after a relist)."""
        self._reported.intersection_update(uids)

    def __len__(self) -> int:
        return len(self._by_uid)

    @property
    def reported_count(self) -> int:
        return len(self._reported)
