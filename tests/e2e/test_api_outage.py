"""The real service through a TCP proxy that black-holes every connection to the API server (no
reset, no bytes; new connections accepted and black-holed too), then restores it: scaled settings
(API timeout 1 s, watch silence bound 2 s, bookmarks every 0.5 s, threshold 2 s, Lease 3/2/0.3 s).

While black-holed: ``/readyz`` fails with the cause ("kubernetes api: no answer for Ns") and
``retired_pod_gc_api_reachable`` is 0, and nothing reaches the API server. After the restore
(black-holed connections stay dead, as after a dropped conntrack entry): the pod whose row was
retired during the outage is deleted, with its preconditions, exactly once; the pod whose row
stayed active is not; readiness and the gauge come back. The seconds from the restore to the
DELETE are recorded (``record_property``), not asserted: ``benchmarks/blackhole.py`` (B11)
measures them at the default settings.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.pg.devdata import seed_execution, seed_sandbox, set_execution
from service.pg.migrate import migrate
from tests.kubeproxy import proxied

from .harness import (
    LEASE_NAMESPACE,
    SANDBOX_NAMESPACE,
    ServiceLauncher,
    ServiceProcess,
    lease_holder,
    present,
    sample,
    wait_until,
)

pytestmark = pytest.mark.anyio

RETIRED = pod_name("outage00", 1)
KEPT = pod_name("outage01", 1)
GIVE_UP_S = 60.0
"""Only a bound on a hung test: nothing here is judged by the seconds it took."""


async def _seed(url: str, emu: Any) -> dict[str, str]:
    """Two Succeeded pods with active rows; name → uid."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrate(conn, channel="sandbox_execution_changed", with_schema=True)
        uids = {}
        for sandbox_id in ("outage00", "outage01"):
            await seed_sandbox(conn, sandbox_id, namespace=SANDBOX_NAMESPACE)
            await seed_execution(conn, pod_name=pod_name(sandbox_id, 1), sandbox_id=sandbox_id)
            created = emu.create_pod(
                sandbox_pod(sandbox_id=sandbox_id, generation=1, shape=Shape.SUCCEEDED),
                namespace=SANDBOX_NAMESPACE,
            )
            uids[pod_name(sandbox_id, 1)] = created["metadata"]["uid"]
        return uids
    finally:
        await conn.close()


async def _retire(url: str, name: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await set_execution(conn, name, active=False, execution_state="replaced")
    finally:
        await conn.close()


async def _readyz(svc: ServiceProcess) -> tuple[int, str]:
    return await svc.get("/readyz")


async def _gauge(svc: ServiceProcess, name: str) -> float:
    return sample(await svc.metrics(), name)


async def _until(what: str, predicate: Any, svc: ServiceProcess) -> None:
    started = time.monotonic()
    while not await predicate():
        svc.assert_running()
        if time.monotonic() - started > GIVE_UP_S:
            raise AssertionError(f"gave up after {GIVE_UP_S:.0f}s waiting for {what}")
        await anyio.sleep(0.05)


async def test_an_outage_of_every_connection_is_reported_and_the_pods_retired_in_it_are_reaped(
    emulator: RunningEmulator, pg_url: str, tmp_path: Path, record_property: Any
) -> None:
    emu = emulator.emulator
    emu.ensure_namespace(LEASE_NAMESPACE)
    uids = await _seed(pg_url, emu)
    async with proxied(emulator) as proxy:
        launcher = ServiceLauncher(tmp_path=tmp_path, emulator_url=proxy.url, database_url=pg_url)
        try:
            svc = launcher.start(
                "outage",
                ENABLED=True,
                DRY_RUN=False,
                THRESHOLD_SECONDS=2,
                API_TIMEOUT_SECONDS=1,
                WATCH_SILENCE_SECONDS=2,
            )
            await svc.wait_for("/readyz", 200, timeout_s=GIVE_UP_S)
            await wait_until(lambda: lease_holder(emu) == "outage", timeout_s=GIVE_UP_S)

            async def bookmarked() -> bool:
                # The silence bound applies once a periodic bookmark came.
                metrics = await svc.metrics()
                return sample(metrics, "retired_pod_gc_watch_events_total", type="BOOKMARK") >= 2

            await _until("a periodic bookmark", bookmarked, svc)
            assert await _gauge(svc, "retired_pod_gc_api_reachable") == 1

            proxy.blackhole_all()
            await _retire(pg_url, RETIRED)
            requests_in = len(emu.audit_log())

            async def unready() -> bool:
                status, body = await _readyz(svc)
                return status == 503 and "kubernetes api: no answer for" in body

            await _until("/readyz 503 naming the API server", unready, svc)
            assert await _gauge(svc, "retired_pod_gc_api_reachable") == 0
            # The outage lasts on: the watch and the Lease keep failing (backoffs grow).
            await anyio.sleep(6)
            status, body = await _readyz(svc)
            assert status == 503, body
            assert "kubernetes api: no answer for" in body, body
            assert await _gauge(svc, "retired_pod_gc_api_last_answer_age_seconds") >= 6
            assert len(emu.audit_log()) == requests_in, "nothing reached the API server"
            assert present(emu) == {RETIRED, KEPT}

            proxy.restore()
            restored = time.time()
            await wait_until(
                lambda: RETIRED not in present(emu),
                timeout_s=GIVE_UP_S,
                what="the pod retired during the outage deleted",
            )
            deletes = [
                d
                for d in emu.audit_log(
                    method="DELETE", path_contains=f"/namespaces/{SANDBOX_NAMESPACE}/pods/"
                )
                if d.status < 300
            ]
            assert [d.path.rsplit("/", 1)[-1] for d in deletes] == [RETIRED]
            (delete,) = deletes
            assert delete.body["preconditions"]["uid"] == uids[RETIRED]
            assert delete.time_s > restored
            record_property("restore_to_delete_s", round(delete.time_s - restored, 2))

            async def ready() -> bool:
                status, _ = await _readyz(svc)
                return status == 200

            await _until("/readyz 200 again", ready, svc)
            assert await _gauge(svc, "retired_pod_gc_api_reachable") == 1
            assert KEPT in present(emu)
            svc.assert_running()
        finally:
            launcher.close()
