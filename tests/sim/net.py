"""What every model shares: the loop, the trace, and the faults drawn from the seed.

A call of an adapter model goes out, reaches its server after an uplink latency (where it takes
effect, at that virtual instant), and its answer comes back after a downlink latency. Both are
drawn from the seed (whole milliseconds, so that completions often coincide and the loop's
permutation decides their order), and so is whether the call fails on the way. Faults are
*armed* by the schedule's steps (the next N calls of a kind fail, the next N are slow) and also
drawn at random for every call while the seed's fault phase lasts (:attr:`Net.p_fail`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any


class Trace:
    """The seed's trace: one line per model event, in virtual-time order."""

    __slots__ = ("lines", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(f"{self.loop.time():.6f} {line}")


class Net:
    """Latencies and faults, drawn from one seeded RNG in call order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rng: random.Random, trace: Trace) -> None:
        self.loop = loop
        self.at = loop.call_later  # type: ignore[method-assign]
        self.rng = rng
        self.trace = trace
        self.faults_on = True
        self.p_fail = 0.0
        """Probability that any one call fails on the way (while ``faults_on``)."""
        self.p_slow = 0.0
        """Probability that any one call is slow (up to ``slow_s``)."""
        self.slow_s = 0.3
        self.max_ms = 3
        """Usual latency, each way: 0..max_ms whole milliseconds."""
        self.armed: dict[str, list[Any]] = {}
        """Faults armed by steps: op -> [what, ...] consumed in order by the next calls."""

    def lift(self) -> None:
        self.faults_on = False
        self.armed.clear()

    def arm(self, op: str, what: Any, count: int = 1) -> None:
        if self.faults_on:
            self.armed.setdefault(op, []).extend([what] * count)

    def take_armed(self, op: str) -> Any:
        armed = self.armed.get(op)
        if armed:
            return armed.pop(0)
        return None

    def latency(self) -> float:
        """One way, in whole milliseconds (occasionally slow while faults are on)."""
        rng = self.rng
        ms = int(rng.random() * (self.max_ms + 1))
        if self.p_slow and self.faults_on and rng.random() < self.p_slow:
            ms += int(rng.random() * self.slow_s * 1000)
        return ms / 1000.0

    def fails(self) -> bool:
        return self.faults_on and self.p_fail > 0 and self.rng.random() < self.p_fail

    def at(
        self, delay_s: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle:
        """``callback(*args)`` after ``delay_s`` of virtual time (the loop's ``call_later``:
        :meth:`__init__` binds it in place of this method, saving a frame a call)."""
        return self.loop.call_later(delay_s, callback, *args)


class Call:
    """One request in flight: it reaches the server at a set time whatever the caller does
    (cancelling the caller does not unsend it), and the caller waits for the answer at most
    ``timeout_s`` (then ``TimeoutError``, as aiohttp's total timeout and asyncpg's ``timeout=``
    raise)."""

    __slots__ = ("_down", "_fut", "_net", "_timer")

    def __init__(self, net: Net, timeout_s: float | None) -> None:
        self._net = net
        self._fut: asyncio.Future[Any] = net.loop.create_future()
        self._timer = net.at(timeout_s, self._timed_out) if timeout_s is not None else None
        self._down = 0.0

    def _timed_out(self) -> None:
        if not self._fut.done():
            self._fut.set_exception(TimeoutError())

    def answer(self, value: Any, down_s: float | None = None) -> None:
        """Send the answer back (it arrives after a downlink latency)."""
        self._net.at(self._net.latency() if down_s is None else down_s, self._deliver, value, None)

    def fail(self, exc: BaseException, down_s: float | None = None) -> None:
        self._net.at(self._net.latency() if down_s is None else down_s, self._deliver, None, exc)

    def deliver(self, value: Any) -> None:
        """The answer arrives now (the caller's pipe decided when)."""
        self._deliver(value, None)

    def hang(self) -> None:
        """No answer ever comes (only the caller's timeout ends the wait)."""

    def _deliver(self, value: Any, exc: BaseException | None) -> None:
        fut = self._fut
        if fut.done():
            return
        if self._timer is not None:
            self._timer.cancel()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    async def wait(self) -> Any:
        try:
            return await self._fut
        finally:
            if self._timer is not None:
                self._timer.cancel()
            if self._fut.done() and not self._fut.cancelled():
                self._fut.exception()  # retrieved
