"""The pod informer of a sandbox namespace, as client-go's shared informer: a ``PodStore`` that
a ``Reflector`` keeps in step, telling every change, in order, to each handler added; those of
several namespaces behind one ``ports.PodCache``, as controller-runtime's multi-namespace cache
(a Role in each, never a cluster-wide watch).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import anyio
from anyio.abc import TaskStatus

from service.config import KubeSettings
from service.domain import PodSnapshot
from service.kit.backoff import Backoff
from service.kube.listwatch import ListWatch
from service.kube.reflector import Reflector
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
    """The cache of the pods ``lw`` lists and watches (``ports.PodCache``), and its sink."""

    __slots__ = ("_handlers", "_running", "reflector")

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
        self.reflector = Reflector(
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

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sync and watch until cancelled. Signals ``task_status`` at once (not at sync), so a
        caller's start never blocks on an unreachable server."""
        self._running = True
        task_status.started()
        await self.reflector.run()


class MultiNamespaceInformer:
    """Implements ``ports.PodCache`` over one :class:`PodInformer` per namespace."""

    def __init__(
        self, namespaces: Sequence[str], new_informer: Callable[[str], PodInformer]
    ) -> None:
        if not namespaces:
            raise ValueError("at least one namespace")
        self.informers: dict[str, PodInformer] = {ns: new_informer(ns) for ns in namespaces}
        """Namespace → its informer, in the order configured."""
        self._by_name = {ns: informer.by_name for ns, informer in self.informers.items()}

    def add_handler(self, handler: PodEventHandler) -> None:
        """Tell ``handler`` every change of every namespace (before :meth:`run`)."""
        for informer in self.informers.values():
            informer.add_handler(handler)

    def get(self, key: str) -> PodSnapshot | None:
        namespace, _, name = key.partition("/")
        by_name = self._by_name.get(namespace)
        return None if by_name is None else by_name(name)

    def keys(self) -> Iterable[str]:
        return list(itertools.chain.from_iterable(i.keys() for i in self.informers.values()))

    @property
    def synced(self) -> bool:
        return all(informer.synced for informer in self.informers.values())

    def namespace_synced(self, namespace: str) -> bool:
        informer = self.informers.get(namespace)
        return informer is not None and informer.synced

    def __len__(self) -> int:
        return sum(len(informer) for informer in self.informers.values())

    async def wait_synced(self) -> None:
        for informer in self.informers.values():
            await informer.wait_synced()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every namespace's informer until cancelled (signals at once, as each does)."""
        async with anyio.create_task_group() as tg:
            for namespace, informer in self.informers.items():
                await tg.start(informer.run, name=f"pod-informer-{namespace}")
            task_status.started()
