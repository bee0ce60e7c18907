"""Cancel-create cleanup with a real PostgreSQL, the emulator and the real pod client: the fenced
retire, then a delete under the UID of a pod whose labels match — or nothing at all."""

from __future__ import annotations

import os
from typing import Any

import anyio
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.pg.devdata import seed_execution, seed_sandbox
from service.app.cancel_create import CancelOutcome, CancelReport, cancel_create
from service.config import KubeSettings
from service.domain import KEEP_ANNOTATION
from service.kit.errors import Unavailable
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.errors import KubeApiError
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from service.pg.errors import DatabaseError
from tests.kubefixtures import eventually

pytestmark = pytest.mark.anyio

NS = "sandboxes"
SID = "canc0001"
NAME = pod_name(SID, 1)


@pytest.fixture
def pods(kube_api: ApiTransport, kube_settings: KubeSettings) -> KubePodClient:
    return KubePodClient(
        kube_api, kube_settings, PodDecoder(kube_settings.label_keys), KubeMetrics()
    )


async def _seed(
    conn: asyncpg.Connection, *, attempt: int = 0, state: str = "active", active: bool = True
) -> None:
    await seed_sandbox(conn, SID, namespace=NS)
    await seed_execution(
        conn,
        pod_name=NAME,
        sandbox_id=SID,
        generation=1,
        activation_attempt=attempt,
        execution_state=state,
        active=active,
    )


def _create_pod(running: RunningEmulator, **labels: str) -> dict[str, Any]:
    body = sandbox_pod(sandbox_id=SID, generation=1, shape=Shape.PENDING_STUCK, namespace=NS)
    body["metadata"]["labels"].update(labels)
    return running.emulator.create_pod(body)


async def _row(conn: asyncpg.Connection) -> tuple[bool, str, int]:
    r = await conn.fetchrow(
        "SELECT active, execution_state, activation_attempt FROM sandbox_k8s_executions "
        "WHERE pod_name = $1",
        NAME,
    )
    assert r is not None
    return r["active"], r["execution_state"], r["activation_attempt"]


async def _cancel(conn: asyncpg.Connection, pods: KubePodClient, attempt: int = 0) -> CancelReport:
    return await cancel_create(
        conn=conn,
        pods=pods,
        namespaces=(NS,),
        sandbox_id=SID,
        generation=1,
        activation_attempt=attempt,
        timeout_s=5.0,
    )


def _deletes(running: RunningEmulator) -> list[Any]:
    return running.emulator.audit_log(method="DELETE", path_contains=f"/pods/{NAME}")


