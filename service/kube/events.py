"""The ``events.k8s.io/v1`` Events of the service's reports and their one writer
(``ports.ReapRecorder``, ``ports.KeptRecorder``), never in a delete's way:

- ``record``/``record_kept`` only append to a bounded buffer; one drain task writes the Events one
  at a time, each under its own timeout.
- A delete's Event is not paced (the delete budget paced the delete); dry-run reports and kept
  Events are, together. Reports beyond ``report_bound`` are counted (``summarized``) and named in
  one warning. Kept Events are written only when nothing else waits.
- A transient failure (429, 5xx, timeout, no connection) is written again, same name, first in its
  buffer, after a backoff of at least the Retry-After, until older than ``EVENT_MAX_AGE_S``. A 409
  is an earlier attempt that was written. Every Event not written is counted with its reason.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import anyio
from anyio.abc import TaskStatus

from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.causelog import CauseLog
from service.kit.errors import Unavailable
from service.kit.ratelimit import limiter
from service.kube.errors import KubeApiError, RequestTimeout
from service.kube.transport import ApiTransport
from service.metrics import EventResult, KubeMetrics
from service.ports import KeptReport, ReapReport

logger = logging.getLogger(__name__)

_Report = ReapReport | KeptReport

EVENT_BUFFER_SIZE = 1000
"""Fewest delete Events and reports that may wait (two minutes of the budget's deletes if more)."""
REPORT_BOUND = 1000
KEPT_BUFFER_SIZE = 1000
EVENT_BURST = 20
EVENTS_PER_SECOND = 2.0
SUMMARY_INTERVAL_S = 60.0
EVENT_MAX_AGE_S = 300.0
EVENT_RETRY_BACKOFF = Backoff(initial_s=0.5, max_s=30.0, jitter=0.2)
FLUSH_TIMEOUT_S = 2.0

REPORTING_CONTROLLER = "space.sandbox/retired-pod-gc"
REASON_DELETED = "RetiredPodDeleted"
REASON_WOULD_DELETE = "RetiredPodWouldDelete"
REASON_KEPT = "RetiredPodKept"
_NOTE_MAX_BYTES = 1024  # the API server rejects a longer note
_INSTANCE_MAX = 128  # and a longer reportingInstance


def event_time(ts: float) -> str:
    """A ``MicroTime`` as the API server writes it."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(report: _Report, *, instance: str, at_s: float) -> dict[str, Any]:
    """The Event of ``report`` regarding its pod, named ``<pod>.<hex nanoseconds>`` as the API
    server requires (a ``generateName`` of ``<pod>.`` is rejected). Its note says what a reader of
    ``kubectl get events`` needs: what, why, for how long and the preconditions the DELETE carried
    (or would have); for a kept pod why, the row's state, since when and its runbook entry."""
    pod = report.pod
    if isinstance(report, KeptReport):
        action, reason, kind = "Keep", REASON_KEPT, "Warning"
        note = (
            f"Execution retired ({report.row_state}, inactive) since {event_time(report.since_s)} "
            f"({report.since_source}) but the pod is kept: {report.reason}: {report.rule}. Kept "
            f"for {report.kept_for_s:.0f}s. Nothing will delete it: "
            f'docs/operations.md, "Retired but kept", {report.reason}.'
        )
    else:
        action, kind = "Delete", "Normal"
        reason = REASON_WOULD_DELETE if report.dry_run else REASON_DELETED
        what = "Would delete (dry run)" if report.dry_run else "Deleted"
        note = (
            f"{what} as {report.verdict}: {report.rule}. Reapable continuously for "
            f"{report.reapable_for_s:.0f}s; execution row state {report.row_state}, inactive. "
            f"Preconditions uid={pod.uid} resourceVersion={pod.resource_version}."
        )
    if len(note.encode()) > _NOTE_MAX_BYTES:
        note = note.encode()[: _NOTE_MAX_BYTES - 3].decode("utf-8", "ignore") + "..."
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{pod.name}.{int(at_s * 1e9):x}", "namespace": pod.namespace},
        "eventTime": event_time(at_s),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:_INSTANCE_MAX],
        "action": action,
        "reason": reason,
        "regarding": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": pod.namespace,
            "name": pod.name,
            "uid": pod.uid,
            "resourceVersion": pod.resource_version,
        },
        "note": note,
        "type": kind,
    }


_LOGGED_ONCE = (EventResult.DROPPED_BUFFER_FULL, EventResult.EXPIRED, EventResult.THROTTLED)
"""Results logged the first time only; a failed write otherwise once per change of cause."""


def _result_of(status: int) -> EventResult:
    if status == 403:
        return EventResult.FORBIDDEN
    if status == 429:
        return EventResult.THROTTLED
    if status >= 500:
        return EventResult.SERVER_ERROR
    return EventResult.REJECTED


_Entry = tuple[_Report, float, float]  # report, wall-clock time of its Event, loop time recorded


