"""The seed's polling design, rebuilt on the service's own adapters for a fair comparison.

Every ``tick_s``: scan the whole informer cache, drop what the pod-only prefilter rejects (a
courtesy the seed did not extend: it makes the baseline cheaper, never dearer), batch-look up the
rows of the rest (``lookup_many``, ``LOOKUP_BATCH_SIZE`` names a query), classify, and judge the
threshold by the first tick that saw each UID reapable. Pods past the threshold go through the
same guarded path as the service: a budget token, a fresh GET, a row re-read, classify again,
and a DELETE with preconditions. Same informer, store, pod client, classifier and budget: only
the *trigger* differs (a timer instead of events).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio

from service.classifier import classify, prefilter
from service.config import Settings
from service.domain import DeleteResult, PodSnapshot, Verdict
from service.engine.budget import DeleteBudget
from service.kit import clock
from service.kube.api import new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.informer import PodInformer
from service.kube.listwatch import ListWatch
from service.metrics import Metrics
from service.pg.store import PgExecutionStore

logger = logging.getLogger(__name__)


class PollingGC:
    def __init__(
        self,
        *,
        settings: Settings,
        informer: PodInformer,
        pods: KubePodClient,
        store: PgExecutionStore,
        budget: DeleteBudget,
        tick_s: float = 10.0,
        on_clock_start: Callable[[str], None] | None = None,
    ) -> None:
        self._settings = settings
        self._informer = informer
        self._pods = pods
        self._store = store
        self._budget = budget
        self.tick_s = tick_s
        self._on_clock_start = on_clock_start
        self._first_seen: dict[tuple[str, Verdict], float] = {}
        self.ticks = 0
        self.tick_durations_s: list[float] = []
        self.deleted = 0

    async def run(self) -> None:
        next_at = clock.now()
        while True:
            await self.tick()
            next_at += self.tick_s
            await anyio.sleep(max(0.0, next_at - clock.now()))

    async def tick(self) -> None:
        started = time.perf_counter()
        informer = self._informer
        candidates = []
        for key in informer.keys():  # noqa: SIM118 (PodCache.keys(), not a dict)
            pod = informer.get(key)
            if pod is not None and prefilter(pod) is None:
                candidates.append(pod)
        rows = await self._store.lookup_many([p.key for p in candidates])
        now = clock.now()
        seen: dict[tuple[str, Verdict], float] = {}
        due: list[tuple[PodSnapshot, Verdict]] = []
        for pod in candidates:
            verdict = classify(pod, rows.get(pod.key)).verdict
            if verdict is None:
                continue
            mark = (pod.uid, verdict)
            first = self._first_seen.get(mark)
            if first is None:
                first = now
                if self._on_clock_start is not None:
                    self._on_clock_start(pod.key)
            seen[mark] = first
            if now - first >= self._settings.threshold_s:
                due.append((pod, verdict))
        self._first_seen = seen
        for pod, verdict in due:
            if not self._settings.dry_run:
                await self._act(pod, verdict)
        self.ticks += 1
        self.tick_durations_s.append(time.perf_counter() - started)

    async def _act(self, pod: PodSnapshot, verdict: Verdict) -> None:
        await (await self._budget.turn()).take()
        fresh = await self._pods.get_pod(pod.namespace, pod.name)
        if fresh is None or fresh.uid != pod.uid:
            return
        row = await self._store.read_fresh(pod.key)
        if classify(fresh, row).verdict is not verdict:
            return
        outcome = await self._pods.delete_pod(
            pod.namespace, pod.name, uid=fresh.uid, resource_version=fresh.resource_version
        )
        if outcome.result is DeleteResult.DELETED:
            self.deleted += 1
            self._first_seen.pop((pod.uid, verdict), None)


class RunningBaseline:
    def __init__(self, gc: PollingGC, informer: PodInformer, metrics: Metrics) -> None:
        self.gc = gc
        self.informer = informer
        self.metrics = metrics


async def run_baseline(
    emulator_url: str,
    settings: Settings,
    *,
    tick_s: float,
    on_clock_start: Callable[[str], None] | None,
    task_status: anyio.abc.TaskStatus[RunningBaseline] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the polling design until cancelled; reports the parts once the cache is synced."""
    metrics = Metrics()
    api = await new_api_client(host=emulator_url, metrics=metrics.kube)
    decoder = PodDecoder(settings.kube.label_keys)
    store = PgExecutionStore(
        settings.database, namespaces=settings.kube.namespaces, metrics=metrics.pg
    )
    informer = PodInformer(
        ListWatch(
            api,
            settings=settings.kube,
            metrics=metrics.kube,
            namespace=settings.kube.namespaces[0],
        ),
        settings=settings.kube,
        metrics=metrics.kube,
    )
    gc = PollingGC(
        settings=settings,
        informer=informer,
        pods=KubePodClient(api, settings.kube, decoder, metrics.kube),
        store=store,
        budget=DeleteBudget(settings.deletes_per_minute),
        tick_s=tick_s,
        on_clock_start=on_clock_start,
    )
    await store.start()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(informer.run)
            await informer.wait_synced()
            tg.start_soon(gc.run)
            task_status.started(RunningBaseline(gc, informer, metrics))
    finally:
        with anyio.CancelScope(shield=True):
            await store.aclose()
            await api.close()
