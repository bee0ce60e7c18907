"""Retired but kept, end to end: the real ``retired-pod-gc run`` process against the API emulator
and a real PostgreSQL (docs/operations.md, "Retired but kept").

A Running pod whose row is then retired is reported by the notification (one confirming query,
no sweep in between), gets exactly one ``RetiredPodKept`` Warning Event once kept longer than
the (scaled-down) bound, and is listed by ``pending``, ``scan`` and ``explain``; a Running pod whose
row is active is never reported; a kept pod is reported at its own, lower severity. With the
listener down during the COMMIT, the sweep (a scaled-down resync period) reports it, without
any notification. Every wait polls for evidence under a generous overall timeout.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.pg.devdata import seed_execution, seed_sandbox
from service.domain import KEEP_ANNOTATION
from tests.chaos.pgproxy import PgProxy

from .harness import SANDBOX_NAMESPACE, ServiceLauncher, ServiceProcess, run_cli_async, sample

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
BOUND_S = 2
RETIRED = pod_name("retired", 1)
"""Running; its row is retired while the service watches."""
ACTIVE = pod_name("active", 1)
"""Running; its row stays active: never reported."""
KEPT = pod_name("kept", 1)
"""Running, annotated to be kept; its row retired an hour before the service starts."""
LOST = pod_name("lost", 1)
"""Running; its row is retired while the listener is down."""
KEPT_PODS = "retired_pod_gc_retired_kept_pods"
OLDEST = "retired_pod_gc_retired_kept_oldest_seconds"
QUERIES = "retired_pod_gc_row_queries_total"


async def _seed(url: str, emulator: RunningEmulator, rows: dict[str, bool]) -> None:
    """Sandboxes, one generation-1 row each (active or not), and a Running pod each."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        for name, active in rows.items():
            sandbox_id = name.removeprefix("space-sbx-").removesuffix("-g1")
            await seed_sandbox(conn, sandbox_id, namespace=NS)
            await seed_execution(
                conn,
                pod_name=name,
                sandbox_id=sandbox_id,
                execution_state="active" if active else "suspended",
                active=active,
            )
            if not active:
                await conn.execute(
                    "UPDATE sandbox_k8s_executions SET retired_at = now() - interval '1 hour' "
                    "WHERE pod_name = $1",
                    name,
                )
            emulator.emulator.create_pod(
                sandbox_pod(sandbox_id=sandbox_id, generation=1, shape=Shape.RUNNING, namespace=NS)
            )
    finally:
        await conn.close()


async def _retire(url: str, name: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended', "
            "retired_at = now() WHERE pod_name = $1",
            name,
        )
    finally:
        await conn.close()


async def _until(what: str, check: Any, *, timeout_s: float = 60.0) -> None:
    """Poll ``check`` until it holds; fails naming ``what`` after ``timeout_s`` (generous: the
    evidence, not the time, is what the tests judge)."""
    with anyio.move_on_after(timeout_s):
        while not await check():
            await anyio.sleep(0.05)
        return
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def _kept_section(svc: ServiceProcess) -> dict[str, Any]:
    status, body = await svc.get("/debug/pending", debug=True)
    assert status == 200, body
    section: dict[str, Any] = json.loads(body)["retired_kept"]
    return section


def _events(emulator: RunningEmulator, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in emulator.emulator.events.events(NS, "reason=RetiredPodKept")
        if e["regarding"]["name"] == name
    ]


