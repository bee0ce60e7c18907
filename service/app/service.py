"""The composition root: builds every part from the settings and runs them under one task group.

Only this module constructs the Kubernetes and PostgreSQL adapters (the ``new_*`` functions) and
wires them to the engine (:func:`build`); the commands of ``service/app/commands.py`` take their
adapters from here. A child of the task group that crashes takes the process down (a kubelet
restart is the remedy). A stop request drains: no new work, in-flight reconciles get
``SHUTDOWN_TIMEOUT_SECONDS``, then everything is cancelled and the lease released.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskStatus

from service.config import Settings
from service.engine.activation import Activation
from service.engine.budget import DeleteBudget
from service.engine.controller import Controller
from service.engine.kept.view import KeptPods
from service.engine.observation import ObservationClocks
from service.engine.reconciler import Reconciler
from service.engine.workqueue import WorkQueue
from service.kit.backoff import Backoff
from service.kit.memory import freeze_long_lived
from service.kube.api import new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.events import KubeEventRecorder
from service.kube.informer import MultiNamespaceInformer, PodInformer
from service.kube.leaderelection import LeaderElector, default_identity
from service.kube.listwatch import ListWatch
from service.kube.transport import ApiTransport
from service.metrics import KeptMetrics, KubeMetrics, Metrics, PgMetrics
from service.pg.connect import connect_once
from service.pg.listener import RetirementListener
from service.pg.store import PgExecutionStore
from service.ports import ExecutionStore, KeptRecorder, PodClient, ReapRecorder, RetiredRowSource

from .health import HealthServer, Heartbeats, cached_ping
from .pending import pending_view

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCHDOG_PERIOD_S = 1.0
WATCHDOG_ALLOWANCE_S = 15.0
MAX_BACKOFF_S = 5.0
"""Cap of a key's own retry backoff, for failures of that key (an answer that was not the
expected one, a bug). A dependency that gives no answer is not retried key by key: the
reconciler's shared backoff holds every key's step (``service/kit/gate.py``)."""


def lease_namespace(settings: Settings) -> str:
    if settings.leader.lease_namespace:
        return settings.leader.lease_namespace
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or settings.kube.namespaces[0]
    except OSError:
        return settings.kube.namespaces[0]


@dataclass
class Parts:
    """Everything :func:`build` made (tests, the demo and benchmarks look inside)."""

    settings: Settings
    metrics: Metrics
    store: PgExecutionStore
    informer: MultiNamespaceInformer
    """One pod cache per sandbox namespace (``informer.informers``)."""
    pods: KubePodClient
    queue: WorkQueue
    clocks: ObservationClocks
    controller: Controller
    listener: RetirementListener
    elector: LeaderElector | None
    recorder: KubeEventRecorder | None
    """``None`` when ``EVENTS_ENABLED`` is false."""
    heartbeats: Heartbeats
    health: HealthServer
    kept: KeptPods | None = None
    """Retired but kept (``service/engine/kept/``)."""


APPLICATION_NAME = "retired-pod-gc"
"""The ``application_name`` of the service's database sessions (the listener's has its own)."""


async def new_api(metrics: KubeMetrics) -> ApiTransport:
    """The Kubernetes API client, in-cluster or from the kubeconfig (``service/kube/api.py``),
    counting into ``metrics``; ``ApiConfigError`` when neither is found. The caller closes it."""
    return await new_api_client(metrics=metrics)


async def new_connection(settings: Settings, metrics: PgMetrics) -> asyncpg.Connection:
    """A database connection of its own (a one-shot command's), opened as every connection of
    the service is (``service/pg/connect.py``). The caller closes it."""
    return await connect_once(settings.database, metrics=metrics, application_name=APPLICATION_NAME)


def new_list_watch(
    settings: Settings,
    api: ApiTransport,
    metrics: KubeMetrics,
    *,
    namespace: str,
    decoder: PodDecoder | None = None,
    rng: random.Random | None = None,
) -> ListWatch:
    """The pod requests of one sandbox namespace (its informer's, or a command's probe)."""
    return ListWatch(
        api,
        settings=settings.kube,
        metrics=metrics,
        namespace=namespace,
        decoder=decoder or new_decoder(settings),
        rng=rng or random.Random(),
    )


def new_store(settings: Settings, metrics: PgMetrics) -> PgExecutionStore:
    return PgExecutionStore(settings.database, namespaces=settings.kube.namespaces, metrics=metrics)


def new_decoder(settings: Settings) -> PodDecoder:
    """The one pod decoder of the process (GETs, list pages and watch events)."""
    return PodDecoder(settings.kube.label_keys)


def new_pod_client(
    settings: Settings, api: ApiTransport, metrics: KubeMetrics, decoder: PodDecoder | None = None
) -> KubePodClient:
    return KubePodClient(api, settings.kube, decoder or new_decoder(settings), metrics)


def new_informer(
    settings: Settings,
    api: ApiTransport,
    metrics: KubeMetrics,
    *,
    decoder: PodDecoder | None = None,
    backoff: Backoff | None = None,
) -> MultiNamespaceInformer:
    """One namespaced informer per sandbox namespace (never a cluster-wide watch)."""
    decoder = decoder or new_decoder(settings)

    def informer(namespace: str) -> PodInformer:
        return PodInformer(
            new_list_watch(settings, api, metrics, namespace=namespace, decoder=decoder),
            settings=settings.kube,
            metrics=metrics,
            backoff=backoff,
        )

    return MultiNamespaceInformer(settings.kube.namespaces, informer)


def default_queue_backoff() -> Backoff:
    """The work queue's per-key retry delays."""
    return Backoff(initial_s=0.005, max_s=MAX_BACKOFF_S, jitter=0.1)


@dataclass(frozen=True, slots=True)
class Engine:
    queue: WorkQueue
    clocks: ObservationClocks
    controller: Controller


def wire_engine(
    settings: Settings,
    *,
    informer: MultiNamespaceInformer,
    pods: PodClient,
    store: ExecutionStore,
    listener: RetirementListener,
    activation: Activation,
    recorder: ReapRecorder | None,
    metrics: Metrics,
    queue_backoff: Backoff,
    gate_backoff: Backoff | None = None,
) -> Engine:
    """The engine on its adapters: the work queue, the observation clocks, the reconciler and
    the controller, which becomes the informer's and the listener's handler. :func:`build`
    wires the service with it, and the deterministic simulator (``tests/sim``) wires the same
    engine on its models, so the two cannot drift apart."""
    queue = WorkQueue(metrics=metrics.queue, backoff=queue_backoff)
    clocks = ObservationClocks(metrics=metrics.engine)
    reconciler = Reconciler(
        settings=settings,
        cache=informer,
        pods=pods,
        store=store,
        clocks=clocks,
        budget=DeleteBudget(settings.deletes_per_minute),
        activation=activation,
        metrics=metrics.engine,
        barrier=listener,
        recorder=recorder,
        gate_backoff=gate_backoff,
    )
    controller = Controller(
        cache=informer,
        queue=queue,
        reconciler=reconciler,
        clocks=clocks,
        activation=activation,
        metrics=metrics.engine,
        batch_size=settings.database.batch_max_size,
    )
    # Handlers are added once everything exists (client-go's AddEventHandler): no part needs
    # another that is built after it.
    informer.add_handler(controller)
    listener.add_handler(controller)
    return Engine(queue, clocks, controller)


def wire_kept(
    settings: Settings,
    *,
    informer: MultiNamespaceInformer,
    rows: RetiredRowSource,
    listener: RetirementListener,
    activation: Activation,
    recorder: KeptRecorder | None,
    metrics: KeptMetrics,
) -> KeptPods:
    """The retired-but-kept view beside the engine (it never touches it): the informer's and the
    listener's handler after the controller, sweeping every resync period. :func:`build` and
    the deterministic simulator wire it the same way."""
    kept = KeptPods(
        cache=informer,
        rows=rows,
        namespaces=settings.kube.namespaces,
        activation=activation,
        metrics=metrics,
        period_s=settings.resync_period_s,
        bound_s=settings.kept_bound_s,
        recorder=recorder,
    )
    informer.add_handler(kept)
    listener.add_handler(kept)
    return kept


def new_elector(
    settings: Settings, api: ApiTransport, metrics: KubeMetrics
) -> LeaderElector | None:
    """The Lease's elector; ``None`` when ``LEADER_ELECTION`` is false."""
    if not settings.leader.enabled:
        return None
    return LeaderElector(
        api,
        settings=settings.leader,
        namespace=lease_namespace(settings),
        metrics=metrics,
        request_timeout_s=settings.kube.api_timeout_s,
    )


def new_recorder(
    settings: Settings, api: ApiTransport, metrics: KubeMetrics
) -> KubeEventRecorder | None:
    """The writer of Events; ``None`` when ``EVENTS_ENABLED`` is false."""
    if not settings.events_enabled:
        return None
    return KubeEventRecorder(
        api,
        # The Lease's holder identity, so an Event names the replica that acted.
        instance=settings.leader.identity or default_identity(),
        metrics=metrics,
        timeout_s=settings.kube.api_timeout_s,
        deletes_per_minute=settings.deletes_per_minute,
    )


def new_pending(
    settings: Settings, engine: Engine, kept: KeptPods
) -> Callable[[int, str | None], dict[str, Any]] | None:
    """``/debug/pending``; ``None`` when ``DEBUG_PENDING`` is off."""
    if not settings.debug_pending:
        return None
    return pending_view(
        clocks=engine.clocks,
        kept=kept,
        threshold_s=settings.threshold_s,
        mode=settings.mode,
        active=lambda: engine.controller.active,
    )


def build(settings: Settings, *, api: ApiTransport, metrics: Metrics) -> Parts:
    store = new_store(settings, metrics.pg)
    decoder = new_decoder(settings)
    informer = new_informer(settings, api, metrics.kube, decoder=decoder)
    pods = new_pod_client(settings, api, metrics.kube, decoder)
    elector = new_elector(settings, api, metrics.kube)
    # Checked right before every DELETE or report: a leader whose renewals lapse stops acting
    # at the renew deadline, before its lease can expire for anybody else.
    activation = Activation(
        enabled=settings.enabled,
        leader_check=elector.is_leader if elector is not None else None,
    )
    # The reconciler's notification barrier; the controller becomes its handler once built.
    listener = RetirementListener(
        settings.database,
        metrics=metrics.pg,
        probe=store.notify,
        namespaces=settings.kube.namespaces,
    )
    recorder = new_recorder(settings, api, metrics.kube)
    engine = wire_engine(
        settings,
        informer=informer,
        pods=pods,
        store=store,
        listener=listener,
        activation=activation,
        recorder=recorder,
        metrics=metrics,
        queue_backoff=default_queue_backoff(),
    )
    kept = wire_kept(
        settings,
        informer=informer,
        rows=store,
        listener=listener,
        activation=activation,
        recorder=recorder,
        metrics=metrics.kept,
    )
    if elector is not None:
        elector.add_handler(engine.controller.set_leader)
    heartbeats = Heartbeats()
    health = HealthServer(
        registry=metrics.registry,
        heartbeats=heartbeats,
        cache_synced=lambda: informer.synced,
        database_problem=cached_ping(store),
        listener_problem=lambda: listener.problem,
        api_problem=lambda: api.problem,
        host=settings.bind_host,
        port=settings.bind_port,
        pending=new_pending(settings, engine, kept),
        debug_host=settings.debug_host,
        debug_port=settings.debug_port,
    )
    metrics.service.enabled.set(1 if settings.enabled else 0)
    metrics.service.dry_run.set(1 if settings.dry_run else 0)
    metrics.service.threshold.set(settings.threshold_s)
    metrics.kube.is_leader.set(0)
    return Parts(
        settings=settings,
        metrics=metrics,
        store=store,
        informer=informer,
        pods=pods,
        queue=engine.queue,
        clocks=engine.clocks,
        controller=engine.controller,
        listener=listener,
        elector=elector,
        recorder=recorder,
        heartbeats=heartbeats,
        health=health,
        kept=kept,
    )


async def _watchdog(parts: Parts) -> None:
    """Beats for two loops: the event loop itself (this task runs), and the workers (they make
    progress whenever keys are ready). /healthz fails when either falls silent."""
    heartbeats = parts.heartbeats
    allowance_s = max(WATCHDOG_ALLOWANCE_S, 2 * parts.settings.reconcile_timeout_s)
    heartbeats.register("event-loop", WATCHDOG_ALLOWANCE_S)
    heartbeats.register("workers", allowance_s)
    last_done = -1
    while True:
        heartbeats.beat("event-loop")
        done = parts.controller.reconciles_done
        if done != last_done or len(parts.queue) == 0:
            heartbeats.beat("workers")
            last_done = done
        await anyio.sleep(WATCHDOG_PERIOD_S)


async def _freeze_when_synced(parts: Parts) -> None:
    """Once every namespace's cache has first synced, keep what is alive from then on out of the
    garbage collector's full scans (kit ``freeze_long_lived``)."""
    await parts.informer.wait_synced()
    frozen = freeze_long_lived()
    logger.info(
        "pod cache synced in every sandbox namespace; %d cached objects exempted from full "
        "garbage collections (saves CPU with a large cache)",
        frozen,
    )


async def run(
    parts: Parts,
    *,
    stop: anyio.Event,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run until ``stop`` is set (then drain) or a child fails (then raise)."""
    settings = parts.settings
    logger.info(
        "starting in %s mode (threshold %.0fs, %d deletes/min, namespaces %s)",
        settings.mode,
        settings.threshold_s,
        settings.deletes_per_minute,
        ",".join(settings.kube.namespaces),
        extra={"database": settings.database.masked_url},
    )
    await parts.store.start()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(parts.health.run)
            tg.start_soon(_watchdog, parts)
            await tg.start(parts.informer.run)
            tg.start_soon(_freeze_when_synced, parts)
            if parts.recorder is not None:
                await tg.start(parts.recorder.run)
            if parts.kept is not None:
                await tg.start(parts.kept.run)
            # Not awaited: a database that is down must not keep the HTTP server and the
            # informer from starting (readiness reports it instead).
            tg.start_soon(parts.listener.run)
            await tg.start(parts.controller.run_workers, settings.workers)
            await tg.start(parts.controller.run_resync, settings.resync_period_s)
            await tg.start(parts.controller.reaped.run)
            if parts.elector is not None:
                await tg.start(parts.elector.run)
            else:
                # No lease: the one replica acts from the start, and says so as a leader would.
                parts.controller.set_leader(True)
                parts.metrics.kube.is_leader.set(1)
            task_status.started()
            await stop.wait()
            logger.info("stopping: draining in-flight reconciles")
            drained = await parts.controller.stop(settings.shutdown_timeout_s)
            if not drained:
                logger.warning("in-flight reconciles did not finish within the shutdown timeout")
            if parts.recorder is not None:
                await parts.recorder.flush()
            tg.cancel_scope.cancel()
    finally:
        with anyio.move_on_after(5, shield=True):
            await parts.store.aclose()
    logger.info("stopped")
