"""In-memory fakes of the Protocols in ``service.ports``, plus builders of pods, rows and settings.

The fakes behave like the real adapters where the engine depends on it: :class:`FakePodClient`
holds the *server's* pods (separate from :class:`FakePodCache`, so a test can make the cache
stale), records every DELETE with its preconditions and answers 404 / 409 exactly as the API
server does when a precondition fails; :class:`FakeExecutionStore` counts its queries and can be
told to fail. No ``MagicMock``: these are small implementations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio
from msgspec import structs
from prometheus_client import CollectorRegistry

from service import config
from service.config import Settings
from service.domain import (
    ConditionStatus,
    DeleteOutcome,
    DeleteResult,
    ExecutionRow,
    ExecutionState,
    PodKind,
    PodPhase,
    PodSnapshot,
)
from service.engine.activation import Activation
from service.engine.budget import DeleteBudget
from service.engine.controller import Controller
from service.engine.observation import Observation, ObservationClocks
from service.engine.reconciler import Reconciler
from service.engine.results import ReconcileResult
from service.engine.workqueue import WorkQueue
from service.kit import clock
from service.metrics import LOOP, Metrics
from service.ports import NotificationBarrier
from tests import virtualtime

NAMESPACE = "sandboxes"


# ---------------------------------------------------------------- builders

logger = logging.getLogger(__name__)


def make_pod(
    sandbox_id: str = "sbx1",
    generation: int = 1,
    *,
    uid: str | None = None,
    resource_version: str = "100",
    phase: PodPhase = PodPhase.SUCCEEDED,
    terminating: bool = False,
    pod_ip: str | None = None,
    ready_to_start: ConditionStatus = ConditionStatus.FALSE,
    container_count: int = 1,
    all_containers_terminated: bool = True,
    kind: PodKind = PodKind.CREATE,
    namespace: str = NAMESPACE,
) -> PodSnapshot:
    """A pod named like the platform names them; by default a terminal, reapable-shaped pod."""
    return PodSnapshot(
        namespace=namespace,
        name=f"space-sbx-{sandbox_id}-g{generation}",
        uid=uid if uid is not None else f"uid-{sandbox_id}-{generation}",
        resource_version=resource_version,
        phase=phase,
        terminating=terminating,
        pod_ip=pod_ip,
        ready_to_start=ready_to_start,
        container_count=container_count,
        all_containers_terminated=all_containers_terminated,
        sandbox_id=sandbox_id,
        generation=generation,
        kind=kind,
        created_at_s=1.7e9,
    )


def make_pending_pod(sandbox_id: str = "sbx1", generation: int = 1, **kw: object) -> PodSnapshot:
    """The ``replaced_never_started`` pod shape (pair it with a ``replaced`` row)."""
    base = make_pod(
        sandbox_id,
        generation,
        phase=PodPhase.PENDING,
        container_count=1,
        all_containers_terminated=False,
    )
    return structs.replace(base, **kw)


def make_row(
    pod: PodSnapshot,
    *,
    active: bool = False,
    state: ExecutionState = ExecutionState.SUSPENDED,
    kubernetes_managed: bool = True,
) -> ExecutionRow:
    """The execution row matching ``pod``'s labels; retired (``suspended``) by default."""
    assert pod.sandbox_id is not None and pod.generation is not None
    return ExecutionRow(
        pod_name=pod.name,
        namespace=pod.namespace,
        sandbox_id=pod.sandbox_id,
        generation=pod.generation,
        activation_attempt=1,
        pod_kind=pod.kind,
        state=state,
        active=active,
        kubernetes_managed=kubernetes_managed,
    )


def make_settings(
    *,
    enabled: bool = True,
    dry_run: bool = False,
    threshold_s: float = 300.0,
    deletes_per_minute: int = 120,
    env: Mapping[str, str] | None = None,
    **overrides: object,
) -> Settings:
    """Settings through the real loader, with the engine knobs set for tests."""
    p = config.PREFIX
    base = {
        f"{p}ENABLED": str(enabled).lower(),
        f"{p}DRY_RUN": str(dry_run).lower(),
        f"{p}THRESHOLD_SECONDS": repr(float(threshold_s)),
        f"{p}DELETES_PER_MINUTE": str(deletes_per_minute),
    }
    base.update(env or {})
    settings = config.load(base)
    return dataclasses.replace(settings, **overrides)  # type: ignore[arg-type]


# ----------------------------------------------------------------- PodCache


