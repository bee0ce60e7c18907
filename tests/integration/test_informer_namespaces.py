"""Several sandbox namespaces: the composition root's informer (one namespaced informer per
namespace, ``service/kube/informer.py``) against the emulator over HTTP.

Each namespace is its own cache: filled by its own namespaced list+watch (never a request across
every namespace), synced or cold on its own, and a key is answered by its own namespace's cache
only; a namespace not configured is never requested and has no synced cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from prometheus_client import CollectorRegistry

from devtools.emulator import RunningEmulator
from service.app import service
from service.config import PREFIX, Settings
from service.kube.informer import MultiNamespaceInformer
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from tests.fakes import make_settings
from tests.kubefixtures import (
    RecordingHandler,
    cache_state,
    eventually,
    sandbox_pod,
    server_pods,
)

pytestmark = pytest.mark.anyio
A, B, C = "sandboxes", "tenant-b", "not-configured"


def two_namespaces() -> Settings:
    return make_settings(
        env={PREFIX + "NAMESPACES": f"{A},{B}", PREFIX + "API_TIMEOUT_SECONDS": "5"}
    )


@asynccontextmanager
async def running(
    api: ApiTransport, settings: Settings
) -> AsyncIterator[tuple[MultiNamespaceInformer, RecordingHandler, KubeMetrics]]:
    metrics = KubeMetrics(CollectorRegistry())
    informer = service.new_informer(settings, api, metrics)
    handler = RecordingHandler()
    informer.add_handler(handler)
    async with anyio.create_task_group() as tg:
        await tg.start(informer.run)
        try:
            yield informer, handler, metrics
        finally:
            tg.cancel_scope.cancel()


async def test_each_namespace_has_its_own_cache_and_nothing_else_is_listed(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    for ns in (A, B, C):
        for i in range(3):
            emu.create_pod(sandbox_pod(f"{ns}-{i}", phase="Succeeded"), namespace=ns)
    # The same pod name in two namespaces: two pods, two keys.
    emu.create_pod(sandbox_pod("same", phase="Succeeded"), namespace=A)
    emu.create_pod(sandbox_pod("same", phase="Pending"), namespace=B)
    async with running(kube_api, two_namespaces()) as (informer, handler, metrics):
        await informer.wait_synced()
        assert informer.synced
        assert cache_state(informer) == server_pods(emu, A) | server_pods(emu, B)
        assert len(informer) == 8
        same_a, same_b = (
            informer.get(f"{A}/space-sbx-same-g1"),
            informer.get(f"{B}/space-sbx-same-g1"),
        )
        assert same_a is not None and same_b is not None and same_a.uid != same_b.uid
        assert informer.get(f"{C}/space-sbx-{C}-0-g1") is None
        assert informer.namespace_synced(A) and informer.namespace_synced(B)
        assert not informer.namespace_synced(C)
        assert sorted(handler.namespaces) == [A, B]  # one cache_synced each
        for ns, count in ((A, 4), (B, 4)):
            registry = metrics.registry
            assert (
                registry.get_sample_value("retired_pod_gc_cache_pods", {"sandbox_namespace": ns})
                == count
            )
            assert (
                registry.get_sample_value("retired_pod_gc_cache_synced", {"sandbox_namespace": ns})
                == 1
            )
        # A change in C is not seen; one in B is, under B's key.
        emu.create_pod(sandbox_pod("late"), namespace=C)
        emu.create_pod(sandbox_pod("late"), namespace=B)
        await eventually(lambda: informer.get(f"{B}/space-sbx-late-g1") is not None)
        assert informer.get(f"{C}/space-sbx-late-g1") is None
    paths = {r.path for r in emu.requests}
    assert paths <= {f"/api/v1/namespaces/{A}/pods", f"/api/v1/namespaces/{B}/pods"}, paths


async def test_one_namespace_relisting_leaves_the_other_synced(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    for ns in (A, B):
        emu.create_pod(sandbox_pod(f"{ns}-0", phase="Succeeded"), namespace=ns)
    async with running(kube_api, two_namespaces()) as (informer, handler, _):
        await informer.wait_synced()
        handler.log.clear()
        handler.namespaces.clear()
        # B's watch is refused with 410 Gone when it reconnects: B relists, A resumes.
        emu.fail_next(
            1,
            code=410,
            method="GET",
            path_contains=f"/namespaces/{B}/pods",
            query={"watch": "true"},
        )
        emu.drop_watches(abrupt=False)
        emu.create_pod(sandbox_pod("new"), namespace=B)
        await eventually(lambda: handler.synced == 3)
        assert [entry for entry in handler.log if entry in ("cold", "synced")] == ["cold", "synced"]
        assert handler.namespaces == [B, B]
        assert informer.namespace_synced(A) and informer.namespace_synced(B)
        await eventually(lambda: cache_state(informer) == server_pods(emu, A) | server_pods(emu, B))
