"""One open watch stream as the store and the fan-out share it: its filter and its queue of encoded
event lines.

Its own module so that the store (``store``, which keeps each resource's open watchers) and the
fan-out (``watch``, which fills and drains them) both depend on it and not on each other.
"""

from __future__ import annotations

import asyncio

from devtools.emulator.selectors import Matcher


class Watcher:
    """One open watch stream's queue of encoded event lines."""

    __slots__ = ("abort", "closed", "lines", "matcher", "namespace", "wake")

    def __init__(self, namespace: str | None, matcher: Matcher | None) -> None:
        self.namespace = namespace
        self.matcher = matcher
        self.lines: list[bytes] = []
        self.wake = asyncio.Event()
        self.closed = False
        self.abort = False
