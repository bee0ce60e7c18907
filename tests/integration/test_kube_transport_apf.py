"""The transport on the emulator's priority level of one seat (429 beyond it,
``devtools/emulator/flowcontrol.py``): every request ends answered and every Event is
written."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.flowcontrol import FlowControl
from service.config import KubeSettings
from service.domain import ExecutionState, Verdict
from service.kube.api import new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.events import KubeEventRecorder
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from service.ports import ReapReport
from tests.integration.test_engine_safety import (
    eventually,
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
def emulator_options() -> dict[str, object]:
    """Every user's requests on a priority level of one seat."""
    return {
        "bookmark_interval_s": 0.2,
        "history_size": 10_000,
        "flow_control": FlowControl(seats=1),
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


def flow(emulator: RunningEmulator) -> FlowControl:
    control = emulator.emulator.flow_control
    assert control is not None
    return control


async def test_on_a_level_of_one_seat_every_request_is_answered_and_every_event_written(
    emulator: RunningEmulator, api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    names = []
    for i in range(40):
        created = emu.create_pod(sandbox_pod(f"s{i:02d}"), namespace=NS)
        names.append(created["metadata"]["name"])
    client, metrics = pod_client(api, kube_settings)
    recorder = KubeEventRecorder(api, instance="gc-1", metrics=metrics, timeout_s=5.0)
    found: list[str] = []

    async def get(name: str) -> None:
        pod = await client.get_pod(NS, name)
        assert pod is not None
        found.append(pod.name)
        recorder.record(
            ReapReport(
                pod=pod,
                verdict=Verdict.TERMINAL_RETIRED,
                rule="test",
                reapable_for_s=1.0,
                row_state=ExecutionState.SUSPENDED,
                dry_run=False,
            )
        )

    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run)
        async with anyio.create_task_group() as gets:
            for name in names:  # 40 GETs at once on one seat, Events written beside them
                gets.start_soon(get, name)
        # Stored by the server is not yet answered to the recorder: wait for its count too.
        await eventually(
            lambda: (
                metric(metrics.registry, "retired_pod_gc_events_total", result="created")
                == len(names)
            ),
            "every Event written and counted",
        )
        tg.cancel_scope.cancel()
    assert len(emu.events.events(NS)) == len(names)  # each once: none written twice
    assert sorted(found) == sorted(names)
    registry = metrics.registry
    rejected = sum(flow(emulator).rejected.values())
    assert rejected > 0  # the level was fought for: 429s came, and each was sent again
    assert metric(registry, "retired_pod_gc_api_throttled_total", action="retried") == rejected
    assert metric(registry, "retired_pod_gc_api_throttled_total", action="returned") == 0
    # The limit came down from the pool size.
    assert api.limit.slots < 32
