"""The pod cache: ``namespace/name`` → :class:`PodSnapshot`, and how far it matches the server.

The pods are held by namespace, then by name: the name a pod is found by is the snapshot's own
``name`` string, so a cached pod costs no key string of its own (a ``namespace/name`` key is
84 bytes more a pod; ``keys()`` builds the keys when asked).

:class:`PodStore` implements ``ports.PodCache``. Its one piece of state besides the pods is a
:class:`SyncState`. A sync (a list, or the initial events of a streaming list) puts every pod the
server has; the store remembers the names it was told about, and when the sync is complete it
reports every cached pod the sync did not mention as deleted. Every change is reported to one
``ports.PodEventHandler`` (the informer's dispatch), on the event loop, as it happens.

::

    begin_sync    COLD, LISTING ──▶ LISTING       SYNCED, RELISTING ──▶ RELISTING
    finish_sync   LISTING, RELISTING ──▶ SYNCED

(``begin_sync`` during a sync starts it over: a retry after a failure, a list restarted.)
Leaving ``SYNCED`` tells the handler ``cache_cold()`` (observations may have gaps from now on);
reaching it, ``cache_synced()``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import anyio
import msgspec

from service.domain import PodSnapshot, pod_key
from service.metrics import Metrics
from service.ports import PodEventHandler


class SyncState(enum.StrEnum):
    """How far the cache matches the server."""

    COLD = "cold"
    """Never filled: nothing is known yet."""
    LISTING = "listing"
    """Being filled for the first time."""
    SYNCED = "synced"
    """Matches the server as of the last event applied."""
    RELISTING = "relisting"
    """Being filled again after it was synced (a 410, a rejected watch): it may have missed
    changes; the pods it holds are the old ones until the sync reports the difference."""


_SYNCED = SyncState.SYNCED  # a global read on the per-event path instead of an attribute chain
_NONE: frozenset[str] = frozenset()


class PodStore:
    """Implements ``ports.PodCache``; reports changes to ``sink``."""

    __slots__ = (
        "_count",
        "_pods",
        "_seen",
        "_size",
        "_synced_event",
        "_synced_gauge",
        "sink",
        "state",
    )

    def __init__(self, metrics: Metrics, sink: PodEventHandler) -> None:
        self.state = SyncState.COLD
        """Read it; only :meth:`begin_sync` and :meth:`finish_sync` move it."""
        self.sink = sink
        """Where changes go (the informer replaces it as handlers are added)."""
        self._pods: dict[str, dict[str, PodSnapshot]] = {}
        """namespace → name → snapshot (a namespace without pods has no entry)."""
        self._count = 0
        self._seen: dict[str, set[str]] = {}
        """namespace → the names the sync in progress has put (empty outside a sync)."""
        self._synced_event = anyio.Event()
        self._size = metrics.cache_pods
        self._synced_gauge = metrics.cache_synced
        self._size.set(0)
        self._synced_gauge.set(0)

    # ------------------------------------------------------------------ PodCache

    def get(self, key: str) -> PodSnapshot | None:
        namespace, _, name = key.partition("/")
        names = self._pods.get(namespace)
        return None if names is None else names.get(name)

    def keys(self) -> Iterable[str]:
        """A copy of the cached keys (safe to iterate while events arrive)."""
        return [
            pod_key(namespace, name) for namespace, names in self._pods.items() for name in names
        ]

    @property
    def synced(self) -> bool:
        return self.state is _SYNCED

    def __len__(self) -> int:
        return self._count

    async def wait_synced(self) -> None:
        """Return once the cache matches the server (immediately if it does now)."""
        while self.state is not _SYNCED:
            await self._synced_event.wait()

    # ------------------------------------------------------------------ sync

    def begin_sync(self) -> SyncState:
        """Start filling the cache from the server, or start over (a failed or restarted sync):
        the keys put so far are forgotten, the pods are kept. Returns the new state."""
        match self.state:
            case SyncState.COLD | SyncState.LISTING:
                self.state = SyncState.LISTING
            case SyncState.SYNCED:
                self.state = SyncState.RELISTING
                self._synced_gauge.set(0)
                self._synced_event = anyio.Event()
                self.sink.cache_cold()
            case SyncState.RELISTING:
                pass
        self._seen = {}
        return self.state

    def finish_sync(self) -> None:
        """The sync is complete: every cached pod it did not put is reported deleted."""
        if self.state not in (SyncState.LISTING, SyncState.RELISTING):
            raise RuntimeError(f"finish_sync in state {self.state}: no sync in progress")
        seen, sink = self._seen, self.sink
        for namespace, names in list(self._pods.items()):
            put = seen.get(namespace, _NONE)
            for name in [n for n in names if n not in put]:
                sink.pod_changed(names.pop(name), None)
            if not names:
                del self._pods[namespace]
        self._seen = {}
        self._count = sum(len(names) for names in self._pods.values())
        self._size.set(self._count)
        self.state = SyncState.SYNCED
        self._synced_gauge.set(1)
        self._synced_event.set()
        sink.cache_synced()

    # ------------------------------------------------------------------ changes

    def put(self, snap: PodSnapshot) -> None:
        """The server has this pod in this state. While synced this is a change (a watch event)
        and always reported; during a sync only when the pod is new or changed since cached."""
        namespace, name = snap.namespace, snap.name
        names = self._pods.get(namespace)
        if names is None:
            names = self._pods[namespace] = {}
        before = names.get(name)
        if self.state is _SYNCED:
            self.sink.pod_changed(before, self._replace(names, before, snap))
            self._size.set(self._count)
            return
        put = self._seen.get(namespace)
        if put is None:
            put = self._seen[namespace] = set()
        if before is None:
            put.add(name)
        else:
            put.add(before.name)  # the string the store holds already, not a copy of it
            if before.resource_version == snap.resource_version and before.uid == snap.uid:
                return
        self.sink.pod_changed(before, self._replace(names, before, snap))

    def delete(self, snap: PodSnapshot) -> None:
        """The server deleted this pod; reported with the last cached state (or ``snap``)."""
        before = self._pop(snap.namespace, snap.name)
        if self.state is not _SYNCED:
            put = self._seen.get(snap.namespace)
            if put is not None:
                put.discard(snap.name)
        self.sink.pod_changed(before if before is not None else snap, None)
        self._size.set(self._count)

    def forget(self, key: str) -> None:
        """Drop a pod whose state can no longer be read; reported deleted if it was cached."""
        namespace, _, name = key.partition("/")
        before = self._pop(namespace, name)
        if before is not None:
            self.sink.pod_changed(before, None)
            self._size.set(self._count)

    def _replace(
        self, names: dict[str, PodSnapshot], before: PodSnapshot | None, snap: PodSnapshot
    ) -> PodSnapshot:
        """Store ``snap``; returns it as stored. A dict keeps the key it has, and that key is
        ``before.name``: the new snapshot takes that string instead of keeping a second copy."""
        if before is None:
            self._count += 1
        elif snap.name is not before.name:
            snap = msgspec.structs.replace(snap, name=before.name)
        names[snap.name] = snap
        return snap

    def _pop(self, namespace: str, name: str) -> PodSnapshot | None:
        names = self._pods.get(namespace)
        if names is None:
            return None
        before = names.pop(name, None)
        if before is not None:
            self._count -= 1
            if not names:
                del self._pods[namespace]
        return before
