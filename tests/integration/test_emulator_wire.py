"""Emulator fidelity: status codes, Status bodies, list pagination and watch framing compared
with the real kube-apiserver responses in tests/fixtures/wire.

Requests go through the real ``kubernetes_asyncio`` client (raw responses, so the bytes are
what the server sent); watch streams are read with aiohttp to see the framing itself.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s_client

from devtools.emulator import RunningEmulator
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
WIRE = Path(__file__).parent.parent / "fixtures" / "wire"


def sample(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((WIRE / name).read_text())
    return data


async def raw(response: Any) -> tuple[int, Any]:
    try:
        body = await response.read()
    finally:
        response.release()
    return response.status, json.loads(body)


def core(api: k8s_client.ApiClient) -> k8s_client.CoreV1Api:
    return k8s_client.CoreV1Api(api)


async def test_missing_pod_get_and_delete_answer_the_real_404_bodies(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    name = "space-sbx-01a1be5de309-g1"
    status, body = await raw(
        await core(library_api).read_namespaced_pod(name, NS, _preload_content=False)
    )
    expected = sample("get-missing.404.json")
    assert (status, body) == (expected["http_status"], expected["body"])
    status, body = await raw(
        await core(library_api).delete_namespaced_pod(name, NS, _preload_content=False)
    )
    expected = sample("delete-missing.404.json")
    assert (status, body) == (expected["http_status"], expected["body"])


async def test_delete_precondition_conflicts_match_the_real_bodies(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    name = "space-sbx-01a1be5de309-g1"
    pod = emu.create_pod(sandbox_pod("01a1be5de309", phase="Succeeded"), namespace=NS)
    uid, rv = pod["metadata"]["uid"], pod["metadata"]["resourceVersion"]
    wrong = "826efe1f-0fcb-4036-93b5-129b24536935"
    status, body = await raw(
        await core(library_api).delete_namespaced_pod(
            name, NS, body={"preconditions": {"uid": wrong}}, _preload_content=False
        )
    )
    expected = sample("delete-wrong-uid.409.json")["body"]
    expected["message"] = expected["message"].replace("e5124fd6-ed82-4df6-a5d0-03a86734ba5b", uid)
    assert (status, body) == (409, expected)

    emu.set_status(NS, name, {"phase": "Succeeded", "podIP": "192.0.2.12"})
    status, body = await raw(
        await core(library_api).delete_namespaced_pod(
            name,
            NS,
            body={"preconditions": {"uid": uid, "resourceVersion": rv}},
            _preload_content=False,
        )
    )
    current = emu.get_pod(NS, name)
    assert current is not None
    expected = sample("delete-stale-rv.409.json")["body"]
    expected["message"] = (
        expected["message"]
        .replace("(333)", f"({rv})")
        .replace("(334)", f"({current['metadata']['resourceVersion']})")
    )
    assert (status, body) == (409, expected)
    assert emu.get_pod(NS, name) == current  # a failed precondition deletes nothing


async def test_lease_put_with_a_stale_version_is_the_real_409(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    coordination = k8s_client.CoordinationV1Api(library_api)
    lease = sample("lease-create.json")["body"]
    create_body = {"metadata": {"name": lease["metadata"]["name"]}, "spec": lease["spec"]}
    status, created = await raw(
        await coordination.create_namespaced_lease(NS, create_body, _preload_content=False)
    )
    assert status == 201
    assert created["kind"] == "Lease" and created["apiVersion"] == "coordination.k8s.io/v1"
    assert created["spec"] == lease["spec"]
    renewed = dict(created, spec=dict(created["spec"], renewTime="2026-11-29T20:00:10.000000Z"))
    status, after = await raw(
        await coordination.replace_namespaced_lease(
            "retired-pod-gc", NS, renewed, _preload_content=False
        )
    )
    assert status == 200
    assert int(after["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    status, body = await raw(
        await coordination.replace_namespaced_lease(
            "retired-pod-gc", NS, renewed, _preload_content=False
        )
    )
    expected = sample("lease-put-stale.409.json")
    assert (status, body) == (expected["http_status"], expected["body"])
    # A no-op PUT with the current version does not bump it.
    status, same = await raw(
        await coordination.replace_namespaced_lease(
            "retired-pod-gc", NS, after, _preload_content=False
        )
    )
    assert (status, same["metadata"]["resourceVersion"]) == (
        200,
        after["metadata"]["resourceVersion"],
    )


async def test_list_pages_carry_continue_and_remaining_and_stay_consistent(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    for i in range(6):
        emu.create_pod(sandbox_pod(f"{i:012x}"), namespace=NS)
    api = core(library_api)
    status, page1 = await raw(await api.list_namespaced_pod(NS, limit=2, _preload_content=False))
    real1 = sample("list-page1.json")["body"]
    assert status == 200
    assert (page1["kind"], page1["apiVersion"]) == (real1["kind"], real1["apiVersion"])
    assert set(page1["metadata"]) == set(real1["metadata"])
    assert page1["metadata"]["remainingItemCount"] == 4
    assert all("kind" not in item for item in page1["items"])  # like the real server
    list_rv = page1["metadata"]["resourceVersion"]
    # Changes between pages must not show up: the list is consistent at list_rv.
    emu.delete_pod(NS, "space-sbx-000000000005-g1")
    emu.create_pod(sandbox_pod("000000000004a"), namespace=NS)
    emu.set_status(NS, "space-sbx-000000000003-g1", {"phase": "Running"})
    status, page2 = await raw(
        await api.list_namespaced_pod(
            NS, limit=2, _continue=page1["metadata"]["continue"], _preload_content=False
        )
    )
    assert page2["metadata"]["resourceVersion"] == list_rv
    assert page2["metadata"]["remainingItemCount"] == 2
    status, page3 = await raw(
        await api.list_namespaced_pod(
            NS, limit=2, _continue=page2["metadata"]["continue"], _preload_content=False
        )
    )
    assert set(page3["metadata"]) == {"resourceVersion"}
    names = [p["metadata"]["name"] for p in page1["items"] + page2["items"] + page3["items"]]
    assert names == [f"space-sbx-{i:012x}-g1" for i in range(6)]
    phases = {p["metadata"]["name"]: p["status"]["phase"] for p in page2["items"]}
    assert phases["space-sbx-000000000003-g1"] == "Pending"


async def test_an_expired_continue_token_is_the_real_410(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    for i in range(3):
        emu.create_pod(sandbox_pod(f"c{i}"), namespace=NS)
    api = core(library_api)
    _, page1 = await raw(await api.list_namespaced_pod(NS, limit=2, _preload_content=False))
    emu.compact()
    status, body = await raw(
        await api.list_namespaced_pod(
            NS, limit=2, _continue=page1["metadata"]["continue"], _preload_content=False
        )
    )
    expected = sample("list-expired-continue.410.json")
    assert status == expected["http_status"]
    assert set(body["metadata"]) == {"continue"}
    assert {k: v for k, v in body.items() if k != "metadata"} == {
        k: v for k, v in expected["body"].items() if k != "metadata"
    }


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("space.pod-kind=restore", {"b", "c"}),
        ("space.pod-kind==restore", {"b", "c"}),
        ("space.pod-kind!=restore", {"a", "d"}),
        ("space.sandbox-id in (a, c)", {"a", "c"}),
        ("space.sandbox-id notin (a,c)", {"b", "d"}),
        ("app.kubernetes.io/managed-by", {"a", "b", "c"}),
        ("!app.kubernetes.io/managed-by", {"d"}),
        ("app.kubernetes.io/managed-by=space-sandbox,space.pod-kind=create", {"a"}),
    ],
)
async def test_label_selectors_filter_lists(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient, selector: str, expected: set[str]
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("a"), namespace=NS)
    emu.create_pod(sandbox_pod("b", kind="restore"), namespace=NS)
    emu.create_pod(sandbox_pod("c", kind="restore"), namespace=NS)
    emu.create_pod(sandbox_pod("d", managed=False), namespace=NS)
    _, body = await raw(
        await core(library_api).list_namespaced_pod(
            NS, label_selector=selector, _preload_content=False
        )
    )
    assert {p["metadata"]["labels"]["space.sandbox-id"] for p in body["items"]} == expected


async def test_a_bad_selector_is_a_400(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    status, body = await raw(
        await core(library_api).list_namespaced_pod(
            NS, label_selector="a in b", _preload_content=False
        )
    )
    assert (status, body["reason"]) == (400, "BadRequest")


async def read_watch(url: str, **query: str) -> tuple[aiohttp.ClientResponse, list[bytes]]:
    async with aiohttp.ClientSession() as session, session.get(url, params=query) as resp:
        lines = [line async for line in resp.content]
        return resp, lines


async def test_watch_framing_event_order_and_deleted_last_state(
    emulator: RunningEmulator,
) -> None:
    emu = emulator.emulator
    start = str(emu.resource_version)
    emu.create_pod(sandbox_pod("w1"), namespace=NS)
    emu.set_status(NS, "space-sbx-w1-g1", {"phase": "Succeeded"})
    emu.create_pod(sandbox_pod("skip", managed=False), namespace=NS)
    emu.delete_pod(NS, "space-sbx-w1-g1")
    url = f"{emulator.url}/api/v1/namespaces/{NS}/pods"
    resp, lines = await read_watch(
        url,
        watch="true",
        resourceVersion=start,
        timeoutSeconds="1",
        labelSelector="app.kubernetes.io/managed-by=space-sandbox",
    )
    assert resp.status == 200
    assert resp.headers["Transfer-Encoding"] == "chunked"
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)
    events = [json.loads(line) for line in lines]
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]
    assert all(set(e) == {"type", "object"} for e in events)
    assert all((e["object"]["kind"], e["object"]["apiVersion"]) == ("Pod", "v1") for e in events)
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs) and rvs[0] > int(start)
    deleted = events[-1]["object"]
    assert deleted["status"]["phase"] == "Succeeded"
    assert deleted["metadata"]["deletionGracePeriodSeconds"] == 0
    assert deleted["metadata"]["deletionTimestamp"]
    # From a later version only later events come.
    resp, lines = await read_watch(url, watch="1", resourceVersion=str(rvs[1]), timeoutSeconds="1")
    later = [(e["type"], e["object"]["metadata"]["name"]) for e in map(json.loads, lines)]
    assert later == [
        ("ADDED", "space-sbx-skip-g1"),
        ("MODIFIED", "space-sbx-w1-g1"),
        ("DELETED", "space-sbx-w1-g1"),
    ]


async def test_watch_bookmarks_look_like_the_real_ones(emulator: RunningEmulator) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("b1"), namespace=NS)
    _, lines = await read_watch(
        f"{emulator.url}/api/v1/namespaces/{NS}/pods",
        watch="True",
        resourceVersion=str(emu.resource_version),
        allowWatchBookmarks="true",
        timeoutSeconds="1",
    )
    events = [json.loads(line) for line in lines]
    assert len(events) >= 2  # bookmark interval 0.2 s within a 1 s stream
    real = json.loads((WIRE / "watch-stream.jsonl").read_text().splitlines()[-1])
    real["object"]["metadata"]["resourceVersion"] = str(emu.resource_version)
    assert all(e == real for e in events)


@pytest.mark.parametrize("emulator_options", [{"bookmark_interval_s": 60.0}])
async def test_a_watch_gets_a_last_bookmark_before_its_timeout_and_ends_there(
    emulator: RunningEmulator,
) -> None:
    # As a kube-apiserver: a bookmark every 60 s, and one 2 s before timeoutSeconds. A watch of
    # 3 s gets that one alone (not sooner), and ends at its timeout; one that does not allow
    # bookmarks gets none.
    emu = emulator.emulator
    url = f"{emulator.url}/api/v1/namespaces/{NS}/pods"
    loop = asyncio.get_running_loop()
    for allowed in (True, False):
        query = {"watch": "1", "resourceVersion": str(emu.resource_version), "timeoutSeconds": "3"}
        if allowed:
            query["allowWatchBookmarks"] = "true"
        arrivals: list[tuple[float, bytes]] = []
        async with aiohttp.ClientSession() as session:
            started = loop.time()
            async with session.get(url, params=query) as resp:
                async for line in resp.content:
                    arrivals.append((loop.time() - started, line))
            ended = loop.time() - started
        assert ended >= 3.0
        types = [json.loads(line)["type"] for _, line in arrivals]
        if allowed:
            assert types == ["BOOKMARK"]
            assert arrivals[0][0] >= 1.0
        else:
            assert types == []


async def test_watch_from_a_compacted_version_is_one_410_error_event(
    emulator: RunningEmulator,
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("o1"), namespace=NS)
    emu.compact()
    resp, lines = await read_watch(
        f"{emulator.url}/api/v1/namespaces/{NS}/pods", watch="true", resourceVersion="1"
    )
    assert resp.status == 200
    [line] = lines
    event = json.loads(line)
    real = json.loads((WIRE / "watch-too-old.jsonl").read_text())
    assert event["type"] == real["type"] == "ERROR"
    assert re.fullmatch(r"too old resource version: 1 \(\d+\)", event["object"]["message"])
    strip = {k: v for k, v in event["object"].items() if k != "message"}
    assert strip == {k: v for k, v in real["object"].items() if k != "message"}
