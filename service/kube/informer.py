"""The pod informer: the slim cache of one sandbox namespace, and the handlers it tells.

:class:`PodInformer` composes the parts as client-go's shared informer does:
:class:`~service.kube.listwatch.ListWatch` makes the requests, the
:class:`~service.kube.reflector.Reflector` runs the list-watch loop (the one writer of the store,
and the fallback between the ways of filling it), the :class:`~service.kube.store.PodStore` holds
the pods and their sync state. The informer
implements ``ports.PodCache`` for its consumers and delivers every change, in order, to each
``ports.PodEventHandler`` registered with :meth:`PodInformer.add_handler`. Several namespaces
are several informers behind one cache (``service/kube/namespaces.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import anyio
from anyio.abc import TaskStatus
from kubernetes_asyncio import client as k8s_client

from service.config import KubeSettings
from service.domain import PodSnapshot
from service.kit.backoff import Backoff
from service.kube.decode import PodDecoder
from service.kube.listwatch import ListWatch
from service.kube.reflector import Reflector, SyncMode
from service.kube.store import PodStore
from service.kube.transport import transport_of
from service.metrics import Metrics
from service.ports import PodEventHandler

BACKOFF_MAX_S = 30.0
"""Cap of the delay between list/watch attempts after failures."""
WATCH_JITTER = 0.1
"""The default fraction by which a watch's server ``timeoutSeconds`` is randomly lengthened."""


def default_backoff() -> Backoff:
    """Half a second after the first failure, doubling to :data:`BACKOFF_MAX_S`, each delay
    uniform in its upper half."""
    return Backoff(initial_s=0.5, max_s=BACKOFF_MAX_S, jitter=0.5)


class _Handlers:
    """The store's one sink: every handler added, told in the order it was added (none for
    ``scan``, which reads the cache only)."""

    __slots__ = ("_handlers",)

    def __init__(self) -> None:
        self._handlers: tuple[PodEventHandler, ...] = ()

    def add(self, handler: PodEventHandler) -> None:
        self._handlers = (*self._handlers, handler)

    def pod_changed(self, old: PodSnapshot | None, new: PodSnapshot | None) -> None:
        for handler in self._handlers:
            handler.pod_changed(old, new)

    def cache_cold(self, namespace: str) -> None:
        for handler in self._handlers:
            handler.cache_cold(namespace)

    def cache_synced(self, namespace: str) -> None:
        for handler in self._handlers:
            handler.cache_synced(namespace)


class PodInformer:
    """Implements ``ports.PodCache``; tells the handlers added with :meth:`add_handler`.

    ``backoff`` paces the attempts after failures, ``watch_jitter`` is the fraction by which the
    server ``timeoutSeconds`` is randomly lengthened, and a stream that ends cleanly within
    ``min_watch_s`` without any event counts as a failure.
    """

    def __init__(
        self,
        api: k8s_client.ApiClient,
        settings: KubeSettings,
        decoder: PodDecoder,
        metrics: Metrics,
        *,
        namespace: str,
        rng: random.Random | None = None,
        backoff: Backoff | None = None,
        watch_jitter: float = WATCH_JITTER,
        min_watch_s: float = 1.0,
    ) -> None:
        self._handlers = _Handlers()
        self._running = False
        self.namespace = namespace
        """The namespace watched (a namespaced list+watch: no cluster-wide request)."""
        self._store = PodStore(metrics, sink=self._handlers, namespace=namespace)
        transport = transport_of(api)
        self._reflector = Reflector(
            ListWatch(
                api,
                settings,
                decoder,
                metrics,
                namespace=namespace,
                rng=rng or random.Random(),
                watch_jitter=watch_jitter,
            ),
            self._store,
            decoder,
            metrics,
            settings=settings,
            backoff=backoff or default_backoff(),
            min_watch_s=min_watch_s,
            reachability=transport.reachability if transport is not None else None,
        )

    def add_handler(self, handler: PodEventHandler) -> None:
        """Tell ``handler`` every change from the start (client-go's ``AddEventHandler``).

        Handlers are added before :meth:`run`: one added later would never hear of the pods
        already cached, so that raises ``RuntimeError``."""
        if self._running:
            raise RuntimeError("handlers are added before the informer runs")
        self._handlers.add(handler)

    # ------------------------------------------------------------------ PodCache

    def get(self, key: str) -> PodSnapshot | None:
        return self._store.get(key)

    @property
    def by_name(self) -> Callable[[str], PodSnapshot | None]:
        """See :attr:`PodStore.by_name`."""
        return self._store.by_name

    def keys(self) -> Iterable[str]:
        """A copy of the cached keys (safe to iterate while events arrive)."""
        return self._store.keys()

    @property
    def synced(self) -> bool:
        return self._store.synced

    def namespace_synced(self, namespace: str) -> bool:
        return namespace == self.namespace and self._store.synced

    def __len__(self) -> int:
        return len(self._store)

    async def wait_synced(self) -> None:
        """Return once the cache matches the server (immediately if it does now)."""
        await self._store.wait_synced()

    @property
    def resource_version(self) -> str | None:
        """The last resourceVersion seen (sync, event or bookmark); ``None`` before a sync."""
        return self._reflector.resource_version

    @property
    def sync_mode(self) -> SyncMode | None:
        """How the cache was last filled; ``None`` before the first sync."""
        return self._reflector.sync_mode

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sync and watch until cancelled. Signals ``task_status`` at once (not at sync: use
        :meth:`wait_synced`), so a caller's start never blocks on an unreachable server. Raises
        only what is a bug (failures of the API server are retried)."""
        self._running = True
        task_status.started()
        await self._reflector.run()
