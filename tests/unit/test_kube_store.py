"""The pod store: its SyncState transitions, what each one tells the handler, and what a sync
reports (changes only, then the pods it did not mention as deleted)."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client import CollectorRegistry

from service.kube.store import PodStore, SyncState
from service.metrics import KubeMetrics
from tests.fakes import NAMESPACE, make_pod
from tests.kubefixtures import RecordingHandler
from tests.virtualtime import settle


def new_store() -> tuple[PodStore, RecordingHandler, KubeMetrics]:
    handler = RecordingHandler()
    metrics = KubeMetrics(CollectorRegistry())
    return PodStore(metrics, sink=handler, namespace=NAMESPACE), handler, metrics


def store_in(state: SyncState) -> tuple[PodStore, RecordingHandler, KubeMetrics]:
    """A store brought to ``state`` the way the reflector brings it there."""
    store, handler, metrics = new_store()
    steps = {
        SyncState.COLD: (),
        SyncState.LISTING: ("begin",),
        SyncState.SYNCED: ("begin", "finish"),
        SyncState.RELISTING: ("begin", "finish", "begin"),
    }[state]
    for step in steps:
        if step == "begin":
            store.begin_sync()
        else:
            store.finish_sync()
    assert store.state is state
    handler.log.clear()
    handler.namespaces.clear()
    return store, handler, metrics


def gauge(metrics: KubeMetrics, name: str) -> float | None:
    """The store's gauge: every series of it is labelled with the store's namespace."""
    return metrics.registry.get_sample_value(name, {"sandbox_namespace": NAMESPACE})


BEGIN = {
    SyncState.COLD: SyncState.LISTING,
    SyncState.LISTING: SyncState.LISTING,
    SyncState.SYNCED: SyncState.RELISTING,
    SyncState.RELISTING: SyncState.RELISTING,
}


@pytest.mark.parametrize("state", list(SyncState))
def test_begin_sync_moves_every_state_and_only_leaving_synced_tells_the_handler_cold(
    state: SyncState,
) -> None:
    store, handler, metrics = store_in(state)
    assert store.begin_sync() is BEGIN[state]
    assert store.state is BEGIN[state]
    assert not store.synced
    assert handler.log == (["cold"] if state is SyncState.SYNCED else [])
    assert handler.namespaces == ([NAMESPACE] if state is SyncState.SYNCED else [])
    assert gauge(metrics, "retired_pod_gc_cache_synced") == 0


@pytest.mark.parametrize("state", list(SyncState))
def test_finish_sync_is_the_only_way_to_synced_and_only_from_a_sync_in_progress(
    state: SyncState,
) -> None:
    store, handler, metrics = store_in(state)
    if state in (SyncState.LISTING, SyncState.RELISTING):
        store.finish_sync()
        assert store.state is SyncState.SYNCED and store.synced
        assert handler.log == ["synced"]
        assert handler.namespaces == [NAMESPACE]
        assert gauge(metrics, "retired_pod_gc_cache_synced") == 1
    else:
        with pytest.raises(RuntimeError, match="no sync in progress"):
            store.finish_sync()
        assert store.state is state
        assert handler.log == []


def test_a_sync_reports_new_and_changed_pods_once_and_the_rest_deleted_at_its_end() -> None:
    store, handler, metrics = store_in(SyncState.SYNCED)
    store.begin_sync()
    for pod in (make_pod("a"), make_pod("b"), make_pod("c")):
        store.put(pod)
    store.finish_sync()
    handler.log.clear()
    handler.changes.clear()

    store.begin_sync()  # a relist: b changed on the server, c is gone, d is new
    store.put(make_pod("a"))
    store.put(make_pod("b", resource_version="101"))
    store.put(make_pod("a"))  # told twice: still unchanged
    store.put(make_pod("d"))
    assert len(store) == 4  # c is still cached until the sync is complete
    store.finish_sync()

    assert handler.log == [
        "cold",
        f"update {make_pod('b').key}",
        f"add {make_pod('d').key}",
        f"delete {make_pod('c').key}",
        "synced",
    ]
    assert sorted(store.keys()) == sorted(make_pod(s).key for s in "abd")
    assert gauge(metrics, "retired_pod_gc_cache_pods") == 3


def test_a_pod_recreated_under_the_same_name_is_a_change_even_at_the_same_version() -> None:
    store, handler, _ = store_in(SyncState.SYNCED)
    store.put(make_pod("a", uid="first"))
    store.begin_sync()
    store.put(make_pod("a", uid="second"))
    store.finish_sync()
    pod = store.get(make_pod("a").key)
    assert pod is not None and pod.uid == "second"
    assert handler.changes[-1][0] is not None and handler.changes[-1][0].uid == "first"


def test_starting_a_sync_over_forgets_what_the_failed_attempt_put() -> None:
    store, handler, _ = store_in(SyncState.SYNCED)
    store.put(make_pod("a"))
    store.put(make_pod("b"))
    store.begin_sync()
    store.put(make_pod("a"))
    store.put(make_pod("b"))
    store.begin_sync()  # the attempt failed; the retry sees only a
    store.put(make_pod("a"))
    store.finish_sync()
    assert list(store.keys()) == [make_pod("a").key]
    assert handler.deleted_keys() == [make_pod("b").key]
    assert handler.cold == 1  # one gap, however many attempts it took


def test_while_synced_every_put_and_delete_is_reported_and_counted() -> None:
    store, handler, metrics = store_in(SyncState.SYNCED)
    store.put(make_pod("a"))
    store.put(make_pod("a"))  # a watch event is a change even if nothing we read moved
    assert gauge(metrics, "retired_pod_gc_cache_pods") == 1
    store.delete(make_pod("a", resource_version="102"))
    store.delete(make_pod("z"))  # never cached: reported with the event's own state
    assert handler.log == [
        f"add {make_pod('a').key}",
        f"update {make_pod('a').key}",
        f"delete {make_pod('a').key}",
        f"delete {make_pod('z').key}",
    ]
    deleted_a = handler.changes[2][0]
    assert deleted_a is not None and deleted_a.resource_version == "100"  # the cached state
    assert len(store) == 0 and gauge(metrics, "retired_pod_gc_cache_pods") == 0


def test_a_pod_deleted_during_a_sync_is_not_reported_again_at_its_end() -> None:
    store, handler, _ = store_in(SyncState.SYNCED)
    store.put(make_pod("a"))
    store.begin_sync()
    store.put(make_pod("a"))
    store.delete(make_pod("a"))
    store.finish_sync()
    assert handler.deleted_keys() == [make_pod("a").key]


def test_forget_drops_a_cached_pod_as_deleted_and_ignores_an_unknown_key() -> None:
    store, handler, _ = store_in(SyncState.SYNCED)
    store.put(make_pod("a"))
    store.forget(make_pod("a").key)
    store.forget("nowhere/none")
    assert store.get(make_pod("a").key) is None
    assert handler.log == [f"add {make_pod('a').key}", f"delete {make_pod('a').key}"]


@pytest.mark.anyio
async def test_wait_synced_returns_only_once_synced_and_waits_again_during_a_relist() -> None:
    store, _, _ = new_store()
    done: list[int] = []

    async def waiter(tag: int) -> None:
        await store.wait_synced()
        done.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 1)
        store.begin_sync()
        await settle()
        assert done == []
        store.finish_sync()
        await settle()
        assert done == [1]
        store.begin_sync()
        tg.start_soon(waiter, 2)
        await settle()
        assert done == [1]
        store.finish_sync()
    assert done == [1, 2]
