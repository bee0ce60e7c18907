"""Kubernetes test harness: an API server emulator on a free port and clients aimed at it.

Fixtures: ``emulator`` (a :class:`RunningEmulator`; ``emulator.emulator`` is the state with the
Python helpers and fault controls), ``kube_api`` (the service's ``ApiTransport`` over HTTP, as
``new_api_client`` makes it), ``library_api`` (a plain ``kubernetes_asyncio`` ApiClient, the
emulator's other client), ``kube_settings`` (``KubeSettings`` for the ``sandboxes`` namespace
with small timeouts), ``proxied_emulator`` (a :class:`ProxiedEmulator`: the same emulator behind
a TCP proxy that resets or black-holes connections, ``tests/kubeproxy.py``).
Both async fixtures depend on ``event_loop_guard`` so that the event-loop guard runs after the
client and server have been closed (keep-alive connections own server tasks until then).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from kubernetes_asyncio import client as k8s_client

from devtools.emulator import Emulator, RunningEmulator, start_emulator
from service import config
from service.config import KubeSettings
from service.domain import LabelKeys, PodSnapshot
from service.kube.api import new_api_client
from service.kube.transport import ApiTransport
from service.ports import PodCache
from tests.kubeproxy import KubeProxy, proxied

SANDBOX_NAMESPACE = "sandboxes"
SANDBOX_SELECTOR = "app.kubernetes.io/managed-by=space-sandbox"


@pytest.fixture
def emulator_options() -> dict[str, object]:
    """Override in a test module to construct the emulator differently."""
    return {"bookmark_interval_s": 0.2, "history_size": 10_000}


@pytest.fixture
async def emulator(
    event_loop_guard: None, emulator_options: dict[str, object]
) -> AsyncIterator[RunningEmulator]:
    emu = Emulator(**emulator_options)  # type: ignore[arg-type]
    emu.ensure_namespace(SANDBOX_NAMESPACE)
    running = await start_emulator(emulator=emu)
    try:
        yield running
    finally:
        await running.aclose()


@pytest.fixture
async def kube_api(
    event_loop_guard: None, emulator: RunningEmulator
) -> AsyncIterator[ApiTransport]:
    api = await new_api_client(host=emulator.url)
    try:
        yield api
    finally:
        await api.close()


def library_client(url: str) -> k8s_client.ApiClient:
    """A plain ``kubernetes_asyncio`` ApiClient (the library's own rest client) for ``url``."""
    configuration = k8s_client.Configuration()
    configuration.host = url
    return k8s_client.ApiClient(configuration)


@pytest.fixture
async def library_api(
    event_loop_guard: None, emulator: RunningEmulator
) -> AsyncIterator[k8s_client.ApiClient]:
    api = library_client(emulator.url)
    try:
        yield api
    finally:
        await api.close()


@dataclass(frozen=True, slots=True)
class ProxiedEmulator:
    """The emulator behind a proxy: ``url`` leads through ``proxy``; ``running.url`` does not."""

    running: RunningEmulator
    proxy: KubeProxy

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def emulator(self) -> Emulator:
        return self.running.emulator


@pytest.fixture
async def proxied_emulator(
    event_loop_guard: None, emulator: RunningEmulator
) -> AsyncIterator[ProxiedEmulator]:
    async with proxied(emulator) as proxy:
        yield ProxiedEmulator(emulator, proxy)


@pytest.fixture
def kube_settings() -> KubeSettings:
    return dataclasses.replace(
        config.load({}).kube,
        namespaces=(SANDBOX_NAMESPACE,),
        label_selector=SANDBOX_SELECTOR,
        label_keys=LabelKeys(),
        api_timeout_s=5.0,
        watch_timeout_s=30.0,
        list_page_size=500,
        delete_grace_period_s=None,
    )


# ---------------------------------------------------------------- helpers for kube tests


class RecordingHandler:
    """A ``ports.PodEventHandler`` that records what the informer told it."""

    def __init__(self) -> None:
        self.changes: list[tuple[PodSnapshot | None, PodSnapshot | None]] = []
        self.cold = 0
        self.synced = 0
        self.log: list[str] = []
        self.namespaces: list[str] = []
        """The namespace named by each ``cache_cold`` / ``cache_synced``, in order."""

    def pod_changed(self, old: PodSnapshot | None, new: PodSnapshot | None) -> None:
        self.changes.append((old, new))
        kind = "add" if old is None else "delete" if new is None else "update"
        snap = new if new is not None else old
        assert snap is not None
        self.log.append(f"{kind} {snap.key}")

    def cache_cold(self, namespace: str) -> None:
        self.cold += 1
        self.log.append("cold")
        self.namespaces.append(namespace)

    def cache_synced(self, namespace: str) -> None:
        self.synced += 1
        self.log.append("synced")
        self.namespaces.append(namespace)

    def deleted_keys(self) -> list[str]:
        return [old.key for old, new in self.changes if new is None and old is not None]

    def added_keys(self) -> list[str]:
        return [new.key for old, new in self.changes if old is None and new is not None]


def sandbox_pod(
    sandbox_id: str,
    generation: int = 1,
    *,
    phase: str = "Pending",
    node: str | None = "node-a",
    kind: str = "create",
    managed: bool = True,
    finalizers: list[str] | None = None,
) -> dict[str, Any]:
    """A sandbox pod body in the platform's naming and labelling."""
    labels = {
        "space.sandbox-id": sandbox_id,
        "space.generation": str(generation),
        "space.pod-kind": kind,
    }
    if managed:
        labels["app.kubernetes.io/managed-by"] = "space-sandbox"
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"space-sbx-{sandbox_id}-g{generation}", "labels": labels},
        "spec": {"containers": [{"name": "sandbox", "image": "registry.example/sandbox:1.0"}]},
        "status": {"phase": phase},
    }
    if node is not None:
        pod["spec"]["nodeName"] = node
    if finalizers:
        pod["metadata"]["finalizers"] = finalizers
    return pod


def server_pods(emu: Emulator, namespace: str = SANDBOX_NAMESPACE) -> dict[str, str]:
    """key → resourceVersion of the server's sandbox-labelled pods (what the informer must hold)."""
    out: dict[str, str] = {}
    for pod in emu.pods(namespace):
        labels = pod["metadata"].get("labels") or {}
        if labels.get("app.kubernetes.io/managed-by") == "space-sandbox":
            out[f"{namespace}/{pod['metadata']['name']}"] = pod["metadata"]["resourceVersion"]
    return out


def cache_state(cache: PodCache) -> dict[str, str]:
    """key → resourceVersion of an informer's cache (``PodCache.keys()``, not a dict)."""
    out: dict[str, str] = {}
    for key in cache.keys():  # noqa: SIM118
        snap = cache.get(key)
        assert snap is not None
        out[key] = snap.resource_version
    return out


async def eventually(predicate: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    """Wait (polling every 10 ms) until ``predicate()`` holds; fail after ``timeout_s``."""
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.01)
