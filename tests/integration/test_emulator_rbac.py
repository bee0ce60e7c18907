"""The emulator's RBAC authorization (``devtools/emulator/rbac.py``), with the rendered manifests.

With the policy of ``deploy/overlays/two-namespaces`` installed, the controller's service account
may read and delete pods and create Events in its two sandbox namespaces, and use its one Lease,
and nothing else: a cluster-wide list or watch, a third namespace, a verb or a Lease it was not
granted all answer 403 with a kube-apiserver's Status. Without a policy, everything is allowed.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.rbac import RbacPolicy, attributes
from tests.deploy.rendering import render
from tests.deploy.support import OVERLAYS

pytestmark = pytest.mark.anyio
SA_NAMESPACE = "retired-pod-gc"
SA_NAME = "retired-pod-gc"
USER = f"system:serviceaccount:{SA_NAMESPACE}:{SA_NAME}"


def overlay_policy() -> RbacPolicy:
    return RbacPolicy(
        render(OVERLAYS["two-namespaces"]), namespace=SA_NAMESPACE, service_account=SA_NAME
    )


async def call(
    url: str, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, json=body) as response,
    ):
        text = await response.text()
        if "watch=true" in path:
            return response.status, None  # the stream (or its error Status) is not read here
        return response.status, json.loads(text) if text else None


def event(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": "e1", "namespace": namespace},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "retired-pod-gc",
        "reportingInstance": "test",
        "action": "Delete",
        "reason": "RetiredPodDeleted",
        "type": "Normal",
        "regarding": {"kind": "Pod", "namespace": namespace, "name": "p", "apiVersion": "v1"},
    }


async def test_the_overlay_grants_its_namespaces_and_the_lease_and_nothing_else(
    emulator: RunningEmulator,
) -> None:
    emu = emulator.emulator
    for ns in ("sandboxes-b", "elsewhere", SA_NAMESPACE):
        emu.ensure_namespace(ns)
    emu.rbac = overlay_policy()
    url = emulator.url
    allowed = [
        ("GET", "/api/v1/namespaces/sandboxes/pods"),
        ("GET", "/api/v1/namespaces/sandboxes-b/pods"),
        ("GET", "/api/v1/namespaces/sandboxes-b/pods?watch=true&timeoutSeconds=1"),
        ("GET", "/api/v1/namespaces/sandboxes/pods/absent"),
        ("DELETE", "/api/v1/namespaces/sandboxes-b/pods/absent"),
        ("GET", f"/apis/coordination.k8s.io/v1/namespaces/{SA_NAMESPACE}/leases/retired-pod-gc"),
        ("GET", "/api"),
        ("GET", "/apis"),
        ("GET", "/version"),
    ]
    for method, path in allowed:
        status, _ = await call(url, method, path)
        assert status != 403, (method, path)
    status, _ = await call(
        url, "POST", "/apis/events.k8s.io/v1/namespaces/sandboxes-b/events", event("sandboxes-b")
    )
    assert status == 201
    denied = [
        ("GET", "/api/v1/pods", "list", "at the cluster scope"),
        ("GET", "/api/v1/pods?watch=true", "watch", "at the cluster scope"),
        ("GET", "/api/v1/namespaces/elsewhere/pods", "list", 'in the namespace "elsewhere"'),
        ("DELETE", "/api/v1/namespaces/elsewhere/pods/p", "delete", '"elsewhere"'),
        ("PATCH", "/api/v1/namespaces/sandboxes/pods/p", "patch", '"sandboxes"'),
        ("GET", f"/apis/coordination.k8s.io/v1/namespaces/{SA_NAMESPACE}/leases/other", "get", ""),
        (
            "GET",
            "/apis/coordination.k8s.io/v1/namespaces/sandboxes/leases/retired-pod-gc",
            "get",
            "",
        ),
        ("GET", "/api/v1/namespaces", "list", "at the cluster scope"),
    ]
    for method, path, verb, scope in denied:
        status, body = await call(url, method, path, {} if method == "PATCH" else None)
        assert status == 403, (method, path)
        if body is not None:
            assert (body["kind"], body["reason"], body["code"]) == ("Status", "Forbidden", 403)
            assert f'User "{USER}" cannot {verb} resource' in body["message"], body
            assert scope in body["message"], body
    status, _ = await call(
        url, "POST", "/apis/events.k8s.io/v1/namespaces/elsewhere/events", event("elsewhere")
    )
    assert status == 403
    # The denied write reached no handler: the one Event stored is the allowed one.
    assert [e["metadata"]["namespace"] for e in emu.events.events()] == ["sandboxes-b"]


async def test_without_a_policy_every_request_is_allowed(emulator: RunningEmulator) -> None:
    assert emulator.emulator.rbac is None
    status, _ = await call(emulator.url, "GET", "/api/v1/pods")
    assert status == 200


def test_request_attributes_follow_the_api_server() -> None:
    cases = {
        ("GET", "/api/v1/namespaces/a/pods", ""): ("list", "", "pods", "a", None),
        ("GET", "/api/v1/namespaces/a/pods", "watch"): ("watch", "", "pods", "a", None),
        ("GET", "/api/v1/pods", ""): ("list", "", "pods", None, None),
        ("GET", "/api/v1/namespaces/a/pods/p", ""): ("get", "", "pods", "a", "p"),
        ("PUT", "/api/v1/namespaces/a/pods/p/status", ""): ("update", "", "pods/status", "a", "p"),
        ("DELETE", "/api/v1/namespaces/a/pods", ""): ("deletecollection", "", "pods", "a", None),
        ("GET", "/api/v1/namespaces/a", ""): ("get", "", "namespaces", None, "a"),
        ("POST", "/apis/coordination.k8s.io/v1/namespaces/n/leases", ""): (
            "create",
            "coordination.k8s.io",
            "leases",
            "n",
            None,
        ),
    }
    for (method, path, watch), expected in cases.items():
        a = attributes(method, path, {"watch": "true"} if watch else {})
        assert a is not None
        assert (a.verb, a.group, a.resource, a.namespace, a.name) == expected, path
    for path in ("/api", "/apis", "/version", "/apis/events.k8s.io/v1"):
        assert attributes("GET", path, {}) is None
