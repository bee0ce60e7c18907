"""The transport's connections against the emulator behind a TCP proxy (``tests/kubeproxy.py``):
black-holed pooled connections cost one request its timeout, then the pool is new and the next
requests succeed at once (the pod client's, and the whole service's reaping a pod retired behind
the black hole); watches never reuse a connection."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import cast

import aiohttp
import anyio
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.flowcontrol import FlowControl
from devtools.emulator.sandboxpods import Shape
from service.config import KubeSettings
from service.kit.errors import Unavailable
from service.kube.api import new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from tests.integration.test_engine_safety import (
    create_pod,
    deletes,
    eventually,
    outcome,
    running_service,
    sample,
    seed_row,
)
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod
from tests.kubeproxy import KubeProxy, proxied
from tests.pgfixtures import metric

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
POD = "space-sbx-p1-g1"


@pytest.fixture
def emulator_options() -> dict[str, object]:
    """Seats enough for everything (the flow control is here for its ``hold``)."""
    return {
        "bookmark_interval_s": 0.2,
        "history_size": 10_000,
        "flow_control": FlowControl(seats=100),
    }


@pytest.fixture
async def proxy(event_loop_guard: None, emulator: RunningEmulator) -> AsyncIterator[KubeProxy]:
    async with proxied(emulator) as kube_proxy:
        yield kube_proxy


@pytest.fixture
async def api(proxy: KubeProxy) -> AsyncIterator[ApiTransport]:
    client = await new_api_client(host=proxy.url)
    try:
        yield client
    finally:
        await client.close()


def pod_client(api: ApiTransport, settings: KubeSettings) -> tuple[KubePodClient, KubeMetrics]:
    metrics = api.metrics
    return KubePodClient(api, settings, PodDecoder(settings.label_keys), metrics), metrics


async def test_black_holed_pooled_connections_cost_one_request_its_timeout(
    emulator: RunningEmulator,
    proxy: KubeProxy,
    api: ApiTransport,
    kube_settings: KubeSettings,
) -> None:
    emulator.emulator.create_pod(sandbox_pod("p1"), namespace=NS)
    client, metrics = pod_client(api, dataclasses.replace(kube_settings, api_timeout_s=1.0))

    async def get() -> None:
        assert await client.get_pod(NS, POD) is not None

    # Eight GETs at once (held by the server until all eight are in) leave eight idle
    # keep-alive connections in the pool.
    flow = emulator.emulator.flow_control
    assert flow is not None
    flow.hold()
    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(get)
        await eventually(lambda: sum(flow.in_flight.values()) == 8, "eight GETs in")
        flow.release()
    assert proxy.open == 8
    assert proxy.blackhole_existing() == 8
    # The first GET after the black hole lands on a dead pooled connection: no answer within
    # its timeout, and the pool is replaced.
    with pytest.raises(Unavailable):
        await client.get_pod(NS, POD)
    registry = metrics.registry
    assert metric(registry, "retired_pod_gc_api_pool_replacements_total") == 1
    # The next ones open new connections and are answered: none of them meets one of the seven
    # dead siblings.
    for _ in range(8):
        await get()
    assert metric(registry, "retired_pod_gc_api_requests_total", op="get", result="transport") == 1
    assert metric(registry, "retired_pod_gc_api_pool_replacements_total") == 1
    assert proxy.accepted == 8 + 1


async def test_a_caller_giving_up_near_the_timeout_replaces_the_pool_and_an_early_one_not(
    emulator: RunningEmulator,
    proxy: KubeProxy,
    api: ApiTransport,
    kube_settings: KubeSettings,
) -> None:
    emulator.emulator.create_pod(sandbox_pod("p1"), namespace=NS)
    client, metrics = pod_client(api, dataclasses.replace(kube_settings, api_timeout_s=1.0))

    async def fill_pool() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(client.get_pod, NS, POD)

    registry = metrics.registry
    await fill_pool()
    proxy.blackhole_existing()
    # The reconciler bounds each call by the same timeout from outside: whichever fires first,
    # a request without an answer for (about) its whole timeout leaves the pool suspect.
    with pytest.raises(TimeoutError), anyio.fail_after(0.95):
        await client.get_pod(NS, POD)
    assert metric(registry, "retired_pod_gc_api_pool_replacements_total") == 1
    assert await client.get_pod(NS, POD) is not None
    # A caller that gives up early (a shutdown, a reconcile out of time) says nothing about
    # the connection.
    await fill_pool()
    proxy.blackhole_existing()
    with anyio.move_on_after(0.2):
        await client.get_pod(NS, POD)
    assert metric(registry, "retired_pod_gc_api_pool_replacements_total") == 1


async def test_watches_never_reuse_a_connection_and_other_requests_do(
    emulator: RunningEmulator, proxy: KubeProxy, api: ApiTransport
) -> None:
    emulator.emulator.create_pod(sandbox_pod("p1"), namespace=NS)
    path = f"/api/v1/namespaces/{NS}/pods"
    for _ in range(3):
        answer = await api.request("GET", path, op="list", timeouts=aiohttp.ClientTimeout(total=5))
        assert answer.body
    assert proxy.accepted == 1  # one keep-alive connection, reused
    for _ in range(3):
        # A watch the server ends at once (timeoutSeconds=1), read to its end.
        stream = await api.watch(
            path,
            op="watch",
            query={"timeoutSeconds": 1, "watch": True},
            timeouts=aiohttp.ClientTimeout(total=None, sock_read=5),
            open_within_s=5,
        )
        try:
            await stream.read()
        finally:
            stream.close()
    assert proxy.accepted == 1 + 3  # each watch on a connection of its own


async def test_a_pod_retired_behind_black_holed_connections_costs_one_timeout_then_is_deleted(
    emulator: RunningEmulator, proxy: KubeProxy, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    name = await seed_row(pg_conn, "h1", active=True, state="active")
    create_pod(emu, "h1", Shape.SUCCEEDED)
    through_proxy = cast(RunningEmulator, SimpleNamespace(url=proxy.url))
    # A list (not a streaming list) fills the cache: its connection stays in the pool.
    async with running_service(
        through_proxy, pg_url, THRESHOLD_SECONDS=1, API_TIMEOUT_SECONDS=2, LIST_MODE="list"
    ) as parts:
        # Synced is not yet watching: the watch opens its connection after the list returns.
        await eventually(lambda: proxy.open >= 2, "the pooled list connection and the watch")
        assert proxy.blackhole_existing() >= 2
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended' "
            "WHERE pod_name = $1",
            name,
        )
        await eventually(lambda: any(e.status == 200 for e in deletes(emu, name)), "the DELETE")
        # The fresh GET met the dead pooled connection once (its reconcile ended in an error,
        # whichever of its bounds fired first); the pool was replaced and the retry went
        # through on a new connection.
        assert sample(parts, "retired_pod_gc_api_pool_replacements_total") == 1
        assert outcome(parts, "error") == 1
    sent = deletes(emu, name)
    assert [e.status for e in sent] == [200]
