"""Emulator object semantics over HTTP: graceful deletion, finalizers, the status subresource,
patch flavours, no-op writes; and the admin endpoints (faults, audit, bulk, kubelet, reset)
plus ``python -m devtools.emulator`` as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from kubernetes_asyncio import client as k8s_client

from devtools.emulator import Emulator, RunningEmulator
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
WIRE = Path(__file__).parent.parent / "fixtures" / "wire"
T0 = 1_800_000_000.0


async def raw(response: Any) -> tuple[int, Any]:
    try:
        body = await response.read()
    finally:
        response.release()
    return response.status, json.loads(body)


def core(api: k8s_client.ApiClient) -> k8s_client.CoreV1Api:
    return k8s_client.CoreV1Api(api)


def events_of(emu: Emulator, since: int) -> list[tuple[str, str]]:
    """(type, resourceVersion) of the pod watch history after ``since``."""
    table = emu.table(emu.resource("", "pods"))  # type: ignore[arg-type]
    return [
        (t.decode(), e.obj["metadata"]["resourceVersion"])
        for rv, t, e in table.history
        if rv > since
    ]


@pytest.mark.parametrize("emulator_options", [{"clock": lambda: T0}])
async def test_graceful_delete_of_a_node_bound_pending_pod_matches_the_real_server(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("01a1be5ebfdd", 2), namespace=NS)
    name = "space-sbx-01a1be5ebfdd-g2"
    before = emu.resource_version
    status, body = await raw(
        await core(library_api).delete_namespaced_pod(name, NS, _preload_content=False)
    )
    real = json.loads((WIRE / "delete-pending-node-bound.200.json").read_text())["body"]
    assert status == 200
    meta = body["metadata"]
    assert (
        meta["deletionGracePeriodSeconds"] == real["metadata"]["deletionGracePeriodSeconds"] == 30
    )
    assert meta["deletionTimestamp"] == "2027-01-15T08:00:30Z"  # T0 + 30 s
    assert meta["generation"] == real["metadata"]["generation"] == 2
    assert events_of(emu, before) == [("MODIFIED", meta["resourceVersion"])]
    assert emu.get_pod(NS, name) is not None
    # Deleting it again gracefully changes nothing; grace 0 (the kubelet's delete) removes it.
    status, again = await raw(
        await core(library_api).delete_namespaced_pod(name, NS, _preload_content=False)
    )
    assert (status, again["metadata"]["resourceVersion"]) == (200, meta["resourceVersion"])
    status, final = await raw(
        await core(library_api).delete_namespaced_pod(
            name, NS, body={"gracePeriodSeconds": 0}, _preload_content=False
        )
    )
    assert status == 200
    assert final["metadata"]["deletionTimestamp"] == "2027-01-15T08:00:00Z"  # like delete-grace0
    assert final["metadata"]["deletionGracePeriodSeconds"] == 0
    assert [t for t, _ in events_of(emu, before)] == ["MODIFIED", "MODIFIED", "DELETED"]
    assert emu.get_pod(NS, name) is None


@pytest.mark.parametrize(
    ("pod", "query"),
    [
        (sandbox_pod("term", phase="Succeeded"), {}),
        (sandbox_pod("failed", phase="Failed"), {}),
        (sandbox_pod("nonode", node=None), {}),
        (sandbox_pod("grace0"), {"grace_period_seconds": 0}),
    ],
)
async def test_pods_that_go_away_at_once(
    emulator: RunningEmulator,
    library_api: k8s_client.ApiClient,
    pod: dict[str, Any],
    query: dict[str, int],
) -> None:
    emu = emulator.emulator
    emu.create_pod(pod, namespace=NS)
    name = pod["metadata"]["name"]
    before = emu.resource_version
    status, body = await raw(
        await core(library_api).delete_namespaced_pod(name, NS, _preload_content=False, **query)
    )
    assert status == 200
    assert body["metadata"]["deletionGracePeriodSeconds"] == 0
    assert [t for t, _ in events_of(emu, before)] == ["MODIFIED", "DELETED"]
    assert body["metadata"]["resourceVersion"] == str(emu.resource_version)
    assert emu.get_pod(NS, name) is None


async def test_finalizers_hold_a_deleted_pod_until_removed(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    emu.create_pod(
        sandbox_pod("fin", phase="Succeeded", finalizers=["example.com/hold"]), namespace=NS
    )
    name = "space-sbx-fin-g1"
    status, body = await raw(
        await core(library_api).delete_namespaced_pod(name, NS, _preload_content=False)
    )
    assert status == 200 and body["metadata"]["deletionTimestamp"]
    assert emu.get_pod(NS, name) is not None
    status, body = await raw(
        await core(library_api).patch_namespaced_pod(
            name,
            NS,
            {"metadata": {"$deleteFromPrimitiveList/finalizers": ["example.com/hold"]}},
            _preload_content=False,
        )
    )
    assert status == 200
    assert emu.get_pod(NS, name) is None


async def test_status_subresource_and_main_object_writes_are_separate(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("st"), namespace=NS)
    name = "space-sbx-st-g1"
    api = core(library_api)
    status, body = await raw(
        await api.patch_namespaced_pod_status(
            name,
            NS,
            {
                "metadata": {"labels": {"ignored": "yes"}},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
            },
            _preload_content=False,
        )
    )
    assert status == 200
    assert body["status"]["phase"] == "Running"
    assert "ignored" not in body["metadata"]["labels"]
    # Strategic merge: conditions merge by type, labels merge, status is untouched by the main
    # object.
    status, body = await raw(
        await api.patch_namespaced_pod_status(
            name,
            NS,
            {"status": {"conditions": [{"type": "PodReadyToStartContainers", "status": "False"}]}},
            _preload_content=False,
        )
    )
    assert [c["type"] for c in body["status"]["conditions"]] == [
        "Ready",
        "PodReadyToStartContainers",
    ]
    status, body = await raw(
        await api.patch_namespaced_pod(
            name,
            NS,
            {"metadata": {"labels": {"extra": "1"}}, "status": {"phase": "Failed"}},
            _preload_content=False,
        )
    )
    assert body["metadata"]["labels"]["extra"] == "1"
    assert body["metadata"]["labels"]["space.sandbox-id"] == "st"
    assert body["status"]["phase"] == "Running"
    # A write that changes nothing keeps the resourceVersion and emits no event.
    rv = body["metadata"]["resourceVersion"]
    before = emu.resource_version
    status, same = await raw(
        await api.patch_namespaced_pod(
            name, NS, {"metadata": {"labels": {"extra": "1"}}}, _preload_content=False
        )
    )
    assert (status, same["metadata"]["resourceVersion"]) == (200, rv)
    assert emu.resource_version == before
    # PUT of the status with a stale resourceVersion conflicts.
    stale = dict(same, metadata=dict(same["metadata"], resourceVersion="1"))
    status, body = await raw(
        await api.replace_namespaced_pod_status(name, NS, stale, _preload_content=False)
    )
    assert (status, body["reason"]) == (409, "Conflict")


async def test_http_create_fills_server_metadata(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    pod = sandbox_pod("new", phase="Succeeded")
    status, body = await raw(
        await core(library_api).create_namespaced_pod(NS, pod, _preload_content=False)
    )
    real = json.loads((WIRE / "create-pod.response.json").read_text())
    assert status == real["http_status"] == 201
    assert list(body)[:2] == ["kind", "apiVersion"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "generation"):
        assert key in body["metadata"] and key in real["body"]["metadata"]
    assert body["status"] == {"phase": "Pending"}  # status is not settable on create
    status, again = await raw(
        await core(library_api).create_namespaced_pod(NS, pod, _preload_content=False)
    )
    assert (status, again["reason"]) == (409, "AlreadyExists")
    status, missing_ns = await raw(
        await core(library_api).create_namespaced_pod("nowhere", pod, _preload_content=False)
    )
    assert (status, missing_ns["message"]) == (404, 'namespaces "nowhere" not found')


async def test_admin_endpoints_drive_faults_audit_bulk_and_kubelet(
    emulator: RunningEmulator,
) -> None:
    emu = emulator.emulator
    admin = f"{emulator.url}/_emulator"
    pods = f"{emulator.url}/api/v1/namespaces/{NS}/pods"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{admin}/pods/bulk", json={"namespace": NS, "count": 50}) as r:
            assert (await r.json())["created"] == 50
        assert len(emu.pod_keys(NS)) == 50
        async with http.post(
            f"{admin}/faults", json={"code": 429, "count": 1, "retry_after_s": 3, "method": "GET"}
        ) as r:
            assert r.status == 200
        async with http.get(pods) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "3"
            assert (await r.json())["details"]["retryAfterSeconds"] == 3
        async with http.get(pods) as r:
            assert r.status == 200 and len((await r.json())["items"]) == 50
        name = "space-sbx-000000000000-g1"
        async with http.delete(f"{pods}/{name}", json={"preconditions": {"uid": "x"}}) as r:
            assert r.status == 409
        async with http.delete(f"{pods}/{name}") as r:
            assert r.status == 200
        async with http.get(f"{admin}/audit") as r:
            audit = await r.json()
        assert [(a["method"], a["status"], a["body"]) for a in audit] == [
            ("DELETE", 409, {"preconditions": {"uid": "x"}}),
            ("DELETE", 200, None),
        ]
        assert emu.get_pod(NS, name) is not None  # node-bound Pending: terminating
        async with http.post(f"{admin}/kubelet/finish", json={}) as r:
            assert (await r.json())["finished"] == 1
        assert emu.get_pod(NS, name) is None
        async with http.post(f"{admin}/reset") as r:
            assert r.status == 200
        async with http.get(f"{admin}/state") as r:
            assert (await r.json())["pods"] == 0


async def test_a_fault_limited_to_watch_requests_spares_lists_and_gets(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("w"), namespace=NS)
    emu.fail_next(1, code=500, method="GET", path_contains="/pods", query={"watch": "true"})
    api = core(library_api)
    listed = await raw(await api.list_namespaced_pod(NS, _preload_content=False))
    got = await raw(await api.read_namespaced_pod("space-sbx-w-g1", NS, _preload_content=False))
    assert (listed[0], got[0]) == (200, 200)
    # The client sends watch=True; the rule matches regardless of the boolean's spelling.
    watched = await raw(
        await api.list_namespaced_pod(NS, watch=True, timeout_seconds=1, _preload_content=False)
    )
    assert watched[0] == 500 and watched[1]["message"].endswith("injected fault")
    assert [r.query.get("watch") for r in emu.requests][-1] == "True"


@pytest.mark.parametrize("emulator_options", [{"kubelet_finish_after_s": 0.05}])
async def test_the_kubelet_knob_finishes_graceful_deletions_by_itself(
    emulator: RunningEmulator,
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("auto"), namespace=NS)
    emu.delete_pod(NS, "space-sbx-auto-g1")
    assert emu.get_pod(NS, "space-sbx-auto-g1") is not None
    with anyio.fail_after(5):
        while emu.get_pod(NS, "space-sbx-auto-g1") is not None:
            await anyio.sleep(0.01)


async def test_module_entry_point_serves_over_http(event_loop_guard: None) -> None:
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "devtools.emulator"),
            *("--port", "0", "--namespace", NS, "--pods", "3"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        with anyio.fail_after(20):
            line = await anyio.to_thread.run_sync(process.stdout.readline)
        url = line.decode().strip().rpartition(" ")[2]
        assert url.startswith("http://127.0.0.1:")
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/api/v1/namespaces/{NS}/pods") as r,
        ):
            assert len((await r.json())["items"]) == 3
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
