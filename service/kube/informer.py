"""The pod informer of one sandbox namespace, as client-go's shared informer: a
:class:`~service.kube.store.PodStore` that a :class:`~service.kube.reflector.Reflector` keeps in
step, and that tells every change, in order, to each ``ports.PodEventHandler`` added.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus

from service.config import KubeSettings
from service.domain import PodSnapshot
from service.kit.backoff import Backoff
from service.kube.listwatch import ListWatch
from service.kube.reflector import Reflector, SyncMode
from service.kube.store import PodStore
from service.metrics import KubeMetrics
from service.ports import PodEventHandler

BACKOFF_MAX_S = 30.0
"""Cap of the delay between list/watch attempts after failures."""


def default_backoff() -> Backoff:
    """Half a second after the first failure, doubling to :data:`BACKOFF_MAX_S`, each delay
    uniform in its upper half."""
    return Backoff(initial_s=0.5, max_s=BACKOFF_MAX_S, jitter=0.5)


class PodInformer(PodStore):
    """The cache of the pods ``lw`` lists and watches (``ports.PodCache``); tells the handlers
    added with :meth:`add_handler`, and is the store's sink."""

    __slots__ = ("_handlers", "_reflector", "_running")

    def __init__(
        self,
        lw: ListWatch,
        *,
        settings: KubeSettings,
        metrics: KubeMetrics,
        backoff: Backoff | None = None,
        min_watch_s: float = 1.0,
    ) -> None:
        super().__init__(metrics, sink=self, namespace=lw.namespace)
        self._handlers: list[PodEventHandler] = []
        self._running = False
        self._reflector = Reflector(
            lw,
            self,
            metrics,
            settings=settings,
            backoff=backoff or default_backoff(),
            min_watch_s=min_watch_s,
            reachability=lw.reachability,
        )

    def add_handler(self, handler: PodEventHandler) -> None:
        """Tell ``handler`` every change from the start. Added before :meth:`run` (one added
        later would never hear of the pods already cached: ``RuntimeError``)."""
        if self._running:
            raise RuntimeError("handlers are added before the informer runs")
        self._handlers.append(handler)

    def pod_changed(self, old: PodSnapshot | None, new: PodSnapshot | None) -> None:
        """Tell every handler, in the order they were added."""
        for handler in self._handlers:
            handler.pod_changed(old, new)

    def cache_cold(self, namespace: str) -> None:
        for handler in self._handlers:
            handler.cache_cold(namespace)

    def cache_synced(self, namespace: str) -> None:
        for handler in self._handlers:
            handler.cache_synced(namespace)

    def namespace_synced(self, namespace: str) -> bool:
        return namespace == self.namespace and self.synced

    @property
    def resource_version(self) -> str | None:
        """See :attr:`~service.kube.watching.Watcher.resource_version`."""
        return self._reflector.resource_version

    @property
    def sync_mode(self) -> SyncMode | None:
        """How the cache was last filled; ``None`` before the first sync."""
        return self._reflector.sync_mode

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sync and watch until cancelled. Signals ``task_status`` at once (not at sync), so a
        caller's start never blocks on an unreachable server."""
        self._running = True
        task_status.started()
        await self._reflector.run()
