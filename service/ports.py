"""The small Protocols between the engine and the outside world.

The engine (work queue, reconciler) depends only on these; the Kubernetes and PostgreSQL
adapters implement them structurally (they never import the engine), and tests implement them
with in-memory fakes. No I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from service.domain import (
    DeleteOutcome,
    ExecutionChange,
    ExecutionRow,
    ExecutionState,
    PodSnapshot,
    Verdict,
)


class PodCache(Protocol):
    """The informer's view of the sandbox namespaces (one cache each)."""

    def get(self, key: str) -> PodSnapshot | None: ...

    def keys(self) -> Iterable[str]: ...

    @property
    def synced(self) -> bool:
        """Every namespace's cache matches the server."""
        ...

    def namespace_synced(self, namespace: str) -> bool:
        """The cache of ``namespace`` matches the server; False for a namespace not watched."""
        ...


class PodClient(Protocol):
    """Fresh reads and preconditioned deletes against the API server."""

    async def get_pod(self, namespace: str, name: str) -> PodSnapshot | None:
        """The pod as the server has it now; ``None`` on 404. A failure raises a kit error
        (``Unavailable``, ``ApiError``, ``Undecodable``)."""
        ...

    async def delete_pod(
        self, namespace: str, name: str, *, uid: str, resource_version: str
    ) -> DeleteOutcome:
        """DELETE with ``preconditions`` {uid, resourceVersion}; the expected answers (deleted,
        404, 409) are typed, a failure raises as :meth:`get_pod`'s does."""
        ...

    def delete_slot(self) -> AbstractAsyncContextManager[None]:
        """``async with pods.delete_slot():`` final check, DELETE: the API client's request slot
        held throughout, so that the DELETE never waits for one."""
        ...


class ExecutionStore(Protocol):
    """Execution rows of Kubernetes-managed sandboxes, looked up by pod key (``namespace/name``):
    a row is found for a key only when its sandbox's namespace is the key's namespace."""

    async def lookup_many(self, keys: Sequence[str]) -> dict[str, ExecutionRow]:
        """Rows by pod key (absent keys left out), in as few queries as the batch size allows."""
        ...

    async def read_fresh(self, key: str) -> ExecutionRow | None:
        """The row of one key, read now (the final re-check before a delete)."""
        ...


class PodEventHandler(Protocol):
    """What the informer tells its consumer. Called on the event loop; must not block."""

    def pod_changed(self, old: PodSnapshot | None, new: PodSnapshot | None) -> None:
        """Add: ``old`` is None. Delete: ``new`` is None (``old`` is the last state)."""
        ...

    def cache_cold(self, namespace: str) -> None:
        """``namespace``'s cache is being rebuilt (410, restart): its observations may have gaps."""
        ...

    def cache_synced(self, namespace: str) -> None:
        """The cache of ``namespace`` matches the server again."""
        ...


class ExecutionEventHandler(Protocol):
    """What the PostgreSQL listener tells its consumer. Must not block."""

    def executions_changed(self, changes: Sequence[ExecutionChange]) -> None:
        """The changes of one notification, as one unit (a batch of a statement's changed rows;
        a single change is a batch of one). Never empty."""
        ...

    def notifications_missed(self) -> None:
        """The listener (re)connected: notifications may have been lost meanwhile."""
        ...


class NotificationBarrier(Protocol):
    """Lets the reconciler make sure no change notification is still on its way."""

    async def sync(self) -> None:
        """Return once every notification committed before the call has been handled; raise
        when that cannot be vouched for (listener down or stalled)."""
        ...


@dataclass(frozen=True, slots=True)
class ReapReport:
    """One live delete (``dry_run`` false) or one dry-run "would reap", as an operator sees it."""

    pod: PodSnapshot
    """The fresh GET: its UID and resourceVersion are the DELETE's preconditions."""
    verdict: Verdict
    rule: str
    reapable_for_s: float
    """How long the pod had been seen continuously in the reapable shape."""
    row_state: ExecutionState
    dry_run: bool


class ReapRecorder(Protocol):
    """Makes deletes and dry-run reports visible outside the process (Kubernetes Events)."""

    def record(self, report: ReapReport) -> None:
        """Hand the report over and return at once: never awaits, never raises, and whatever
        becomes of the report can never change what is deleted or when."""
        ...


@dataclass(frozen=True, slots=True)
class RetiredRow:
    """A retired (inactive) execution row and its ``retired_at`` (Unix seconds; ``None``: NULL)."""

    row: ExecutionRow
    retired_at_s: float | None


class RetiredRowSource(Protocol):
    """The retired rows among a namespace's pods (``service/engine/kept/``)."""

    async def retired_rows(
        self, namespace: str, names: Sequence[str], *, kind: str
    ) -> dict[str, RetiredRow]:
        """The inactive rows among ``names`` of ``namespace``'s Kubernetes-managed sandboxes, by
        pod key, in ONE query whatever their number (``kind``: its ``row_queries`` label)."""
        ...


@dataclass(frozen=True, slots=True)
class KeptReport:
    """A pod whose execution is retired but that is kept, kept longer than the bound."""

    pod: PodSnapshot
    reason: str
    """The classifier's skip reason."""
    rule: str
    row_state: ExecutionState
    since_s: float
    """Unix seconds: since when the pod is known retired (the row's ``retired_at``, else the
    notification's arrival, else first seen)."""
    since_source: str
    kept_for_s: float


class KeptRecorder(Protocol):
    """Makes a retired-but-kept pod visible outside the process (a ``RetiredPodKept`` Event)."""

    def record_kept(self, report: KeptReport) -> None:
        """Hand the report over and return at once: never awaits, never raises."""
        ...
