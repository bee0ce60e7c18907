"""Notification batches through the whole service (the harness of ``test_engine_safety``: real
PostgreSQL with trigger 0003, the API emulator over HTTP, the service in-process).

One UPDATE retires 9,999 rows and re-activates one row whose clock is running: the trigger
sends the statement as a few batches, and the batch holding the re-activation must clear that
pod's clock the moment the listener hands it over — before its key, deduplicated among 10,000,
is reconciled, and so before any DELETE could be sent — while the clocks of the pods the
statement did not touch run on untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from service.domain import ExecutionChange, pod_key
from tests.fakes import clock_of
from tests.integration.test_engine_safety import NS, deletes, eventually, running_service

pytestmark = pytest.mark.anyio

EARLY = 100
"""Pods retired first (their clocks run when the big statement comes); one is re-activated."""
BATCH = 10_000
"""Rows the big statement changes: the re-activation and 9,999 retirements."""


def _name(i: int) -> str:
    return f"space-sbx-{i:012x}-g1"


async def _seed(conn: asyncpg.Connection, count: int) -> None:
    await conn.execute(
        "INSERT INTO sandboxes SELECT lpad(to_hex(i), 12, '0'), $1, 'kubernetes'"
        " FROM generate_series(0, $2 - 1) i",
        NS,
        count,
    )
    await conn.execute(
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active)"
        " SELECT lpad(to_hex(i), 12, '0'), 1, 0, 'space-sbx-' || lpad(to_hex(i), 12, '0') || '-g1',"
        " 'create', 'active', true FROM generate_series(0, $1 - 1) i",
        count,
    )


async def test_a_reactivation_inside_a_10000_row_batch_clears_exactly_its_clock_at_arrival(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    total = EARLY + BATCH - 1
    template = sandbox_pod(sandbox_id="x", generation=1, shape=Shape.SUCCEEDED)
    del template["metadata"]["name"]
    emu.bulk_create_pods(namespace=NS, count=total, template=template)
    await _seed(pg_conn, total)
    early = [_name(i) for i in range(EARLY)]
    later = [_name(i) for i in range(EARLY, total)]
    flipped = early[EARLY // 2]
    flipped_key = pod_key(NS, flipped)
    # A long threshold: no DELETE can be due during the test, so any clock seen is the one the
    # retirement started, and what is cleared is cleared by an event. No periodic delivery probe
    # within the test either (the first after 300 s; the one at connect still proves delivery):
    # on a loaded machine, with the service's loop busy with 10,000 changes, a probe at the
    # suite's 0.2 s cadence can miss its 1 s bound, and the listener then rightly reconnects and
    # clears every clock (a different event from the one this test judges).
    async with running_service(
        emulator, pg_url, THRESHOLD_SECONDS=3600, LISTENER_HEARTBEAT_SECONDS=300
    ) as parts:
        await eventually(lambda: parts.listener.connected, "the LISTEN")
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended'"
            " WHERE pod_name = ANY($1)",
            early,
        )
        await eventually(lambda: len(parts.clocks) == EARLY, "the early clocks")
        early_since = {
            n: clock_of(parts.clocks, parts.clocks.uid_for(pod_key(NS, n)) or "") for n in early
        }
        assert all(o is not None for o in early_since.values())

        controller = parts.controller
        original = controller.executions_changed
        seen: list[dict[str, Any]] = []

        def observing(changes: Sequence[ExecutionChange]) -> None:
            added: list[str] = []
            add = parts.queue.add

            def recording(*keys: str) -> None:
                added.extend(keys)
                add(*keys)

            parts.queue.add = recording  # type: ignore[method-assign]
            try:
                original(changes)
            finally:
                del parts.queue.add
            # Right after the handler returned, before any reconcile of this batch can run.
            if any(c.pod_name == flipped for c in changes):
                seen.append(
                    {
                        "batch": len(changes),
                        "flipped_clock": parts.clocks.uid_for(flipped_key),
                        "early_clocks": sum(
                            parts.clocks.uid_for(pod_key(NS, n)) is not None for n in early
                        ),
                        "flipped_reconciling": flipped_key in parts.queue.processing,
                        "flipped_queued": flipped_key in added,
                        "deletes": len(deletes(emu)),
                    }
                )

        controller.executions_changed = observing  # type: ignore[method-assign]
        # One statement: the re-activation and 9,999 retirements.
        status = await pg_conn.execute(
            "UPDATE sandbox_k8s_executions"
            " SET active = (pod_name = $1),"
            "     execution_state = CASE WHEN pod_name = $1 THEN 'active' ELSE 'replaced' END"
            " WHERE pod_name = $1 OR pod_name = ANY($2)",
            flipped,
            later,
        )
        assert status == f"UPDATE {BATCH}"
        await eventually(lambda: len(parts.clocks) == EARLY - 1 + len(later), "the later clocks")
        await eventually(lambda: not len(parts.queue) and not parts.queue.processing, "idle")

    # The statement arrived in several batches, and the one with the re-activation cleared its
    # clock on arrival: with the key still waiting in the queue, nothing deleted.
    assert len(seen) == 1
    (arrival,) = seen
    assert 1 < arrival["batch"] < BATCH
    assert arrival["flipped_clock"] is None
    assert arrival["early_clocks"] == EARLY - 1
    assert arrival["flipped_queued"] and not arrival["flipped_reconciling"]
    assert arrival["deletes"] == 0
    # Afterwards: exactly that clock is gone; every other early clock ran on from where it was;
    # every retirement of the statement started one.
    assert parts.clocks.uid_for(flipped_key) is None
    for name in early:
        if name == flipped:
            continue
        observation = clock_of(parts.clocks, parts.clocks.uid_for(pod_key(NS, name)) or "")
        assert observation == early_since[name]
    assert all(parts.clocks.uid_for(pod_key(NS, n)) is not None for n in later)
    assert deletes(emu) == []
