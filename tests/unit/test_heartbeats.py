"""Heartbeats behind /healthz: a loop that stops beating past its allowance is reported stuck."""

from __future__ import annotations

from service.app.health import Heartbeats
from service.kit.clock import FakeClock


def test_a_loop_is_stuck_only_after_its_allowance_without_a_beat() -> None:
    clock = FakeClock()
    beats = Heartbeats(clock=clock)
    beats.register("event-loop", 15.0)
    beats.register("workers", 90.0)
    clock.advance(14.0)
    assert beats.stuck() == []
    beats.beat("event-loop")
    clock.advance(14.0)
    assert beats.stuck() == []
    clock.advance(2.0)
    assert beats.stuck() == ["event-loop"]
    clock.advance(61.0)
    assert beats.stuck() == ["event-loop", "workers"]
    beats.beat("event-loop")
    beats.beat("workers")
    assert beats.stuck() == []
