"""API Priority and Fairness as a throttled priority level: N seats per user, then 429.

A kube-apiserver classifies every request by a FlowSchema into a priority level with a number
of seats (its concurrency share). A request executes in a seat; when none is free and the level's
``limitResponse`` is ``Reject`` (no queues), the APF filter answers at once what
``k8s.io/apiserver/pkg/server/filters/priority-and-fairness.go`` does through ``tooManyRequests``:

- status 429, ``Retry-After: <seconds>`` (the server computes it per level, from 1 up to 32 as
  rejections persist; here it is :attr:`FlowControl.retry_after_s`, 1 by default);
- the body Go's ``http.Error`` writes: ``Too many requests, please try again later.`` and a
  newline, ``Content-Type: text/plain; charset=utf-8``, ``X-Content-Type-Options: nosniff``
  (plain text, not a ``Status``: a client reads the header, not the body);
- ``X-Kubernetes-PF-FlowSchema-UID`` and ``X-Kubernetes-PF-PriorityLevel-UID``, which the
  server also sets on every request it served on that level.

With a :class:`FlowControl` installed (``Emulator.flow_control``), every user (or only the
``users`` named) has a level of its own with ``seats`` seats. A request holds its seat while it
is handled and for ``seat_time_s`` more (the server's own work on it, which the emulator does
in no time: without it, requests of one client would almost never overlap). Watches take no
seat (long-running requests; the seat a real watch holds while it initializes is not modelled).
:meth:`FlowControl.hold` keeps seated requests waiting until :meth:`FlowControl.release`, so a
test can fill the seats provably, without racing the clock.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Collection

from aiohttp import web

TOO_MANY_REQUESTS_TEXT = "Too many requests, please try again later.\n"
FLOW_SCHEMA_UID_HEADER = "X-Kubernetes-PF-FlowSchema-UID"
PRIORITY_LEVEL_UID_HEADER = "X-Kubernetes-PF-PriorityLevel-UID"
DEFAULT_SEAT_TIME_S = 0.005


def _uid(kind: str, user: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"emulator/{kind}/{user}"))


class FlowControl:
    """Seats per user and the counts of what happened to each user's requests."""

    def __init__(
        self,
        *,
        seats: int,
        retry_after_s: int = 1,
        seat_time_s: float = DEFAULT_SEAT_TIME_S,
        users: Collection[str] | None = None,
    ) -> None:
        if seats < 1:
            raise ValueError("a priority level has at least one seat")
        self.seats = seats
        self.retry_after_s = retry_after_s
        self.seat_time_s = seat_time_s
        self.users: frozenset[str] | None = frozenset(users) if users is not None else None
        """The users throttled; ``None``: every user."""
        self.in_flight: Counter[str] = Counter()
        self.peak_in_flight: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        """User → requests that got a seat."""
        self.rejected: Counter[str] = Counter()
        """User → requests answered 429."""
        self._gate = asyncio.Event()
        self._gate.set()

    def applies(self, user: str, *, watch: bool) -> bool:
        return not watch and (self.users is None or user in self.users)

    def headers(self, user: str) -> dict[str, str]:
        """The classification headers of a request of ``user``."""
        return {
            FLOW_SCHEMA_UID_HEADER: _uid("flowschema", user),
            PRIORITY_LEVEL_UID_HEADER: _uid("prioritylevel", user),
        }

    def try_acquire(self, user: str) -> bool:
        """Take a seat of ``user``'s level; ``False`` (counted): none is free."""
        if self.in_flight[user] >= self.seats:
            self.rejected[user] += 1
            return False
        self.in_flight[user] += 1
        self.served[user] += 1
        self.peak_in_flight[user] = max(self.peak_in_flight[user], self.in_flight[user])
        return True

    def release_seat(self, user: str) -> None:
        self.in_flight[user] -= 1

    async def before_handling(self) -> None:
        """Wait while :meth:`hold` holds seated requests."""
        await self._gate.wait()

    async def after_handling(self) -> None:
        """The rest of the request's time in its seat."""
        if self.seat_time_s > 0:
            await asyncio.sleep(self.seat_time_s)

    def hold(self) -> None:
        """Keep every request that gets a seat waiting in it (before it is handled)."""
        self._gate.clear()

    def release(self) -> None:
        """Let held requests go on."""
        self._gate.set()

    def too_many_requests(self, user: str) -> web.Response:
        """The 429 the APF filter answers."""
        headers = {
            "Retry-After": str(self.retry_after_s),
            "X-Content-Type-Options": "nosniff",
            **self.headers(user),
        }
        return web.Response(
            status=429,
            text=TOO_MANY_REQUESTS_TEXT,
            content_type="text/plain",
            charset="utf-8",
            headers=headers,
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "seats": self.seats,
            "retry_after_s": self.retry_after_s,
            "seat_time_s": self.seat_time_s,
            "users": sorted(self.users) if self.users is not None else None,
            "held": not self._gate.is_set(),
            "in_flight": {u: n for u, n in self.in_flight.items() if n},
            "peak_in_flight": dict(self.peak_in_flight),
            "served": dict(self.served),
            "rejected": dict(self.rejected),
        }
