"""The one signal policy of every command (``service/app/signals.py``), in this process: a signal
during plain code (imports, configuration, ``config``) exits 128 + signal; in the event loop a
one-shot is cancelled and a draining command gets ``stop`` first; the handlers in force before
are back afterwards. Each signal is sent to this process by the code under test's own thread."""

from __future__ import annotations

import os
import signal
import threading
import time

import anyio
import pytest

from service.app import signals


def _kill_self(signum: signal.Signals) -> None:
    os.kill(os.getpid(), signum)


@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_plain_code_exits_128_plus_the_signal(
    signum: signal.Signals, expected: int, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    reached_the_end = threading.Event()

    def command() -> int:
        _kill_self(signum)
        time.sleep(30)  # the handler raises here, long before this returns
        reached_the_end.set()
        return 0

    assert signals.exit_code_of(command) == expected
    assert not reached_the_end.is_set()
    assert capsys.readouterr().err == f"retired-pod-gc: interrupted by {signum.name}\n"
    assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before


def test_a_command_that_ends_keeps_its_exit_code_and_the_handlers_are_restored() -> None:
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    seen: list[object] = []

    def command() -> int:
        seen.append(signal.getsignal(signal.SIGTERM))
        return 3

    assert signals.exit_code_of(command) == 3
    assert seen and seen[0] not in (signal.SIG_DFL, signal.SIG_IGN, before[signal.SIGTERM])
    assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before


def test_a_one_shot_in_the_event_loop_is_cancelled_by_the_first_signal() -> None:
    finished: list[str] = []

    async def main(stop: anyio.Event) -> int:
        try:
            _kill_self(signal.SIGTERM)
            await anyio.sleep(30)
            return 0
        finally:
            finished.append("cancelled")

    def command() -> int:
        code = signals.run_async(main)
        finished.append("returned")
        return code

    assert signals.exit_code_of(command) == 143
    assert finished == ["cancelled"]


def test_a_draining_command_gets_stop_first_and_a_second_signal_cancels_the_drain() -> None:
    async def drains_when_stopped(stop: anyio.Event) -> int:
        _kill_self(signal.SIGTERM)
        await stop.wait()
        return 0

    assert signals.exit_code_of(lambda: signals.run_async(drains_when_stopped, drains=True)) == 0

    async def drain_that_never_ends(stop: anyio.Event) -> int:
        _kill_self(signal.SIGINT)
        await stop.wait()
        _kill_self(signal.SIGTERM)
        await anyio.sleep(30)
        return 0

    code = signals.exit_code_of(lambda: signals.run_async(drain_that_never_ends, drains=True))
    assert code == 143


def test_the_plain_code_after_the_event_loop_is_still_covered() -> None:
    async def main(stop: anyio.Event) -> int:
        return 0

    def command() -> int:
        assert signals.run_async(main) == 0
        _kill_self(signal.SIGINT)  # after the loop closed: the raising handler is back
        time.sleep(30)
        return 0

    assert signals.exit_code_of(command) == 130


def test_what_the_command_raises_passes_through_unwrapped() -> None:
    class Failure(Exception):
        pass

    async def main(stop: anyio.Event) -> int:
        raise Failure("boom")

    with pytest.raises(Failure, match="boom"):
        signals.run_async(main)
