"""The ``RetiredPodKept`` Events of the retired-but-kept view: a pod kept longer than the bound
gets one, at most one a pod UID in :data:`EVENT_INTERVAL_S` (its row read again before)."""

from __future__ import annotations

from collections.abc import Iterable

from service.domain import PodSnapshot
from service.engine.kept.model import KeptPod
from service.ports import KeptRecorder, KeptReport

EVENT_INTERVAL_S = 86400.0


class KeptEvents:
    """Which kept pods are due an Event, and their recording."""

    def __init__(self, recorder: KeptRecorder | None, bound_s: float) -> None:
        self.recorder = recorder
        self._bound_s = bound_s
        self._evented: dict[str, float] = {}
        """When each pod UID's Event was recorded."""

    def due(self, kept: Iterable[KeptPod], now_s: float) -> list[KeptPod]:
        """The pods of ``kept`` kept longer than the bound whose UID has no recent Event."""
        horizon = now_s - EVENT_INTERVAL_S
        for uid in [u for u, at in self._evented.items() if at <= horizon]:
            del self._evented[uid]
        return [k for k in kept if self._is_due(k, now_s)]

    def record(
        self, kept: KeptPod, pod: PodSnapshot, *, now_s: float, wall_offset_s: float
    ) -> None:
        """The Event of ``kept`` (``pod`` as cached now), if it is still due."""
        if self.recorder is None or not self._is_due(kept, now_s):
            return
        self._evented[kept.uid] = now_s
        self.recorder.record_kept(
            KeptReport(
                pod=pod,
                reason=str(kept.reason),
                rule=kept.rule,
                row_state=kept.row_state,
                since_s=kept.since_s + wall_offset_s,
                since_source=str(kept.source),
                kept_for_s=now_s - kept.since_s,
            )
        )

    def forget(self, uid: str) -> None:
        """The pod of ``uid`` is gone (its UID never comes back)."""
        self._evented.pop(uid, None)

    def clear(self) -> None:
        self._evented.clear()

    def _is_due(self, kept: KeptPod, now_s: float) -> bool:
        return now_s - kept.since_s >= self._bound_s and kept.uid not in self._evented
