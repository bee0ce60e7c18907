"""Heartbeats behind /healthz: a loop that stops beating past its allowance is reported stuck."""

from __future__ import annotations

import pytest

from service.app.health import Heartbeats
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
