"""The one Event writer (implements ``ports.ReapRecorder`` and ``ports.KeptRecorder``): writes
the Events of deletes, dry-run reports and retired-but-kept pods (``service/kube/eventbodies.py``)
without ever being in the way of a delete.

- :meth:`KubeEventRecorder.record` and :meth:`KubeEventRecorder.record_kept` only append to a
  bounded buffer; they never await and never raise. One drain task writes the Events, one at a
  time, each call under its own timeout, so a hanging Events API holds one connection at most.
- A delete's Event waits for no pace: the delete budget paced the deletes already (in a burst the
  Events trail the deletes by what the one drain task has not written yet). The
  buffer holds two minutes of deletes at the budget's cap (at least ``EVENT_BUFFER_SIZE``).
- Dry-run reports take no delete token, so they are paced (as live deletes would go, at least
  ``EVENTS_PER_SECOND`` after ``EVENT_BURST``) and at most ``report_bound`` wait; the ones beyond
  are counted (``summarized``) and named in one warning when the drain catches up, or every
  ``SUMMARY_INTERVAL_S`` while it cannot.
- Kept Events wait in a buffer of their own (``KEPT_BUFFER_SIZE``), are written only when no
  delete Event or report waits, and share the reports' pace, so they never starve delete Events.
- A write that fails transiently (429, 5xx, timeout, no connection) is written again, same
  name, ahead of its buffer after a backoff (``EVENT_RETRY_BACKOFF``, at least the Retry-After),
  until its age passes ``EVENT_MAX_AGE_S`` (then dropped: ``expired``). A 409 means an earlier
  attempt was written after all, and counts as ``created``.
- Every Event not written is counted with its reason, in ``retired_pod_gc_events_total`` or
  ``retired_pod_gc_kept_events_total``; failed writes are logged once per change of cause
  (:class:`CauseLog`), a full buffer the first time.
- On shutdown, :meth:`KubeEventRecorder.flush` gives pending Events a short, bounded time, then
  logs how many were left unwritten and counts them (``dropped_shutdown``).
  ``retired_pod_gc_events_unwritten`` says at any time how many wait: what a SIGKILL loses.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import aiohttp
import anyio
from anyio.abc import TaskStatus

from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.causelog import CauseLog
from service.kit.errors import Unavailable
from service.kit.ratelimit import limiter
from service.kube.errors import KubeApiError, RequestTimeout
from service.kube.eventbodies import event_body
from service.kube.transport import ApiTransport
from service.metrics import EventResult, KubeMetrics
from service.ports import KeptReport, ReapReport

logger = logging.getLogger(__name__)

EVENT_BUFFER_SIZE = 1000
"""Fewest reports that may wait to be written (the buffer holds two minutes of deletes at the
delete budget's cap when that is more); more are dropped (``dropped_buffer_full``)."""
REPORT_BOUND = 1000
"""Most dry-run reports waiting to be written; more are summarised (``summarized``)."""
KEPT_BUFFER_SIZE = 1000
"""Most ``RetiredPodKept`` Events waiting to be written; more are dropped
(``dropped_buffer_full``)."""
EVENT_BURST = 20
"""Dry-run reports and kept Events written back to back before their pace applies."""
EVENTS_PER_SECOND = 2.0
"""Slowest pace of dry-run reports and kept Events, together (it is the pace of live deletes at
the budget's cap when that is faster)."""
SUMMARY_INTERVAL_S = 60.0
"""While reports are being summarised, how often the summary is logged at most."""
EVENT_MAX_AGE_S = 300.0
"""How long after its delete (or report) an Event whose writes fail transiently is still retried;
older, it is dropped (``expired``)."""
EVENT_RETRY_BACKOFF = Backoff(initial_s=0.5, max_s=30.0, jitter=0.2)
"""Delays between attempts of an Event whose write failed transiently (at least the server's
Retry-After)."""
FLUSH_TIMEOUT_S = 2.0
"""On shutdown, how long pending Events may still be written."""

_WRITE_FAILURES = frozenset(
    (
        EventResult.TIMEOUT,
        EventResult.TRANSPORT_ERROR,
        EventResult.FORBIDDEN,
        EventResult.SERVER_ERROR,
        EventResult.REJECTED,
    )
)
"""The results of a write that failed (the others are the buffer's)."""


def _result_of(status: int) -> EventResult:
    if status == 403:
        return EventResult.FORBIDDEN
    if status == 429:
        return EventResult.THROTTLED
    if status >= 500:
        return EventResult.SERVER_ERROR
    return EventResult.REJECTED


_TRANSIENT_RESULTS = frozenset({EventResult.THROTTLED, EventResult.SERVER_ERROR})
"""Results of an answer whose Event is written again."""


_Report = ReapReport | KeptReport
_Entry = tuple[_Report, float, float]
"""(report, wall-clock time of the Event, event-loop time it was recorded)."""


def _paced(report: _Report) -> bool:
    """Whether the Event waits for the pace (a delete's Event does not: the budget paced it)."""
    return isinstance(report, KeptReport) or report.dry_run


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
        self.buffer_size = (
            buffer_size
            if buffer_size is not None
            else max(EVENT_BUFFER_SIZE, 2 * deletes_per_minute)
        )
        """Most reports waiting to be written."""
        self.report_bound = min(report_bound, self.buffer_size)
        """Most dry-run reports waiting to be written."""
        self.kept_buffer_size = kept_buffer_size
        """Most kept Events waiting to be written."""
        self.reports_per_second = (
            per_second
            if per_second is not None
            else max(EVENTS_PER_SECOND, deletes_per_minute / 60.0)
        )
        """The pace of dry-run reports and kept Events (deletes are paced by the delete budget
        alone)."""
        # Paces them on the event loop's clock, as the summary interval is measured.
        self._limiter = limiter(burst=burst, per_second=self.reports_per_second)
        self._wall_clock = wall_clock
        self.max_age_s = max_age_s
        """How long an Event is retried after it was recorded."""
        self._attempts = Attempts(retry_backoff)
        self._retry_at = float("-inf")
        """Event-loop time before which no Event is written (the last attempt failed)."""
        self._pending: deque[_Entry] = deque()
        """Deletes and dry-run reports."""
        self._kept: deque[_Entry] = deque()
        """Kept pods: written only when ``_pending`` is empty."""
        self._pending_reports = 0
        """Dry-run reports among ``_pending``."""
        self._summarized = 0
        """Dry-run reports summarised since the last summary was logged."""
        self._summary_at = -SUMMARY_INTERVAL_S
        self._sending: _Report | None = None
        self._wake = anyio.Event()
        self._progress = anyio.Event()
        self._logged: set[tuple[bool, str]] = set()
        """(kept, result) of the buffer's results logged once."""
        self._write_failures = CauseLog("Event writes fail", logger)
        """Failed writes, logged once per change of cause (their result) and when one works."""
        self._closed = False
        self._write_scope = anyio.CancelScope()
        metrics.events_unwritten.set_function(lambda: self.pending)

    @property
    def pending(self) -> int:
        """Reports (kept ones included) buffered or being written."""
        return len(self._pending) + len(self._kept) + (self._sending is not None)

    @property
    def summarized(self) -> int:
        """Dry-run reports summarised and not yet named in a summary line."""
        return self._summarized

    def record(self, report: ReapReport) -> None:
        if self._closed:
            self._count(report, EventResult.DROPPED_SHUTDOWN, "")
            return
        if report.dry_run and self._pending_reports >= self.report_bound:
            self._summarized += 1
            self._metrics.events.labels(result=EventResult.SUMMARIZED).inc()
            self._wake.set()
            return
        if len(self._pending) >= self.buffer_size:
            self._count(
                report, EventResult.DROPPED_BUFFER_FULL, "event buffer full; dropping Events"
            )
            return
        self._pending.append((report, self._wall_clock(), clock.now()))
        self._pending_reports += report.dry_run
        self._wake.set()

    def record_kept(self, report: KeptReport) -> None:
        if self._closed:
            self._count(report, EventResult.DROPPED_SHUTDOWN, "")
            return
        if len(self._kept) >= self.kept_buffer_size:
            self._count(
                report, EventResult.DROPPED_BUFFER_FULL, "kept-pod Event buffer full; dropping"
            )
            return
        self._kept.append((report, self._wall_clock(), clock.now()))
        self._wake.set()

    def _queue(self) -> deque[_Entry]:
        """Where the next Event comes from: a delete's or report's first, a kept one's only
        when none waits."""
        return self._pending if self._pending else self._kept

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
            if _paced(self._queue()[0][0]):
                await self._limiter.acquire()
            queue = self._queue()
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
        """The Event ``entry`` failed transiently: first in line of its buffer again after
        ``retry_s``, unless it would be older than ``max_age_s`` by then (dropped:
        ``expired``)."""
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
        """Wait up to ``timeout_s`` for pending Events (:meth:`run` must be running); then drop
        and count what is left, the write in flight included, and accept no more reports.
        Returns the number dropped."""
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
        self._pending_reports = 0
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
        """Name the summarised reports in one warning: when the drain caught up, or every
        ``SUMMARY_INTERVAL_S`` while it cannot."""
        if not self._summarized:
            return
        now = anyio.current_time()
        if not caught_up and now - self._summary_at < SUMMARY_INTERVAL_S:
            return
        logger.warning(
            "dry run: %d more would-delete reports were not written as Events (at most %d wait "
            "to be written, %.1f a second); each is in the 'would have deleted' summary and "
            'counted in retired_pod_gc_events_total{result="summarized"}',
            self._summarized,
            self.report_bound,
            self.reports_per_second,
            extra={"summarized": self._summarized},
        )
        self._summarized = 0
        self._summary_at = now

    async def _write(self, report: _Report, at_s: float) -> float | None:
        """Write one Event; ``None`` when it is done with (written, or dropped and counted),
        else the least delay before it is written again (the server's Retry-After, or 0)."""
        namespace = report.pod.namespace
        # Whatever goes wrong with an Event is counted and forgotten; it must not end the drain
        # task (and with it the process). A bug is logged with its traceback as well.
        try:
            body = event_body(report, instance=self._instance, at_s=at_s)
            with anyio.fail_after(self._timeout_s):
                await self._api.request(
                    "POST",
                    f"/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                    op=None,  # counted in the Event metrics
                    body=body,
                    timeouts=aiohttp.ClientTimeout(total=self._timeout_s),
                    # 409 AlreadyExists: an earlier attempt of this very Event (its name) was
                    # written.
                    expect=(200, 201, 409),
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
            retried = result in _TRANSIENT_RESULTS
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
        """Count ``result`` for ``report``'s kind of Event; log ``message`` (when there is one)
        as its kind of result is logged."""
        kept = isinstance(report, KeptReport)
        metric = "retired_pod_gc_kept_events_total" if kept else "retired_pod_gc_events_total"
        (self._metrics.kept_events if kept else self._metrics.events).labels(result=result).inc()
        if not message:
            return
        if result in _WRITE_FAILURES:
            self._write_failures.failed(
                result, f"{message} (counted in {metric}{{result={result!r}}})"
            )
            logger.debug("%s", message)
            return
        if (kept, result) in self._logged:
            logger.debug("%s", message)
            return
        self._logged.add((kept, result))
        logger.warning("%s (logged once; counted in %s)", message, metric)
