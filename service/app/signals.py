"""How every command ends on SIGTERM and SIGINT: one policy, PID 1 included.

As PID 1 of a container the kernel drops a signal whose disposition is the default, so every
command runs under these handlers, from the start of ``cli.main`` to its end:

* :func:`exit_code_of` wraps the whole command: while plain Python code runs (imports,
  configuration), a signal raises :class:`Interrupted`; the command prints
  ``retired-pod-gc: interrupted by SIGTERM`` and exits ``128 + signal`` (143, or 130 for SIGINT).
* :func:`run_async` runs a command's event loop with the signals delivered to the loop. A
  one-shot command is cancelled on the first signal and exits ``128 + signal``. A draining
  command (``run``) gets the first signal as its ``stop`` event, drains and exits with its own
  code; a second signal cancels the drain and exits ``128 + signal``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import anyio
from anyio.abc import TaskStatus

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A command stopped by a signal (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` of the command swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def _raising() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Interrupted` inside; the previous handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can handle signals (an in-process caller's worker thread)
        return
    previous = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_code_of(command: Callable[[], int]) -> int:
    """``command()``'s exit code, or ``128 + signal`` when SIGTERM or SIGINT interrupted it."""
    try:
        with _raising():
            return command()
    except Interrupted as exc:
        print(f"retired-pod-gc: interrupted by {exc}", file=sys.stderr)
        return 128 + exc.signum


def run_async(main: Callable[[anyio.Event], Awaitable[int]], *, drains: bool = False) -> int:
    """``anyio.run(main, stop)`` with the signals delivered to the loop (see the module docstring);
    raises :class:`Interrupted` when a signal cancelled ``main``, else what ``main`` raised."""
    received: list[int] = []
    outcome: list[int | Exception] = []
    in_main_thread = threading.current_thread() is threading.main_thread()

    async def guarded() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def watch(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
                with anyio.open_signal_receiver(*SIGNALS) as signals:
                    task_status.started()
                    async for signum in signals:
                        received.append(signum)
                        logger.info("received %s", signal.Signals(signum).name)
                        if drains and len(received) == 1:
                            stop.set()
                        else:
                            tg.cancel_scope.cancel()
                            return

            if in_main_thread:  # only the main thread can handle signals
                await tg.start(watch)
            try:
                outcome.append(await main(stop))
            except Exception as exc:  # raised below, outside the task group (no ExceptionGroup)
                outcome.append(exc)
            tg.cancel_scope.cancel()

    # The loop's signal handling restores the default dispositions when it closes, not the
    # ones in force before: put those back, so the rest of the command is still covered.
    previous = {}
    if in_main_thread:
        previous = {s: h for s in SIGNALS if (h := signal.getsignal(s)) is not None}
    try:
        anyio.run(guarded)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not outcome:
        raise Interrupted(received[-1])
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]