async def test_active_matching_attempt_is_retired_and_its_pod_deleted_under_its_uid(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    await _seed(pg_conn)
    pod = _create_pod(emulator)
    report = await _cancel(pg_conn, pods)
    assert report == CancelReport(CancelOutcome.DELETED, True, NAME, "")
    assert await _row(pg_conn) == (False, "cancelled", 0)
    (delete,) = _deletes(emulator)
    assert delete.status == 200
    assert delete.body["preconditions"] == {
        "uid": pod["metadata"]["uid"],
        "resourceVersion": pod["metadata"]["resourceVersion"],
    }
    # Node-bound and not terminal: the API server marks it terminating (the kubelet finishes).
    after = emulator.emulator.get_pod(NS, NAME)
    assert after is None or after["metadata"].get("deletionTimestamp")


async def test_already_retired_by_another_writer_still_deletes_the_pod(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    await _seed(pg_conn, state="replaced", active=False)
    pod = _create_pod(emulator)
    report = await _cancel(pg_conn, pods)
    assert report.outcome is CancelOutcome.DELETED
    assert report.retired_now is False
    # The other writer's state is kept: the fenced UPDATE matched nothing.
    assert await _row(pg_conn) == (False, "replaced", 0)
    (delete,) = _deletes(emulator)
    assert delete.body["preconditions"]["uid"] == pod["metadata"]["uid"]


async def test_a_newer_activation_keeps_its_row_and_its_pod(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    await _seed(pg_conn, attempt=1)  # the row is a newer activation of the same generation
    _create_pod(emulator)
    report = await _cancel(pg_conn, pods, attempt=0)
    assert report == CancelReport(CancelOutcome.LEFT_ALONE_ACTIVE, False, NAME)
    assert await _row(pg_conn) == (True, "active", 1)
    assert _deletes(emulator) == []
    assert emulator.emulator.get_pod(NS, NAME) is not None


@pytest.mark.parametrize(
    "labels",
    [{"space.sandbox-id": "other001"}, {"space.generation": "2"}],
    ids=["other-sandbox", "other-generation"],
)
async def test_a_pod_recreated_under_the_name_with_other_labels_is_left_alone(
    emulator: RunningEmulator,
    pg_conn: asyncpg.Connection,
    pods: KubePodClient,
    labels: dict[str, str],
) -> None:
    await _seed(pg_conn)
    _create_pod(emulator, **labels)
    report = await _cancel(pg_conn, pods)
    assert report.outcome is CancelOutcome.LEFT_ALONE_OTHER_POD
    assert report.retired_now is True
    assert _deletes(emulator) == []
    assert emulator.emulator.get_pod(NS, NAME) is not None


@pytest.mark.parametrize("value", ["true", "yes-please"])
async def test_a_kept_pod_is_left_alone_and_deleted_once_released(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient, value: str
) -> None:
    emu = emulator.emulator
    await _seed(pg_conn)
    _create_pod(emulator)
    emu.patch_pod(NS, NAME, {"metadata": {"annotations": {KEEP_ANNOTATION: value}}})
    report = await _cancel(pg_conn, pods)
    assert report.outcome is CancelOutcome.LEFT_ALONE_KEPT
    assert report.retired_now is True
    assert f"annotate pod {NAME} {KEEP_ANNOTATION}-" in report.detail
    assert await _row(pg_conn) == (False, "cancelled", 0)
    assert _deletes(emulator) == []
    kept = emu.get_pod(NS, NAME)
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")

    # Released (`kubectl annotate pod ... keep-`): run again, the pod is deleted.
    released = emu.patch_pod(NS, NAME, {"metadata": {"annotations": {KEEP_ANNOTATION: None}}})
    assert KEEP_ANNOTATION not in (released["metadata"].get("annotations") or {})
    again = await _cancel(pg_conn, pods)
    assert again == CancelReport(CancelOutcome.DELETED, False, NAME, "")
    (delete,) = _deletes(emulator)
    assert delete.body["preconditions"] == {
        "uid": released["metadata"]["uid"],
        "resourceVersion": released["metadata"]["resourceVersion"],
    }


async def test_a_pod_replaced_between_get_and_delete_survives(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    emu = emulator.emulator
    await _seed(pg_conn)
    old = _create_pod(emulator)
    emu.add_latency(0.3, method="DELETE", path_contains=f"/pods/{NAME}", count=1)
    seen = len(emu.requests)
    result: list[CancelReport] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            result.append(await _cancel(pg_conn, pods))

        tg.start_soon(run)
        await eventually(
            lambda: any(r.method == "DELETE" for r in list(emu.requests)[seen:]), timeout_s=5
        )
        # While the DELETE is on its way, the pod is force-deleted and recreated (new UID).
        emu.delete_pod(NS, NAME, grace_period_s=0)
        new = _create_pod(emulator)
    assert result[0].outcome is CancelOutcome.CONFLICT
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    survivor = emu.get_pod(NS, NAME)
    assert survivor is not None
    assert survivor["metadata"]["uid"] == new["metadata"]["uid"]
    assert not survivor["metadata"].get("deletionTimestamp")


async def test_no_pod_and_no_execution(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    assert (await _cancel(pg_conn, pods)).outcome is CancelOutcome.NO_EXECUTION
    await _seed(pg_conn)
    report = await _cancel(pg_conn, pods)
    assert report == CancelReport(CancelOutcome.POD_ABSENT, True, NAME)
    assert _deletes(emulator) == []


async def test_a_retire_the_server_refuses_raises_database_error_and_deletes_nothing(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    await _seed(pg_conn)
    _create_pod(emulator)
    role = f"rpg_read_only_{os.getpid()}"
    await pg_conn.execute(f"DROP ROLE IF EXISTS {role}")
    await pg_conn.execute(f"CREATE ROLE {role} NOLOGIN")
    await pg_conn.execute(f"GRANT SELECT ON sandboxes, sandbox_k8s_executions TO {role}")
    try:
        await pg_conn.execute(f"SET ROLE {role}")
        with pytest.raises(DatabaseError) as raised:
            await _cancel(pg_conn, pods)
        assert raised.value.sqlstate == "42501"  # insufficient_privilege
        assert isinstance(raised.value.__cause__, asyncpg.InsufficientPrivilegeError)
    finally:
        await pg_conn.execute("RESET ROLE")
        await pg_conn.execute(f"DROP OWNED BY {role}")
        await pg_conn.execute(f"DROP ROLE {role}")
    assert await _row(pg_conn) == (True, "active", 0)
    assert _deletes(emulator) == []


async def test_a_retire_on_a_closed_connection_raises_unavailable_and_deletes_nothing(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    await _seed(pg_conn)
    _create_pod(emulator)
    closed = await asyncpg.connect(pg_url)
    await closed.close()
    with pytest.raises(Unavailable) as raised:
        await _cancel(closed, pods)
    assert isinstance(raised.value.__cause__, asyncpg.InterfaceError)
    assert await _row(pg_conn) == (True, "active", 0)
    assert _deletes(emulator) == []


async def test_a_failed_get_or_delete_of_the_pod_raises_alike_and_running_again_deletes_it(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    await _seed(pg_conn)
    pod = _create_pod(emulator)
    emu = emulator.emulator
    emu.fail_next(1, code=503, method="GET", path_contains=f"/pods/{NAME}")
    with pytest.raises(KubeApiError) as get_failed:
        await _cancel(pg_conn, pods)
    emu.fail_next(1, code=503, method="DELETE", path_contains=f"/pods/{NAME}")
    with pytest.raises(KubeApiError) as delete_failed:
        await _cancel(pg_conn, pods)
    assert (get_failed.value.status, delete_failed.value.status) == (503, 503)
    assert await _row(pg_conn) == (False, "cancelled", 0)  # retired by the first call
    assert [d.status for d in _deletes(emulator)] == [503]
    assert emu.get_pod(NS, NAME) is not None
    report = await _cancel(pg_conn, pods)
    assert report == CancelReport(CancelOutcome.DELETED, False, NAME, "")
    assert _deletes(emulator)[-1].body["preconditions"]["uid"] == pod["metadata"]["uid"]


async def test_with_several_namespaces_the_pod_is_deleted_in_its_sandbox_namespace_only(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    other = "tenant-b"
    await seed_sandbox(pg_conn, SID, namespace=other)
    await seed_execution(pg_conn, pod_name=NAME, sandbox_id=SID, generation=1)
    # A pod of that name in each namespace: only the sandbox's own namespace holds its pod.
    decoy = _create_pod(emulator)
    body = sandbox_pod(sandbox_id=SID, generation=1, shape=Shape.PENDING_STUCK, namespace=other)
    theirs = emulator.emulator.create_pod(body)
    report = await cancel_create(
        conn=pg_conn,
        pods=pods,
        namespaces=(NS, other),
        sandbox_id=SID,
        generation=1,
        activation_attempt=0,
        timeout_s=5.0,
    )
    assert report == CancelReport(CancelOutcome.DELETED, True, NAME, "")
    (delete,) = _deletes(emulator)
    assert delete.path == f"/api/v1/namespaces/{other}/pods/{NAME}"
    assert delete.body["preconditions"]["uid"] == theirs["metadata"]["uid"]
    assert emulator.emulator.get_pod(NS, NAME) == decoy


async def test_a_sandbox_of_a_namespace_not_configured_is_left_alone(
    emulator: RunningEmulator, pg_conn: asyncpg.Connection, pods: KubePodClient
) -> None:
    await seed_sandbox(pg_conn, SID, namespace="elsewhere")
    await seed_execution(pg_conn, pod_name=NAME, sandbox_id=SID, generation=1)
    body = sandbox_pod(
        sandbox_id=SID, generation=1, shape=Shape.PENDING_STUCK, namespace="elsewhere"
    )
    emulator.emulator.create_pod(body)
    report = await _cancel(pg_conn, pods)
    assert report.outcome is CancelOutcome.NO_EXECUTION and not report.retired_now
    assert await _row(pg_conn) == (True, "active", 0)
    assert _deletes(emulator) == []
