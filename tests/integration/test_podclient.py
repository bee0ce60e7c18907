"""KubePodClient against the emulator: fresh GETs and preconditioned DELETEs with typed outcomes.

The emulator's audit log proves what was sent (and that nothing else was deleted).
"""

from __future__ import annotations

import dataclasses
import socket

import aiohttp
import pytest

from devtools.emulator import RunningEmulator
from service.config import KubeSettings
from service.domain import DeleteResult, PodPhase
from service.kit.errors import ApiError, Unavailable, Undecodable
from service.kube.api import new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import KubeApiError
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE


def make_client(api: ApiTransport, settings: KubeSettings) -> tuple[KubePodClient, KubeMetrics]:
    metrics = api.metrics
    return KubePodClient(api, settings, PodDecoder(settings.label_keys), metrics), metrics


async def test_get_pod_decodes_the_server_state_and_none_when_missing(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    created = emu.create_pod(sandbox_pod("g1", phase="Succeeded"), namespace=NS)
    client, metrics = make_client(kube_api, kube_settings)
    snap = await client.get_pod(NS, "space-sbx-g1-g1")
    assert snap is not None
    assert snap.uid == created["metadata"]["uid"]
    assert snap.resource_version == created["metadata"]["resourceVersion"]
    assert snap.phase is PodPhase.SUCCEEDED
    assert snap.sandbox_id == "g1"
    assert await client.get_pod(NS, "space-sbx-nope-g1") is None
    ok = metrics.registry.get_sample_value(
        "retired_pod_gc_api_requests_total", {"op": "get", "result": "ok"}
    )
    assert ok == 1


async def test_get_pod_raises_kube_api_error_on_a_server_error_and_unavailable_on_a_timeout(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("g2"), namespace=NS)
    client, metrics = make_client(kube_api, dataclasses.replace(kube_settings, api_timeout_s=0.2))
    emu.fail_next(1, code=429, method="GET", retry_after_s=7)
    with pytest.raises(KubeApiError) as err:
        await client.get_pod(NS, "space-sbx-g2-g1")
    assert (err.value.status, err.value.retry_after_s) == (429, 7.0)
    emu.add_latency(1.0, method="GET", count=1)
    with pytest.raises(Unavailable) as unavailable:
        await client.get_pod(NS, "space-sbx-g2-g1")
    assert not isinstance(unavailable.value, ApiError)
    assert isinstance(unavailable.value.__cause__, TimeoutError)
    transport = metrics.registry.get_sample_value(
        "retired_pod_gc_api_requests_total", {"op": "get", "result": "transport"}
    )
    assert transport == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refused_connection_is_unavailable_on_get_and_on_delete_alike(
    event_loop_guard: None, kube_settings: KubeSettings
) -> None:
    api = await new_api_client(host=f"http://127.0.0.1:{_free_port()}")
    try:
        client, metrics = make_client(api, kube_settings)
        with pytest.raises(Unavailable) as unavailable:
            await client.get_pod(NS, "space-sbx-any-g1")
        assert not isinstance(unavailable.value, ApiError)
        assert isinstance(unavailable.value.__cause__, aiohttp.ClientError | OSError)
        with pytest.raises(Unavailable) as unavailable:
            await client.delete_pod(NS, "space-sbx-any-g1", uid="u", resource_version="1")
        assert not isinstance(unavailable.value, ApiError)
        assert isinstance(unavailable.value.__cause__, aiohttp.ClientError | OSError)
        for op in ("get", "delete"):
            transport = metrics.registry.get_sample_value(
                "retired_pod_gc_api_requests_total", {"op": op, "result": "transport"}
            )
            assert transport == 1, op
    finally:
        await api.close()


async def test_an_undecodable_pod_from_get_is_its_own_error_counted_never_an_api_error(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    bad = sandbox_pod("u1")
    bad["metadata"]["labels"]["space.generation"] = 5  # not a string: the decoder rejects it
    emu.create_pod(bad, namespace=NS)
    client, metrics = make_client(kube_api, kube_settings)
    with pytest.raises(PodDecodeError) as undecodable:
        await client.get_pod(NS, "space-sbx-u1-g1")
    assert isinstance(undecodable.value, Undecodable)
    assert not isinstance(undecodable.value, ApiError)
    decode_errors = metrics.registry.get_sample_value(
        "retired_pod_gc_decode_errors_total", {"source": "get"}
    )
    assert decode_errors == 1
    assert emu.audit_log(method="DELETE") == []


async def test_delete_with_a_stale_uid_is_a_conflict_and_deletes_nothing(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    pod = emu.create_pod(sandbox_pod("u1", phase="Succeeded"), namespace=NS)
    client, _ = make_client(kube_api, kube_settings)
    outcome = await client.delete_pod(
        NS,
        "space-sbx-u1-g1",
        uid="not-the-uid",
        resource_version=pod["metadata"]["resourceVersion"],
    )
    assert outcome.result is DeleteResult.CONFLICT
    assert outcome.status == 409
    assert "the UID in the precondition (not-the-uid)" in outcome.message
    assert emu.get_pod(NS, "space-sbx-u1-g1") == pod


async def test_delete_with_a_stale_resource_version_is_a_conflict(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    pod = emu.create_pod(sandbox_pod("r1", phase="Succeeded"), namespace=NS)
    old_rv = pod["metadata"]["resourceVersion"]
    emu.patch_pod(NS, "space-sbx-r1-g1", {"metadata": {"annotations": {"touched": "yes"}}})
    client, _ = make_client(kube_api, kube_settings)
    outcome = await client.delete_pod(
        NS, "space-sbx-r1-g1", uid=pod["metadata"]["uid"], resource_version=old_rv
    )
    assert outcome.result is DeleteResult.CONFLICT
    assert f"the ResourceVersion in the precondition ({old_rv})" in outcome.message
    assert emu.get_pod(NS, "space-sbx-r1-g1") is not None


async def test_delete_of_a_missing_pod_is_gone(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    client, _ = make_client(kube_api, kube_settings)
    outcome = await client.delete_pod(NS, "space-sbx-none-g1", uid="u", resource_version="1")
    assert outcome.result is DeleteResult.GONE
    assert outcome.status == 404
    assert outcome.message == 'pods "space-sbx-none-g1" not found'


async def test_delete_sends_both_preconditions_and_removes_a_terminal_pod(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    pod = emu.create_pod(sandbox_pod("t1", phase="Succeeded"), namespace=NS)
    other = emu.create_pod(sandbox_pod("t2", phase="Succeeded"), namespace=NS)
    client, metrics = make_client(kube_api, kube_settings)
    meta = pod["metadata"]
    outcome = await client.delete_pod(
        NS, "space-sbx-t1-g1", uid=meta["uid"], resource_version=meta["resourceVersion"]
    )
    assert outcome.result is DeleteResult.DELETED
    assert emu.get_pod(NS, "space-sbx-t1-g1") is None
    assert emu.get_pod(NS, "space-sbx-t2-g1") == other
    [entry] = emu.audit_log(method="DELETE")
    assert entry.path == f"/api/v1/namespaces/{NS}/pods/space-sbx-t1-g1"
    assert entry.status == 200
    assert entry.body["preconditions"] == {
        "uid": meta["uid"],
        "resourceVersion": meta["resourceVersion"],
    }
    assert "gracePeriodSeconds" not in entry.body  # settings: None = the pod's own
    assert (
        metrics.registry.get_sample_value(
            "retired_pod_gc_api_requests_total", {"op": "delete", "result": "ok"}
        )
        == 1
    )


async def test_delete_of_a_node_bound_pending_pod_leaves_it_terminating(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    pod = emu.create_pod(sandbox_pod("n1", phase="Pending"), namespace=NS)
    client, _ = make_client(kube_api, kube_settings)
    meta = pod["metadata"]
    outcome = await client.delete_pod(
        NS, "space-sbx-n1-g1", uid=meta["uid"], resource_version=meta["resourceVersion"]
    )
    assert outcome.result is DeleteResult.DELETED
    after = emu.get_pod(NS, "space-sbx-n1-g1")
    assert after is not None
    assert after["metadata"]["deletionTimestamp"]
    assert after["metadata"]["deletionGracePeriodSeconds"] == 30
    assert int(after["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    fresh = await client.get_pod(NS, "space-sbx-n1-g1")
    assert fresh is not None and fresh.terminating
    # Repeating the delete with the old resourceVersion conflicts (the graceful delete bumped it).
    again = await client.delete_pod(
        NS, "space-sbx-n1-g1", uid=meta["uid"], resource_version=meta["resourceVersion"]
    )
    assert again.result is DeleteResult.CONFLICT
    assert emu.finish_terminating() == 1
    assert await client.get_pod(NS, "space-sbx-n1-g1") is None


async def test_configured_grace_period_is_sent(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    pod = emu.create_pod(sandbox_pod("z1", phase="Pending"), namespace=NS)
    client, _ = make_client(kube_api, dataclasses.replace(kube_settings, delete_grace_period_s=0))
    meta = pod["metadata"]
    outcome = await client.delete_pod(
        NS, "space-sbx-z1-g1", uid=meta["uid"], resource_version=meta["resourceVersion"]
    )
    assert outcome.result is DeleteResult.DELETED
    assert emu.get_pod(NS, "space-sbx-z1-g1") is None  # grace 0: gone at once, node or not
    assert emu.audit_log(method="DELETE")[0].body["gracePeriodSeconds"] == 0


async def test_a_failed_delete_raises_as_a_failed_get_does(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    pod = emu.create_pod(sandbox_pod("e1", phase="Succeeded"), namespace=NS)
    meta = pod["metadata"]
    client, _ = make_client(kube_api, dataclasses.replace(kube_settings, api_timeout_s=0.2))
    for method in ("GET", "DELETE"):
        emu.fail_next(1, code=429, method=method, retry_after_s=7)
    with pytest.raises(KubeApiError) as get_error:
        await client.get_pod(NS, "space-sbx-e1-g1")
    with pytest.raises(KubeApiError) as delete_error:
        await client.delete_pod(
            NS, "space-sbx-e1-g1", uid=meta["uid"], resource_version=meta["resourceVersion"]
        )
    for err in (get_error, delete_error):
        assert (err.value.status, err.value.retry_after_s) == (429, 7.0)
    emu.fail_next(1, code=500, method="DELETE")
    with pytest.raises(KubeApiError) as delete_error:
        await client.delete_pod(
            NS, "space-sbx-e1-g1", uid=meta["uid"], resource_version=meta["resourceVersion"]
        )
    assert (delete_error.value.status, delete_error.value.retry_after_s) == (500, None)
    assert emu.get_pod(NS, "space-sbx-e1-g1") is not None  # a failed DELETE deleted nothing
    emu.add_latency(1.0, method="DELETE", count=1)
    with pytest.raises(Unavailable) as unavailable:
        await client.delete_pod(
            NS, "space-sbx-e1-g1", uid=meta["uid"], resource_version=meta["resourceVersion"]
        )
    assert isinstance(unavailable.value.__cause__, TimeoutError)
