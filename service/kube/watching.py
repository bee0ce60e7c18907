"""Following one open watch stream into the pod store, and saying why it ended.

:class:`Watcher` is the reflector's one read loop, as client-go's ``handleWatch``, for a
streaming list's initial events (up to their ``k8s.io/initial-events-end`` bookmark) and for a
watch. Each stream has a bound on its silence: ``STREAM_SYNC_TIMEOUT`` before the initial events
end; on a watch, ``WATCH_SILENCE_SECONDS`` after its last line, after which the connection is
taken for dead (docs/architecture.md, "A silent watch"). Until the server is known to send
periodic bookmarks, a watch asks for a ``timeoutSeconds`` short of that bound
(:meth:`Watcher.timeout_cap`) and is dead once silent past it. Any end other than the server's
clean one raises a :class:`WatchEnd`; what follows is the reflector's choice.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable

import anyio

from service.config import KubeSettings
from service.kit import clock
from service.kube.reachability import Reachability
from service.kube.store import PodStore
from service.kube.watchstream import (
    Bookmark,
    ErrorStatus,
    EventStream,
    PodChange,
    Unreadable,
    WatchEvent,
)


class End(enum.StrEnum):
    """Why a watch stream ended (or was not opened), when the protocol says so."""

    EMPTY = "empty"
    """Closed at once without a single line: a misbehaving server (back off)."""
    EXPIRED = "expired"
    """410 Gone (an answer or an ``ERROR`` event), or a version too large: relist."""
    UNSUPPORTED = "unsupported"
    """A streaming list the server rejected (a 4xx) or did not honour."""
    ERROR = "error"
    """An ``ERROR`` event with a status other than 410."""
    BROKEN = "broken"
    """A stream that broke the protocol (e.g. an initial-events-end bookmark without a version)."""
    REFUSED = "refused"
    """A list from the watch cache the server refused: the sync lists from etcd instead."""
    SILENT = "silent"
    """Silent past its bound (:meth:`Watcher._silence_bound`): the connection is taken for dead
    (resume at once)."""


class WatchEnd(Exception):
    """How a watch stream ended: the reason, and the server's status and message if any."""

    def __init__(self, why: End, status: int = 0, message: str = "") -> None:
        super().__init__(why, status, message)
        self.why = why
        self.status = status
        self.message = message

    def __str__(self) -> str:
        status = f" {self.status}" if self.status else ""
        return f"watch {self.why}{status}: {self.message}" if self.message else f"watch {self.why}"


def end_margin_s(settings: KubeSettings) -> float:
    """How long past its ``timeoutSeconds`` a watch may stay open and silent before it is taken
    for dead, while the server is not known to send bookmarks: ``API_TIMEOUT_SECONDS`` (how late
    any answer may be), at most a quarter of ``WATCH_SILENCE_SECONDS``."""
    return min(settings.api_timeout_s, settings.watch_silence_s / 4)


def short_timeout_s(settings: KubeSettings) -> int:
    """The ``timeoutSeconds`` of a watch while the server is not known to send bookmarks:
    ``WATCH_SILENCE_SECONDS`` less :func:`end_margin_s`, in whole seconds (at least 1)."""
    return max(1, math.floor(settings.watch_silence_s - end_margin_s(settings)))


