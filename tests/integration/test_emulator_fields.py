"""Field selectors on pod lists, as the runbook's population counts use them (docs/operations.md,
"Rollout"): through the real ``kubernetes_asyncio`` client and through the real kubectl."""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client.exceptions import ApiException

from devtools.emulator import Emulator, RunningEmulator
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from tests.kubectl import KubectlCluster

NS = "sandboxes"
SHAPES = {
    "stuck": Shape.PENDING_STUCK,
    "withip": Shape.PENDING_WITH_IP,
    "live": Shape.RUNNING,
    "idle": Shape.SUCCEEDED,
    "failed": Shape.FAILED,
}


def seed(emu: Emulator) -> None:
    for name, shape in SHAPES.items():
        emu.create_pod(sandbox_pod(sandbox_id=name, generation=1, shape=shape), namespace=NS)
    emu.create_pod(
        sandbox_pod(sandbox_id="elsewhere", generation=1, shape=Shape.SUCCEEDED, node="node-b"),
        namespace=NS,
    )


async def names(api: k8s_client.ApiClient, field_selector: str, **kw: object) -> list[str]:
    pods = await k8s_client.CoreV1Api(api).list_namespaced_pod(
        NS, field_selector=field_selector, **kw
    )
    return sorted(p.metadata.name for p in pods.items)


@pytest.mark.anyio
async def test_pod_lists_select_by_field(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    seed(emulator.emulator)
    assert await names(library_api, "status.phase=Succeeded") == [
        "space-sbx-elsewhere-g1",
        "space-sbx-idle-g1",
    ]
    assert await names(library_api, "status.phase==Succeeded,spec.nodeName!=node-b") == [
        "space-sbx-idle-g1"
    ]
    assert await names(library_api, "status.podIP=") == ["space-sbx-stuck-g1"]
    assert await names(library_api, "metadata.name=space-sbx-live-g1") == ["space-sbx-live-g1"]
    # A page of a filtered list: fewer items than the limit may come back, never a wrong one,
    # and the pages together are the whole answer.
    api = k8s_client.CoreV1Api(library_api)
    seen: list[str] = []
    token = None
    while True:
        page = await api.list_namespaced_pod(
            NS, field_selector="status.phase=Pending", limit=2, _continue=token
        )
        assert page.metadata.remaining_item_count is None
        seen += [p.metadata.name for p in page.items]
        token = page.metadata._continue
        if not token:
            break
    assert sorted(seen) == ["space-sbx-stuck-g1", "space-sbx-withip-g1"]


@pytest.mark.anyio
async def test_unsupported_field_and_field_watches_are_400(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    api = k8s_client.CoreV1Api(library_api)
    with pytest.raises(ApiException) as bad_field:
        await api.list_namespaced_pod(NS, field_selector="spec.containers=x")
    assert bad_field.value.status == 400
    assert "field label not supported: spec.containers" in bad_field.value.body
    with pytest.raises(ApiException) as watch:
        await api.list_namespaced_pod(NS, field_selector="status.phase=Running", watch=True)
    assert watch.value.status == 400


def test_the_rollout_population_counts_with_the_real_kubectl(
    kubectl_cluster: KubectlCluster,
) -> None:
    kubectl_cluster.call(seed)
    selector = ("-l", "app.kubernetes.io/managed-by=space-sandbox")
    terminal = kubectl_cluster.run(
        "-n",
        NS,
        "get",
        "pods",
        *selector,
        "--field-selector=status.phase=Succeeded",
        "--no-headers",
    )
    assert sorted(line.split()[0] for line in terminal.stdout.splitlines()) == [
        "space-sbx-elsewhere-g1",
        "space-sbx-idle-g1",
    ]
    pending = kubectl_cluster.run(
        "-n", NS, "get", "pods", *selector, "--field-selector=status.phase=Pending", "-o", "name"
    )
    assert sorted(pending.stdout.split()) == ["pod/space-sbx-stuck-g1", "pod/space-sbx-withip-g1"]
    refused = kubectl_cluster.run(
        "-n", NS, "get", "pods", "--field-selector=spec.foo=x", check=False
    )
    assert refused.returncode == 1 and "field label not supported: spec.foo" in refused.stderr
