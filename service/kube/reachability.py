"""Whether the API server answers, as the transport and the watches' lines tell.

The server is **unreachable** once a request ended without an answer and nothing has answered
since that request was sent (one request stuck on a dead pooled connection while its siblings are
answered is not that; a watch closed for silence is a request unanswered since its last line).
Unreachable makes the replica unready and sets ``retired_pod_gc_api_reachable`` to 0 until the
first answer (docs/operations.md, "Kubernetes API connectivity", gives the bounds).
"""

from __future__ import annotations

import anyio

from service.kit import clock
from service.metrics import KubeMetrics


class Reachability:
    __slots__ = ("_cause", "_last_answer", "_metrics", "_silent_since", "_wake")

    def __init__(self, metrics: KubeMetrics | None = None) -> None:
        self._last_answer: float | None = None
        """When the server last answered (``None``: never yet)."""
        self._silent_since: float | None = None
        """When the earliest request that ended unanswered, with no answer since, was sent."""
        self._cause = ""
        self._wake: anyio.Event | None = None
        self._metrics = metrics if metrics is not None else KubeMetrics()
        self._metrics.api_reachable.set(1)
        self._metrics.api_last_answer_age.set_function(self.last_answer_age_s)

    def answered(self) -> None:
        """An answer came (any HTTP status, a line on a watch stream)."""
        self._last_answer = clock.now()
        if self._silent_since is not None:
            self._silent_since = None
            self._metrics.api_reachable.set(1)
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    def unanswered(self, sent_at: float, cause: str) -> None:
        """A request sent at ``sent_at`` ended without an answer (``cause``: how)."""
        if self._last_answer is not None and sent_at < self._last_answer:
            return  # the server answered since: this connection's failure, not the server's
        if self._silent_since is None or sent_at < self._silent_since:
            if self._silent_since is None:
                self._metrics.api_reachable.set(0)
            self._silent_since = sent_at
        self._cause = cause

    def last_answer_age_s(self) -> float:
        """Seconds since the last answer; before any, since the first request that went
        unanswered (0 while there was neither)."""
        since = self._last_answer if self._last_answer is not None else self._silent_since
        return 0.0 if since is None else max(0.0, clock.now() - since)

    @property
    def problem(self) -> str | None:
        """``no answer for Ns: <cause>`` while unreachable; ``None`` otherwise."""
        if self._silent_since is None:
            return None
        return f"no answer for {self.last_answer_age_s():.0f}s: {self._cause}"

    async def answered_after(self, since: float, timeout_s: float) -> bool:
        """Wait until an answer later than ``since`` (at once when one came already), at most
        ``timeout_s``; whether one came (it ends the reflector's backoff early)."""
        if not self._answered_after(since):
            if self._wake is None:
                self._wake = anyio.Event()
            with anyio.move_on_after(timeout_s):
                await self._wake.wait()
        return self._answered_after(since)

    def _answered_after(self, since: float) -> bool:
        return self._last_answer is not None and self._last_answer > since