async def test_a_retirement_is_reported_by_its_notification_evented_once_and_listed(
    emulator: RunningEmulator, launcher: ServiceLauncher, pg_url: str
) -> None:
    await _seed(pg_url, emulator, {RETIRED: True, ACTIVE: True, KEPT: False})
    emulator.emulator.patch_pod(NS, KEPT, {"metadata": {"annotations": {KEEP_ANNOTATION: "true"}}})
    svc = launcher.start(
        "gc",
        ENABLED=True,
        DRY_RUN=False,
        LEADER_ELECTION=False,
        DEBUG_PENDING=True,
        KEPT_BOUND_SECONDS=BOUND_S,
        RESYNC_PERIOD_SECONDS=600,
    )
    await svc.wait_for("/readyz", 200, timeout_s=30)

    async def first_sweep_done() -> bool:
        text = await svc.metrics()
        return sample(text, KEPT_PODS, reason="keep_annotation") == 1

    await _until("the kept pod reported by the first sweep", first_sweep_done)
    before = await svc.metrics()
    sweeps = sample(before, QUERIES, kind="kept_sweep")
    confirms = sample(before, QUERIES, kind="kept_confirm")
    assert sweeps == 1 and sample(before, KEPT_PODS, reason="pod_running") == 0

    await _retire(pg_url, RETIRED)

    async def reported() -> bool:
        return sample(await svc.metrics(), KEPT_PODS, reason="pod_running") == 1

    await _until("the retired Running pod in the gauge", reported)
    after = await svc.metrics()
    # By the notification: one confirming query, and no sweep since the COMMIT.
    assert sample(after, QUERIES, kind="kept_sweep") == sweeps
    assert sample(after, QUERIES, kind="kept_confirm") > confirms

    section = await _kept_section(svc)
    pods = {p["key"]: p for p in section["pods"]}
    assert set(pods) == {f"{NS}/{RETIRED}", f"{NS}/{KEPT}"}  # never the active row's pod
    assert (pods[f"{NS}/{RETIRED}"]["reason"], pods[f"{NS}/{RETIRED}"]["severity"]) == (
        "pod_running",
        "warning",
    )
    assert (pods[f"{NS}/{KEPT}"]["reason"], pods[f"{NS}/{KEPT}"]["severity"]) == (
        "keep_annotation",
        "info",
    )
    assert pods[f"{NS}/{RETIRED}"]["since_source"] == "retired_at"
    assert pods[f"{NS}/{KEPT}"]["kept_for_s"] >= 3600

    # One Event each once kept past the bound, and no second one while the pods stay kept (the
    # age gauge shows the view kept ticking for several bounds after the first Event).
    async def evented() -> bool:
        return len(_events(emulator, RETIRED)) >= 1 and len(_events(emulator, KEPT)) >= 1

    await _until("the RetiredPodKept Events", evented)

    async def several_bounds_later() -> bool:
        return sample(await svc.metrics(), OLDEST, reason="pod_running") >= 4 * BOUND_S

    await _until("four bounds of keeping", several_bounds_later)
    [event] = _events(emulator, RETIRED)
    assert len(_events(emulator, KEPT)) == 1
    assert _events(emulator, ACTIVE) == []
    assert event["type"] == "Warning" and event["regarding"]["kind"] == "Pod"
    assert "pod_running" in event["note"] and "(suspended, inactive)" in event["note"]
    assert "since " in event["note"]
    assert sample(await svc.metrics(), KEPT_PODS, reason="pod_running") == 1

    env = launcher.env()
    table = await run_cli_async("pending", "--url", svc.debug_url, env=env)
    assert table.code == 0, table.stderr
    assert "retired but kept: 2 pods" in table.stdout
    assert any(RETIRED in line and "pod_running" in line for line in table.stdout.splitlines())
    explained = await run_cli_async("explain", f"{NS}/{RETIRED}", "--url", svc.debug_url, env=env)
    assert explained.code == 0, explained.stderr
    assert "retired but kept: pod_running (severity warning)" in explained.stdout
    explained_active = await run_cli_async("explain", f"{NS}/{ACTIVE}", env=env)
    assert explained_active.code == 0, explained_active.stderr
    assert "retired but kept" not in explained_active.stdout
    scanned = await run_cli_async("scan", "--output", "json", env=env)
    assert scanned.code == 0, scanned.stderr
    report = json.loads(scanned.stdout)
    assert report["retired_kept_by_reason"] == {"keep_annotation": 1, "pod_running": 1}
    assert {k["pod"] for k in report["retired_kept"]} == {f"{NS}/{RETIRED}", f"{NS}/{KEPT}"}
    svc.assert_running()


def _through(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


async def test_a_retirement_whose_notification_was_lost_is_reported_by_the_sweep(
    emulator: RunningEmulator, launcher: ServiceLauncher, pg_url: str
) -> None:
    await _seed(pg_url, emulator, {LOST: True, ACTIVE: True})
    upstream = urlsplit(pg_url)
    assert upstream.hostname is not None and upstream.port is not None
    proxy = await PgProxy(upstream.hostname, upstream.port).start()
    try:
        svc = launcher.start(
            "gc",
            ENABLED=True,
            DRY_RUN=False,
            LEADER_ELECTION=False,
            DEBUG_PENDING=True,
            RESYNC_PERIOD_SECONDS=3,
            LISTENER_DATABASE_URL=_through(pg_url, proxy.port),
        )
        await svc.wait_for("/readyz", 200, timeout_s=30)

        async def swept() -> bool:
            return sample(await svc.metrics(), QUERIES, kind="kept_sweep") >= 1

        await _until("a first sweep", swept)
    finally:
        await proxy.aclose()  # the listener's link is cut, and every reconnect is refused

    async def listener_down() -> bool:
        return sample(await svc.metrics(), "retired_pod_gc_listener_connected") == 0

    await _until("the listener down", listener_down)
    before = await svc.metrics()
    notifications = sample(before, "retired_pod_gc_notifications_total")
    sweeps = sample(before, QUERIES, kind="kept_sweep")
    await _retire(pg_url, LOST)

    async def reported() -> bool:
        return sample(await svc.metrics(), KEPT_PODS, reason="pod_running") == 1

    await _until("the sweep's report", reported)
    after = await svc.metrics()
    # No notification arrived: the listener stayed down and no suspect was confirmed.
    assert sample(after, "retired_pod_gc_listener_connected") == 0
    assert sample(after, "retired_pod_gc_notifications_total") == notifications
    assert sample(after, QUERIES, kind="kept_confirm") == 0
    assert sample(after, QUERIES, kind="kept_sweep") > sweeps
    section = await _kept_section(svc)
    assert [(p["key"], p["reason"]) for p in section["pods"]] == [(f"{NS}/{LOST}", "pod_running")]
    svc.assert_running()
