"""Virtual time for async tests: anyio's asyncio backend on :class:`tests.sim.loop.VirtualLoop`.

The product reads and waits on the running event loop's clock only (``service/kit/clock.py``),
so a test that needs fake time runs on this loop and moves time by waiting: ``await
anyio.sleep(5)`` returns at once in real time, with every timer due within those 5 s fired in
deadline order on the way. Time moves only when no task is ready, so what a test sees never
depends on how busy the machine is. A test module (or conftest) selects it with::

    @pytest.fixture
    def anyio_backend() -> object:
        return VIRTUAL_TIME

The loop has no I/O: a test that talks to a server runs on the real loop (``"asyncio"``).
"""

from __future__ import annotations

import asyncio
import random

import anyio

from tests.sim.loop import VirtualLoop

START_S = 1000.0
"""The loop's time when a test starts (not 0: a test's times read as offsets from it)."""


def virtual_loop() -> VirtualLoop:
    """A virtual-time loop that keeps asyncio's order: timers due at the same instant run in
    the order they were set, none held back (the simulator's seeded reordering is off)."""
    return VirtualLoop(random.Random(0), hold_p=0.0, permute=False, start_s=START_S)


VIRTUAL_TIME = ("asyncio", {"loop_factory": virtual_loop})
"""The ``anyio_backend`` of a test on virtual time."""


def running_loop() -> VirtualLoop:
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualLoop):
        raise TypeError("this test helper needs the virtual-time loop (tests/virtualtime.py)")
    return loop


def pending_timers() -> int:
    """Timers of the running virtual-time loop that are set and not cancelled."""
    return sum(1 for _, _, timer in running_loop()._scheduled if not timer.cancelled())


async def settle() -> None:
    """Let every task run until each waits for something (a timer later than now, an event),
    without moving time. ``anyio.wait_all_tasks_blocked`` is not for virtual time: it polls
    with ``sleep(0.1)``, which moves this clock."""
    loop = running_loop()
    while True:
        await asyncio.sleep(0)
        if loop.idle():
            return


async def advance(seconds: float) -> None:
    """Settle, let ``seconds`` of virtual time pass (every task runs at its timers' deadlines),
    settle again: what was due by then has run."""
    await settle()
    await anyio.sleep(seconds)
    await settle()
