"""The pod cache of one namespace, and how far it matches the server.

A sync puts every pod the server has; once complete, every cached pod it did not put is reported
deleted. Every change is reported to one ``ports.PodEventHandler`` (the informer's dispatch), on
the event loop, as it happens.

::

    begin_sync    COLD, LISTING ──▶ LISTING       SYNCED, RELISTING ──▶ RELISTING
    finish_sync   LISTING, RELISTING ──▶ SYNCED

(``begin_sync`` during a sync starts it over.) Leaving ``SYNCED`` tells the handler
``cache_cold(namespace)`` (observations of this namespace may have gaps from now on); reaching
it, ``cache_synced(namespace)``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import anyio
import msgspec

from service.domain import PodSnapshot, pod_key
from service.metrics import KubeMetrics
from service.ports import PodEventHandler


class SyncState(enum.StrEnum):
    """How far the cache matches the server."""

    COLD = "cold"
    LISTING = "listing"
    SYNCED = "synced"
    """Matches the server as of the last event applied."""
    RELISTING = "relisting"
    """Being filled again: it holds the old pods until the sync reports the difference."""


class PodStore:
    """Implements ``ports.PodCache``; reports changes to ``sink``."""

    __slots__ = (
        "_pods",
        "_seen",
        "_size",
        "_synced_event",
        "_synced_gauge",
        "namespace",
        "sink",
        "state",
    )

    def __init__(self, metrics: KubeMetrics, sink: PodEventHandler, *, namespace: str) -> None:
        self.namespace = namespace
        self.state = SyncState.COLD
        """Read it; only :meth:`begin_sync` and :meth:`finish_sync` move it."""
        self.sink = sink
        self._pods: dict[str, PodSnapshot] = {}
        """name → snapshot, keyed by the snapshot's own ``name`` string (no key string of its
        own: ``benchmarks/NOTES.md``, RSS per cached pod). Never replaced (:meth:`by_name`)."""
        self._seen: set[str] = set()
        """The names the sync in progress has put (empty outside a sync)."""
        self._synced_event = anyio.Event()
        self._size = metrics.cache_pods.labels(sandbox_namespace=namespace)
        self._synced_gauge = metrics.cache_synced.labels(sandbox_namespace=namespace)
        self._size.set(0)
        self._synced_gauge.set(0)

    def get(self, key: str) -> PodSnapshot | None:
        namespace, _, name = key.partition("/")
        return self._pods.get(name) if namespace == self.namespace else None

    @property
    def by_name(self) -> Callable[[str], PodSnapshot | None]:
        """The cached snapshot of a pod name (``None``: not cached), current whenever called."""
        return self._pods.get

    def keys(self) -> Iterable[str]:
        """A copy of the cached keys (safe to iterate while events arrive)."""
        namespace = self.namespace
        return [pod_key(namespace, name) for name in self._pods]

    @property
    def synced(self) -> bool:
        return self.state is SyncState.SYNCED

    def __len__(self) -> int:
        return len(self._pods)

    async def wait_synced(self) -> None:
        """Return once the cache matches the server (immediately if it does now)."""
        while self.state is not SyncState.SYNCED:
            await self._synced_event.wait()

    def begin_sync(self) -> SyncState:
        """Start filling the cache, or start over (the pods kept, the names put forgotten)."""
        match self.state:
            case SyncState.COLD | SyncState.LISTING:
                self.state = SyncState.LISTING
            case SyncState.SYNCED:
                self.state = SyncState.RELISTING
                self._synced_gauge.set(0)
                self._synced_event = anyio.Event()
                self.sink.cache_cold(self.namespace)
        self._seen = set()
        return self.state

    def finish_sync(self) -> None:
        if self.state not in (SyncState.LISTING, SyncState.RELISTING):
            raise RuntimeError(f"finish_sync in state {self.state}: no sync in progress")
        pods, seen, sink = self._pods, self._seen, self.sink
        for name in [n for n in pods if n not in seen]:
            sink.pod_changed(pods.pop(name), None)
        self._seen = set()
        self._size.set(len(pods))
        self.state = SyncState.SYNCED
        self._synced_gauge.set(1)
        self._synced_event.set()
        sink.cache_synced(self.namespace)

    def put(self, snap: PodSnapshot) -> None:
        """The server has this pod in this state. While synced this is a change (a watch event)
        and always reported; during a sync only when the pod is new or changed since cached."""
        pods = self._pods
        before = pods.get(snap.name)
        if self.state is SyncState.SYNCED:
            self.sink.pod_changed(before, self._replace(before, snap))
            self._size.set(len(pods))
            return
        if before is None:
            self._seen.add(snap.name)
        else:
            self._seen.add(before.name)  # the string the store holds already, not a copy of it
            if before.resource_version == snap.resource_version and before.uid == snap.uid:
                return
        self.sink.pod_changed(before, self._replace(before, snap))

    def delete(self, snap: PodSnapshot) -> None:
        """The server deleted this pod; reported with the last cached state (or ``snap``)."""
        pods = self._pods
        before = pods.pop(snap.name, None)
        if self.state is not SyncState.SYNCED:
            self._seen.discard(snap.name)
        self.sink.pod_changed(before if before is not None else snap, None)
        self._size.set(len(pods))

    def forget(self, key: str) -> None:
        """Drop a pod whose state can no longer be read; reported deleted if it was cached."""
        namespace, _, name = key.partition("/")
        before = self._pods.pop(name, None) if namespace == self.namespace else None
        if before is not None:
            self.sink.pod_changed(before, None)
            self._size.set(len(self._pods))

    def _replace(self, before: PodSnapshot | None, snap: PodSnapshot) -> PodSnapshot:
        """Store ``snap`` under the key string the dict keeps (``before.name``); as stored."""
        if before is not None and snap.name is not before.name:
            snap = msgspec.structs.replace(snap, name=before.name)
        self._pods[snap.name] = snap
        return snap
