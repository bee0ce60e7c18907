"""Whether this replica may act: ENABLED, and holding the lease (invariant 6 of
docs/architecture.md).

Shared by the controller (which stops handing keys to the reconciler when inactive) and the
reconciler (which checks it once more right before a DELETE or a dry-run report, because a
reconcile can be in flight when leadership is lost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True)
class Activation:
    enabled: bool
    leader_check: Callable[[], bool] | None = None
    """Optional live check (e.g. ``LeaderElector.is_leader``, which also expires with the renew
    deadline between two renewals)."""
    leader: bool = field(default=False, init=False)

    def set_leader(self, leader: bool) -> None:
        self.leader = leader

    @property
    def active(self) -> bool:
        if not (self.enabled and self.leader):
            return False
        return self.leader_check is None or self.leader_check()
