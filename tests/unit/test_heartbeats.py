"""Heartbeats behind /healthz: a loop that stops beating past its allowance is reported stuck."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from service.app.health import Heartbeats
from service.app.service import WATCHDOG_ALLOWANCE_S, WATCHDOG_PERIOD_S, _watchdog
from tests.virtualtime import advance


@pytest.mark.anyio
async def test_a_loop_is_stuck_only_after_its_allowance_without_a_beat() -> None:
    beats = Heartbeats()
    beats.register("event-loop", 15.0)
    beats.register("workers", 90.0)
    await advance(14.0)
    assert beats.stuck() == []
    beats.beat("event-loop")
    await advance(14.0)
    assert beats.stuck() == []
    await advance(2.0)
    assert beats.stuck() == ["event-loop"]
    await advance(61.0)
    assert beats.stuck() == ["event-loop", "workers"]
    beats.beat("event-loop")
    beats.beat("workers")
    assert beats.stuck() == []


@pytest.mark.anyio
async def test_the_watchdog_beats_for_the_workers_while_the_controller_finishes_reconciles() -> (
    None
):
    controller = SimpleNamespace(reconciles_done=0)
    queue = ["key"]
    parts = SimpleNamespace(
        heartbeats=Heartbeats(),
        settings=SimpleNamespace(reconcile_timeout_s=1.0),
        controller=controller,
        queue=queue,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watchdog, parts)
        await advance(WATCHDOG_ALLOWANCE_S + 2)
        assert parts.heartbeats.stuck() == ["workers"]  # keys ready, none finished
        controller.reconciles_done += 3
        await advance(2 * WATCHDOG_PERIOD_S)
        assert parts.heartbeats.stuck() == []
        queue.clear()  # nothing ready: no progress expected
        await advance(WATCHDOG_ALLOWANCE_S + 2)
        assert parts.heartbeats.stuck() == []
        tg.cancel_scope.cancel()
