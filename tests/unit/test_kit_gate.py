"""The kit's Gate: a dependency's shared backoff (one probe a step, released on an answer)."""

from __future__ import annotations

import pytest

from service.kit.backoff import Backoff
from service.kit.gate import Gate, Ticket
from tests.virtualtime import advance

pytestmark = pytest.mark.anyio


def _gate() -> tuple[Gate, list[str]]:
    gate = Gate("database", Backoff(initial_s=1.0, max_s=4.0))
    seen: list[str] = []
    gate.on_open(lambda: seen.append("open"))
    gate.on_change(lambda closed: seen.append("closed" if closed else "opened"))
    return gate, seen


def _ticket(answer: Ticket | float) -> Ticket:
    assert isinstance(answer, Ticket), answer
    return answer


async def test_an_open_gate_admits_everyone_and_an_answer_changes_nothing() -> None:
    gate, seen = _gate()
    tickets = [_ticket(gate.admit()) for _ in range(100)]
    assert not any(t.probe for t in tickets)
    for ticket in tickets:
        gate.succeeded(ticket)
    assert not gate.closed and seen == []


async def test_no_answer_holds_every_caller_but_one_probe_a_step_capped() -> None:
    gate, seen = _gate()
    in_flight = [_ticket(gate.admit()) for _ in range(50)]
    gate.failed(in_flight[0])
    assert gate.closed and seen == ["closed"]
    # The other calls that were in flight fail too: the step stays where the first put it.
    for ticket in in_flight[1:]:
        gate.failed(ticket)
    assert gate.failures == 1
    assert gate.admit() == pytest.approx(1.0)
    sent = 0
    for step_s in (1.0, 2.0, 4.0, 4.0, 4.0):
        await advance(step_s - 0.01)
        assert not isinstance(gate.admit(), Ticket)  # not before the next attempt time
        await advance(0.01)
        probe = _ticket(gate.admit())
        assert probe.probe
        sent += 1
        # While the probe is out, everyone else is held.
        assert all(not isinstance(gate.admit(), Ticket) for _ in range(1000))
        gate.failed(probe)
    assert sent == 5 and seen == ["closed"]


async def test_the_first_answer_opens_the_gate_and_wakes_the_held_callers() -> None:
    gate, seen = _gate()
    gate.failed(_ticket(gate.admit()))
    await advance(1.0)
    probe = _ticket(gate.admit())
    gate.succeeded(probe)
    assert not gate.closed and seen == ["closed", "opened", "open"]
    assert not _ticket(gate.admit()).probe
    assert gate.retry_in_s() == 0.0


async def test_an_abandoned_probe_gives_its_slot_back_without_moving_the_step() -> None:
    gate, _ = _gate()
    gate.failed(_ticket(gate.admit()))
    await advance(1.0)
    probe = _ticket(gate.admit())
    gate.abandoned(probe)  # cancelled, say
    assert _ticket(gate.admit()).probe  # the next caller probes at once
    assert gate.failures == 1