class FakePodCache:
    """The informer's cache: a dict keyed by ``namespace/name``."""

    def __init__(
        self,
        pods: Iterable[PodSnapshot] = (),
        *,
        synced: bool = True,
        namespaces: Iterable[str] = (NAMESPACE,),
    ) -> None:
        self.pods: dict[str, PodSnapshot] = {p.key: p for p in pods}
        self.namespaces = frozenset(namespaces)
        """The namespaces watched: any other has no synced cache (as the real informer)."""
        self.synced = synced
        """False while every namespace relists (between ``cache_cold`` and ``cache_synced``)."""
        self.cold_namespaces: set[str] = set()
        """Namespaces whose own cache relists while the others stay synced."""

    def namespace_synced(self, namespace: str) -> bool:
        return (
            self.synced and namespace in self.namespaces and namespace not in self.cold_namespaces
        )

    def get(self, key: str) -> PodSnapshot | None:
        return self.pods.get(key)

    def keys(self) -> Iterable[str]:
        return self.pods.keys()

    def put(self, pod: PodSnapshot) -> PodSnapshot | None:
        old = self.pods.get(pod.key)
        self.pods[pod.key] = pod
        return old

    def remove(self, key: str) -> PodSnapshot | None:
        return self.pods.pop(key, None)


# ---------------------------------------------------------------- PodClient


@dataclass(frozen=True, slots=True)
class DeleteCall:
    namespace: str
    name: str
    uid: str
    resource_version: str
    at_s: float
    """The event loop's time when the DELETE was sent."""


class FakePodClient:
    """The API server's view: fresh GETs and preconditioned DELETEs with real 404/409 rules."""

    def __init__(self, pods: Iterable[PodSnapshot] = ()) -> None:
        self.pods: dict[str, PodSnapshot] = {p.key: p for p in pods}
        self.deletes: list[DeleteCall] = []
        self.gets: list[str] = []
        self.get_error: Exception | None = None
        self.delete_script: deque[DeleteOutcome | Exception] = deque()
        """Answers to return (or raise) for the next DELETEs, before the real rules apply."""

    def delete_slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def get_pod(self, namespace: str, name: str) -> PodSnapshot | None:
        key = f"{namespace}/{name}"
        self.gets.append(key)
        if self.get_error is not None:
            raise self.get_error
        return self.pods.get(key)

    async def delete_pod(
        self, namespace: str, name: str, *, uid: str, resource_version: str
    ) -> DeleteOutcome:
        key = f"{namespace}/{name}"
        at = clock.now()
        self.deletes.append(DeleteCall(namespace, name, uid, resource_version, at))
        if self.delete_script:
            scripted = self.delete_script.popleft()
            if isinstance(scripted, Exception):
                raise scripted
            return scripted
        pod = self.pods.get(key)
        if pod is None:
            return DeleteOutcome(DeleteResult.GONE, 404, f'pods "{name}" not found')
        if pod.uid != uid or pod.resource_version != resource_version:
            return DeleteOutcome(
                DeleteResult.CONFLICT, 409, "Precondition failed: UID or ResourceVersion"
            )
        del self.pods[key]
        return DeleteOutcome(DeleteResult.DELETED, 200)

    @property
    def deleted_keys(self) -> list[str]:
        return [f"{d.namespace}/{d.name}" for d in self.deletes]


# ----------------------------------------------------------- ExecutionStore


class FakeExecutionStore:
    """Rows by pod key (``namespace/name``), as the real store answers: a row is found only
    under the key of its own namespace. Counts queries; ``lookup_error`` / ``fresh_error`` make
    calls fail."""

    def __init__(self, rows: Iterable[ExecutionRow] = ()) -> None:
        self.rows: dict[str, ExecutionRow] = {r.key: r for r in rows}
        self.fresh_read_times: list[float] = []
        """The event loop's time when each ``read_fresh`` began (the earliest its answer can
        describe)."""
        self.fresh_read_delays: deque[float] = deque()
        """Seconds the next ``read_fresh`` calls take to answer, after reading the row: a stall of
        the virtual-time loop (time moves on while no other task runs)."""
        self.lookups = 0
        """``lookup_many`` calls (batch row queries)."""
        self.fresh_reads = 0
        self.lookup_error: Exception | None = None
        self.fresh_error: Exception | None = None
        self.fresh_read_log: str | None = None
        """When set, each ``read_fresh`` logs it (``%s``: the pod name) as an adapter would."""
        self.batched_rows: dict[str, ExecutionRow] | None = None
        """When set, ``lookup_many`` answers from this (an older snapshot) instead of ``rows``;
        ``read_fresh`` always reads ``rows``."""
        self.lookup_gate: anyio.Event | None = None
        """When set, ``lookup_many`` waits for it (to interleave events with a lookup in
        flight)."""

    @property
    def queries(self) -> int:
        return self.lookups + self.fresh_reads

    def put(self, row: ExecutionRow) -> None:
        self.rows[row.key] = row

    async def lookup_many(self, keys: Sequence[str]) -> dict[str, ExecutionRow]:
        self.lookups += 1
        if self.lookup_gate is not None:
            await self.lookup_gate.wait()
        if self.lookup_error is not None:
            raise self.lookup_error
        rows = self.batched_rows if self.batched_rows is not None else self.rows
        return {k: rows[k] for k in keys if k in rows}

    async def read_fresh(self, key: str) -> ExecutionRow | None:
        self.fresh_reads += 1
        self.fresh_read_times.append(clock.now())
        if self.fresh_error is not None:
            raise self.fresh_error
        if self.fresh_read_log is not None:
            logger.info(self.fresh_read_log, key)
        row = self.rows.get(key)
        if self.fresh_read_delays:
            virtualtime.running_loop().stall(self.fresh_read_delays.popleft())
        return row


