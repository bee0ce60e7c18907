"""The reconciler's calls to its dependencies, and what their failures mean.

A dependency that gives no answer is backed off from as one, not key by key: the row lookup and
re-read go through the database's ``Gate`` (``service/kit/gate.py``), the pod GET and DELETE
through the API server's. Once a call finds its dependency unavailable, that call of every key
is :class:`Held` (not sent; the key parked, ``engine/held.py``) but for one probe a backoff step
(:func:`dependency_backoff`). A call's expected failures are the kit's errors and its own timeout
(:data:`FAILURES`); anything else is a bug and propagates to the worker loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from service.domain import Outcome
from service.engine.results import ReconcileResult
from service.kit.backoff import Backoff
from service.kit.errors import ApiError, ExternalError, Unavailable
from service.kit.gate import Gate, Ticket
from service.kit.timeouts import fail_after
from service.metrics import Dependency, EngineMetrics, ProbeResult

T = TypeVar("T")

DEPENDENCY_BACKOFF_INITIAL_S = 0.25
"""A dependency's first probe comes this long after the call that found it unavailable."""
DEPENDENCY_BACKOFF_MAX_S = 5.0
"""Cap of the time between two probes: a restored dependency is found, and every held key
released, within this (docs/operations.md, "What the service does to a dependency that is down")."""
THROTTLED_REQUEUE_S = 1.0
"""A key whose GET or DELETE was throttled (429) without a Retry-After comes back this later."""

FAILURES = (ExternalError, TimeoutError)
"""A step's expected failures: the outside world's (typed at the adapter edge), its timeout."""
Failure = ExternalError | TimeoutError


def dependency_backoff() -> Backoff:
    """The shared backoff from an unavailable dependency (one probe a step)."""
    return Backoff(
        initial_s=DEPENDENCY_BACKOFF_INITIAL_S, max_s=DEPENDENCY_BACKOFF_MAX_S, jitter=0.2
    )


def describe(what: str, exc: Failure) -> str:
    return f"{what}: {type(exc).__name__}: {exc}"


def no_answer(exc: Failure) -> bool:
    """Whether the dependency gave no answer (what closes its gate)."""
    return isinstance(exc, Unavailable | TimeoutError)


def throttled_s(exc: Failure) -> float | None:
    """How long the API server asked to wait when it throttled the call (a 429, or a 503 with
    Retry-After: the request was not processed); ``None`` when it did not."""
    if not isinstance(exc, ApiError):
        return None
    if exc.status == 429 or (exc.status == 503 and exc.retry_after_s is not None):
        return exc.retry_after_s if exc.retry_after_s is not None else THROTTLED_REQUEUE_S
    return None


def unauthorized(exc: Failure) -> bool:
    """The API server refused the credentials (the API client has read them again already)."""
    return isinstance(exc, ApiError) and exc.status == 401


@dataclass(frozen=True, slots=True)
class Held:
    """A call not sent: its dependency's shared backoff holds it for ``wait_s``."""

    dependency: str
    wait_s: float

    def result(self, outcome: Outcome) -> ReconcileResult:
        return ReconcileResult.held(outcome, self.dependency, self.wait_s)


class Gates:
    """The database's and the API server's gates, and calls through them."""

    def __init__(self, metrics: EngineMetrics, backoff: Backoff) -> None:
        self._metrics = metrics
        self.database = Gate(Dependency.DATABASE, backoff)
        self.api = Gate(Dependency.API_SERVER, backoff)
        for gate in self.all:
            gate.on_change(metrics.dependency_backoff.labels(dependency=gate.name).set)

    @property
    def all(self) -> tuple[Gate, ...]:
        return (self.database, self.api)

    async def call(
        self, gate: Gate, timeout_s: float, call: Callable[[], Awaitable[T]], *, keys: int = 1
    ) -> T | Held:
        """``call()`` within ``timeout_s`` through ``gate`` (for ``keys`` keys), or held while
        the dependency is backed off from; a failure propagates (no answer closes the gate)."""
        ticket = gate.admit()
        if not isinstance(ticket, Ticket):
            self._metrics.dependency_held.labels(dependency=gate.name).inc(keys)
            return Held(gate.name, ticket)
        try:
            with fail_after(timeout_s):
                result = await call()
        except FAILURES as exc:
            self._report(gate, ticket, answered=not no_answer(exc))
            raise
        except BaseException:
            gate.abandoned(ticket)  # cancelled, or a bug
            raise
        self._report(gate, ticket, answered=True)
        return result

    @staticmethod
    def failed(
        gate: Gate, exc: Failure, outcome: Outcome, otherwise: ReconcileResult | None = None
    ) -> ReconcileResult:
        """The result of a key whose call failed: held to the next attempt time when it got no
        answer and ``gate`` is closed, else ``otherwise`` (by default, backed off)."""
        if no_answer(exc) and gate.closed:
            return ReconcileResult.held(outcome, gate.name, gate.retry_in_s())
        return otherwise if otherwise is not None else ReconcileResult.backoff(outcome)

    def api_failed(self, exc: Failure) -> ReconcileResult:
        """A GET or DELETE that failed, neither throttled nor refused: held while the API server
        gives no answer, else retried (after its Retry-After, if it gave one)."""
        retry = ReconcileResult.retry(exc.retry_after_s if isinstance(exc, ApiError) else None)
        return self.failed(self.api, exc, Outcome.ERROR, retry)

    def _report(self, gate: Gate, ticket: Ticket, *, answered: bool) -> None:
        if ticket.probe:
            self._metrics.dependency_probes.labels(
                dependency=gate.name,
                result=ProbeResult.ANSWERED if answered else ProbeResult.FAILED,
            ).inc()
        if answered:
            gate.succeeded(ticket)
        else:
            gate.failed(ticket)
