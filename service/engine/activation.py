"""Whether this replica may act: ENABLED, and holding the lease (invariant 6 of
docs/architecture.md). The controller hands out no key while inactive; the reconciler checks it
once more right before a DELETE or a dry-run report (leadership may be lost meanwhile)."""

from __future__ import annotations

from collections.abc import Callable


class Activation:
    def __init__(self, *, enabled: bool, leader_check: Callable[[], bool] | None = None) -> None:
        """``leader_check``: optional live check (e.g. ``LeaderElector.is_leader``, which also
        expires with the renew deadline between two renewals)."""
        self._enabled = enabled
        self._leader = False
        self._leader_check = leader_check

    @property
    def leader(self) -> bool:
        return self._leader

    def set_leader(self, leader: bool) -> None:
        self._leader = leader

    @property
    def active(self) -> bool:
        check = self._leader_check
        return self._enabled and self._leader and (check is None or check())
