"""``RetiredPodKept`` Warning Events (implements ``ports.KeptRecorder``).

A pod whose execution is retired but that the controller keeps, longer than the bound
(``KEPT_BOUND_SECONDS``), gets one ``events.k8s.io/v1`` Event of type ``Warning`` regarding it,
naming the classifier's reason, the row's state and since when (``service/engine/kept.py``
decides when: at most one a pod a day, never for a pod whose row is active).

Written as the reap Events are (``service/kube/events.py``), within the same Event budget and
never in anybody's way: :meth:`KeptEventWriter.record_kept` only appends to a bounded buffer;
one drain task writes them one at a time, each call under its own timeout, at the pace of
dry-run reports (``EVENT_BURST`` back to back, then ``EVENTS_PER_SECOND``); a full buffer drops
(counted). Every result is counted in ``retired_pod_gc_kept_events_total{result}``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import aiohttp
import anyio
from anyio.abc import TaskStatus
from kubernetes_asyncio import client as k8s_client

from service.kit.ratelimit import limiter
from service.kube.errors import TRANSIENT_ERRORS, read_whole, status_message
from service.kube.events import EVENT_BURST, EVENTS_PER_SECOND, REPORTING_CONTROLLER, event_time
from service.metrics import Metrics
from service.ports import KeptReport

logger = logging.getLogger(__name__)

REASON_KEPT = "RetiredPodKept"
ACTION_KEEP = "Keep"
BUFFER_SIZE = 1000
"""Most Events waiting to be written; more are dropped (``dropped_buffer_full``)."""
_NOTE_MAX_BYTES = 1024
RUNBOOK = 'docs/operations.md, "Retired but kept"'
"""Where the Event sends its reader (the runbook entry of each reason)."""
_INSTANCE_MAX = 128


def kept_note(report: KeptReport) -> str:
    """The reason, the row's state and since when, and what to read next."""
    since = event_time(report.since_s)
    note = (
        f"Execution retired ({report.row_state}, inactive) since {since} ({report.since_source}) "
        f"but the pod is kept: {report.reason}: {report.rule}. Kept for "
        f"{report.kept_for_s:.0f}s. Nothing will delete it: {RUNBOOK}, {report.reason}."
    )
    encoded = note.encode()
    if len(encoded) <= _NOTE_MAX_BYTES:
        return note
    return encoded[: _NOTE_MAX_BYTES - 3].decode("utf-8", "ignore") + "..."


def kept_event_body(report: KeptReport, *, instance: str, at_s: float) -> dict[str, Any]:
    pod = report.pod
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{pod.name}.{int(at_s * 1e9):x}", "namespace": pod.namespace},
        "eventTime": event_time(at_s),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:_INSTANCE_MAX],
        "action": ACTION_KEEP,
        "reason": REASON_KEPT,
        "regarding": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": pod.namespace,
            "name": pod.name,
            "uid": pod.uid,
            "resourceVersion": pod.resource_version,
        },
        "note": kept_note(report),
        "type": "Warning",
    }


class KeptEventWriter:
    """Buffers kept reports and writes them as Events from its own task (:meth:`run`)."""

    def __init__(
        self,
        api: k8s_client.ApiClient,
        *,
        instance: str,
        metrics: Metrics,
        timeout_s: float,
        buffer_size: int = BUFFER_SIZE,
        burst: int = EVENT_BURST,
        per_second: float = EVENTS_PER_SECOND,
        wall_clock: Callable[[], float] = time.time,  # noqa: TID251 (Event timestamps)
    ) -> None:
        self._events = k8s_client.EventsV1Api(api)
        self._instance = instance
        self._metrics = metrics
        self._timeout_s = timeout_s
        self.buffer_size = buffer_size
        self._limiter = limiter(burst=burst, per_second=per_second)
        self._wall_clock = wall_clock
        self._pending: deque[tuple[KeptReport, float]] = deque()
        self._wake = anyio.Event()
        self._logged: set[str] = set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def record_kept(self, report: KeptReport) -> None:
        if len(self._pending) >= self.buffer_size:
            self._count("dropped_buffer_full", "kept-pod Event buffer full; dropping Events")
            return
        self._pending.append((report, self._wall_clock()))
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write buffered Events until cancelled."""
        task_status.started()
        while True:
            if not self._pending:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            await self._limiter.acquire()
            report, at_s = self._pending.popleft()
            await self._write(report, at_s)

    async def _write(self, report: KeptReport, at_s: float) -> None:
        # Whatever goes wrong is counted and forgotten: it must never end the drain task.
        try:
            body = kept_event_body(report, instance=self._instance, at_s=at_s)
            with anyio.fail_after(self._timeout_s):
                response, raw = await read_whole(
                    self._events.create_namespaced_event(
                        report.pod.namespace,
                        cast(Any, body),
                        _preload_content=False,
                        _request_timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                    )
                )
        except TimeoutError:
            self._count("timeout", f"kept-pod Event write timed out after {self._timeout_s:.1f}s")
            return
        except TRANSIENT_ERRORS as exc:
            self._count("transport_error", f"kept-pod Event write failed: {exc!r}")
            return
        except Exception:
            logger.exception("writing a kept-pod Event raised (a bug); the Event is dropped")
            self._metrics.kept_events.labels(result="bug").inc()
            return
        status = response.status
        if status in (200, 201):
            self._metrics.kept_events.labels(result="created").inc()
            logger.info(
                "retired but kept: %s (%s) Event written",
                report.pod.key,
                report.reason,
                extra={"pod": report.pod.key, "reason": report.reason},
            )
            return
        result = "forbidden" if status == 403 else "server_error" if status >= 500 else "rejected"
        self._count(result, f"kept-pod Event write answered {status}: {status_message(raw)}")

    def _count(self, result: str, message: str) -> None:
        self._metrics.kept_events.labels(result=result).inc()
        if result in self._logged:
            logger.debug("%s", message)
            return
        self._logged.add(result)
        logger.warning("%s (logged once; counted in retired_pod_gc_kept_events_total)", message)
