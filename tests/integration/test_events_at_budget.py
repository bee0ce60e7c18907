"""An Event for every delete at a raised budget: ``DELETES_PER_MINUTE=600`` and a backlog of 1,200
due pods, against the API server emulator over HTTP.

Everything runs on real time (it talks to a server): the informer, the pod client and the Event
recorder are the real adapters, and the delete budget is the real one, both stages, with its
window scaled down to ``WINDOW_S`` so that the two windows the backlog needs pass in seconds; the
recorder is sized for 600 a minute, as the service sizes it. The DELETEs and the Events are read
from the emulator: every DELETE it answered 200 has exactly one ``RetiredPodDeleted`` Event
regarding that UID, and nothing was dropped or summarised. Nothing is judged by elapsed time.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
from prometheus_client import CollectorRegistry

from devtools.emulator import RunningEmulator
from devtools.emulator.core import DEFAULT_POD_TEMPLATE
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from service.config import KubeSettings
from service.engine.activation import Activation
from service.engine.budget import DeleteBudget
from service.engine.controller import Controller
from service.engine.observation import ObservationClocks
from service.engine.reconciler import Reconciler
from service.engine.workqueue import WorkQueue
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.events import REASON_DELETED, KubeEventRecorder
from service.kube.informer import PodInformer
from service.kube.listwatch import ListWatch
from service.kube.transport import ApiTransport
from service.metrics import EventResult, Metrics
from tests.fakes import FakeExecutionStore, NoNotifications, make_row, make_settings
from tests.kubefixtures import SANDBOX_NAMESPACE, eventually
from tests.pgfixtures import metric

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
BUDGET = 600
BACKLOG = 1200
THRESHOLD_S = 1.0
WINDOW_S = 2.0
"""The budget's window, scaled down from 60 s: at most 600 DELETEs in any 2 s."""
EVENTUALLY_S = 90.0
"""Generous: 1,200 GETs, DELETEs and Events over HTTP on a loaded 2-core machine."""


@pytest.fixture
def emulator_options() -> Iterator[dict[str, object]]:
    # Terminal pods go at once on DELETE; no kubelet needed.
    yield {"bookmark_interval_s": 0.5, "history_size": 20_000}


def _event_results(metrics: Metrics) -> dict[str, int]:
    counts = {
        r: int(metric(metrics.registry, "retired_pod_gc_events_total", result=r))
        for r in EventResult
    }
    return {r: n for r, n in counts.items() if n}


async def test_every_delete_has_its_event_at_600_a_minute_with_a_backlog_of_1200(
    emulator: RunningEmulator, kube_api: ApiTransport, kube_settings: KubeSettings
) -> None:
    emu = emulator.emulator
    template = sandbox_pod(sandbox_id="0", generation=1, shape=Shape.SUCCEEDED)
    template["metadata"] = {"labels": dict(DEFAULT_POD_TEMPLATE["metadata"]["labels"])}
    emu.bulk_create_pods(namespace=NS, count=BACKLOG, template=template)
    settings = make_settings(threshold_s=THRESHOLD_S, deletes_per_minute=BUDGET)
    metrics = Metrics(CollectorRegistry())
    decoder = PodDecoder(settings.kube.label_keys)
    informer = PodInformer(
        ListWatch(kube_api, settings=kube_settings, metrics=metrics.kube, namespace=NS),
        settings=kube_settings,
        metrics=metrics.kube,
    )
    store = FakeExecutionStore()
    clocks = ObservationClocks(metrics=metrics.engine)
    budget = DeleteBudget(BUDGET, window_s=WINDOW_S)
    recorder = KubeEventRecorder(
        kube_api,
        instance="gc-test",
        metrics=metrics.kube,
        timeout_s=10.0,
        deletes_per_minute=BUDGET,
    )
    activation = Activation(enabled=True)
    queue = WorkQueue(metrics=metrics.queue)
    reconciler = Reconciler(
        settings=settings,
        cache=informer,
        pods=KubePodClient(kube_api, kube_settings, decoder, metrics.kube),
        store=store,
        clocks=clocks,
        budget=budget,
        activation=activation,
        metrics=metrics.engine,
        # The rows live in the fake store and change only when the test says so: no
        # notification can be in flight.
        barrier=NoNotifications(),
        recorder=recorder,
    )
    controller = Controller(
        cache=informer,
        queue=queue,
        reconciler=reconciler,
        clocks=clocks,
        activation=activation,
        metrics=metrics.engine,
        batch_size=500,
    )
    informer.add_handler(controller)

    def deleted() -> int:
        return sum(
            1
            for e in emu.audit_log(method="DELETE", path_contains=f"/namespaces/{NS}/pods/")
            if e.status == 200
        )

    async with anyio.create_task_group() as tg:
        await tg.start(informer.run)
        await tg.start(recorder.run)
        with anyio.fail_after(EVENTUALLY_S):
            await informer.wait_synced()
        for key in list(informer.keys()):
            pod = informer.get(key)
            assert pod is not None
            store.put(make_row(pod))
        await tg.start(controller.run_workers, 8)
        # Enqueues every cached candidate: the clocks start, and the whole backlog falls due
        # THRESHOLD_S later, at once.
        controller.set_leader(True)
        await eventually(lambda: deleted() == BACKLOG, timeout_s=EVENTUALLY_S)
        await eventually(
            lambda: _event_results(metrics) == {"created": BACKLOG}, timeout_s=EVENTUALLY_S
        )
        queue.shut_down()
        tg.cancel_scope.cancel()

    sent = [
        e
        for e in emu.audit_log(method="DELETE", path_contains=f"/namespaces/{NS}/pods/")
        if e.status == 200
    ]
    assert len(sent) == BACKLOG
    uids = {e.body["preconditions"]["uid"] for e in sent if isinstance(e.body, dict)}
    assert len(uids) == BACKLOG
    events = emu.events.events(NS)
    assert len(events) == BACKLOG
    assert {e["regarding"]["uid"] for e in events} == uids
    assert {e["reason"] for e in events} == {REASON_DELETED}
    assert _event_results(metrics) == {"created": BACKLOG}
    assert recorder.pending == 0
