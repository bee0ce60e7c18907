"""An asyncio event loop on virtual time, whose choices come from a seed.

:class:`VirtualLoop` is a :class:`asyncio.BaseEventLoop` with no selector and no real clock:

- ``time()`` is virtual; when nothing is ready the loop jumps straight to the next timer, so
  nothing ever sleeps for real and a seed's minutes of virtual time take milliseconds;
- the scheduling choices asyncio leaves open are drawn from the seed: timers that fall due at the
  same virtual instant run in a permuted order, and a due timer may be held back for one
  iteration (it runs after the callbacks already ready, as if its I/O had arrived a moment
  later). Callbacks made ready by ``call_soon`` keep asyncio's FIFO order, which real code may
  rely on (the listener's notification barrier does);
- there is no I/O at all: every adapter is a model that completes its calls with timers.

The product reads and waits on the running loop's clock only (``service/kit/clock.py``), so on
this loop all of it runs on virtual time; the unit tests use it too (``tests/virtualtime.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import heapq
import itertools
import operator
import random
from asyncio import format_helpers
from collections.abc import Callable
from typing import Any


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is pending: every task waits for something that never comes."""


class SimTask(asyncio.Task):  # type: ignore[type-arg]
    """A task hashed by its creation order in the seed, not by its address: code that keeps
    tasks in a set (anyio's cancel scopes do) then iterates them in the same order in every
    process."""

    def __init__(self, coro: Any, *, loop: VirtualLoop, **kwargs: Any) -> None:
        # Before: the task registers itself (hashed) at once.
        self.sim_id = sim_id = next(loop._task_ids)
        self._sim_hash = sim_id.__index__
        super().__init__(coro, loop=loop, **kwargs)

    # hash(task) is sim_id, without a Python frame (sets of tasks hash them ~600 times a seed):
    # the type's hash slot gets ``__hash__`` through the property (C), which gives the bound
    # ``sim_id.__index__`` (C), which it calls. Equality stays the inherited identity.
    __hash__ = property(operator.attrgetter("_sim_hash"))  # type: ignore[assignment]


class _Handle(asyncio.Handle):
    """A ``call_soon`` callback, made without ``Handle.__init__`` (the loop has no debug mode,
    so there is no source traceback to take: it and the cached repr are always ``None``)."""

    __slots__ = ()
    _source_traceback = None
    _repr = None


class _Timer(asyncio.TimerHandle):
    """A timer, made without ``TimerHandle.__init__`` and cancelled without the debug-mode
    checks; otherwise ``TimerHandle``'s (the loop's count of cancelled timers included)."""

    __slots__ = ()
    _source_traceback = None
    _repr = None

    def cancel(self) -> None:
        if not self._cancelled:
            if self._scheduled:
                self._loop._timer_cancelled_count += 1
            self._cancelled = True
            self._callback = None
            self._args = None


_new = object.__new__
_read_now = operator.attrgetter("_now")
_copy_context = contextvars.copy_context
_heappush = heapq.heappush


