"""A watch whose connection dies silently, with the real client against the emulator behind the
TCP proxy of ``tests/kubeproxy.py``: the informer gives the dead stream up once it has heard
nothing for ``WATCH_SILENCE_SECONDS`` and hears of what happened meanwhile
(docs/architecture.md, "A silent watch").

Scaled down: bookmarks every 0.5 s, a bound of 3 s, and a server ``timeoutSeconds`` of 10
minutes, so that only the bound can end the dead stream within the test (the request's read
timeout, the backstop, would wait out those 10 minutes: without the bound the test times out).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from prometheus_client import CollectorRegistry

from devtools.emulator import RunningEmulator
from service.config import KubeSettings
from service.kit.backoff import Backoff
from service.kube.api import new_api_client
from service.kube.informer import PodInformer
from service.kube.listwatch import ListWatch
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from tests.kubefixtures import (
    SANDBOX_NAMESPACE,
    RecordingHandler,
    cache_state,
    eventually,
    sandbox_pod,
    server_pods,
)
from tests.kubeproxy import KubeProxy, proxied

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
SILENCE_S = 3.0
DEAF_FOR_AT_MOST_S = 60.0
"""How long the test waits for the pod created in the black hole: far beyond the bound, far
short of the backstop (600 s)."""


@pytest.fixture
def emulator_options() -> dict[str, object]:
    return {"bookmark_interval_s": 0.5, "history_size": 10_000}


def metric(metrics: KubeMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@asynccontextmanager
async def informer_through(
    proxy: KubeProxy, settings: KubeSettings
) -> AsyncIterator[tuple[PodInformer, RecordingHandler, KubeMetrics]]:
    api: ApiTransport = await new_api_client(host=proxy.url)
    handler = RecordingHandler()
    metrics = KubeMetrics(CollectorRegistry())
    informer = PodInformer(
        ListWatch(
            api,
            settings=settings,
            metrics=metrics,
            namespace=NS,
            rng=random.Random(7),
        ),
        settings=settings,
        metrics=metrics,
        backoff=Backoff(initial_s=0.02, max_s=0.1, jitter=0.5, rng=random.Random(7)),
        min_watch_s=0.0,
    )
    informer.add_handler(handler)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(informer.run)
            try:
                yield informer, handler, metrics
            finally:
                tg.cancel_scope.cancel()
    finally:
        await api.close()


async def test_a_black_holed_watch_is_given_up_and_a_pod_created_in_the_hole_is_seen(
    emulator: RunningEmulator, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("before"), namespace=NS)
    settings = dataclasses.replace(kube_settings, watch_timeout_s=600.0, watch_silence_s=SILENCE_S)
    async with (
        proxied(emulator) as proxy,
        informer_through(proxy, settings) as (informer, handler, metrics),
    ):
        await informer.wait_synced()
        # A periodic bookmark has come after the initial-events-end one: the server is known to
        # send them, and the bound applies.
        await eventually(
            lambda: metric(metrics, "retired_pod_gc_watch_events_total", type="BOOKMARK") >= 2
        )
        # The informer's connections (the streaming list going on as the watch), all of them.
        assert proxy.blackhole_existing() == proxy.accepted
        accepted = proxy.accepted
        emu.create_pod(sandbox_pod("after"), namespace=NS)
        created = server_pods(emu)

        await eventually(
            lambda: informer.get(f"{NS}/space-sbx-after-g1") is not None,
            timeout_s=DEAF_FOR_AT_MOST_S,
        )
        # Given up for its silence (not for a read timeout or an error), watched again over a
        # new connection from the version last seen: no relist, the cache never went cold.
        # (At least once: a machine too busy to read a bookmark for 3 s may cut a live one too.)
        assert metric(metrics, "retired_pod_gc_watch_restarts_total", reason="silent") >= 1
        for reason in ("timeout", "error", "expired"):
            assert metric(metrics, "retired_pod_gc_watch_restarts_total", reason=reason) == 0
        assert metric(metrics, "retired_pod_gc_relists_total") == 0
        assert handler.cold == 0
        assert proxy.accepted > accepted
        assert cache_state(informer) == created
        assert handler.added_keys() == [f"{NS}/space-sbx-before-g1", f"{NS}/space-sbx-after-g1"]
