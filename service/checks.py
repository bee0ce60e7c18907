"""The pipeline's safety checks that are not rules of the classifier, one named function each.

The engine, the pod client and the listener call each through this module by name
(``checks.uid_unchanged(...)``), so that every check between a pod and its DELETE is in one place
with the invariant it keeps (docs/architecture.md, "The seven safety invariants and where each is
enforced"), and the mutation check (``tests/chaos/removals.py``) disables one by its name. Each is
pure and cheap; the awaits stay with the caller, except the notification sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from service.domain import Decision, ExecutionChange, PodSnapshot, Verdict
from service.ports import NotificationBarrier, PodCache


def cache_synced(cache: PodCache, namespace: str) -> bool:
    """Nothing of a namespace is observed while its cache (re)lists: a clock started from a
    snapshot the relist is about to replace would cover states the relist collapsed."""
    return cache.namespace_synced(namespace)


def observed_long_enough(elapsed_s: float, threshold_s: float) -> bool:
    """Invariant 3's threshold: the pod's UID has been continuously reapable for
    ``threshold_s`` (checked at observation, after verification and at the final check)."""
    return elapsed_s >= threshold_s


def uid_unchanged(observed: PodSnapshot, fresh: PodSnapshot) -> bool:
    """The fresh GET found the pod that was observed, not a new one under its name."""
    return fresh.uid == observed.uid


def verdict_unchanged(verdict: Verdict, again: Decision) -> bool:
    """Classified again from the fresh GET and the direct row re-read, the pod is reapable for
    the same reason it was observed to be."""
    return again.verdict is verdict


def resource_version_unchanged(observed: PodSnapshot, fresh: PodSnapshot) -> bool:
    """The fresh GET of the observed pod is the version the cache observed: a newer one means
    events the watch has not delivered yet (a state in between is unknown), so the reconciler
    waits for them. Versions of one pod only: a pod of another UID under the name is another
    object, which :func:`uid_unchanged` judges."""
    return fresh.uid != observed.uid or fresh.resource_version == observed.resource_version


async def sync_notifications(barrier: NotificationBarrier) -> None:
    """No retirement flip committed before the row re-read is still on its way to the listener
    (raises when that cannot be vouched for)."""
    await barrier.sync()


def deletes_allowed(dry_run: bool) -> bool:
    """Invariants 5 and 6: a dry run never deletes (it reports)."""
    return not dry_run


def delete_preconditions(uid: str, resource_version: str) -> dict[str, str]:
    """Invariant 7: the DELETE applies only to the pod verified, at the version verified."""
    return {"uid": uid, "resourceVersion": resource_version}


def probe_delivered(arrived: int, seq: int) -> bool:
    """The listener's delivery proof: the probe ``seq`` came back on the listening connection
    (probes arrive in order, ``arrived`` is the last one that did)."""
    return arrived >= seq


def pod_state_changed(old: PodSnapshot, new: PodSnapshot) -> bool:
    """A pod event changed something classification reads (anything but the resourceVersion):
    the pod's clock restarts (invariant 3)."""
    return msgspec.structs.replace(old, resource_version=new.resource_version) != new


def keys_cleared_by(changes: Sequence[ExecutionChange]) -> list[str]:
    """The keys whose clocks a batch of row notifications restarts: every one (invariant 3).
    Re-activated is not reapable as of now, and one retired state for another can change the
    verdict (a Pending pod is reapable only when its row is retired as ``replaced``)."""
    return [change.key for change in changes]