class _Silence:
    """Cancels ``scope`` once the stream has been silent for ``bound_s``, counted from its
    last line or from ``after``, whichever is later. The reader sets :attr:`last` per line (an
    assignment); the timer checks it when due and sets itself again for the new deadline."""

    __slots__ = ("_after", "_bound_s", "_handle", "_loop", "_scope", "last")

    def __init__(self, scope: anyio.CancelScope, bound_s: float, after: float = -math.inf) -> None:
        self._loop = asyncio.get_running_loop()
        self._scope = scope
        self._bound_s = bound_s
        self._after = after
        self.last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._due(), self._check)

    def _due(self) -> float:
        return max(self.last, self._after) + self._bound_s

    def _check(self) -> None:
        due = self._due()
        if self._loop.time() >= due:
            self._handle = None
            self._scope.cancel()
        else:
            self._handle = self._loop.call_at(due, self._check)

    def rebound(self, bound_s: float, after: float = -math.inf) -> None:
        self._bound_s = bound_s
        self._after = after
        if self._handle is not None:
            self._handle.cancel()
            self._handle = self._loop.call_at(self._due(), self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Watcher:
    """Reads streams into ``store``. ``worked`` is called once a watch delivers its first line;
    a watch that ends cleanly within ``min_watch_s`` without a line is :attr:`End.EMPTY`, so that
    a misbehaving server cannot make the loop spin."""

    def __init__(
        self,
        store: PodStore,
        reachability: Reachability,
        *,
        settings: KubeSettings,
        min_watch_s: float,
        worked: Callable[[], None],
    ) -> None:
        self._store = store
        self._reach = reachability
        self._sync_timeout_s = settings.stream_sync_timeout_s
        self._silence_s = settings.watch_silence_s
        self._min_watch_s = min_watch_s
        self._worked = worked
        self.resource_version: str | None = None
        """The last resourceVersion seen (sync, event or bookmark); ``None`` before a sync."""
        self._bookmarks_sent = False
        """Whether the server is known to send periodic bookmarks: set by one, cleared by a
        watch that lived for the silence bound without one."""
        self._stream_bookmarks = 0
        self._end_margin_s = end_margin_s(settings)
        self._short_timeout_s = short_timeout_s(settings)

    def timeout_cap(self) -> int | None:
        """The longest ``timeoutSeconds`` the next stream may ask for: ``None`` once the server
        is known to send periodic bookmarks; before, :func:`short_timeout_s`."""
        return None if self._bookmarks_sent else self._short_timeout_s

    def _silence_bound(self, opened: float, timeout_cap: int | None) -> tuple[float, float] | None:
        """The :class:`_Silence` bound of a watch opened at ``opened``: ``WATCH_SILENCE_SECONDS``
        once the server is known to send bookmarks; before, the end margin past the
        ``timeoutSeconds`` asked for (at most ``timeout_cap``), at which the server ends every
        watch. ``None`` for a watch without a cap before bookmarks (its read timeout ends it)."""
        if self._bookmarks_sent:
            return self._silence_s, -math.inf
        if timeout_cap is not None:
            return self._end_margin_s, opened + timeout_cap
        return None

    async def read(
        self,
        stream: EventStream,
        opened: float,
        *,
        timeout_cap: int | None,
        initial: bool = False,
        continued: bool = False,
    ) -> str | None:
        """Events into the store until the stream ends, an event ends it, or it stays silent
        past its bound. ``initial``: a streaming list's initial events, bounded by the sync
        timeout; else a watch (``continued``: the rest of a streaming list). ``opened`` is when
        its answer came, ``timeout_cap`` what :meth:`timeout_cap` said when it was asked for.
        The version of the initial-events-end bookmark (``initial``), else ``None`` for a
        stream the server ended; raises :class:`WatchEnd` for any other end."""
        answered = self._reach.answered
        loop_time = asyncio.get_running_loop().time
        self._stream_bookmarks = 0
        lines = 1 if continued else 0
        proven = self._bookmarks_sent
        with anyio.CancelScope() as scope:
            silence: _Silence | None = None
            if initial:
                silence = _Silence(scope, self._sync_timeout_s)
            elif (bound := self._silence_bound(opened, timeout_cap)) is not None:
                silence = _Silence(scope, *bound)
            try:
                async for event in stream:
                    answered()
                    if silence is not None:
                        silence.last = loop_time()
                    rv = self._apply(event, initial=initial)
                    if rv is not None:
                        return rv
                    if not proven and self._bookmarks_sent:
                        # The first periodic bookmark: silence is evidence from now on.
                        proven = True
                        bound = self._silence_bound(opened, timeout_cap)
                        if bound is not None:
                            if silence is None:
                                silence = _Silence(scope, *bound)
                            else:
                                silence.rebound(*bound)
                    lines += 1
                    if lines == 1 and not initial:
                        self._worked()
            finally:
                if silence is not None:
                    silence.stop()
                unmarked = not initial and not self._stream_bookmarks
                if unmarked and clock.now() - opened >= self._silence_s:
                    self._bookmarks_sent = False  # lived the bound without one: none are sent
        if scope.cancelled_caught:
            raise self._silent(initial=initial, proven=proven, timeout_cap=timeout_cap)
        if initial:
            message = "streaming list ended before its initial-events-end bookmark"
            raise WatchEnd(End.BROKEN, message=message)
        if lines == 0 and clock.now() - opened < self._min_watch_s:
            raise WatchEnd(End.EMPTY, message="watch stream closed at once without events")
        return None

    def _silent(self, *, initial: bool, proven: bool, timeout_cap: int | None) -> WatchEnd:
        if initial:
            message = f"no initial-events-end bookmark within {self._sync_timeout_s:g}s"
            return WatchEnd(End.UNSUPPORTED, message=f"{message} of silence")
        if proven:
            message = f"no event and no bookmark for {self._silence_s:g}s"
        else:
            message = (
                f"no end of the stream and no line {self._end_margin_s:g}s past its "
                f"timeoutSeconds (at most {timeout_cap}s), and no bookmark yet"
            )
        return WatchEnd(End.SILENT, message=f"{message}: the connection is taken for dead")

    def _apply(self, event: WatchEvent, *, initial: bool) -> str | None:
        """Apply one event: the version of the initial-events-end bookmark when the initial
        events end; raises :class:`WatchEnd` when the event ends the stream."""
        store = self._store
        match event:
            case PodChange(pod=pod, deleted=deleted):
                if deleted:
                    store.delete(pod)
                else:
                    store.put(pod)
                if not initial:
                    self.resource_version = pod.resource_version
            case Unreadable(key=key):
                # A pod we can no longer read is a gap in its observation: fail closed by
                # dropping it from the cache until a readable event or a sync brings it back.
                if key is not None:
                    store.forget(key)
            case Bookmark(resource_version=rv, initial_events_end=initial_end):
                if not initial_end:
                    # A periodic one (a server may send the initial-events-end one alone).
                    self._stream_bookmarks += 1
                    self._bookmarks_sent = True
                if not initial:
                    if rv:
                        self.resource_version = rv
                    return None
                if not initial_end:
                    message = "a bookmark came before the initial-events-end bookmark"
                    raise WatchEnd(End.UNSUPPORTED, message=message)
                if not rv:
                    message = "initial-events-end bookmark without resourceVersion"
                    raise WatchEnd(End.BROKEN, message=message)
                return rv
            case ErrorStatus(code=code, message=message):
                raise WatchEnd(End.EXPIRED if code == 410 else End.ERROR, code, message)
        return None
