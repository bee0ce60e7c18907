"""Events never in the way of a delete, with the whole service in-process (the harness of
``test_engine_safety``): the Events API answering 403, 500 or not at all leaves every DELETE
as it is — the same pods, each once, with the preconditions of the pod as created, none before
its threshold — and every failed write is counted. A working Events API gets one Event per
deleted UID, regarding that UID, with the verdict in its note."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape
from service.kube.events import REASON_DELETED
from service.metrics import EventResult
from tests.integration.test_engine_safety import (
    NS,
    TERMINAL,
    create_pod,
    deletes,
    eventually,
    outcome,
    preconditions,
    running_service,
    sample,
    seed_row,
)

pytestmark = pytest.mark.anyio
THRESHOLD_S = 1.0
PODS = 3
EVENTS_PATH = f"/apis/events.k8s.io/v1/namespaces/{NS}/events"


def event_results(parts: Any) -> dict[str, int]:
    counts = {r: int(sample(parts, "retired_pod_gc_events_total", result=r)) for r in EventResult}
    return {r: n for r, n in counts.items() if n}


@pytest.mark.parametrize("fault", ["none", "403", "500", "hang"])
async def test_events_api_failures_leave_every_delete_unchanged(
    fault: str, emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    created: dict[str, tuple[str, str]] = {}
    for i in range(PODS):
        name = await seed_row(pg_conn, f"ev{i}", active=False, state="suspended")
        pod = create_pod(emu, f"ev{i}", Shape.SUCCEEDED)
        created[name] = (pod["metadata"]["uid"], pod["metadata"]["resourceVersion"])
    if fault in ("403", "500"):
        emu.fail_next(100, code=int(fault), method="POST", path_contains=EVENTS_PATH)
    elif fault == "hang":
        # Far longer than the test: the first Event write is still waiting when it ends.
        emu.add_latency(600.0, method="POST", path_contains=EVENTS_PATH)
    # Taken before the service starts: no clock can have started earlier.
    not_before_s = time.time() + THRESHOLD_S
    async with running_service(
        emulator, pg_url, THRESHOLD_SECONDS=THRESHOLD_S, API_TIMEOUT_SECONDS=60
    ) as parts:
        await eventually(lambda: len(deletes(emu)) >= PODS, "every DELETE")
        await eventually(lambda: outcome(parts, TERMINAL) >= PODS, "every outcome")
        if fault == "hang":
            # Every DELETE went out while the first Event write was still hanging.
            assert sum(r.method == "POST" for r in emu.requests) == 1
            assert parts.recorder is not None
            assert parts.recorder.pending == PODS
            assert event_results(parts) == {}
        else:
            expected = {"none": "created", "403": "forbidden", "500": "server_error"}[fault]
            await eventually(
                lambda: event_results(parts) == {expected: PODS}, f"{PODS} {expected} Events"
            )
    sent = deletes(emu)
    assert sorted(d.path.rsplit("/", 1)[-1] for d in sent) == sorted(created)
    for d in sent:
        assert d.status == 200
        assert preconditions(d) == created[d.path.rsplit("/", 1)[-1]]
        assert d.time_s >= not_before_s
    assert outcome(parts, TERMINAL) == PODS
    events = emu.events.events(NS)
    if fault != "none":
        assert events == []
        if fault == "hang":
            # The shutdown flush is bounded: the hanging write and the rest are dropped.
            assert event_results(parts) == {"dropped_shutdown": PODS}
        return
    by_uid = {e["regarding"]["uid"]: e for e in events}
    assert len(events) == PODS
    assert set(by_uid) == {uid for uid, _ in created.values()}
    for name, (uid, rv) in created.items():
        event = by_uid[uid]
        assert (event["reason"], event["regarding"]["name"]) == (REASON_DELETED, name)
        assert event["regarding"]["resourceVersion"] == rv
        assert TERMINAL in event["note"]
        assert f"uid={uid} resourceVersion={rv}" in event["note"]
