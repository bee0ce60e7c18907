"""The transport against the emulator's bearer-token authentication
(``devtools/emulator/auth.py``): a rotated token file costs one 401, a token revoked and not
replaced warns once and makes the replica unready, and the service reaps through a rotation."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.auth import TokenAuth
from devtools.emulator.sandboxpods import Shape
from service.config import KubeSettings
from service.kube.api import new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.errors import KubeApiError
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from tests.integration.test_engine_safety import (
    create_pod,
    deletes,
    eventually,
    running_service,
    sample,
    seed_row,
)
from tests.kubefixtures import SANDBOX_NAMESPACE, sandbox_pod
from tests.pgfixtures import metric

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
USER = "system:serviceaccount:retired-pod-gc:retired-pod-gc"


@pytest.fixture
def token_path(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-one\n")
    return path


@pytest.fixture
def emulator_options(token_path: Path) -> dict[str, object]:
    """Tokens checked against the file: a new token in it revokes the old one at once."""
    return {
        "bookmark_interval_s": 0.2,
        "history_size": 10_000,
        "auth": TokenAuth(token_file=token_path, token_file_user=USER),
    }


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


async def test_a_rotated_token_file_costs_one_401(
    emulator: RunningEmulator,
    api: ApiTransport,
    kube_settings: KubeSettings,
    token_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    client, metrics = pod_client(api, kube_settings)
    assert await client.get_pod(NS, "space-sbx-t1-g1") is not None
    token_path.write_text("token-two\n")  # the old token is revoked at once
    assert await client.get_pod(NS, "space-sbx-t1-g1") is not None
    assert emu.auth.unauthorized == 1
    assert (
        metric(metrics.registry, "retired_pod_gc_api_credential_reloads_total", result="changed")
        == 1
    )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_rotated_token_first_refused_on_a_delete_is_no_standing_refusal(
    emulator: RunningEmulator,
    api: ApiTransport,
    kube_settings: KubeSettings,
    token_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by the simulator (a rotation whose first refused request is a DELETE, seed 142):
    # the DELETE is not sent again, its 401 goes back to the caller, and the next one carries
    # the token read at that 401; no warning, never unready (docs/operations.md, token rotated).
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    client, metrics = pod_client(api, kube_settings)
    transport = api
    assert transport is not None
    pod = await client.get_pod(NS, "space-sbx-t1-g1")
    assert pod is not None
    token_path.write_text("token-two\n")  # the old token is revoked at once
    with pytest.raises(KubeApiError) as err:
        await client.delete_pod(NS, pod.name, uid=pod.uid, resource_version=pod.resource_version)
    assert err.value.status == 401
    assert transport.problem is None
    assert metric(metrics.registry, "retired_pod_gc_api_unauthorized_answers_total") == 0
    outcome = await client.delete_pod(
        NS, pod.name, uid=pod.uid, resource_version=pod.resource_version
    )
    assert outcome.status == 200
    assert emu.auth.unauthorized == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_revoked_token_not_replaced_warns_once_is_unready_and_recovers(
    emulator: RunningEmulator,
    kube_settings: KubeSettings,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emu = emulator.emulator
    emu.create_pod(sandbox_pod("t1"), namespace=NS)
    token = emu.auth.issue(USER)
    own = tmp_path / "own-token"
    own.write_text(token)
    api = await new_api_client(host=emulator.url, token_file=str(own))
    try:
        client, metrics = pod_client(api, kube_settings)
        transport = api
        assert transport is not None
        assert await client.get_pod(NS, "space-sbx-t1-g1") is not None
        emu.auth.revoke(token)
        for _ in range(3):
            with pytest.raises(KubeApiError) as err:
                await client.get_pod(NS, "space-sbx-t1-g1")
            assert err.value.status == 401
        assert emu.auth.unauthorized == 3  # none sent twice: the token read again was the same
        assert transport.problem is not None
        assert metric(metrics.registry, "retired_pod_gc_api_unauthorized") == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert "refuses the credentials" in warnings[0]
        emu.auth.issue(USER, token=token)  # accepted again
        assert await client.get_pod(NS, "space-sbx-t1-g1") is not None
        assert transport.problem is None
    finally:
        await api.close()


async def test_the_service_reaps_through_a_rotation_and_is_unready_while_refused(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection, token_path: Path
) -> None:
    emu = emulator.emulator
    name = await seed_row(pg_conn, "r1", active=True, state="active")
    create_pod(emu, "r1", Shape.SUCCEEDED)
    with pytest.MonkeyPatch.context() as patch:
        # The service's client reads the test's token file (the in-cluster path otherwise).
        real = new_api_client

        async def with_token(**kwargs: object) -> ApiTransport:
            return await real(**kwargs, token_file=str(token_path))  # type: ignore[arg-type]

        patch.setattr("tests.integration.test_engine_safety.new_api_client", with_token)
        async with running_service(emulator, pg_url, THRESHOLD_SECONDS=1) as parts:
            token_path.write_text("token-two\n")  # rotated: the old token is refused from now
            await pg_conn.execute(
                "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended'"
                " WHERE pod_name = $1",
                name,
            )
            await eventually(lambda: [e.status for e in deletes(emu, name)] == [200], "DELETE")
            assert emu.auth.unauthorized <= 1
            # The token refused from now on and not replaced: unready, nothing crashes.
            emu.auth.token_file = None
            emu.drop_watches()  # the informer's next request meets the refusal
            await eventually(
                lambda: sample(parts, "retired_pod_gc_api_unauthorized") == 1, "the refusal"
            )
            port = parts.health.bound_port
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/readyz") as response,
            ):
                assert response.status == 503
                assert "kubernetes api: credentials refused" in await response.text()
