"""The live view's document on fakes and virtual time: exactly the running clocks, each due one
threshold after it started, and what each waits for (threshold, verification, budget, reported)
as the pipeline moves it along; its table and ``explain``'s live-clock lines."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import anyio
import pytest

from service.app.pending import live_clock_lines, pending_document, pending_lines
from service.domain import ExecutionChange, ExecutionState, Outcome, Verdict
from service.kit import clock
from tests.fakes import EngineRig, make_pending_pod, make_pod, make_rig, make_row, make_settings
from tests.virtualtime import settle

pytestmark = pytest.mark.anyio
THRESHOLD_S = 300.0
WALL_OFFSET_S = 1_796_000_000.0
"""The wall clock reads this much more than the fake monotonic clock."""


def _doc(rig: EngineRig, **options: Any) -> dict[str, Any]:
    now = clock.now()
    return pending_document(
        clocks=rig.clocks,
        threshold_s=rig.settings.threshold_s,
        mode=rig.settings.mode,
        active=rig.controller.active,
        now_s=now,
        wall_offset_s=WALL_OFFSET_S,
        **options,
    )


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


async def test_lists_exactly_the_running_clocks_each_due_one_threshold_after_it_started() -> None:
    rig = make_rig(make_settings(threshold_s=THRESHOLD_S))
    terminal, stuck = make_pod("a"), make_pending_pod("b")
    rig.add(terminal, make_row(terminal))
    rig.add(stuck, make_row(stuck, state=ExecutionState.REPLACED))
    active_row = make_pod("c")
    rig.add(active_row, make_row(active_row, active=True))
    started = clock.now()
    assert (await rig.reconcile(terminal.key)).outcome == Outcome.TOO_YOUNG
    await rig.advance(10)
    assert (await rig.reconcile(stuck.key)).outcome == Outcome.TOO_YOUNG
    assert (await rig.reconcile(active_row.key)).outcome == Outcome.SKIPPED
    await rig.advance(5)
    doc = _doc(rig)
    assert (doc["mode"], doc["active"], doc["threshold_s"], doc["count"]) == (
        "live",
        True,
        THRESHOLD_S,
        2,
    )
    first, second = doc["pods"]
    assert (first["key"], first["uid"], first["verdict"]) == (
        terminal.key,
        terminal.uid,
        str(Verdict.TERMINAL_RETIRED),
    )
    assert (second["key"], second["verdict"]) == (stuck.key, str(Verdict.REPLACED_NEVER_STARTED))
    assert _ts(first["observed_since"]) == pytest.approx(started + WALL_OFFSET_S, abs=1e-3)
    assert _ts(first["due_at"]) == pytest.approx(started + THRESHOLD_S + WALL_OFFSET_S, abs=1e-3)
    assert _ts(second["due_at"]) == pytest.approx(
        started + 10 + THRESHOLD_S + WALL_OFFSET_S, abs=1e-3
    )
    assert (first["observed_for_s"], first["due_in_s"]) == (15.0, THRESHOLD_S - 15)
    assert {p["waits_for"] for p in doc["pods"]} == {"threshold"}
    # a clock cleared by an event leaves the view at once
    rig.controller.executions_changed(
        [ExecutionChange(stuck.namespace, stuck.name, active=True, state=ExecutionState.ACTIVE)]
    )
    assert [p["key"] for p in _doc(rig)["pods"]] == [terminal.key]


async def test_a_limit_shows_the_soonest_due_and_a_key_shows_one_pod() -> None:
    rig = make_rig(make_settings(threshold_s=THRESHOLD_S))
    pods = [make_pod(f"p{i}") for i in range(5)]
    for pod in reversed(pods):  # the last is observed first, so it is due first
        rig.add(pod, make_row(pod), event=False)
        await rig.reconcile(pod.key)
        await rig.advance(1)
    doc = _doc(rig, limit=2)
    assert (doc["count"], doc["shown"]) == (5, 2)
    assert [p["key"] for p in doc["pods"]] == [pods[4].key, pods[3].key]
    assert [p["key"] for p in _doc(rig)["pods"]] == [p.key for p in reversed(pods)]
    [one] = _doc(rig, key=pods[2].key)["pods"]
    assert (one["key"], one["uid"]) == (pods[2].key, pods[2].uid)
    assert _doc(rig, key="sandboxes/space-sbx-none-g1")["pods"] == []
    header = pending_lines(doc)[0]
    assert "5 pods with a running clock, the 2 soonest due shown" in header


async def test_a_due_pod_waits_for_verification_then_the_budget_then_leaves_when_deleted() -> None:
    # One DELETE per 10 s: b's wait for the budget is within the reconciler's 15 s for a turn.
    rig = make_rig(make_settings(threshold_s=THRESHOLD_S, deletes_per_minute=1), budget_window_s=10)
    a, b = make_pod("a"), make_pod("b")
    for pod in (a, b):
        rig.add(pod, make_row(pod), event=False)
        assert (await rig.reconcile(pod.key)).outcome == Outcome.TOO_YOUNG
    await rig.advance(THRESHOLD_S)
    assert {p["waits_for"] for p in _doc(rig)["pods"]} == {"verification"}
    assert (await rig.reconcile(a.key)).outcome == Verdict.TERMINAL_RETIRED
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.reconcile, b.key)
        await settle()
        # b is verified and in line for the budget's next grant, 10 s after a's
        [entry] = _doc(rig)["pods"]
        assert (entry["key"], entry["waits_for"]) == (b.key, "budget")
        await rig.advance(10)
    assert _doc(rig)["pods"] == []
    assert rig.pods.deleted_keys == [a.key, b.key]


async def test_a_dry_run_shows_a_reported_pod_as_reported() -> None:
    rig = make_rig(make_settings(threshold_s=THRESHOLD_S, dry_run=True))
    pod = make_pod("a")
    rig.add(pod, make_row(pod), event=False)
    await rig.reconcile(pod.key)
    await rig.advance(THRESHOLD_S)
    assert (await rig.reconcile(pod.key)).outcome == Verdict.TERMINAL_RETIRED
    [entry] = _doc(rig)["pods"]
    assert (entry["waits_for"], entry["due_in_s"]) == ("reported", 0.0)
    assert _doc(rig)["mode"] == "dry_run"


def test_the_table_and_the_live_clock_lines() -> None:
    doc = {
        "mode": "live",
        "active": True,
        "threshold_s": 300.0,
        "now": "2026-12-01T00:00:00.000000Z",
        "count": 1,
        "pods": [
            {
                "key": "sandboxes/space-sbx-a-g1",
                "uid": "uid-a",
                "verdict": "terminal_retired",
                "observed_since": "2026-11-30T23:59:00.000000Z",
                "due_at": "2026-12-01T00:04:00.000000Z",
                "observed_for_s": 60.0,
                "due_in_s": 240.0,
                "waits_for": "threshold",
            }
        ],
    }
    header, columns, row = pending_lines(doc)
    assert "1 pods with a running clock" in header and "threshold 300.0s" in header
    assert columns.split()[:2] == ["KEY", "UID"]
    assert row.split() == [
        "sandboxes/space-sbx-a-g1",
        "uid-a",
        "terminal_retired",
        "2026-11-30T23:59:00.000000Z",
        "2026-12-01T00:04:00.000000Z",
        "240.0s",
        "threshold",
    ]
    assert pending_lines({**doc, "count": 0, "pods": []})[1:] == []
    url = "http://127.0.0.1:8080"
    [live] = live_clock_lines("sandboxes/space-sbx-a-g1", url, doc)
    assert "due at 2026-12-01T00:04:00.000000Z" in live and "waits for threshold" in live
    [none] = live_clock_lines("sandboxes/other", url, doc)
    assert "none runs for this pod" in none
    [unknown] = live_clock_lines("sandboxes/other", url, "could not reach it: refused")
    assert unknown == "live clock: unknown, could not reach it: refused"
    [not_asked] = live_clock_lines("sandboxes/other", None, None)
    assert "not asked" in not_asked
