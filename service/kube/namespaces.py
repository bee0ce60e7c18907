"""The pod caches of several sandbox namespaces behind one ``ports.PodCache``.

As controller-runtime's multi-namespace cache: one namespaced informer per namespace (a Role in
each, never a cluster-wide watch), each with its own sync state. A key is answered by the cache of
its own namespace only; a key of a namespace not configured finds no pod and no synced cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import anyio
from anyio.abc import TaskStatus

from service.domain import PodSnapshot
from service.kube.informer import PodInformer
from service.ports import PodEventHandler


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
        """Namespace → its cache's lookup by pod name (what :meth:`get` reads)."""

    def add_handler(self, handler: PodEventHandler) -> None:
        """Tell ``handler`` every change of every namespace (before :meth:`run`)."""
        for informer in self.informers.values():
            informer.add_handler(handler)

    def get(self, key: str) -> PodSnapshot | None:
        namespace, _, name = key.partition("/")
        by_name = self._by_name.get(namespace)
        return None if by_name is None else by_name(name)

    def keys(self) -> Iterable[str]:
        """A copy of the cached keys of every namespace."""
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
        """Return once every namespace's cache matches the server."""
        for informer in self.informers.values():
            await informer.wait_synced()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every namespace's informer until cancelled (signals at once, as each does)."""
        async with anyio.create_task_group() as tg:
            for namespace, informer in self.informers.items():
                await tg.start(informer.run, name=f"pod-informer-{namespace}")
            task_status.started()
