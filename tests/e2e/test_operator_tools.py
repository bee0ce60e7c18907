"""What an operator uses on a running replica, end to end: the real ``retired-pod-gc run`` process
(leader election on) against the API emulator and a real PostgreSQL, on the demo's population,
and the CLI as real processes beside it.

One of the two retired pods is kept with the keep annotation. ``retired-pod-gc pending`` lists
exactly the other one, due one threshold after its clock started, and its DELETE comes no sooner;
the kept pod is never deleted until the annotation is removed, and then no sooner than one full
threshold after the removal. While ``pending`` runs, single-pod GETs fail (500), so the one clock
keeps running however long the process takes to start.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

import anyio
import pytest

from devtools.demo import POPULATION
from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape
from service.domain import KEEP_ANNOTATION

from .harness import (
    SANDBOX_NAMESPACE,
    ServiceLauncher,
    lease_holder,
    present,
    run_cli_async,
    seed_population,
    wait_until,
)

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
THRESHOLD_S = 2.0
KEPT = next(p.name for p in POPULATION if p.expect_deleted and p.shape is Shape.SUCCEEDED)
DUE = next(p.name for p in POPULATION if p.expect_deleted and p.name != KEPT)


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _deletes(emulator: RunningEmulator, name: str) -> list[float]:
    return [
        e.time_s
        for e in emulator.emulator.audit_log(method="DELETE", path_contains=f"/pods/{name}")
        if e.status == 200
    ]


async def test_pending_lists_the_running_clock_and_a_kept_pod_waits_for_its_release(
    emulator: RunningEmulator, launcher: ServiceLauncher, pg_url: str
) -> None:
    emu = emulator.emulator
    created = await seed_population(pg_url, emu)
    emu.patch_pod(NS, KEPT, {"metadata": {"annotations": {KEEP_ANNOTATION: "true"}}})
    emu.fail_next(
        100_000, code=500, method="GET", path_contains=f"/namespaces/{NS}/pods/space-sbx-"
    )
    svc = launcher.start(
        "gc", ENABLED=True, DRY_RUN=False, THRESHOLD_SECONDS=THRESHOLD_S, DEBUG_PENDING=True
    )
    await svc.wait_for("/readyz", 200)
    await wait_until(lambda: lease_holder(emu) == "gc", timeout_s=15, what="the lease")

    async def one_clock() -> None:
        """One running clock, and the annotated pod known as retired but kept: the kept view
        learns of it from its own row query, which may come after the clock starts."""
        while True:
            status, body = await svc.get("/debug/pending", debug=True)
            if status == 200:
                document = json.loads(body)
                kept_pods = (document.get("retired_kept") or {}).get("pods", [])
                if document["count"] == 1 and any(KEPT in str(p) for p in kept_pods):
                    return
            await anyio.sleep(0.05)

    with anyio.fail_after(20):
        await one_clock()
    table = await run_cli_async("pending", "--url", svc.debug_url, env=launcher.env())
    explained = await run_cli_async(
        "explain", f"{NS}/{KEPT}", "--url", svc.debug_url, env=launcher.env()
    )
    assert table.code == 0, table.stderr
    clocks, _, kept = table.stdout.partition("\n\n")
    header, _columns, *rows = clocks.splitlines()
    # Its execution retired, the annotated pod is listed apart, as retired but kept.
    assert kept.startswith("retired but kept: ")
    assert any(
        line.split()[:3] == [f"{NS}/{KEPT}", "keep_annotation", "info"]
        for line in kept.splitlines()
    )
    assert "mode live, active true" in header and "1 pods with a running clock" in header
    [row] = rows
    key, uid, verdict, since, due_at, _due_in, _waits = row.split()
    assert (key, uid) == (f"{NS}/{DUE}", created[DUE]["metadata"]["uid"])
    assert verdict == "replaced_never_started"
    assert _ts(due_at) - _ts(since) == pytest.approx(THRESHOLD_S, abs=1e-5)
    # explain's own GET fails too while the fault holds; what it says is one line, no traceback
    assert explained.code == 1 and "Traceback" not in explained.stderr
    emu.clear_faults()

    await wait_until(lambda: DUE not in present(emu), timeout_s=20, what="the due pod deleted")
    [deleted_at] = _deletes(emulator, DUE)
    assert deleted_at >= _ts(due_at)
    # The kept pod outlives two more thresholds, then explain shows why.
    await anyio.sleep(2 * THRESHOLD_S)
    assert KEPT in present(emu) and _deletes(emulator, KEPT) == []
    explained = await run_cli_async(
        "explain", f"{NS}/{KEPT}", "--url", svc.debug_url, env=launcher.env()
    )
    assert explained.code == 0, explained.stderr
    assert "decision: skip keep_annotation" in explained.stdout
    assert f"live clock ({svc.debug_url}): none runs for this pod" in explained.stdout

    released_at = time.time()
    emu.patch_pod(NS, KEPT, {"metadata": {"annotations": {KEEP_ANNOTATION: None}}})
    await wait_until(lambda: KEPT not in present(emu), timeout_s=20, what="the released pod")
    [kept_deleted_at] = _deletes(emulator, KEPT)
    assert kept_deleted_at >= released_at + THRESHOLD_S
    svc.assert_running()