class KubeEventRecorder:
    """Buffers reports and writes them as Events from its own task (:meth:`run`)."""

    def __init__(
        self,
        api: ApiTransport,
        *,
        instance: str,
        metrics: KubeMetrics,
        timeout_s: float,
        deletes_per_minute: int = 120,
        buffer_size: int | None = None,
        report_bound: int = REPORT_BOUND,
        kept_buffer_size: int = KEPT_BUFFER_SIZE,
        burst: int = EVENT_BURST,
        per_second: float | None = None,
        wall_clock: Callable[[], float] = time.time,  # noqa: TID251 (Event timestamps)
        max_age_s: float = EVENT_MAX_AGE_S,
        retry_backoff: Backoff = EVENT_RETRY_BACKOFF,
    ) -> None:
        self._api = api
        self._instance = instance
        self._metrics = metrics
        self._timeout_s = timeout_s
        default_buffer = max(EVENT_BUFFER_SIZE, 2 * deletes_per_minute)
        self.buffer_size = default_buffer if buffer_size is None else buffer_size
        self.report_bound = min(report_bound, self.buffer_size)
        self.kept_buffer_size = kept_buffer_size
        default_pace = max(EVENTS_PER_SECOND, deletes_per_minute / 60.0)
        self.reports_per_second = default_pace if per_second is None else per_second
        self._limiter = limiter(burst=burst, per_second=self.reports_per_second)
        self._wall_clock = wall_clock
        self.max_age_s = max_age_s
        self._attempts = Attempts(retry_backoff)
        self._retry_at = float("-inf")
        self._pending: deque[_Entry] = deque()
        self._kept: deque[_Entry] = deque()
        self._pending_reports = 0
        """Dry-run reports among ``_pending``."""
        self.summarized = 0
        """Dry-run reports summarised and not yet named in a summary line."""
        self._summary_at = -SUMMARY_INTERVAL_S
        self._sending: _Report | None = None
        self._wake = anyio.Event()
        self._progress = anyio.Event()
        self._logged: set[tuple[bool, str]] = set()
        self._write_failures = CauseLog("Event writes fail", logger)
        self._closed = False
        metrics.events_unwritten.set_function(lambda: self.pending)

    @property
    def pending(self) -> int:
        """Reports (kept ones included) buffered or being written."""
        return len(self._pending) + len(self._kept) + (self._sending is not None)

    def record(self, report: ReapReport) -> None:
        if report.dry_run and not self._closed and self._pending_reports >= self.report_bound:
            self.summarized += 1
            self._metrics.events.labels(result=EventResult.SUMMARIZED).inc()
            self._wake.set()
        elif self._buffer(
            report, self._pending, self.buffer_size, "event buffer full; dropping Events"
        ):
            self._pending_reports += report.dry_run

    def record_kept(self, report: KeptReport) -> None:
        self._buffer(
            report, self._kept, self.kept_buffer_size, "kept-pod Event buffer full; dropping"
        )

    def _buffer(self, report: _Report, queue: deque[_Entry], size: int, full: str) -> bool:
        """Whether ``report`` was appended to ``queue`` (not shut down, fewer than ``size``)."""
        if self._closed:
            self._count(report, EventResult.DROPPED_SHUTDOWN, "")
        elif len(queue) >= size:
            self._count(report, EventResult.DROPPED_BUFFER_FULL, full)
        else:
            queue.append((report, self._wall_clock(), clock.now()))
            self._wake.set()
            return True
        return False

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write buffered reports until cancelled."""
        task_status.started()
        while True:
            self._summarize(caught_up=not self._pending)
            if not self._pending and not self._kept:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            if clock.now() < self._retry_at:
                await clock.sleep_until(self._retry_at)
                continue  # flushed meanwhile, perhaps
            head = (self._pending or self._kept)[0][0]
            if isinstance(head, KeptReport) or head.dry_run:  # a delete's: the budget paced it
                await self._limiter.acquire()
            queue = self._pending or self._kept
            if not queue:
                continue  # flushed while this waited for its turn
            entry = queue.popleft()
            report = entry[0]
            if isinstance(report, ReapReport):
                self._pending_reports -= report.dry_run
            self._sending = report
            retry_s: float | None = None
            try:
                with anyio.CancelScope() as self._write_scope:
                    retry_s = await self._write(report, entry[1])
            finally:
                self._sending = None
                self._progress.set()
                self._progress = anyio.Event()
            if retry_s is None:
                self._attempts.reset()
            elif not self._closed:
                self._again(entry, retry_s)

    def _again(self, entry: _Entry, retry_s: float) -> None:
        """Put a transiently failed ``entry`` first in its buffer again, unless too old by then."""
        delay_s = self._attempts.next_delay(retry_s)
        now = clock.now()
        report = entry[0]
        if now + delay_s - entry[2] > self.max_age_s:
            self._attempts.reset()
            self._count(
                report,
                EventResult.EXPIRED,
                f"an Event could not be written within {self.max_age_s:g}s of its report; dropped",
            )
            return
        if isinstance(report, KeptReport):
            self._kept.appendleft(entry)
        else:
            self._pending.appendleft(entry)
            self._pending_reports += report.dry_run
        self._retry_at = now + delay_s

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> int:
        """Wait up to ``timeout_s`` for pending Events (:meth:`run` running); then drop and count
        what is left (returned: how many), the write in flight included; accept no more."""
        waiting = self.pending
        with anyio.move_on_after(timeout_s):
            while self.pending:
                await self._progress.wait()
        self._closed = True
        self._summarize(caught_up=True)
        left = [entry[0] for entry in (*self._pending, *self._kept)]
        if self._sending is not None:
            left.append(self._sending)
            self._write_scope.cancel()
        self._pending.clear()
        self._kept.clear()
        for report in left:
            self._count(report, EventResult.DROPPED_SHUTDOWN, "")
        if left:
            logger.warning(
                "shutting down: %d of %d unwritten Events not written within %gs (counted as "
                "dropped_shutdown)",
                len(left),
                waiting,
                timeout_s,
                extra={"unwritten": len(left)},
            )
        else:
            logger.info(
                "shutting down: every Event written (%d were unwritten)",
                waiting,
                extra={"unwritten": 0},
            )
        return len(left)

    def _summarize(self, *, caught_up: bool) -> None:
        """Name the summarised reports in one warning, when caught up or at most each interval."""
        now = anyio.current_time()
        if not self.summarized or (not caught_up and now - self._summary_at < SUMMARY_INTERVAL_S):
            return
        logger.warning(
            "dry run: %d more would-delete reports were not written as Events (at most %d wait "
            "to be written, %.1f a second); each is in the 'would have deleted' summary and "
            'counted in retired_pod_gc_events_total{result="summarized"}',
            self.summarized,
            self.report_bound,
            self.reports_per_second,
            extra={"summarized": self.summarized},
        )
        self.summarized = 0
        self._summary_at = now

    async def _write(self, report: _Report, at_s: float) -> float | None:
        """Write one Event; ``None`` when it is done with (written, or dropped and counted),
        else the least delay before it is written again (the server's Retry-After, or 0)."""
        # Whatever goes wrong is counted and forgotten: it must never end the drain task.
        try:
            body = event_body(report, instance=self._instance, at_s=at_s)
            with anyio.fail_after(self._timeout_s):
                await self._api.request(
                    "POST",
                    f"/apis/events.k8s.io/v1/namespaces/{report.pod.namespace}/events",
                    op=None,  # counted in the Event metrics
                    body=body,
                    timeouts=aiohttp.ClientTimeout(total=self._timeout_s),
                    expect=(200, 201, 409),  # 409: an earlier attempt (same name) was written
                )
        except (TimeoutError, RequestTimeout):
            self._count(
                report,
                EventResult.TIMEOUT,
                f"Event write timed out after {self._timeout_s:.1f}s; retrying",
            )
            return 0.0
        except Unavailable as exc:  # refused connection, reset: never fatal here
            self._count(report, EventResult.TRANSPORT_ERROR, f"Event write failed: {exc}; retrying")
            return 0.0
        except KubeApiError as exc:
            result = _result_of(exc.status)
            retried = result in (EventResult.THROTTLED, EventResult.SERVER_ERROR)
            then = "retrying" if retried else "dropped"
            self._count(report, result, f"Event write answered {exc.status}: {exc.message}; {then}")
            return (exc.retry_after_s or 0.0) if retried else None
        except Exception:
            logger.exception("writing an Event raised (a bug); the Event is dropped")
            self._count(report, EventResult.BUG, "")
            return None
        self._count(report, EventResult.CREATED, "")
        self._write_failures.ok()
        if isinstance(report, KeptReport):
            logger.debug(
                "retired but kept: %s (%s) Event written",
                report.pod.key,
                report.reason,
                extra={"pod": report.pod.key, "reason": report.reason},
            )
        return None

    def _count(self, report: _Report, result: EventResult, message: str) -> None:
        """Count ``result`` for ``report``'s kind of Event; log ``message``, if any."""
        kept = isinstance(report, KeptReport)
        metric = "retired_pod_gc_kept_events_total" if kept else "retired_pod_gc_events_total"
        (self._metrics.kept_events if kept else self._metrics.events).labels(result=result).inc()
        if not message:
            return
        if result not in _LOGGED_ONCE:
            self._write_failures.failed(
                result, f"{message} (counted in {metric}{{result={result!r}}})"
            )
            logger.debug("%s", message)
        elif (kept, result) in self._logged:
            logger.debug("%s", message)
        else:
            self._logged.add((kept, result))
            logger.warning("%s (logged once; counted in %s)", message, metric)