class VirtualLoop(asyncio.BaseEventLoop):
    """There is no debug mode: ``get_debug`` is always false (a C call: every future, task and
    handle asks it)."""

    get_debug = staticmethod(bool)

    def __init__(
        self,
        rng: random.Random,
        *,
        hold_p: float = 0.1,
        permute: bool = True,
        start_s: float = 0.0,
    ) -> None:
        super().__init__()
        self._now = start_s
        # time() as a C call (it is read everywhere: anyio, the clock, the models): the
        # method below, without a Python frame.
        self.time = functools.partial(_read_now, self)  # type: ignore[method-assign]
        # create_future() too (every call, event and shield makes one): the C Future, bound.
        self.create_future = functools.partial(asyncio.Future, loop=self)  # type: ignore[method-assign]
        self._rng = rng
        self._hold_p = hold_p
        self._permute = permute
        self.iterations = 0
        self._seq = itertools.count()
        self._task_ids = itertools.count()
        self.stalls: list[tuple[float, float]] = []

    # -- the clock -------------------------------------------------------------------------

    def time(self) -> float:
        return self._now

    def idle(self) -> bool:
        """Nothing is ready to run and no timer is due now: every task waits for a later timer
        or for something that is not a timer (read from inside a task, whose own step is then
        the one running)."""
        if self._ready:
            return False
        scheduled = self._scheduled
        return not scheduled or scheduled[0][0] > self._now

    def stall(self, seconds: float) -> None:
        """The loop was starved (a busy machine, a long GC pause): time moves on at once while
        the current callback runs."""
        self.stalls.append((self._now, seconds))
        self._now += seconds

    # -- what BaseEventLoop needs from a concrete loop -------------------------------------

    def _process_events(self, event_list: Any) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def create_task(self, coro: Any, *, name: str | None = None, context: Any = None) -> SimTask:
        return SimTask(coro, loop=self, name=name, context=context)

    def finish_tasks(self) -> None:
        """Cancel what is left, in creation order, and let it end (no coroutine may be left for
        the garbage collector to close later, in another seed's loop)."""
        left = sorted(
            (t for t in asyncio.all_tasks(self) if isinstance(t, SimTask)),
            key=lambda t: t.sim_id,
        )
        for task in left:
            task.cancel()
        if left:
            self.run_until_complete(asyncio.gather(*left, return_exceptions=True))

    def call_at(
        self, when: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        # The heap holds (when, sequence, handle): compared in C, not by TimerHandle.__lt__.
        # What ``TimerHandle.__init__`` sets, inline (no debug mode, no source traceback).
        if self._closed:
            raise RuntimeError("Event loop is closed")
        timer = _new(_Timer)
        timer._callback = callback
        timer._args = args
        timer._cancelled = False
        timer._loop = self
        timer._context = _copy_context() if context is None else context
        timer._when = when
        timer._scheduled = True
        _heappush(self._scheduled, (when, next(self._seq), timer))
        return timer

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        """``call_at(time() + delay, ...)`` (``asyncio.sleep`` and every model call schedule
        through it)."""
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self._now + delay, callback, *args, context=context)

    def call_soon(
        self, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.Handle:
        """``BaseEventLoop.call_soon`` without its debug-mode checks; what ``Handle.__init__``
        sets, inline."""
        if self._closed:
            raise RuntimeError("Event loop is closed")
        handle = _new(_Handle)
        handle._callback = callback
        handle._args = args
        handle._cancelled = False
        handle._loop = self
        handle._context = _copy_context() if context is None else context
        self._ready.append(handle)
        return handle

    def _run_handle_failed(self, handle: asyncio.Handle, exc: BaseException) -> None:
        """What ``Handle._run`` does when its callback raises."""
        cb = format_helpers._format_callback_source(
            handle._callback,
            handle._args,
        )
        self.call_exception_handler(
            {"message": f"Exception in callback {cb}", "exception": exc, "handle": handle}
        )

    def _run_once(self) -> None:
        self.iterations += 1
        scheduled: list[tuple[float, int, asyncio.TimerHandle]] = self._scheduled
        ready = self._ready
        heappop = heapq.heappop
        if not ready:
            while scheduled and scheduled[0][2]._cancelled:
                self._timer_cancelled_count -= 1
                heappop(scheduled)[2]._scheduled = False
            if not scheduled:
                if self._stopping:
                    return
                raise Deadlock("no task is ready and no timer is pending")
            when = scheduled[0][0]
            if when > self._now:
                self._now = when
        now = self._now
        if scheduled and scheduled[0][0] <= now:
            due = []
            while scheduled and scheduled[0][0] <= now:
                entry = heappop(scheduled)
                handle = entry[2]
                handle._scheduled = False
                if handle._cancelled:
                    self._timer_cancelled_count -= 1
                else:
                    due.append(entry)
            if due:
                rng = self._rng
                if len(due) > 1 and self._permute:
                    # Equal deadlines in a permuted order; earlier deadlines still first.
                    random_ = rng.random
                    due.sort(key=lambda e: (e[0], random_()))
                if self._hold_p and rng.random() < self._hold_p:
                    # Held back: runs after what is ready now and what the others make ready
                    # (it is due again at the next iteration).
                    held = due.pop(int(rng.random() * len(due)))
                    held[2]._scheduled = True
                    heapq.heappush(scheduled, held)
                ready.extend([entry[2] for entry in due])
        popleft = ready.popleft
        for _ in range(len(ready)):
            handle = popleft()
            if handle._cancelled:
                continue
            # Handle._run, inline (one frame fewer for every callback).
            try:
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._run_handle_failed(handle, exc)
        handle = None  # no cycle kept by the frame after a failure

    def close_quietly(self) -> None:
        """Forget every pending timer and callback (the seed is over)."""
        for _, _, handle in self._scheduled:
            handle._scheduled = False
        self._scheduled.clear()
        self._ready.clear()
        self._timer_cancelled_count = 0
        self.close()
