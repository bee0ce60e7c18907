"""The pod informer against the emulator over HTTP: sync, watch, and convergence under faults.

Every fault test ends with the same claim: the cache holds exactly the server's sandbox pods at
their current resourceVersions, and the handler was told about every add, change and delete.
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from kubernetes_asyncio import client as k8s_client

from devtools.emulator import Emulator, RunningEmulator, start_emulator
from service.config import KubeSettings
from service.kit.backoff import Backoff
from service.kube.api import new_api_client
from service.kube.informer import PodInformer
from service.kube.listwatch import ListWatch
from service.kube.reflector import SyncMode
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

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE


def metric(metrics: KubeMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@asynccontextmanager
async def running_informer(
    api: ApiTransport, settings: KubeSettings, **kwargs: object
) -> AsyncIterator[tuple[PodInformer, RecordingHandler, KubeMetrics]]:
    handler = RecordingHandler()
    metrics = api.metrics
    informer = PodInformer(
        ListWatch(
            api,
            settings=settings,
            metrics=metrics,
            namespace=settings.namespaces[0],
            rng=random.Random(7),
        ),
        settings=settings,
        metrics=metrics,
        backoff=Backoff(initial_s=0.02, max_s=0.1, jitter=0.5, rng=random.Random(7)),
        min_watch_s=0.0,
        **kwargs,  # type: ignore[arg-type]
    )
    informer.add_handler(handler)
    async with anyio.create_task_group() as tg:
        await tg.start(informer.run)
        try:
            yield informer, handler, metrics
        finally:
            tg.cancel_scope.cancel()


def converged(informer: PodInformer, emulator: RunningEmulator) -> bool:
    return informer.synced and cache_state(informer) == server_pods(emulator.emulator)


def _seed_selector_cases(emu: Emulator) -> None:
    for i in range(7):
        emu.create_pod(sandbox_pod(f"a{i:03d}"), namespace=NS)
    emu.create_pod(sandbox_pod("unmanaged", managed=False), namespace=NS)
    emu.create_pod(sandbox_pod("elsewhere"), namespace="other")


def _assert_selected_once(informer: PodInformer, handler: RecordingHandler, emu: Emulator) -> None:
    """The cache holds the seven selected pods of the namespace, each reported added once."""
    assert cache_state(informer) == server_pods(emu)
    assert len(informer) == 7
    assert informer.get(f"{NS}/space-sbx-unmanaged-g1") is None
    assert sorted(handler.added_keys()) == sorted(server_pods(emu))
    assert handler.synced == 1
    assert handler.cold == 0


async def test_initial_sync_streams_by_default_and_honours_the_selector(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    _seed_selector_cases(emu)
    async with running_informer(kube_api, kube_settings) as (informer, handler, metrics):
        await informer.wait_synced()
        _assert_selected_once(informer, handler, emu)
        assert informer.reflector.sync_mode is SyncMode.STREAM
        assert informer.reflector.resource_version == str(emu.resource_version)
        assert (
            metric(
                metrics, "retired_pod_gc_informer_list_mode", sandbox_namespace=NS, mode="stream"
            )
            == 1
        )
        assert (
            metric(
                metrics,
                "retired_pod_gc_informer_list_mode",
                sandbox_namespace=NS,
                mode="list_cache",
            )
            == 0
        )
        assert (
            metric(metrics, "retired_pod_gc_api_requests_total", op="watchlist", result="ok") == 1
        )
        assert (
            metric(metrics, "retired_pod_gc_cache_pods", sandbox_namespace=SANDBOX_NAMESPACE) == 7
        )
        assert (
            metric(metrics, "retired_pod_gc_cache_synced", sandbox_namespace=SANDBOX_NAMESPACE) == 1
        )
        # The same stream goes on as the watch: a change arrives without another request.
        emu.create_pod(sandbox_pod("later"), namespace=NS)
        await eventually(lambda: converged(informer, emulator))
    gets = [r for r in emu.requests if r.method == "GET"]
    assert len(gets) == 1  # no list at all
    assert gets[0].query["sendInitialEvents"] == "True"
    assert gets[0].query["resourceVersionMatch"] == "NotOlderThan"
    assert gets[0].query["allowWatchBookmarks"] == "True"
    assert "resourceVersion" not in gets[0].query


async def test_quorum_list_pages_through_the_list_and_honours_the_selector(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    _seed_selector_cases(emu)
    # The list from the watch cache is refused: the quorum list is the last resort.
    emu.fail_next(1, code=410, method="GET", query={"resourceVersion": "0"})
    settings = dataclasses.replace(kube_settings, list_page_size=2, list_mode="list")
    async with running_informer(kube_api, settings) as (informer, handler, metrics):
        await informer.wait_synced()
        _assert_selected_once(informer, handler, emu)
        assert informer.reflector.sync_mode is SyncMode.LIST_QUORUM
        assert (
            metric(
                metrics,
                "retired_pod_gc_informer_list_mode",
                sandbox_namespace=NS,
                mode="list_quorum",
            )
            == 1
        )
        assert metric(metrics, "retired_pod_gc_api_requests_total", op="list", result="410") == 1
        assert metric(metrics, "retired_pod_gc_api_requests_total", op="list", result="ok") == 4
        assert (
            metric(metrics, "retired_pod_gc_cache_pods", sandbox_namespace=SANDBOX_NAMESPACE) == 7
        )
        assert (
            metric(metrics, "retired_pod_gc_cache_synced", sandbox_namespace=SANDBOX_NAMESPACE) == 1
        )
    lists = [r for r in emu.requests if r.method == "GET" and "watch" not in r.query]
    assert lists[0].query["resourceVersion"] == "0"
    pages = lists[1:]
    assert [r.query.get("limit") for r in pages] == ["2"] * 4
    assert all("resourceVersion" not in r.query for r in pages)
    assert "continue" not in pages[0].query
    assert all(r.query.get("continue") for r in pages[1:])


async def test_watch_events_update_the_cache_and_call_the_handler_once_per_change(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("keep"), namespace=NS)
    emu.create_pod(sandbox_pod("gone", phase="Succeeded"), namespace=NS)
    async with running_informer(kube_api, kube_settings) as (informer, handler, metrics):
        await informer.wait_synced()
        handler.changes.clear()
        emu.create_pod(sandbox_pod("new"), namespace=NS)
        emu.set_status(NS, "space-sbx-keep-g1", {"phase": "Running", "podIP": "10.0.0.1"})
        emu.delete_pod(NS, "space-sbx-gone-g1")
        await eventually(lambda: converged(informer, emulator) and len(handler.changes) >= 4)
        kinds = [(o is None, n is None) for o, n in handler.changes]
        # add new; update keep; the terminal pod's delete is MODIFIED (deletionTimestamp) + DELETED
        assert kinds == [(True, False), (False, False), (False, False), (False, True)]
        keep = informer.get(f"{NS}/space-sbx-keep-g1")
        assert keep is not None and keep.pod_ip == "10.0.0.1"
        assert handler.deleted_keys() == [f"{NS}/space-sbx-gone-g1"]
        assert metric(metrics, "retired_pod_gc_watch_events_total", type="DELETED") == 1
        assert metric(metrics, "retired_pod_gc_relists_total") == 0


async def test_bookmarks_advance_the_resource_version_the_next_watch_resumes_from(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("x"), namespace=NS)
    async with running_informer(kube_api, kube_settings) as (informer, _handler, metrics):
        await informer.wait_synced()
        listed_rv = informer.reflector.resource_version
        # Changes the informer does not watch (another namespace) still move the global version.
        for i in range(3):
            emu.create_pod(sandbox_pod(f"o{i}"), namespace="other")
        target = str(emu.resource_version)
        await eventually(lambda: informer.reflector.resource_version == target)
        assert listed_rv != target
        assert metric(metrics, "retired_pod_gc_watch_events_total", type="BOOKMARK") >= 1
        emu.drop_watches(abrupt=False)
        await eventually(lambda: len(emu.watch_requests()) >= 2)
        resumed = emu.watch_requests()[1]
        assert resumed.query["resourceVersion"] == target
        assert resumed.query["allowWatchBookmarks"] == "True"
        assert metric(metrics, "retired_pod_gc_relists_total") == 0


async def test_forced_410_relists_and_reports_what_changed_while_disconnected(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    for i in range(5):
        emu.create_pod(sandbox_pod(f"p{i}", phase="Succeeded"), namespace=NS)
    async with running_informer(kube_api, kube_settings) as (informer, handler, metrics):
        await informer.wait_synced()
        handler.changes.clear()
        handler.log.clear()
        # Disconnect, change the world, and make the reconnecting watch answer 410.
        emu.drop_watches(abrupt=False)
        emu.expire_next_watches(1)
        emu.delete_pod(NS, "space-sbx-p0-g1")
        emu.delete_pod(NS, "space-sbx-p1-g1")
        emu.set_status(NS, "space-sbx-p2-g1", {"phase": "Failed"})
        emu.create_pod(sandbox_pod("late"), namespace=NS)
        await eventually(lambda: handler.synced == 2)
        assert cache_state(informer) == server_pods(emu)
        assert sorted(handler.deleted_keys()) == [f"{NS}/space-sbx-p0-g1", f"{NS}/space-sbx-p1-g1"]
        assert handler.added_keys() == [f"{NS}/space-sbx-late-g1"]
        updated = [o.key for o, n in handler.changes if o is not None and n is not None]
        assert updated == [f"{NS}/space-sbx-p2-g1"]
        assert handler.log[0] == "cold" and handler.log[-1] == "synced"
        assert handler.cold == 1
        assert metric(metrics, "retired_pod_gc_relists_total") == 1
        assert metric(metrics, "retired_pod_gc_watch_restarts_total", reason="expired") == 1
        assert (
            metric(metrics, "retired_pod_gc_cache_synced", sandbox_namespace=SANDBOX_NAMESPACE) == 1
        )
        # After the relist the informer watches again and keeps following changes.
        emu.delete_pod(NS, "space-sbx-p3-g1")
        await eventually(lambda: converged(informer, emulator))


@pytest.mark.parametrize("emulator_options", [{"bookmark_interval_s": 0.2, "history_size": 4}])
async def test_a_version_that_fell_out_of_the_history_window_gets_410_and_a_relist(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator  # history_size=4 (parametrized above)
    for i in range(3):
        emu.create_pod(sandbox_pod(f"h{i}", phase="Succeeded"), namespace=NS)
    async with running_informer(kube_api, kube_settings) as (informer, handler, metrics):
        await informer.wait_synced()
        emu.drop_watches(abrupt=True)
        for i in range(3):
            emu.delete_pod(NS, f"space-sbx-h{i}-g1")  # 6 events: more than the history holds
        await eventually(lambda: handler.synced == 2)
        assert cache_state(informer) == server_pods(emu) == {}
        assert sorted(handler.deleted_keys()) == [f"{NS}/space-sbx-h{i}-g1" for i in range(3)]
        assert metric(metrics, "retired_pod_gc_watch_restarts_total", reason="expired") == 1


async def test_dropped_streams_resume_from_the_last_version_without_relisting(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("d0"), namespace=NS)
    async with running_informer(kube_api, kube_settings) as (informer, handler, metrics):
        await informer.wait_synced()
        for round_ in range(3):
            await eventually(lambda: emu.open_watch_count() == 1)
            seen = informer.reflector.resource_version
            assert emu.drop_watches(abrupt=True) == 1
            emu.create_pod(sandbox_pod(f"r{round_}"), namespace=NS)
            emu.set_status(NS, "space-sbx-d0-g1", {"phase": "Pending", "podIP": f"10.0.0.{round_}"})
            await eventually(lambda: converged(informer, emulator))
            # The stream broke mid-way (no clean end): the next watch still resumes after the
            # last event applied, not from an older version (which would replay old events).
            assert emu.watch_requests()[-1].query["resourceVersion"] == seen
        # Nothing was replayed: no change ever took a cached pod back to an older version.
        updates = [(o, n) for o, n in handler.changes if o is not None and n is not None]
        assert len(updates) == 3
        assert all(int(n.resource_version) > int(o.resource_version) for o, n in updates)
        assert metric(metrics, "retired_pod_gc_relists_total") == 0
        assert metric(metrics, "retired_pod_gc_watch_restarts_total", reason="error") >= 3
        assert handler.cold == 0
        assert sorted(handler.added_keys()) == sorted(server_pods(emu))


async def test_500s_during_the_list_back_off_and_recover(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("s0"), namespace=NS)
    emu.fail_next(3, code=500, method="GET", path_contains="/pods")
    async with running_informer(kube_api, kube_settings) as (informer, _handler, metrics):
        await informer.wait_synced()
        assert cache_state(informer) == server_pods(emu)
        # A 5xx is the server failing, not refusing streams: the streaming list is retried.
        assert informer.reflector.sync_mode is SyncMode.STREAM
        assert (
            metric(metrics, "retired_pod_gc_api_requests_total", op="watchlist", result="500") == 3
        )
        assert metric(metrics, "retired_pod_gc_watch_restarts_total", reason="error") == 3
        # A 500 on the watch request itself: back off, then resume (no relist).
        emu.fail_next(2, code=500, method="GET", path_contains="/pods")
        emu.drop_watches(abrupt=False)
        emu.create_pod(sandbox_pod("s1"), namespace=NS)
        await eventually(lambda: converged(informer, emulator))
        assert metric(metrics, "retired_pod_gc_api_requests_total", op="watch", result="500") == 2
        assert metric(metrics, "retired_pod_gc_relists_total") == 0


async def test_429_retry_after_is_honoured(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t0"), namespace=NS)
    emu.fail_next(1, code=429, method="GET", retry_after_s=1)
    started = time.monotonic()
    async with running_informer(kube_api, kube_settings) as (informer, _handler, metrics):
        await informer.wait_synced()
        elapsed = time.monotonic() - started
        # The API client sent the watch request again after the Retry-After: the informer saw
        # its 200 only.
        assert (
            metric(metrics, "retired_pod_gc_api_requests_total", op="watchlist", result="ok") == 1
        )
        assert (
            metric(metrics, "retired_pod_gc_api_requests_total", op="watchlist", result="429") == 0
        )
    watches = [r for r in emu.requests if r.method == "GET"]
    assert watches[0].status == 429
    assert watches[1].query.get("watch", "").lower() == "true"  # the same list, sent again
    # backoff_max_s is 0.1 in these tests: only Retry-After can explain a wait of a second.
    assert elapsed >= 0.95
    assert watches[1].time_s - watches[0].time_s >= 0.95
    assert cache_state(informer) == server_pods(emu)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connection_refused_backs_off_until_the_server_appears(
    event_loop_guard: None, kube_settings: KubeSettings
) -> None:
    port = _free_port()
    api = await new_api_client(host=f"http://127.0.0.1:{port}")
    try:
        async with running_informer(api, kube_settings) as (informer, _handler, metrics):
            await eventually(
                lambda: metric(metrics, "retired_pod_gc_watch_restarts_total", reason="error") >= 2
            )
            assert not informer.synced
            running = await start_emulator(port=port)
            try:
                running.emulator.create_pod(sandbox_pod("late"), namespace=NS)
                await eventually(lambda: converged(informer, running))
                assert (
                    metric(
                        metrics,
                        "retired_pod_gc_api_requests_total",
                        op="watchlist",
                        result="transport",
                    )
                    >= 2
                )
            finally:
                await running.aclose()
    finally:
        await api.close()


async def test_malformed_objects_are_skipped_and_counted(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    bad = sandbox_pod("bad")
    bad["metadata"]["labels"]["space.generation"] = 5  # not a string: the decoder rejects it
    emu.create_pod(bad, namespace=NS)
    emu.create_pod(sandbox_pod("good"), namespace=NS)
    settings = dataclasses.replace(kube_settings, list_mode="list")
    async with running_informer(kube_api, settings) as (informer, _handler, metrics):
        await informer.wait_synced()
        assert list(informer.keys()) == [f"{NS}/space-sbx-good-g1"]
        assert metric(metrics, "retired_pod_gc_decode_errors_total", source="list") == 1
        await eventually(lambda: emu.open_watch_count() == 1)
        emu.inject_watch_line(b"this is not json")
        emu.inject_watch_line(b'{"type":"ADDED","object":{"metadata":{"name":"x"}}}')
        bad2 = sandbox_pod("bad2")
        bad2["metadata"]["labels"]["space.generation"] = 6
        emu.create_pod(bad2, namespace=NS)
        emu.create_pod(sandbox_pod("after"), namespace=NS)
        await eventually(lambda: informer.get(f"{NS}/space-sbx-after-g1") is not None)
        assert metric(metrics, "retired_pod_gc_decode_errors_total", source="watch") == 3
        assert sorted(informer.keys()) == [f"{NS}/space-sbx-after-g1", f"{NS}/space-sbx-good-g1"]
        assert metric(metrics, "retired_pod_gc_relists_total") == 0


async def test_a_cached_pod_that_turns_unreadable_is_dropped_until_readable_again(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("flaky"), namespace=NS)
    key = f"{NS}/space-sbx-flaky-g1"
    async with running_informer(kube_api, kube_settings) as (informer, handler, _metrics):
        await informer.wait_synced()
        assert informer.get(key) is not None
        await eventually(lambda: emu.open_watch_count() == 1)
        garbage = {
            "type": "MODIFIED",
            "object": {"metadata": {"name": "space-sbx-flaky-g1", "namespace": NS, "uid": 7}},
        }
        emu.inject_watch_line(json.dumps(garbage).encode())
        # The gap in what we know of it must not leave a stale (possibly reapable) snapshot.
        await eventually(lambda: informer.get(key) is None)
        assert f"delete {key}" in handler.log
        emu.set_status(NS, "space-sbx-flaky-g1", {"phase": "Running"})
        await eventually(lambda: informer.get(key) is not None)


async def test_the_informer_never_builds_client_models(
    emulator: RunningEmulator,
    kube_api: ApiTransport,
    kube_settings: KubeSettings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forbidden(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a client model was built")

    monkeypatch.setattr(k8s_client.V1Pod, "__init__", forbidden)
    monkeypatch.setattr(k8s_client.V1PodList, "__init__", forbidden)
    monkeypatch.setattr(k8s_client.ApiClient, "deserialize", forbidden)
    emu = emulator.emulator
    for i in range(5):
        emu.create_pod(sandbox_pod(f"m{i}"), namespace=NS)
    settings = dataclasses.replace(kube_settings, list_page_size=2)
    async with running_informer(kube_api, settings) as (informer, _handler, _metrics):
        await informer.wait_synced()
        emu.create_pod(sandbox_pod("m9"), namespace=NS)
        emu.delete_pod(NS, "space-sbx-m0-g1", grace_period_s=0)
        await eventually(lambda: converged(informer, emulator))
        emu.expire_next_watches(1)
        emu.drop_watches(abrupt=False)
        await eventually(lambda: metric(_metrics, "retired_pod_gc_relists_total") == 1)
        await eventually(lambda: converged(informer, emulator))
    # The patch is live: building a model here fails, so the informer really never did.
    with pytest.raises(AssertionError):
        k8s_client.V1Pod()


class _CompactAfterFirstPage(Emulator):
    """Compacts (expiring continue tokens) right after serving one first page."""

    armed = True

    def list_body(self, *args: Any, **kwargs: Any) -> bytes:
        body = super().list_body(*args, **kwargs)
        if self.armed and not kwargs.get("continue_token"):
            self.armed = False
            self.compact()
        return body


async def test_an_expired_continue_token_restarts_the_list(
    event_loop_guard: None, kube_settings: KubeSettings
) -> None:
    emu = _CompactAfterFirstPage(bookmark_interval_s=0.2)
    for i in range(5):
        emu.create_pod(sandbox_pod(f"k{i}"), namespace=NS)
    running = await start_emulator(emulator=emu)
    api = await new_api_client(host=running.url)
    try:
        settings = dataclasses.replace(kube_settings, list_page_size=2, list_mode="list")
        # Paginated lists are quorum lists: refuse the one from the watch cache.
        emu.fail_next(1, code=410, method="GET", query={"resourceVersion": "0"})
        async with running_informer(api, settings) as (informer, handler, metrics):
            await informer.wait_synced()
            assert cache_state(informer) == server_pods(emu)
            assert sorted(handler.added_keys()) == sorted(server_pods(emu))  # once each
            assert informer.reflector.sync_mode is SyncMode.LIST_QUORUM
            # One 410 refused the watch-cache list, one expired the continue token.
            assert (
                metric(metrics, "retired_pod_gc_api_requests_total", op="list", result="410") == 2
            )
            assert metric(metrics, "retired_pod_gc_api_requests_total", op="list", result="ok") == 4
    finally:
        await api.close()
        await running.aclose()
