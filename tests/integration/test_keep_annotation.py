"""The keep annotation with the whole service in-process (the harness of ``test_engine_safety``:
real client over HTTP against the emulator, real PostgreSQL, real listener), in live and dry run.

A retired pod annotated ``retired-pod-gc.space.sandbox/keep: "true"`` is never deleted nor
reported while a control pod beside it, identical but for the annotation, is; once the annotation
is removed, its observation clock starts at the removal (read from the service's own clocks,
on the same monotonic clock) and it is acted on one full threshold after that.
"""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import pytest

from devtools.emulator import Emulator, RunningEmulator
from devtools.emulator.sandboxpods import Shape
from service.domain import KEEP_ANNOTATION, SkipReason
from service.kube.events import REASON_DELETED, REASON_WOULD_DELETE
from tests.fakes import clock_of
from tests.integration.test_engine_safety import (
    NS,
    TERMINAL,
    create_pod,
    deletes,
    eventually,
    outcome,
    running_service,
    sample,
    seed_row,
    sleep_until_wall,
)
from tests.pgfixtures import set_execution

pytestmark = pytest.mark.anyio
THRESHOLD_S = 1.5


def _events_for(emu: Emulator, uid: str) -> list[dict[str, Any]]:
    return [e for e in emu.events.events(NS) if e["regarding"]["uid"] == uid]


@pytest.mark.parametrize("dry_run", [False, True], ids=["live", "dry_run"])
async def test_a_kept_pod_is_never_acted_on_and_is_one_full_threshold_after_release(
    dry_run: bool, emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    mode = "dry_run" if dry_run else "live"
    reason = REASON_WOULD_DELETE if dry_run else REASON_DELETED
    kept = await seed_row(pg_conn, "keep1", active=False, state="suspended")
    control = await seed_row(pg_conn, "ctrl1", active=False, state="suspended")
    kept_uid = create_pod(emu, "keep1", Shape.SUCCEEDED)["metadata"]["uid"]
    emu.patch_pod(NS, kept, {"metadata": {"annotations": {KEEP_ANNOTATION: "true"}}})
    control_uid = create_pod(emu, "ctrl1", Shape.SUCCEEDED)["metadata"]["uid"]
    t0 = time.time()
    async with running_service(
        emulator, pg_url, THRESHOLD_SECONDS=THRESHOLD_S, DRY_RUN=dry_run
    ) as parts:
        # The control pod is acted on after its threshold: the service is doing its job...
        await eventually(lambda: len(_events_for(emu, control_uid)) == 1, "the control's Event")
        # ...and two thresholds later the kept pod still has no clock, no DELETE, no report. A
        # kept pod fails the prefilter, so only a row notification makes it reconciled: skipped
        # with its own reason.
        await eventually(lambda: parts.listener.connected, "the LISTEN")
        await set_execution(pg_conn, kept, active=False, execution_state="stopped")
        await sleep_until_wall(t0 + 2 * THRESHOLD_S)
        await eventually(
            lambda: (
                sample(parts, "retired_pod_gc_skips_total", reason=SkipReason.KEEP_ANNOTATION) >= 1
            ),
            "the keep_annotation skip",
        )
        assert parts.clocks.uid_for(f"{NS}/{kept}") is None
        assert deletes(emu, kept) == []
        assert _events_for(emu, kept_uid) == []
        assert outcome(parts, TERMINAL, mode=mode) == 1

        before_removal = time.monotonic()  # the service's clock is time.monotonic too
        wall_before_removal = time.time()
        emu.patch_pod(NS, kept, {"metadata": {"annotations": {KEEP_ANNOTATION: None}}})
        await eventually(
            lambda: parts.clocks.uid_for(f"{NS}/{kept}") == kept_uid, "the kept pod's clock"
        )
        observation = clock_of(parts.clocks, kept_uid)
        assert observation is not None
        assert observation.since_s >= before_removal
        since_s = observation.since_s
        await eventually(lambda: len(_events_for(emu, kept_uid)) == 1, "the released pod's Event")
        assert outcome(parts, TERMINAL, mode=mode) == 2
    [event] = _events_for(emu, kept_uid)
    assert event["reason"] == reason
    # "Reapable continuously for Ns": the service's own measure of the clock it acted on
    note = str(event["note"])
    reapable_s = float(note.split("Reapable continuously for ", 1)[1].split("s;", 1)[0])
    assert reapable_s >= THRESHOLD_S - 0.5  # the note rounds to whole seconds
    assert [e["reason"] for e in _events_for(emu, control_uid)] == [reason]
    if dry_run:
        assert emu.audit_log(method="DELETE") == []
        assert emu.get_pod(NS, control) is not None
        assert emu.get_pod(NS, kept) is not None
        return
    assert [d.status for d in deletes(emu, control)] == [200]
    [sent] = deletes(emu, kept)
    assert sent.status == 200
    assert sent.time_s >= wall_before_removal + THRESHOLD_S
    assert since_s >= before_removal
