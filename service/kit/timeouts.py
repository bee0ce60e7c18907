"""A bounded await: :class:`fail_after`, anyio's ``fail_after`` as a class.

``with fail_after(delay_s) as scope:`` is ``with anyio.fail_after(delay_s) as scope:``: an anyio
:class:`~anyio.CancelScope` with a deadline ``delay_s`` from now on the event loop's clock,
entered and exited as anyio's own; when the scope swallowed its own cancellation and its
deadline has passed, ``TimeoutError`` is raised (with the cancellation as its ``__context__``).
Cancelled from outside, or by ``scope.cancel()``, it behaves as anyio's (the cancellation
propagates, or is swallowed without an error). The scope is the caller's to move:
``scope.deadline = ...`` reschedules the bound.

Why a class: anyio's ``fail_after`` is two generator context managers deep and looks its backend
up three times, and every reconcile step, row query and listener round trip takes one bound.
This one is an object and one cancel scope (asyncio only, as the service is: the deadline is on
the running loop's clock, which is anyio's ``current_time()`` there).
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
