"""The emulator answers as a kube-apiserver does to a token it does not accept (401) and to a
user beyond its priority level's seats (429), with the real client over HTTP.

The 401: ``apierrors.NewUnauthorized("Unauthorized")`` as JSON (``filters.Unauthorized``). The
429: the APF filter's ``tooManyRequests`` (Go's ``http.Error``: plain text) with ``Retry-After``
and the flow-schema and priority-level UID headers. Seats are filled provably (``hold``), never
by racing the clock.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio.client.exceptions import ApiException

from devtools.emulator import RunningEmulator
from devtools.emulator.__main__ import build_emulator, parse_args
from devtools.emulator.auth import DEFAULT_USER, TokenAuth
from devtools.emulator.flowcontrol import (
    FLOW_SCHEMA_UID_HEADER,
    PRIORITY_LEVEL_UID_HEADER,
    FlowControl,
)
from devtools.emulator.rbac import RbacPolicy
from devtools.emulator.statuses import PODS
from tests.kubefixtures import SANDBOX_NAMESPACE, eventually, sandbox_pod

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
UNAUTHORIZED = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": "Unauthorized",
    "reason": "Unauthorized",
    "code": 401,
}
OTHER_USER = "system:serviceaccount:other:other"


def client(url: str, token: str | None) -> k8s_client.ApiClient:
    configuration = k8s_client.Configuration(host=url)
    if token is not None:
        configuration.api_key["BearerToken"] = f"Bearer {token}"
    return k8s_client.ApiClient(configuration)


@pytest.fixture
async def clients() -> AsyncIterator[list[k8s_client.ApiClient]]:
    """ApiClients a test made (append them), closed at the end."""
    made: list[k8s_client.ApiClient] = []
    try:
        yield made
    finally:
        for api in made:
            await api.close()


async def read_ns(api: k8s_client.ApiClient) -> str:
    ns = await k8s_client.CoreV1Api(api).read_namespace(NS)
    name: str = ns.metadata.name
    return name


async def admin(url: str, method: str, path: str, body: Any = None) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"{url}/_emulator/{path}", json=body) as response,
    ):
        assert response.status == 200
        return await response.json()


# ---------------------------------------------------------------------- 401


async def test_a_revoked_token_gets_the_real_401_and_a_new_one_gets_through(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    auth = emulator.emulator.auth
    auth.enabled = True
    old = auth.issue(DEFAULT_USER)
    api = client(emulator.url, old)
    clients.append(api)
    assert await read_ns(api) == NS
    assert auth.revoke(old)
    with pytest.raises(ApiException) as caught:
        await read_ns(api)
    assert caught.value.status == 401
    assert caught.value.headers["Content-Type"] == "application/json"
    assert json.loads(caught.value.body) == UNAUTHORIZED
    assert auth.unauthorized == 1
    api.configuration.api_key["BearerToken"] = f"Bearer {auth.issue(DEFAULT_USER)}"
    assert await read_ns(api) == NS
    assert auth.authenticated[DEFAULT_USER] == 2


async def test_no_token_or_an_unknown_one_gets_401_everywhere_but_the_admin_paths(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    await admin(emulator.url, "POST", "auth", {"enabled": True})
    for token in (None, "never-issued"):
        api = client(emulator.url, token)
        clients.append(api)
        with pytest.raises(ApiException) as caught:
            await read_ns(api)
        assert (caught.value.status, json.loads(caught.value.body)) == (401, UNAUTHORIZED)
        # Authentication comes before everything: discovery too.
        with pytest.raises(ApiException) as caught:
            await k8s_client.VersionApi(api).get_code()
        assert caught.value.status == 401
    state = await admin(emulator.url, "GET", "auth")
    assert (state["enabled"], state["unauthorized"]) == (True, 4)
    # Off again: the same tokenless client is let through.
    await admin(emulator.url, "POST", "auth", {"enabled": False})
    assert await read_ns(clients[0]) == NS


async def test_tokens_issued_and_revoked_over_the_admin_endpoints(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    await admin(emulator.url, "POST", "auth", {"enabled": True})
    issued = await admin(emulator.url, "POST", "tokens", {"user": OTHER_USER})
    assert issued["user"] == OTHER_USER
    api = client(emulator.url, issued["token"])
    clients.append(api)
    assert await read_ns(api) == NS
    assert emulator.emulator.auth.authenticated[OTHER_USER] == 1
    assert await admin(emulator.url, "POST", "tokens/revoke", {"token": issued["token"]}) == {
        "revoked": True
    }
    with pytest.raises(ApiException) as caught:
        await read_ns(api)
    assert caught.value.status == 401


async def test_the_token_file_holds_the_one_valid_token_so_rewriting_it_revokes_the_old(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first-token\n")
    emulator.emulator.auth = TokenAuth(token_file=token_file)
    api = client(emulator.url, "first-token")
    clients.append(api)
    assert await read_ns(api) == NS
    token_file.write_text("second-token\n")
    with pytest.raises(ApiException) as caught:
        await read_ns(api)
    assert (caught.value.status, json.loads(caught.value.body)) == (401, UNAUTHORIZED)
    api.configuration.api_key["BearerToken"] = "Bearer second-token"
    assert await read_ns(api) == NS
    assert emulator.emulator.auth.authenticated[DEFAULT_USER] == 2


async def test_the_token_user_is_the_user_rbac_judges(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    emu = emulator.emulator
    emu.rbac = RbacPolicy(
        [
            {
                "kind": "Role",
                "metadata": {"namespace": NS, "name": "reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            },
            {
                "kind": "RoleBinding",
                "metadata": {"namespace": NS, "name": "reader"},
                "roleRef": {"kind": "Role", "name": "reader"},
                "subjects": [
                    {
                        "kind": "ServiceAccount",
                        "name": "retired-pod-gc",
                        "namespace": "retired-pod-gc",
                    }
                ],
            },
        ],
        namespace="retired-pod-gc",
        service_account="retired-pod-gc",
    )
    emu.auth.enabled = True
    granted = client(emulator.url, emu.auth.issue(DEFAULT_USER))
    other = client(emulator.url, emu.auth.issue(OTHER_USER))
    clients.extend([granted, other])
    pods = await k8s_client.CoreV1Api(granted).list_namespaced_pod(NS)
    assert pods.items == []
    with pytest.raises(ApiException) as caught:
        await k8s_client.CoreV1Api(other).list_namespaced_pod(NS)
    assert caught.value.status == 403
    assert f'User "{OTHER_USER}" cannot list' in json.loads(caught.value.body)["message"]


# ---------------------------------------------------------------------- 429


async def fire_reads(apis: list[k8s_client.ApiClient]) -> list[asyncio.Task[Any]]:
    return [
        asyncio.create_task(k8s_client.CoreV1Api(api).read_namespace(NS, _preload_content=False))
        for api in apis
    ]


async def outcomes(tasks: list[asyncio.Task[Any]]) -> list[tuple[int, dict[str, str], str]]:
    """(status, headers, body) of each request, in order."""
    out = []
    for task in tasks:
        try:
            response = await task
        except ApiException as exc:
            out.append((exc.status, dict(exc.headers), exc.body.decode()))
            continue
        body = await response.read()
        out.append((response.status, dict(response.headers), body.decode()))
        response.release()
    return out


async def test_n_plus_one_concurrent_requests_of_one_user_get_exactly_one_429(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    emu = emulator.emulator
    emu.flow_control = flow = FlowControl(seats=2)
    user = "system:anonymous"  # authentication is off
    flow.hold()
    apis = [client(emulator.url, None) for _ in range(3)]
    clients.extend(apis)
    tasks = await fire_reads(apis)
    # Two requests sit in the two seats, provably, and the third was already turned away.
    await eventually(lambda: flow.in_flight[user] == 2 and flow.rejected[user] == 1)
    flow.release()
    results = await outcomes(tasks)
    assert sorted(status for status, _, _ in results) == [200, 200, 429]
    _, headers, body = next(r for r in results if r[0] == 429)
    assert headers["Retry-After"] == "1"
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert body == "Too many requests, please try again later.\n"
    served = [h for status, h, _ in results if status == 200]
    # The classification headers are the same on served and rejected requests of the level.
    for h in [headers, *served]:
        assert h[FLOW_SCHEMA_UID_HEADER] == served[0][FLOW_SCHEMA_UID_HEADER]
        assert h[PRIORITY_LEVEL_UID_HEADER] == served[0][PRIORITY_LEVEL_UID_HEADER]
    assert (flow.served[user], flow.rejected[user], flow.peak_in_flight[user]) == (2, 1, 2)
    # Answered requests gave their seats back: one after another, requests are all served.
    assert flow.in_flight[user] == 0
    for api in apis:
        assert await read_ns(api) == NS
    assert (flow.served[user], flow.rejected[user]) == (5, 1)


async def test_watches_take_no_seat(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    emu = emulator.emulator
    emu.flow_control = flow = FlowControl(seats=1)
    user = "system:anonymous"
    watcher = client(emulator.url, None)
    clients.append(watcher)
    watch = await k8s_client.CoreV1Api(watcher).list_namespaced_pod(
        NS, watch=True, allow_watch_bookmarks=True, _preload_content=False
    )
    try:
        assert watch.status == 200
        assert await watch.content.readline()  # a bookmark: the watch is served, seatless
        assert emu.open_watch_count() == 1
        flow.hold()
        apis = [client(emulator.url, None) for _ in range(2)]
        clients.extend(apis)
        tasks = await fire_reads(apis)
        await eventually(lambda: flow.in_flight[user] == 1 and flow.rejected[user] == 1)
        flow.release()
        assert sorted(status for status, _, _ in await outcomes(tasks)) == [200, 429]
    finally:
        watch.release()


async def test_each_user_has_its_own_seats(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    emu = emulator.emulator
    emu.auth.enabled = True
    emu.flow_control = flow = FlowControl(seats=1, users=[DEFAULT_USER, OTHER_USER])
    flow.hold()
    apis = [client(emulator.url, emu.auth.issue(u)) for u in (DEFAULT_USER, OTHER_USER)]
    clients.extend(apis)
    tasks = await fire_reads(apis)
    await eventually(lambda: flow.in_flight[DEFAULT_USER] == 1 and flow.in_flight[OTHER_USER] == 1)
    third = client(emulator.url, emu.auth.issue(OTHER_USER))
    clients.append(third)
    tasks += await fire_reads([third])
    await eventually(lambda: flow.rejected[OTHER_USER] == 1)
    flow.release()
    assert [status for status, _, _ in await outcomes(tasks)] == [200, 200, 429]
    assert flow.rejected[DEFAULT_USER] == 0


async def test_flow_control_switched_on_a_running_emulator_with_its_retry_after(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    state = await admin(emulator.url, "POST", "flow-control", {"seats": 1, "retry_after_s": 3})
    assert (state["seats"], state["retry_after_s"], state["rejected"]) == (1, 3, {})
    flow = emulator.emulator.flow_control
    assert flow is not None
    flow.hold()
    apis = [client(emulator.url, None) for _ in range(2)]
    clients.extend(apis)
    tasks = await fire_reads(apis)
    await eventually(lambda: flow.rejected["system:anonymous"] == 1)
    flow.release()
    results = await outcomes(tasks)
    assert [h["Retry-After"] for status, h, _ in results if status == 429] == ["3"]
    state = await admin(emulator.url, "GET", "flow-control")
    assert (state["served"], state["rejected"]) == (
        {"system:anonymous": 1},
        {"system:anonymous": 1},
    )
    assert await admin(emulator.url, "POST", "flow-control", {"seats": None}) == {"seats": None}
    assert emulator.emulator.flow_control is None


# ---------------------------------------------------------------------- the command line


def test_the_command_line_sets_every_mode(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    emu = build_emulator(
        parse_args(
            [
                "--bookmark-interval-s",
                "0.5",
                "--token-file",
                str(token_file),
                "--token",
                "t1",
                "--apf-seats",
                "2",
                "--apf-retry-after-s",
                "4",
                "--apf-seat-time-s",
                "0.02",
                "--apf-user",
                DEFAULT_USER,
            ]
        )
    )
    assert emu.bookmark_interval_s == 0.5
    assert emu.auth.enabled and emu.auth.token_file == token_file
    assert emu.auth.user_of("Bearer t1") == DEFAULT_USER
    flow = emu.flow_control
    assert flow is not None
    assert (flow.seats, flow.retry_after_s, flow.seat_time_s, flow.users) == (
        2,
        4,
        0.02,
        frozenset({DEFAULT_USER}),
    )
    plain = build_emulator(parse_args([]))
    assert (plain.bookmark_interval_s, plain.auth.enabled, plain.flow_control) == (
        60.0,
        False,
        None,
    )


# ---------------------------------------------------------------------- bookmarks


@pytest.mark.parametrize("emulator_options", [{"bookmark_interval_s": 0.1}])
async def test_a_watch_that_asked_for_bookmarks_gets_one_every_interval(
    emulator: RunningEmulator, clients: list[k8s_client.ApiClient]
) -> None:
    api = client(emulator.url, None)
    clients.append(api)
    core = k8s_client.CoreV1Api(api)
    asked = await core.list_namespaced_pod(
        NS, watch=True, allow_watch_bookmarks=True, _preload_content=False
    )
    plain = await core.list_namespaced_pod(NS, watch=True, _preload_content=False)
    try:
        lines = [json.loads(await asked.content.readline()) for _ in range(3)]
        assert [line["type"] for line in lines] == ["BOOKMARK"] * 3
        # Three intervals have passed: the watch that did not ask got no BOOKMARK meanwhile,
        # its first line is the event that came after them.
        emulator.emulator.create(PODS, NS, sandbox_pod("after-bookmarks"))
        first = json.loads(await plain.content.readline())
        assert (first["type"], first["object"]["metadata"]["name"]) == (
            "ADDED",
            "space-sbx-after-bookmarks-g1",
        )
    finally:
        asked.release()
        plain.release()