# ------------------------------------------------------------- engine rig


def clock_of(clocks: ObservationClocks, uid: str) -> Observation | None:
    """``uid``'s running clock, read as ``GET /debug/pending`` reads it (``None``: none runs)."""
    running = clocks.running_uid(uid)
    return running[0][0] if running else None


async def take_ready(queue: WorkQueue) -> list[str]:
    """Every ready key, in order, taken as a worker takes a batch and marked done at once
    (nothing reconciled); ``[]`` when none is ready."""
    count = len(queue)
    if count == 0:
        return []
    keys = await queue.get_batch(count, least=count)
    assert keys is not None
    queue.done(*keys)
    return keys


class NoNotifications:
    """The notification barrier of a reconciler that has no change notifications to wait for.

    Right only where rows change through nothing but the test itself and the test delivers
    each change to the controller (``executions_changed``) itself, before reconciling again:
    then no notification is ever in flight when the reconciler re-reads a row, and the sync
    has nothing to wait for. The service never uses it: its barrier is the listener, whose
    round trip proves that every notification committed before the re-read has arrived."""

    async def sync(self) -> None:
        return None


NO_NOTIFICATIONS = NoNotifications()


@dataclass
class EngineRig:
    """The whole engine on fakes (what the wiring assembles, minus adapters); the tests run it
    on virtual time (``tests/virtualtime.py``)."""

    settings: Settings
    cache: FakePodCache
    pods: FakePodClient
    store: FakeExecutionStore
    metrics: Metrics
    clocks: ObservationClocks
    budget: DeleteBudget
    activation: Activation
    queue: WorkQueue
    reconciler: Reconciler
    controller: Controller

    def add(self, pod: PodSnapshot, row: ExecutionRow | None = None, *, event: bool = True) -> None:
        """Put ``pod`` in the cache and on the server (and its row), and tell the controller."""
        old = self.cache.put(pod)
        self.pods.pods[pod.key] = pod
        if row is not None:
            self.store.put(row)
        if event:
            self.controller.pod_changed(old, pod)

    async def reconcile(self, key: str) -> ReconcileResult:
        """One key through the worker loop's body (a batch of one), as a worker takes it."""
        return (await self.controller.process([key]))[key]

    async def reconcile_batch(self, keys: list[str]) -> dict[str, ReconcileResult]:
        return await self.controller.process(keys)

    def outcome(self, label: str, mode: str | None = None) -> float:
        """The outcome counter for ``label`` in ``mode`` (the settings' mode by default)."""
        mode = mode or ("dry_run" if self.settings.dry_run else "live")
        value = self.metrics.registry.get_sample_value(
            "cluster_reconciler_outcome_total", {"loop": LOOP, "mode": mode, "verdict": label}
        )
        return value or 0.0

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    @contextlib.asynccontextmanager
    async def workers(self, n: int = 2) -> AsyncIterator[EngineRig]:
        """The controller's ``n`` workers running; shut down (after everything settled) on exit."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.controller.run_workers, n)
            try:
                yield self
                await virtualtime.settle()
            finally:
                self.queue.shut_down()

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass, every task running at its deadlines, and let
        every woken task run until all wait again."""
        await virtualtime.advance(seconds)


def make_rig(
    settings: Settings | None = None,
    *,
    leader: bool = True,
    budget_window_s: float = 60.0,
    leader_check: Callable[[], bool] | None = None,
    barrier: NotificationBarrier = NO_NOTIFICATIONS,
    batch_size: int | None = None,
    pods: FakePodClient | None = None,
) -> EngineRig:
    settings = settings if settings is not None else make_settings()
    metrics = Metrics(CollectorRegistry())
    cache = FakePodCache(namespaces=settings.kube.namespaces)
    pods = pods if pods is not None else FakePodClient()
    store = FakeExecutionStore()
    clocks = ObservationClocks(metrics=metrics.engine)
    budget = DeleteBudget(settings.deletes_per_minute, window_s=budget_window_s)
    activation = Activation(enabled=settings.enabled, leader_check=leader_check)
    queue = WorkQueue(metrics=metrics.queue)
    reconciler = Reconciler(
        settings=settings,
        cache=cache,
        pods=pods,
        store=store,
        clocks=clocks,
        budget=budget,
        activation=activation,
        metrics=metrics.engine,
        barrier=barrier,
    )
    controller = Controller(
        cache=cache,
        queue=queue,
        reconciler=reconciler,
        clocks=clocks,
        activation=activation,
        metrics=metrics.engine,
        batch_size=batch_size if batch_size is not None else settings.database.batch_max_size,
    )
    if leader:
        controller.set_leader(True)
    return EngineRig(
        settings=settings,
        cache=cache,
        pods=pods,
        store=store,
        metrics=metrics,
        clocks=clocks,
        budget=budget,
        activation=activation,
        queue=queue,
        reconciler=reconciler,
        controller=controller,
    )
