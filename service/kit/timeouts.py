"""A bounded await: :class:`fail_after`, anyio's ``fail_after`` as a class.

``with fail_after(delay_s) as scope:`` behaves as ``anyio.fail_after(delay_s)``: a cancel scope
with a deadline on the event loop's clock, ``TimeoutError`` when it expired, a cancellation from
outside propagating as ever; ``scope.deadline = ...`` moves the bound. A class because anyio's is
two generator context managers deep, and every reconcile step, row query and listener round trip
takes one bound (asyncio only, as the service is).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import anyio


class fail_after:  # named as the anyio function it stands for
    __slots__ = ("_delay_s", "_scope")

    def __init__(self, delay_s: float) -> None:
        self._delay_s = delay_s

    def __enter__(self) -> anyio.CancelScope:
        scope = anyio.CancelScope(deadline=asyncio.get_running_loop().time() + self._delay_s)
        self._scope = scope
        return scope.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:  # as anyio's (a bool typed exactly ``bool`` would make mypy doubt returns)
        scope = self._scope
        swallowed = scope.__exit__(exc_type, exc, tb)
        if scope.cancelled_caught and asyncio.get_running_loop().time() >= scope.deadline:
            raise TimeoutError
        return swallowed
