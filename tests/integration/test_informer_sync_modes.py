"""How the informer fills its cache (streaming list, list from the watch cache, quorum list) and
that each way converges to the server's pod set, at start and on a relist after a disconnect.

Every case ends with the same claim: the cache holds exactly the server's sandbox pods at their
current resourceVersions, and the handler was told about every add, change and delete that
happened while the informer was disconnected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.watch import WatchListSupport
from service.config import KubeSettings
from service.kube.reflector import SyncMode
from service.kube.transport import ApiTransport
from tests.integration.test_informer import converged, metric, running_informer
from tests.kubefixtures import SANDBOX_NAMESPACE, cache_state, eventually, sandbox_pod, server_pods

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE

# (LIST_MODE, what the server does with streaming lists, how the cache must have been filled,
#  and a fault that makes the relist's watch-cache list fail so only a quorum list is left)
CASES: list[tuple[str, WatchListSupport, SyncMode, SyncMode, dict[str, Any] | None]] = [
    ("auto", WatchListSupport.SUPPORTED, SyncMode.STREAM, SyncMode.STREAM, None),
    ("stream", WatchListSupport.SUPPORTED, SyncMode.STREAM, SyncMode.STREAM, None),
    ("auto", WatchListSupport.REJECTED, SyncMode.LIST_CACHE, SyncMode.LIST_CACHE, None),
    ("auto", WatchListSupport.IGNORED, SyncMode.LIST_CACHE, SyncMode.LIST_CACHE, None),
    ("list", WatchListSupport.SUPPORTED, SyncMode.LIST_CACHE, SyncMode.LIST_CACHE, None),
    (
        "list",
        WatchListSupport.SUPPORTED,
        SyncMode.LIST_CACHE,
        SyncMode.LIST_QUORUM,
        {"code": 410, "method": "GET", "query": {"resourceVersionMatch": "NotOlderThan"}},
    ),
]


def _streaming_requests(running: RunningEmulator) -> list[dict[str, str]]:
    return [r.query for r in running.emulator.requests if "sendInitialEvents" in r.query]


def _list_requests(running: RunningEmulator) -> list[dict[str, str]]:
    return [
        r.query for r in running.emulator.requests if r.method == "GET" and "watch" not in r.query
    ]


@pytest.mark.parametrize(
    ("list_mode", "support", "first", "relisted", "relist_fault"),
    CASES,
    ids=[f"{c[0]}-{c[1].value}-{c[3].value}" for c in CASES],
)
async def test_sync_and_relist_converge_to_the_server_pod_set(
    emulator: RunningEmulator,
    kube_api: ApiTransport,
    kube_settings: KubeSettings,
    list_mode: str,
    support: WatchListSupport,
    first: SyncMode,
    relisted: SyncMode,
    relist_fault: dict[str, Any] | None,
) -> None:
    emu = emulator.emulator
    emu.watch_list = support
    for i in range(6):
        emu.create_pod(sandbox_pod(f"m{i}", phase="Succeeded"), namespace=NS)
    emu.create_pod(sandbox_pod("unmanaged", managed=False), namespace=NS)
    settings = dataclasses.replace(kube_settings, list_mode=list_mode)
    async with running_informer(kube_api, settings) as (informer, handler, metrics):
        await informer.wait_synced()
        assert informer.reflector.sync_mode is first
        assert cache_state(informer) == server_pods(emu)
        assert sorted(handler.added_keys()) == sorted(server_pods(emu))  # once each
        assert (
            metric(
                metrics, "retired_pod_gc_informer_list_mode", sandbox_namespace=NS, mode=first.value
            )
            == 1
        )
        assert handler.log[-1] == "synced" and handler.synced == 1
        known = informer.reflector.resource_version
        handler.changes.clear()
        handler.log.clear()
        streams_before = len(_streaming_requests(emulator))
        lists_before = len(_list_requests(emulator))

        # Disconnect, change the world, and make the reconnecting watch answer 410.
        if relist_fault is not None:
            emu.fail_next(1, **relist_fault)
        emu.drop_watches(abrupt=False)
        emu.expire_next_watches(1)
        emu.delete_pod(NS, "space-sbx-m0-g1")
        emu.delete_pod(NS, "space-sbx-m1-g1")
        emu.set_status(NS, "space-sbx-m2-g1", {"phase": "Failed"})
        emu.create_pod(sandbox_pod("late"), namespace=NS)
        await eventually(lambda: handler.synced == 2)

        assert informer.reflector.sync_mode is relisted
        assert cache_state(informer) == server_pods(emu)
        assert sorted(handler.deleted_keys()) == [f"{NS}/space-sbx-m0-g1", f"{NS}/space-sbx-m1-g1"]
        assert handler.added_keys() == [f"{NS}/space-sbx-late-g1"]
        updated = [o.key for o, n in handler.changes if o is not None and n is not None]
        assert updated == [f"{NS}/space-sbx-m2-g1"]
        assert handler.log[0] == "cold" and handler.log[-1] == "synced"
        assert handler.cold == 1
        assert metric(metrics, "retired_pod_gc_relists_total") == 1
        assert (
            metric(
                metrics,
                "retired_pod_gc_informer_list_mode",
                sandbox_namespace=NS,
                mode=relisted.value,
            )
            == 1
        )
        assert (
            sum(
                metric(
                    metrics, "retired_pod_gc_informer_list_mode", sandbox_namespace=NS, mode=m.value
                )
                for m in SyncMode
            )
            == 1
        )

        streams = _streaming_requests(emulator)[streams_before:]
        lists = _list_requests(emulator)[lists_before:]
        if relisted is SyncMode.STREAM:
            # The relist streams from the version already seen, and lists nothing.
            assert [q.get("resourceVersion") for q in streams] == [known]
            assert lists == []
        else:
            # A server found without streaming lists is not asked again.
            assert streams == []
            assert lists[0]["resourceVersion"] == known
            assert lists[0]["resourceVersionMatch"] == "NotOlderThan"
            assert "limit" not in lists[0]
            if relisted is SyncMode.LIST_QUORUM:
                assert all("resourceVersion" not in q for q in lists[1:])
                assert len(lists) >= 2
            else:
                assert len(lists) == 1

        # After the relist the informer watches again and keeps following changes.
        emu.delete_pod(NS, "space-sbx-m3-g1")
        await eventually(lambda: converged(informer, emulator))


async def test_auto_mode_falls_back_to_a_list_from_the_watch_cache_when_streams_are_rejected(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.watch_list = WatchListSupport.REJECTED
    emu.create_pod(sandbox_pod("r0"), namespace=NS)
    async with running_informer(kube_api, kube_settings) as (informer, _handler, metrics):
        await informer.wait_synced()
        assert informer.reflector.sync_mode is SyncMode.LIST_CACHE
        assert cache_state(informer) == server_pods(emu)
        assert (
            metric(metrics, "retired_pod_gc_api_requests_total", op="watchlist", result="422") == 1
        )
    lists = _list_requests(emulator)
    assert [q.get("resourceVersion") for q in lists] == ["0"]  # never a quorum list
    assert "resourceVersionMatch" not in lists[0]


async def test_stream_mode_never_falls_back_and_syncs_once_the_server_streams(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.watch_list = WatchListSupport.REJECTED
    emu.create_pod(sandbox_pod("s0"), namespace=NS)
    settings = dataclasses.replace(kube_settings, list_mode="stream")
    async with running_informer(kube_api, settings) as (informer, _handler, metrics):
        await eventually(
            lambda: (
                metric(metrics, "retired_pod_gc_api_requests_total", op="watchlist", result="422")
                >= 3
            )
        )
        assert not informer.synced
        assert _list_requests(emulator) == []
        emu.watch_list = WatchListSupport.SUPPORTED
        await informer.wait_synced()
        assert informer.reflector.sync_mode is SyncMode.STREAM
        assert cache_state(informer) == server_pods(emu)
    assert _list_requests(emulator) == []


@pytest.mark.parametrize("emulator_options", [{"bookmark_interval_s": 3600.0}])
async def test_a_stream_that_goes_silent_before_its_end_bookmark_is_not_honoured(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator  # no periodic bookmarks: only the silence gives the server away
    emu.watch_list = WatchListSupport.IGNORED
    for i in range(3):
        emu.create_pod(sandbox_pod(f"q{i}"), namespace=NS)
    settings = dataclasses.replace(kube_settings, stream_sync_timeout_s=0.3)
    async with running_informer(kube_api, settings) as (informer, handler, _metrics):
        await informer.wait_synced()
        assert informer.reflector.sync_mode is SyncMode.LIST_CACHE
        assert cache_state(informer) == server_pods(emu)
        assert sorted(handler.added_keys()) == sorted(server_pods(emu))
        assert handler.synced == 1
