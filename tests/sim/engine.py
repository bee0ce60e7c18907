"""The real service, built on the models: the adapters as ``service.app.service.build`` makes
them, and the engine on them by the same ``wire_engine``.

What differs from ``build`` is only what a deterministic run needs: it runs on
:class:`tests.sim.loop.VirtualLoop`, whose clock is virtual (every part reads and waits on the
event loop's clock, as in production), every random choice (backoff jitter, the
watch timeout's jitter) comes from the seed, the listener's delivery probes go out on a fixed
channel (:data:`PROBE_CHANNEL`), the Kubernetes client is the real ``ApiTransport`` whose HTTP
sessions are the model's (:class:`tests.sim.kube.SimSessions`: the
API server model answers the HTTP requests, the token read from a file as in a pod, by
``TokenFile``), ``asyncpg.connect``/``create_pool`` are the database
model's (:class:`tests.sim.pg.Asyncpg`), the reap reports are collected by a recorder of the
simulator's (the Event writer is not run), and there is no HTTP server, watchdog or leader
election (a step flips the leadership through ``Controller.set_leader`` instead).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
from kubernetes_asyncio import client as k8s_client

from service.app.service import (
    default_queue_backoff,
    new_decoder,
    new_pod_client,
    new_store,
    wire_engine,
    wire_kept,
)
from service.config import Settings
from service.engine import workqueue as workqueue_module
from service.engine.activation import Activation
from service.engine.controller import Controller
from service.engine.gates import dependency_backoff
from service.engine.kept.view import KeptPods
from service.engine.workqueue import WorkQueue
from service.kit.backoff import Backoff
from service.kube import informer as informer_module
from service.kube import reflector as reflector_module
from service.kube.api import TokenFile
from service.kube.informer import MultiNamespaceInformer, PodInformer
from service.kube.listwatch import ListWatch
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics, Metrics
from service.pg import listener as listener_module
from service.pg.listener import RetirementListener
from service.ports import ReapReport
from tests.sim.kube import ApiServer, SimSessions
from tests.sim.loop import VirtualLoop
from tests.sim.pg import Asyncpg


@dataclass
class Recorder:
    """``ports.ReapRecorder``: every delete and dry-run report, with its virtual time."""

    loop: VirtualLoop
    reports: list[tuple[float, ReapReport]] = field(default_factory=list)
    on_record: Any = None

    def record(self, report: ReapReport) -> None:
        self.reports.append((self.loop.time(), report))
        if self.on_record is not None:
            self.on_record()


@dataclass
class Service:
    settings: Settings
    controller: Controller
    informer: MultiNamespaceInformer
    listener: RetirementListener
    store: Any
    queue: WorkQueue
    recorder: Recorder
    kept: KeptPods
    api: SimApi


PROBE_CHANNEL = "retired_pod_gc_probe_sim"
"""The listener's delivery-probe channel (the product draws a random one a process)."""

SIM_HOST = "https://kubernetes.sim.invalid"
POOL_SIZE = 32
"""As ``new_api_client``'s."""


@dataclass
class SimApi:
    """The service's Kubernetes client on the model: the real ``ApiTransport``, the token from
    ``credentials``."""

    transport: ApiTransport
    credentials: TokenFile


def new_api(server: ApiServer, *, token_file: str, metrics: KubeMetrics) -> SimApi:
    """As ``service.kube.api.new_api_client`` makes it for a token file, the sessions the
    model's. The token is read (``TokenFile.install``) when the service starts (:func:`run`: it
    reads the loop's clock)."""
    configuration = k8s_client.Configuration()
    configuration.host = SIM_HOST
    credentials = TokenFile(token_file)
    transport = ApiTransport(
        configuration,
        pool_size=POOL_SIZE,
        credentials=credentials,
        metrics=metrics,
        sessions=SimSessions(server),
    )
    return SimApi(transport, credentials)


def build(
    settings: Settings,
    *,
    loop: VirtualLoop,
    api: SimApi,
    rng: random.Random,
    metrics: Metrics,
) -> Service:
    def seeded(policy: Backoff) -> Backoff:
        policy.rng = random.Random(rng.random())
        return policy

    store = new_store(settings, metrics.pg)
    decoder = new_decoder(settings)

    def namespace_informer(namespace: str) -> PodInformer:
        lw = ListWatch(
            api.transport,
            settings=settings.kube,
            metrics=metrics.kube,
            namespace=namespace,
            decoder=decoder,
            rng=random.Random(rng.random()),
        )
        return PodInformer(
            lw,
            settings=settings.kube,
            metrics=metrics.kube,
            backoff=seeded(informer_module.default_backoff()),
        )

    informer = MultiNamespaceInformer(settings.kube.namespaces, namespace_informer)
    pods = new_pod_client(settings, api.transport, metrics.kube, decoder)
    # The seed's draws in the order they were always made: the informers', the queue's, the
    # listener's, the dependencies' shared backoff.
    queue_backoff = seeded(default_queue_backoff())
    listener = RetirementListener(
        settings.database,
        metrics=metrics.pg,
        probe=store.notify,
        backoff=seeded(listener_module.default_backoff()),
        namespaces=settings.kube.namespaces,
        probe_channel=PROBE_CHANNEL,
    )
    gate_backoff = seeded(dependency_backoff())
    recorder = Recorder(loop)
    activation = Activation(enabled=settings.enabled)
    engine = wire_engine(
        settings,
        informer=informer,
        pods=pods,
        store=store,
        listener=listener,
        activation=activation,
        recorder=recorder,
        metrics=metrics,
        queue_backoff=queue_backoff,
        gate_backoff=gate_backoff,
    )
    controller, queue = engine.controller, engine.queue
    kept = wire_kept(
        settings,
        informer=informer,
        rows=store,
        listener=listener,
        activation=activation,
        recorder=None,
        metrics=metrics.kept,
    )
    return Service(settings, controller, informer, listener, store, queue, recorder, kept, api)


async def run(service: Service, *, stop: anyio.Event) -> None:
    """As ``service.app.service.run``, without the HTTP server, watchdog and elector."""
    settings = service.settings
    service.api.credentials.install(service.api.transport.configuration)
    await service.store.start()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(service.informer.run)
            tg.start_soon(service.listener.run)
            await tg.start(service.controller.run_workers, settings.workers)
            await tg.start(service.controller.run_resync, settings.resync_period_s)
            await tg.start(service.kept.run)
            service.controller.set_leader(True)
            await stop.wait()
            await service.controller.stop(settings.shutdown_timeout_s)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await service.store.aclose()


@contextlib.contextmanager
def environment(models: Asyncpg) -> Iterator[None]:
    """What the service runs on, meanwhile: ``asyncpg.connect`` and ``asyncpg.create_pool`` are
    the database model's, and the product's ``trim_heap()`` (glibc's ``malloc_trim`` after a sync
    or a burst) does nothing: the C heap is no part of the model, and the call costs about 50 us.
    Neither draws from the seed or makes a model event: the traces are the same."""
    saved = asyncpg.connect, asyncpg.create_pool
    saved_trim = reflector_module.trim_heap, workqueue_module.trim_heap
    asyncpg.connect = models.connect  # type: ignore[assignment]
    asyncpg.create_pool = models.create_pool  # type: ignore[assignment]
    reflector_module.trim_heap = workqueue_module.trim_heap = bool
    try:
        yield
    finally:
        asyncpg.connect, asyncpg.create_pool = saved
        reflector_module.trim_heap, workqueue_module.trim_heap = saved_trim
