"""API discovery: the emulator's documents compared with a real server's (tests/fixtures/wire),
restricted to what the emulator serves, and a client that discovers before it acts."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.dynamic import DynamicClient

from devtools.emulator import RunningEmulator, discovery
from tests.integration.test_emulator_wire import sample
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
AGGREGATED_ACCEPT = f"{discovery.AGGREGATED},application/json"


async def fetch(running: RunningEmulator, path: str, accept: str = "application/json") -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.get(running.url + path, headers={"Accept": accept}) as resp,
    ):
        return resp.status, resp.headers["Content-Type"], await resp.json(content_type=None)


def served_names(group_version: str) -> set[str]:
    names = set()
    for r in discovery.SERVED:
        if r.group_version == group_version:
            names.add(r.res.plural)
            names.update(f"{r.res.plural}/{sub}" for sub, _ in r.subresources)
    return names


async def test_version_and_core_discovery_have_the_real_shape(emulator: RunningEmulator) -> None:
    status, ctype, body = await fetch(emulator, "/version")
    assert (status, ctype) == (200, "application/json")
    assert list(body) == list(sample("discovery-version.json")["body"])

    status, _, body = await fetch(emulator, "/api")
    real = sample("discovery-api.json")["body"]
    host = emulator.url.removeprefix("http://")
    real["serverAddressByClientCIDRs"][0]["serverAddress"] = host
    assert (status, body) == (200, real)

    status, _, body = await fetch(emulator, "/api/v1")
    real = sample("discovery-api-v1.json")["body"]
    assert status == 200
    assert {k: v for k, v in body.items() if k != "resources"} == {
        k: v for k, v in real.items() if k != "resources"
    }
    expected = [r for r in real["resources"] if r["name"] in served_names("v1")]
    assert body["resources"] == expected
    assert {r["name"] for r in body["resources"]} == served_names("v1")


async def test_group_discovery_has_the_real_shape(emulator: RunningEmulator) -> None:
    status, _, body = await fetch(emulator, "/apis")
    real = sample("discovery-apis.json")["body"]
    assert status == 200
    assert (body["kind"], body["apiVersion"]) == (real["kind"], real["apiVersion"])
    groups = {g["name"] for g in body["groups"]}
    assert groups == set(discovery.groups()) >= {"coordination.k8s.io"}
    order = [g["name"] for g in real["groups"]]
    assert [g for g in real["groups"] if g["name"] in groups] == sorted(
        body["groups"], key=lambda g: order.index(g["name"])
    )

    status, _, body = await fetch(emulator, "/apis/coordination.k8s.io/v1")
    assert (status, body) == (200, sample("discovery-apis-coordination-v1.json")["body"])
    status, _, body = await fetch(emulator, "/apis/coordination.k8s.io")
    assert (status, body["kind"], body["preferredVersion"]["version"]) == (200, "APIGroup", "v1")
    status, _, body = await fetch(emulator, "/apis/apps/v1")
    assert (status, body["reason"]) == (404, "NotFound")


async def test_aggregated_discovery_is_served_when_the_client_asks_for_it(
    emulator: RunningEmulator,
) -> None:
    status, ctype, body = await fetch(emulator, "/api", AGGREGATED_ACCEPT)
    real = sample("discovery-aggregated-api.json")["body"]
    assert (status, ctype) == (200, discovery.AGGREGATED)
    assert {k: v for k, v in body.items() if k != "items"} == {
        k: v for k, v in real.items() if k != "items"
    }
    [version] = body["items"][0]["versions"]
    real_version = real["items"][0]["versions"][0]
    assert (version["version"], version["freshness"]) == ("v1", real_version["freshness"])
    real_by_name = {r["resource"]: r for r in real_version["resources"]}
    for resource in version["resources"]:
        real_resource = dict(real_by_name[resource["resource"]])
        real_resource["subresources"] = [
            s
            for s in real_resource.get("subresources", [])
            if f"{resource['resource']}/{s['subresource']}" in served_names("v1")
        ]
        assert resource == real_resource

    status, ctype, body = await fetch(emulator, "/apis", AGGREGATED_ACCEPT)
    real = sample("discovery-aggregated-apis.json")["body"]
    assert (status, ctype) == (200, discovery.AGGREGATED)
    real_items = {i["metadata"]["name"]: i for i in real["items"]}
    assert [i["metadata"]["name"] for i in body["items"]] == discovery.groups()
    for item in body["items"]:
        assert _without_verbs(item) == _without_verbs(real_items[item["metadata"]["name"]])
        # A resource may announce fewer verbs than a real server (only those it serves).
        real_verbs = _verbs(real_items[item["metadata"]["name"]])
        assert all(set(v) <= set(real_verbs[r]) for r, v in _verbs(item).items())
    served = {i["metadata"]["name"]: i for i in body["items"]}
    assert _verbs(served["coordination.k8s.io"]) == _verbs(real_items["coordination.k8s.io"])


def _resources(group_item: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for v in group_item["versions"] for r in v["resources"]]


def _verbs(group_item: dict[str, Any]) -> dict[str, list[str]]:
    return {r["resource"]: r["verbs"] for r in _resources(group_item)}


def _without_verbs(group_item: dict[str, Any]) -> dict[str, Any]:
    copy = json.loads(json.dumps(group_item))
    for version in copy["versions"]:
        for resource in version["resources"]:
            resource.pop("verbs")
    return copy


async def test_a_discovering_dynamic_client_lists_pods_and_writes_leases(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emulator.emulator.create_pod(sandbox_pod("dyn"), namespace=NS)
    client = await DynamicClient(library_api)
    pods = await client.resources.get(api_version="v1", kind="Pod")
    listed = await client.get(pods, namespace=NS)
    assert [p.metadata.name for p in listed.items] == ["space-sbx-dyn-g1"]
    leases = await client.resources.get(api_version="coordination.k8s.io/v1", kind="Lease")
    body = {"metadata": {"name": "dyn-lease"}, "spec": {"holderIdentity": "me"}}
    await client.create(leases, body=body, namespace=NS)
    lease = await client.get(leases, name="dyn-lease", namespace=NS)
    assert lease.spec.holderIdentity == "me"
    requested = [r.path for r in emulator.emulator.requests]
    first_use = requested.index(f"/api/v1/namespaces/{NS}/pods")
    # It discovered before acting (without /apis and /api/v1 it would have stopped there).
    assert {"/apis", "/api/v1", "/apis/coordination.k8s.io/v1"} <= set(requested[:first_use])
