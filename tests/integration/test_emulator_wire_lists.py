"""Emulator fidelity for streaming lists, list options (resourceVersion, resourceVersionMatch) and
name validation, compared with the real kube-apiserver responses in tests/fixtures/wire."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.watch import WatchListSupport
from tests.integration.test_emulator_wire import WIRE, read_watch, sample
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
STREAM = {
    "watch": "1",
    "sendInitialEvents": "true",
    "resourceVersionMatch": "NotOlderThan",
    "allowWatchBookmarks": "true",
    "timeoutSeconds": "1",
}


def pods_url(running: RunningEmulator) -> str:
    return f"{running.url}/api/v1/namespaces/{NS}/pods"


async def get_json(url: str, **query: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url, params=query) as resp:
        return resp.status, await resp.json()


def seed(running: RunningEmulator) -> list[str]:
    names = []
    for sandbox in ("0000000000a0", "0000000000a1", "0000000000a2"):
        pod = running.emulator.create_pod(sandbox_pod(sandbox), namespace=NS)
        names.append(pod["metadata"]["name"])
    return names


async def test_a_streaming_list_is_added_events_then_the_initial_events_end_bookmark(
    emulator: RunningEmulator,
) -> None:
    names = seed(emulator)
    resp, lines = await read_watch(pods_url(emulator), **STREAM)
    assert resp.status == 200
    events = [json.loads(line) for line in lines]
    real = [json.loads(line) for line in (WIRE / "watchlist-stream.jsonl").read_text().splitlines()]
    assert (
        [e["type"] for e in events[:4]] == [e["type"] for e in real] == ["ADDED"] * 3 + ["BOOKMARK"]
    )
    assert [e["object"]["metadata"]["name"] for e in events[:3]] == names
    real_end = real[-1]
    real_end["object"]["metadata"]["resourceVersion"] = str(emulator.emulator.resource_version)
    assert events[3] == real_end
    # Then an ordinary watch: only plain bookmarks while nothing changes.
    assert all(e["type"] == "BOOKMARK" for e in events[4:])
    assert all("annotations" not in e["object"]["metadata"] for e in events[4:])


async def test_a_streaming_list_goes_on_as_a_watch_with_the_changes_after_its_bookmark(
    emulator: RunningEmulator,
) -> None:
    seed(emulator)
    emu = emulator.emulator
    async with (
        aiohttp.ClientSession() as session,
        session.get(pods_url(emulator), params={**STREAM, "timeoutSeconds": "2"}) as resp,
    ):
        seen: list[dict[str, Any]] = []
        async for line in resp.content:
            seen.append(json.loads(line))
            if seen[-1]["type"] == "BOOKMARK" and len(seen) == 4:
                emu.delete_pod(NS, "space-sbx-0000000000a1-g1")
            if len(seen) > 4 and seen[-1]["type"] != "BOOKMARK":
                break
    # A node-bound Pending pod's delete is graceful: MODIFIED with a deletionTimestamp.
    assert seen[-1]["type"] == "MODIFIED"
    assert seen[-1]["object"]["metadata"]["name"] == "space-sbx-0000000000a1-g1"
    assert seen[-1]["object"]["metadata"]["deletionTimestamp"]
    assert int(seen[-1]["object"]["metadata"]["resourceVersion"]) > int(
        seen[3]["object"]["metadata"]["resourceVersion"]
    )


async def test_streaming_list_option_errors_are_the_real_422s(emulator: RunningEmulator) -> None:
    seed(emulator)
    query = {k: v for k, v in STREAM.items() if k != "resourceVersionMatch"}
    expected = sample("watchlist-without-rvmatch.json")
    assert await get_json(pods_url(emulator), **query) == (
        expected["http_status"],
        expected["body"],
    )
    # Without bookmarks the server still streams (do not rely on it): the first event matches.
    query = {k: v for k, v in STREAM.items() if k != "allowWatchBookmarks"}
    resp, lines = await read_watch(pods_url(emulator), **query)
    real = sample("watchlist-without-bookmarks.json")
    first = json.loads(lines[0])
    assert (resp.status, first["type"]) == (real["http_status"], real["body"]["type"])
    assert all(json.loads(line)["type"] == "ADDED" for line in lines)


async def test_a_server_without_streaming_lists_rejects_or_ignores_them(
    emulator: RunningEmulator,
) -> None:
    names = seed(emulator)
    emu = emulator.emulator
    emu.watch_list = WatchListSupport.REJECTED
    status, body = await get_json(pods_url(emulator), **STREAM)
    assert (status, body["reason"]) == (422, "Invalid")
    assert [c["field"] for c in body["details"]["causes"]] == ["sendInitialEvents"]
    assert "WatchList feature gate" in body["message"]

    emu.watch_list = WatchListSupport.IGNORED
    resp, lines = await read_watch(pods_url(emulator), **STREAM)
    events = [json.loads(line) for line in lines]
    assert resp.status == 200
    assert [e["object"]["metadata"]["name"] for e in events[:3]] == names
    assert events[3:] and all(e["type"] == "BOOKMARK" for e in events[3:])
    assert all("annotations" not in e["object"]["metadata"] for e in events[3:])


async def test_list_option_errors_are_the_real_422_and_410(emulator: RunningEmulator) -> None:
    seed(emulator)
    emu = emulator.emulator
    expected = sample("list-rvmatch-without-rv.json")
    assert await get_json(pods_url(emulator), resourceVersionMatch="NotOlderThan") == (
        expected["http_status"],
        expected["body"],
    )
    old = str(emu.resource_version - 1)
    emu.compact()
    expected = sample("list-exact-too-old.410.json")
    assert await get_json(
        pods_url(emulator), resourceVersion=old, resourceVersionMatch="Exact"
    ) == (
        expected["http_status"],
        expected["body"],
    )
    status, body = await get_json(
        pods_url(emulator),
        resourceVersion=str(emu.resource_version + 5),
        resourceVersionMatch="NotOlderThan",
    )
    assert (status, body["reason"], body["details"]["causes"][0]["reason"]) == (
        504,
        "Timeout",
        "ResourceVersionTooLarge",
    )


@pytest.mark.parametrize(
    ("sample_name", "query"),
    [
        ("list-rv0.json", {"resourceVersion": "0", "limit": "1"}),
        ("list-rvmatch-notolderthan.json", {"resourceVersionMatch": "NotOlderThan"}),
    ],
)
async def test_lists_from_the_watch_cache_are_whole_and_at_the_newest_version(
    emulator: RunningEmulator, sample_name: str, query: dict[str, str]
) -> None:
    names = seed(emulator)
    emu = emulator.emulator
    if "resourceVersionMatch" in query:
        query = {**query, "resourceVersion": str(emu.resource_version - 2)}
    status, body = await get_json(pods_url(emulator), **query)
    real = sample(sample_name)
    assert status == real["http_status"] == 200
    assert (body["kind"], body["apiVersion"]) == (real["body"]["kind"], real["body"]["apiVersion"])
    assert set(body["metadata"]) == set(real["body"]["metadata"]) == {"resourceVersion"}
    assert body["metadata"]["resourceVersion"] == str(emu.resource_version)
    assert [i["metadata"]["name"] for i in body["items"]] == names  # limit ignored


async def test_an_exact_list_shows_the_state_at_that_version_until_it_is_compacted(
    emulator: RunningEmulator,
) -> None:
    emu = emulator.emulator
    first = emu.create_pod(sandbox_pod("e1"), namespace=NS)
    emu.create_pod(sandbox_pod("e2"), namespace=NS)
    at = str(emu.resource_version)
    emu.set_status(NS, "space-sbx-e1-g1", {"phase": "Running"})
    emu.delete_pod(NS, "space-sbx-e2-g1")
    emu.create_pod(sandbox_pod("e3"), namespace=NS)
    emu.set_status(NS, "space-sbx-e1-g1", {"phase": "Succeeded"})
    status, body = await get_json(
        pods_url(emulator), resourceVersion=at, resourceVersionMatch="Exact"
    )
    assert status == 200
    assert body["metadata"] == {"resourceVersion": at}
    state = {i["metadata"]["name"]: i for i in body["items"]}
    assert sorted(state) == ["space-sbx-e1-g1", "space-sbx-e2-g1"]
    e1 = state["space-sbx-e1-g1"]
    assert e1["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert e1["status"] == {"phase": "Pending"}
    emu.compact()
    expected = sample("list-exact-too-old.410.json")
    assert await get_json(pods_url(emulator), resourceVersion=at, resourceVersionMatch="Exact") == (
        expected["http_status"],
        expected["body"],
    )


async def test_a_pod_name_that_is_not_a_lowercase_rfc1123_subdomain_is_a_422(
    emulator: RunningEmulator,
) -> None:
    pod = sandbox_pod("x")
    pod["metadata"]["name"] = "Space_Bad"
    async with (
        aiohttp.ClientSession() as session,
        session.post(pods_url(emulator), json=pod) as resp,
    ):
        status, body = resp.status, await resp.json()
    assert (status, body["reason"], body["code"]) == (422, "Invalid", 422)
    assert body["message"].startswith('Pod "Space_Bad" is invalid: metadata.name: Invalid value')
    assert "a lowercase RFC 1123 subdomain" in body["message"]
    assert body["details"]["causes"][0]["field"] == "metadata.name"
    assert emulator.emulator.get_pod(NS, "Space_Bad") is None
    for good in ("space-sbx-0a-g1", "a.b-c"):
        pod["metadata"]["name"] = good
        emulator.emulator.create_pod(pod, namespace=NS)
        assert emulator.emulator.get_pod(NS, good) is not None
