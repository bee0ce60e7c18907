"""The emulator's Events against the real kube-apiserver responses (tests/fixtures/wire), through
the real ``kubernetes_asyncio`` client: ``events.k8s.io/v1`` create, get and list, the core/v1
list of the same objects, the 422s, injected faults and the audit log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s_client

from devtools.emulator import RunningEmulator
from tests.kubefixtures import SANDBOX_NAMESPACE

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
WIRE = Path(__file__).parent.parent / "fixtures" / "wire"
SERVER_FILLED = ("uid", "resourceVersion", "creationTimestamp", "managedFields")


def sample(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((WIRE / name).read_text())
    return data


def request_from(response_body: dict[str, Any]) -> dict[str, Any]:
    """What a client sent to get ``response_body``: no server-filled or defaulted fields."""
    body = {k: v for k, v in response_body.items() if not k.startswith("deprecated")}
    meta = response_body["metadata"]
    body["metadata"] = {"name": meta["name"], "namespace": meta["namespace"]}
    return body


def without_server_fields(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k not in SERVER_FILLED}
    return {**obj, "metadata": meta}


async def call(request: Any) -> tuple[int, Any]:
    response = await request
    try:
        body = await response.read()
    finally:
        response.release()
    return response.status, json.loads(body)


async def create(api: k8s_client.ApiClient, body: dict[str, Any]) -> tuple[int, Any]:
    return await call(
        k8s_client.EventsV1Api(api).create_namespaced_event(NS, body, _preload_content=False)
    )


async def test_create_answers_the_real_201_bodies_with_and_without_series(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    for name in ("event-create.201.json", "event-create-series.json"):
        expected = sample(name)
        status, body = await create(library_api, request_from(expected["body"]))
        assert status == expected["http_status"] == 201
        assert without_server_fields(body) == without_server_fields(expected["body"])
        assert body["metadata"]["uid"] and int(body["metadata"]["resourceVersion"]) > 0
        status, got = await call(
            k8s_client.EventsV1Api(library_api).read_namespaced_event(
                body["metadata"]["name"], NS, _preload_content=False
            )
        )
        assert (status, got) == (200, body)


async def test_core_v1_list_shows_the_same_events_in_the_legacy_shape(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    for name in ("event-create.201.json", "event-create-series.json"):
        status, _ = await create(library_api, request_from(sample(name)["body"]))
        assert status == 201
    expected = sample("events-core-v1-list.json")["body"]
    status, body = await call(
        k8s_client.CoreV1Api(library_api).list_namespaced_event(NS, _preload_content=False)
    )
    assert status == 200
    assert (body["kind"], body["apiVersion"]) == (expected["kind"], expected["apiVersion"])
    assert [without_server_fields(i) for i in body["items"]] == [
        without_server_fields(i) for i in expected["items"]
    ]


async def test_lists_filter_by_field_selector_as_kubectl_sends_it(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    base = request_from(sample("event-create.201.json")["body"])
    other = json.loads(json.dumps(base))
    other["metadata"]["name"] = "space-sbx-0000000000b0-g1.18eccb7e70eb139b"
    other["regarding"].update(name="space-sbx-0000000000b0-g1", uid="another-uid")
    other["reason"] = "RetiredPodWouldDelete"
    for body in (base, other):
        assert (await create(library_api, body))[0] == 201
    core = k8s_client.CoreV1Api(library_api)
    events = k8s_client.EventsV1Api(library_api)
    cases: list[tuple[Any, str, list[str]]] = [
        (core.list_namespaced_event, "reason=RetiredPodDeleted", [base["metadata"]["name"]]),
        (core.list_namespaced_event, "involvedObject.uid=another-uid", [other["metadata"]["name"]]),
        (events.list_namespaced_event, "regarding.uid!=another-uid", [base["metadata"]["name"]]),
        (events.list_namespaced_event, "", [base["metadata"]["name"], other["metadata"]["name"]]),
    ]
    for lister, selector, names in cases:
        status, body = await call(lister(NS, field_selector=selector, _preload_content=False))
        assert status == 200
        assert [i["metadata"]["name"] for i in body["items"]] == names, selector


async def test_an_event_without_event_time_gets_the_real_422(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    expected = sample("event-create-invalid.422.json")
    body = request_from(sample("event-create.201.json")["body"])
    body["metadata"]["name"] = expected["body"]["details"]["name"]
    del body["eventTime"]
    assert await create(library_api, body) == (expected["http_status"], expected["body"])
    assert emulator.emulator.events.events() == []


async def test_a_generate_name_ending_in_a_dot_and_other_invalid_fields_are_rejected(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    good = request_from(sample("event-create.201.json")["body"])
    generate = json.loads(json.dumps(good))
    generate["metadata"] = {"generateName": "space-sbx-0000000000a0-g1."}
    bad_type = {**good, "type": "Fatal"}
    long_note = {**good, "note": "x" * 1025}
    no_reason = {k: v for k, v in good.items() if k != "reason"}
    for body, field in (
        (generate, "metadata.generateName"),
        (bad_type, "type"),
        (long_note, "note"),
        (no_reason, "reason"),
    ):
        status, answer = await create(library_api, body)
        assert status == 422, field
        assert answer["reason"] == "Invalid"
        assert [c["field"] for c in answer["details"]["causes"]] == [field]
    assert emulator.emulator.events.events() == []


async def test_injected_faults_and_latency_apply_and_the_audit_log_records_the_posts(
    emulator: RunningEmulator, library_api: k8s_client.ApiClient
) -> None:
    emu = emulator.emulator
    body = request_from(sample("event-create.201.json")["body"])
    emu.fail_next(1, code=403, method="POST", path_contains="/events")
    emu.fail_next(1, code=500, method="POST", path_contains="/events")
    status, answer = await create(library_api, body)
    assert (status, answer["reason"]) == (403, "Forbidden")
    status, answer = await create(library_api, body)
    assert (status, answer["reason"]) == (500, "InternalError")
    emu.add_latency(30.0, method="POST", path_contains="/events", count=1)
    with pytest.raises(TimeoutError):
        await create_with_timeout(library_api, body, timeout_s=0.3)
    status, _ = await create(library_api, body)
    assert status == 201
    posts = emu.audit_log(method="POST", path_contains="/events")
    assert [a.status for a in posts][:2] == [403, 500]
    assert posts[-1].status == 201
    assert posts[-1].body["metadata"]["name"] == body["metadata"]["name"]
    assert len(emu.events.events()) == 1


async def create_with_timeout(
    api: k8s_client.ApiClient, body: dict[str, Any], *, timeout_s: float
) -> tuple[int, Any]:
    return await call(
        k8s_client.EventsV1Api(api).create_namespaced_event(
            NS,
            body,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=timeout_s),
        )
    )
