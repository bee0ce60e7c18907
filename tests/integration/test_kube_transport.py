"""The API client's transport (``service/kube/transport.py``) with the real ``kubernetes_asyncio``
client against the emulator over HTTP: 429s retried after their Retry-After (a DELETE's never),
the adaptive limit halved by them, credentials read again at a 401 (one refused request when the
token file was rotated; one warning line and unready when it was not), and the request slot the
reconciler holds across its final check."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import certifi
import pytest

from devtools.emulator import RunningEmulator
from service.config import KubeSettings
from service.domain import DeleteResult
from service.kube.api import TokenFile, new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.errors import KubeApiError
from service.kube.transport import MAX_THROTTLE_RETRIES, ApiTransport
from service.metrics import KubeMetrics
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod
from tests.pgfixtures import metric

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
POD = "space-sbx-t1-g1"
POD_PATH = f"/api/v1/namespaces/{NS}/pods/{POD}"


@pytest.fixture
def token_path(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-one\n")
    return path


@pytest.fixture
async def api(
    event_loop_guard: None, emulator: RunningEmulator, token_path: Path
) -> AsyncIterator[ApiTransport]:
    client = await new_api_client(host=emulator.url, token_file=str(token_path))
    try:
        yield client
    finally:
        await client.close()


def pod_client(api: ApiTransport, settings: KubeSettings) -> tuple[KubePodClient, KubeMetrics]:
    metrics = api.metrics
    return KubePodClient(api, settings, PodDecoder(settings.label_keys), metrics), metrics


def statuses(emulator: RunningEmulator, method: str, path: str = POD_PATH) -> list[int]:
    return [r.status for r in emulator.emulator.requests if (r.method, r.path) == (method, path)]


async def test_a_throttled_get_is_sent_again_after_its_retry_after_and_halves_the_limit(
    emulator: RunningEmulator, api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    client, metrics = pod_client(api, kube_settings)
    emu.fail_next(3, code=429, method="GET", path_contains=POD, retry_after_s=0)
    fresh = await client.get_pod(NS, POD)
    assert fresh is not None
    assert statuses(emulator, "GET") == [429, 429, 429, 200]
    assert metric(metrics.registry, "retired_pod_gc_api_throttled_total", action="retried") == 3
    assert metric(metrics.registry, "retired_pod_gc_api_throttled_total", action="returned") == 0
    # Each retry was sent after the last decrease: 32 -> 16 -> 8 -> 4.
    assert api.limit.slots == 4
    assert metric(metrics.registry, "retired_pod_gc_api_concurrency_limit") == 4


async def test_retries_are_bounded_and_the_last_429_goes_back_to_the_caller(
    emulator: RunningEmulator, api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    client, metrics = pod_client(api, kube_settings)
    emu.fail_next(100, code=429, method="GET", path_contains=POD, retry_after_s=0)
    with pytest.raises(KubeApiError) as err:
        await client.get_pod(NS, POD)
    assert err.value.status == 429
    assert statuses(emulator, "GET") == [429] * (1 + MAX_THROTTLE_RETRIES)
    assert metric(metrics.registry, "retired_pod_gc_api_throttled_total", action="returned") == 1
    assert api.limit.slots == 1  # the floor


async def test_a_retry_after_longer_than_the_timeout_goes_back_at_once(
    emulator: RunningEmulator, api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    client, _ = pod_client(api, kube_settings)  # api_timeout_s 5
    emu.fail_next(1, code=429, method="GET", path_contains=POD, retry_after_s=30)
    with pytest.raises(KubeApiError) as err:
        await client.get_pod(NS, POD)
    assert (err.value.status, err.value.retry_after_s) == (429, 30.0)
    assert statuses(emulator, "GET") == [429]


async def test_a_throttled_delete_is_never_sent_twice(
    emulator: RunningEmulator, api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    created = emu.create_pod(sandbox_pod("t1"), namespace=NS)
    meta = created["metadata"]
    client, metrics = pod_client(api, kube_settings)
    emu.fail_next(1, code=429, method="DELETE", retry_after_s=0)
    with pytest.raises(KubeApiError) as err:
        await client.delete_pod(NS, POD, uid=meta["uid"], resource_version=meta["resourceVersion"])
    assert (err.value.status, err.value.retry_after_s) == (429, 0.0)
    assert statuses(emulator, "DELETE") == [429]
    assert emu.get_pod(NS, POD) is not None
    assert metric(metrics.registry, "retired_pod_gc_api_throttled_total", action="returned") == 1
    assert api.limit.slots == 16  # the DELETE's 429 counts for the limit too


async def test_a_rotated_token_costs_one_refused_request(
    emulator: RunningEmulator,
    api: ApiTransport,
    kube_settings: KubeSettings,
    token_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    client, metrics = pod_client(api, kube_settings)
    assert api.configuration.api_key["BearerToken"] == "Bearer token-one"
    token_path.write_text("token-two\n")  # rotated; the periodic read is a minute away
    emu.fail_next(1, code=401, method="GET", path_contains=POD)
    assert await client.get_pod(NS, POD) is not None
    assert statuses(emulator, "GET") == [401, 200]
    assert api.configuration.api_key["BearerToken"] == "Bearer token-two"
    assert metric(metrics.registry, "retired_pod_gc_api_credential_reloads_total", result="changed")
    assert api.problem is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_refused_token_not_rotated_warns_once_and_makes_the_replica_unready(
    emulator: RunningEmulator,
    api: ApiTransport,
    kube_settings: KubeSettings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    client, metrics = pod_client(api, kube_settings)
    emu.fail_next(6, code=401, method="GET", path_contains=POD)
    for _ in range(3):
        with pytest.raises(KubeApiError) as err:
            await client.get_pod(NS, POD)
        assert err.value.status == 401
    # The token read again was the same: no request was sent twice.
    assert statuses(emulator, "GET") == [401, 401, 401]
    registry = metrics.registry
    assert metric(registry, "retired_pod_gc_api_credential_reloads_total", result="unchanged") == 3
    assert metric(registry, "retired_pod_gc_api_unauthorized_answers_total") == 3
    assert metric(registry, "retired_pod_gc_api_unauthorized") == 1
    problem = api.problem
    assert problem is not None and "401" in problem
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "refuses the credentials" in warnings[0]
    emu.clear_faults()
    assert await client.get_pod(NS, POD) is not None
    assert api.problem is None
    assert metric(registry, "retired_pod_gc_api_unauthorized") == 0


async def test_a_refused_delete_is_not_sent_again_and_the_next_one_carries_the_new_token(
    emulator: RunningEmulator,
    api: ApiTransport,
    kube_settings: KubeSettings,
    token_path: Path,
) -> None:
    emu = emulator.emulator
    created = emu.create_pod(sandbox_pod("t1"), namespace=NS)
    meta = created["metadata"]
    client, _ = pod_client(api, kube_settings)
    token_path.write_text("token-two\n")
    emu.fail_next(1, code=401, method="DELETE")
    with pytest.raises(KubeApiError) as err:
        await client.delete_pod(NS, POD, uid=meta["uid"], resource_version=meta["resourceVersion"])
    assert err.value.status == 401
    assert statuses(emulator, "DELETE") == [401]
    # Read again at the 401: the reconciler's next DELETE carries the new token.
    assert api.configuration.api_key["BearerToken"] == "Bearer token-two"
    outcome = await client.delete_pod(
        NS, POD, uid=meta["uid"], resource_version=meta["resourceVersion"]
    )
    assert outcome.result is DeleteResult.DELETED
    assert statuses(emulator, "DELETE") == [401, 200]


async def test_the_slot_held_across_the_final_check_serves_its_requests_and_no_other(
    event_loop_guard: None, emulator: RunningEmulator, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    for name in ("t1", "t2"):
        emu.create_pod(sandbox_pod(name), namespace=NS)
    # A pool of one: the limit is one request at a time and cannot grow.
    api = await new_api_client(host=emulator.url, pool_size=1)
    try:
        client, _ = pod_client(api, kube_settings)
        limit = api.limit
        order: list[str] = []
        holding = anyio.Event()
        release = anyio.Event()

        async def reconciler() -> None:
            async with client.delete_slot():
                holding.set()
                # A re-verification's GET and then the DELETE, in the slot already held: were
                # a second slot taken, this would wait forever (the limit is one).
                fresh = await client.get_pod(NS, POD)
                assert fresh is not None
                order.append("reconciler GET")
                await release.wait()
                outcome = await client.delete_pod(
                    NS, POD, uid=fresh.uid, resource_version=fresh.resource_version
                )
                assert outcome.result is DeleteResult.DELETED
                order.append("reconciler DELETE")

        async def other() -> None:
            await holding.wait()
            await client.get_pod(NS, "space-sbx-t2-g1")
            order.append("other GET")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reconciler)
                tg.start_soon(other)
                while "reconciler GET" not in order:
                    await anyio.sleep(0.01)
                assert (limit.in_flight, limit.waiting) == (1, 1)  # the other GET waits
                release.set()
        assert order == ["reconciler GET", "reconciler DELETE", "other GET"]
        assert limit.in_flight == 0
    finally:
        await api.close()


async def test_in_cluster_the_token_file_is_the_credentials_read_again(
    event_loop_guard: None, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("sa-token-1")
    ca = certifi.where()  # any CA bundle: it is loaded, never used (no request is made)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.MonkeyPatch.context() as patch:
        # The library reads the CA's path from its module constant; the file must exist.
        patch.setattr("kubernetes_asyncio.config.incluster_config.SERVICE_CERT_FILENAME", ca)
        api = await new_api_client(env=env, token_file=str(token))
    try:
        assert api.configuration.host == "https://10.0.0.1:443"
        assert api.configuration.api_key["BearerToken"] == "Bearer sa-token-1"
        token.write_text("sa-token-2")
        credentials = api.credentials
        assert isinstance(credentials, TokenFile)
        assert credentials.path == token
        await credentials.reload(api.configuration)  # what a 401 does
        assert api.configuration.api_key["BearerToken"] == "Bearer sa-token-2"
    finally:
        await api.close()
