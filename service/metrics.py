"""Every Prometheus metric of the service, defined once, in one group per subsystem.

Each :class:`Group` declares its metrics in its class body and builds them on the registry it is
given; :class:`Metrics` builds every group on one registry for the wiring, which hands each part
only the group it writes. Labels are low-cardinality enums (never a pod name), their label sets
created at zero so that dashboards and alerts see them before the first event.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import product
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from service.domain import DeleteResult, Mode, Outcome, SkipReason

LOOP = "retired_execution_pod_gc"
MODES = (Mode.LIVE, Mode.DRY_RUN)
"""The outcome counter's ``mode`` values (``Reconciler.mode``)."""
OUTCOME_LABELS: tuple[str, ...] = tuple(str(o) for o in Outcome if o is not Outcome.INACTIVE)


class Dependency(enum.StrEnum):
    """The dependencies the reconcile steps back off from as one (``service/kit/gate.py``)."""

    DATABASE = "database"
    API_SERVER = "api_server"


class ProbeResult(enum.StrEnum):
    """A probe of a dependency the steps back off from: no answer, or one (the backoff ends)."""

    FAILED = "failed"
    ANSWERED = "answered"


class EventResult(enum.StrEnum):
    """Results of Kubernetes Event writes: written (``created``), refused and dropped (403, other
    4xx), an attempt that failed transiently and is retried (``throttled``: 429;
    ``server_error``: 5xx; ``timeout``; ``transport_error``: no connection), dropped after
    retrying until its age passed ``EVENT_MAX_AGE_S`` (``expired``), never sent (buffer full,
    shutdown flush over, a dry-run report beyond the bound that is named in a summary line
    instead), or dropped because writing it raised something unexpected (a bug, logged with its
    traceback). Each Event ends as exactly one of created, forbidden, rejected, expired,
    dropped_*, summarized or bug."""

    CREATED = "created"
    FORBIDDEN = "forbidden"
    REJECTED = "rejected"
    SERVER_ERROR = "server_error"
    TIMEOUT = "timeout"
    TRANSPORT_ERROR = "transport_error"
    THROTTLED = "throttled"
    EXPIRED = "expired"
    DROPPED_BUFFER_FULL = "dropped_buffer_full"
    DROPPED_SHUTDOWN = "dropped_shutdown"
    SUMMARIZED = "summarized"
    BUG = "bug"


class ThrottleAction(enum.StrEnum):
    """What the API client did with a 429 (or a 503 with Retry-After): sent the request again
    after its Retry-After, or handed the answer back (a DELETE's, the last retry's, or one whose
    wait would outlast the request's timeout)."""

    RETRIED = "retried"
    RETURNED = "returned"


class CredentialReload(enum.StrEnum):
    """The credentials read again after a 401: other than before, the same, or not readable."""

    CHANGED = "changed"
    UNCHANGED = "unchanged"
    FAILED = "failed"


class WatchRestart(enum.StrEnum):
    """Why the pod watch was started again: the server ended it (``closed``), its version is gone
    (``expired``, a relist follows), a failure (``error``; ``timeout``: no answer within the
    request's timeout), or no event and no bookmark for ``WATCH_SILENCE_SECONDS`` from a server
    that sends bookmarks (``silent``: the connection is taken for dead)."""

    CLOSED = "closed"
    EXPIRED = "expired"
    ERROR = "error"
    TIMEOUT = "timeout"
    SILENT = "silent"


DELETE_RESULTS = (*DeleteResult, Outcome.THROTTLED, Outcome.ERROR)
"""A DELETE's answer, or what its failure made of its reconcile."""
KEPT_REASONS: tuple[str, ...] = tuple(
    str(r) for r in SkipReason if r not in (SkipReason.NO_ROW, SkipReason.ROW_ACTIVE)
)
"""The reasons a pod whose execution is retired can be kept for: every skip reason but the two
that say the execution is not retired (``service/engine/kept/``)."""


class KeyHistogram(Collector):
    """A histogram observed once per work-queue key (the queue wait and the reconcile duration),
    exported as ``prometheus_client``'s ``Histogram`` exports it (without ``_created``), through
    its public custom-collector API.

    Its :meth:`observe` is a bisect and two additions, without ``Histogram.observe``'s two locks
    (every key of a burst is observed twice, benchmarks/NOTES.md, B2b): it is observed and scraped
    on the event loop's thread only (``/metrics`` is served there).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        *,
        buckets: Iterable[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = (*sorted(buckets), math.inf)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        registry.register(self)

    def observe(self, amount: float, count: int = 1) -> None:
        """Record ``count`` observations of ``amount``."""
        self._counts[bisect.bisect_left(self._bounds, amount)] += count
        self._sum += amount * count

    def collect(self) -> Iterator[Metric]:
        cumulative = itertools.accumulate(self._counts)
        yield HistogramMetricFamily(
            self._name,
            self._documentation,
            # Each ``le`` as ``Histogram`` writes it (``0.5``, ``1.0``, ``+Inf``).
            buckets=[
                ("+Inf" if math.isinf(b) else repr(float(b)), n)
                for b, n in zip(self._bounds, cumulative, strict=True)
            ],
            sum_value=self._sum,
        )


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

_M = TypeVar("_M", bound=Collector)
_Family = TypeVar("_Family", Counter, Gauge)
_Histogram = TypeVar("_Histogram", Histogram, KeyHistogram)


class _Declared(Generic[_M]):
    """A metric declared in a group's class body. Each instance of the group builds it on its
    registry (:class:`Group`) as an instance attribute of the same name, which is what reading
    it finds: ``__get__`` only gives it its type."""

    def __init__(self, build: Callable[[CollectorRegistry], _M]) -> None:
        self.build: Callable[[CollectorRegistry], _M] = build

    def __get__(self, group: object, owner: type) -> _M:
        raise AttributeError("a metric is read from an instance of its group")


def _family(
    kind: type[_Family],
    name: str,
    documentation: str,
    labels: Sequence[str] = (),
    *,
    zero: Iterable[tuple[str, ...]] = (),
) -> _Declared[_Family]:
    """A counter or gauge, with each label set of ``zero`` created at zero."""
    zeros = tuple(zero)

    def build(registry: CollectorRegistry) -> _Family:
        family = kind(name, documentation, labels, registry=registry)
        for values in zeros:
            family.labels(*values)
        return family

    return _Declared(build)


counter = partial(_family, Counter)
gauge = partial(_family, Gauge)


def _histogram(kind: type[_Histogram], name: str, documentation: str) -> _Declared[_Histogram]:
    return _Declared(lambda r: kind(name, documentation, buckets=_LATENCY_BUCKETS, registry=r))


latency = partial(_histogram, Histogram)
key_latency = partial(_histogram, KeyHistogram)


class Group:
    """The metrics of one subsystem, declared in the class body, built on one registry (tests
    pass their own; a group built alone gets a registry of its own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        for name, declared in vars(type(self)).items():
            if isinstance(declared, _Declared):
                setattr(self, name, declared.build(self.registry))


class EngineMetrics(Group):
    """The engine's: outcomes and skips of reconciles, their duration, the observation clocks, the
    DELETEs, the final check, the shared backoff from a dependency (``service/engine/``)."""

    outcomes = counter(
        "cluster_reconciler_outcome",
        "Reconcile outcomes: a reaped shape or a named non-reap outcome.",
        ["loop", "mode", "verdict"],
    )
    skips = counter(
        "retired_pod_gc_skips", "Pods classified as not reapable, by skip reason.", ["reason"]
    )
    reconcile_duration = key_latency(
        "retired_pod_gc_reconcile_duration_seconds", "Duration of one key's reconcile."
    )
    tracked_clocks = gauge(
        "retired_pod_gc_tracked_clocks", "Pod UIDs whose observation clock is running."
    )
    oldest_clock = gauge(
        "retired_pod_gc_oldest_clock_seconds",
        "Age of the oldest running observation clock (0: none). Past THRESHOLD_SECONDS in live "
        "mode, a reapable pod waits for its delete (alert RetiredPodGcReapBacklogGrowing); in dry "
        "run a reported pod's clock runs on.",
    )
    deletes = counter(
        "retired_pod_gc_deletes",
        "DELETE requests sent, by sandbox namespace and result (deleted, gone, conflict, error).",
        ["sandbox_namespace", "result"],
    )
    final_check_reverifications = counter(
        "retired_pod_gc_final_check_reverifications",
        "Verifications redone because the final row re-read was older than the bound "
        "(FINAL_CHECK_MAX_AGE_S) when the DELETE or dry-run report was due.",
    )
    final_check_age = latency(
        "retired_pod_gc_final_check_age_seconds",
        "Age of the final row re-read when a DELETE or dry-run report was made.",
    )
    reconcile_bugs = counter(
        "retired_pod_gc_reconcile_bugs",
        "Reconcile steps that raised an unexpected exception (a bug, logged with its traceback); "
        "the key's clock was cleared and it backs off. Expected failures of the API server or the "
        "database are counted as outcomes instead.",
    )
    reconcile_errors = counter(
        "retired_pod_gc_reconcile_errors",
        "Reconciles that ended in an error or timeout and were requeued with backoff.",
    )
    retirement_to_enqueue = latency(
        "retired_pod_gc_retirement_to_enqueue_seconds",
        "From receiving a notification that carries a retirement to its keys being enqueued (one "
        "sample per notification, which may be a batch of many rows).",
    )
    dependency_backoff = gauge(
        "retired_pod_gc_dependency_backoff",
        "1 while the reconcile steps back off from the dependency as one (it gave no answer; one "
        "probe a backoff step goes out), 0 once it answers.",
        ["dependency"],
        zero=product(Dependency),
    )
    dependency_probes = counter(
        "retired_pod_gc_dependency_probes",
        "Attempts sent to a dependency the steps back off from (one a backoff step), by result "
        "(failed: no answer; answered: the backoff ends).",
        ["dependency", "result"],
        zero=product(Dependency, ProbeResult),
    )
    dependency_held = counter(
        "retired_pod_gc_dependency_held",
        "Keys whose step was not sent to a dependency the steps back off from: requeued to its "
        "next attempt time, and at once when it answers (clocks cleared).",
        ["dependency"],
        zero=product(Dependency),
    )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._outcome_children: dict[tuple[str, str], Counter] = {
            (mode, verdict): self.outcomes.labels(loop=LOOP, mode=mode, verdict=verdict)
            for mode in MODES
            for verdict in OUTCOME_LABELS
        }
        self._skip_children: dict[str, Counter] = {
            str(reason): self.skips.labels(reason=str(reason)) for reason in SkipReason
        }

    def bind_namespaces(self, namespaces: Iterable[str]) -> None:
        """Create the per-namespace label sets at zero (the namespaces are fixed by config)."""
        for namespace in namespaces:
            for result in DELETE_RESULTS:
                self.deletes.labels(sandbox_namespace=namespace, result=result)

    def outcome(self, mode: str, verdict: str, count: int = 1) -> None:
        child = self._outcome_children.get((mode, verdict))
        if child is None:
            child = self.outcomes.labels(loop=LOOP, mode=mode, verdict=verdict)
        child.inc(count)

    def skip(self, reason: str, count: int = 1) -> None:
        child = self._skip_children.get(reason)
        if child is None:
            child = self.skips.labels(reason=reason)
        child.inc(count)


class QueueMetrics(Group):
    """The work queue's (``service/engine/workqueue.py``)."""

    queue_depth = gauge("retired_pod_gc_queue_depth", "Keys ready to be processed.")
    queue_delayed = gauge("retired_pod_gc_queue_delayed", "Keys waiting for their add_after time.")
    queue_adds = counter("retired_pod_gc_queue_adds", "Keys added to the work queue.")
    queue_retries = counter("retired_pod_gc_queue_retries", "Keys requeued with backoff.")
    queue_wait = key_latency(
        "retired_pod_gc_queue_wait_seconds",
        "Time a key waited in the queue before a worker took it.",
    )


class KubeMetrics(Group):
    """The Kubernetes adapter's (``service/kube/``): API client, caches, watches, Events, lease."""

    # sandbox_namespace: values fixed by configuration (NAMESPACES), so bounded; not
    # `namespace`, which Prometheus gives the scraped target (the controller's own).
    cache_pods = gauge(
        "retired_pod_gc_cache_pods",
        "Pods in the informer cache, by sandbox namespace.",
        ["sandbox_namespace"],
    )
    cache_synced = gauge(
        "retired_pod_gc_cache_synced",
        "1 when the informer cache of the sandbox namespace is synced.",
        ["sandbox_namespace"],
    )
    watch_events = counter(
        "retired_pod_gc_watch_events", "Watch events received, by type.", ["type"]
    )
    watch_restarts = counter(
        "retired_pod_gc_watch_restarts",
        "Watch (re)starts, by reason (closed, expired, error, timeout, silent).",
        ["reason"],
        zero=product(WatchRestart),
    )
    relists = counter("retired_pod_gc_relists", "Full relists of the pod cache.")
    list_mode = gauge(
        "retired_pod_gc_informer_list_mode",
        "1 for the way the pod cache of the sandbox namespace was last filled (stream, list_cache, "
        "list_quorum).",
        ["sandbox_namespace", "mode"],
    )
    decode_errors = counter(
        "retired_pod_gc_decode_errors",
        "Malformed pod objects skipped, by source (list, watch, get).",
        ["source"],
    )
    events = counter(
        "retired_pod_gc_events",
        "Kubernetes Events about deletes and dry-run reports, by result.",
        ["result"],
        zero=product(EventResult),
    )
    events_unwritten = gauge(
        "retired_pod_gc_events_unwritten",
        "Events of deletes, dry-run reports and kept pods buffered or being written: how far the "
        "Events trail the deletes, and what a SIGKILL would lose now.",
    )
    api_requests = counter(
        "retired_pod_gc_api_requests",
        "Kubernetes API requests, by operation (watchlist, list, watch, get, delete, lease) and "
        "result.",
        ["op", "result"],
    )
    api_pool_replacements = counter(
        "retired_pod_gc_api_pool_replacements",
        "Times the API client's keep-alive connection pool was replaced because a request on it "
        "got no answer within its timeout.",
    )
    api_throttled = counter(
        "retired_pod_gc_api_throttled",
        "Answers 429 (or 503 with Retry-After) from the API server, by what the client did: "
        "retried after the Retry-After, or returned to the caller.",
        ["action"],
        zero=product(ThrottleAction),
    )
    api_concurrency_limit = gauge(
        "retired_pod_gc_api_concurrency_limit",
        "Requests (other than watches) the API client sends at once: halved on a 429, grown back "
        "on answers, from 1 to the connection pool size.",
    )
    api_credential_reloads = counter(
        "retired_pod_gc_api_credential_reloads",
        "Credentials read again after a 401, by result (changed, unchanged, failed).",
        ["result"],
        zero=product(CredentialReload),
    )
    api_unauthorized_answers = counter(
        "retired_pod_gc_api_unauthorized_answers",
        "Answers 401 that stood after the credentials were read again (the request failed).",
    )
    api_unauthorized = gauge(
        "retired_pod_gc_api_unauthorized",
        "1 while the API server refuses the credentials (the last answer was a 401 after a "
        "reload); the replica is not ready meanwhile.",
    )
    api_reachable = gauge(
        "retired_pod_gc_api_reachable",
        "0 while the API server is taken for unreachable: a request ended without an answer and "
        "nothing has answered since it was sent (the replica is not ready meanwhile); else 1.",
    )
    api_last_answer_age = gauge(
        "retired_pod_gc_api_last_answer_age_seconds",
        "Seconds since the API server last answered anything (a response of any status, a line on "
        "a watch stream).",
    )
    kept_events = counter(
        "retired_pod_gc_kept_events",
        "RetiredPodKept Events by result, as retired_pod_gc_events_total counts the Events of "
        "deletes (one writer, service/kube/events.py; failed attempts retried).",
        ["result"],
        zero=product(EventResult),
    )
    is_leader = gauge(
        "retired_pod_gc_is_leader",
        "1 while this replica acts as the leader: it holds the lease, or leader election is off "
        "(LEADER_ELECTION=false).",
    )


class PgMetrics(Group):
    """The PostgreSQL adapter's (``service/pg/``): row queries, connections, the listener."""

    listener_connected = gauge(
        "retired_pod_gc_listener_connected",
        "1 while the LISTEN connection is up and has proven that notifications arrive.",
    )
    listener_delivery_ok = gauge(
        "retired_pod_gc_listener_delivery_ok",
        "1 when the listener's last delivery probe (a NOTIFY sent through the query pool) arrived "
        "on the listening connection in time, else 0.",
    )
    listener_delivery_failures = counter(
        "retired_pod_gc_listener_delivery_failures",
        "Delivery probes that failed (not sent, or not arrived in time).",
    )
    notify_queue_usage = gauge(
        "retired_pod_gc_notify_queue_usage_ratio",
        "pg_notification_queue_usage(): the fraction of the server's NOTIFY queue in use. At 1 "
        "every NOTIFYing COMMIT fails (the platform's retirements among them).",
    )
    database_login_failures = counter(
        "retired_pod_gc_database_login_failures",
        "Connections whose login the server refused (wrong password, unknown role).",
    )
    listener_connect_failures = counter(
        "retired_pod_gc_listener_connect_failures",
        "Attempts to open the LISTEN connection and prove delivery on it that failed.",
    )
    listener_reconnects = counter(
        "retired_pod_gc_listener_reconnects", "LISTEN connection re-establishments."
    )
    notifications = counter(
        "retired_pod_gc_notifications",
        "Change notifications received (payloads; one may carry a batch of changes).",
    )
    notifications_malformed = counter(
        "retired_pod_gc_notifications_malformed",
        "Notification payloads skipped whole (malformed, oversized), plus bad rows skipped inside "
        "otherwise valid batches.",
    )
    row_queries = counter(
        "retired_pod_gc_row_queries",
        "Execution-row queries, by kind (batch, fresh).",
        ["kind"],
    )
    row_query_errors = counter(
        "retired_pod_gc_row_query_errors", "Execution-row queries that failed."
    )
    rows_malformed = counter(
        "retired_pod_gc_rows_malformed",
        "Execution rows that could not be decoded (treated as missing: never reaped).",
    )
    database_up = gauge(
        "retired_pod_gc_database_up", "1 when the last database health check succeeded."
    )


class KeptMetrics(Group):
    """Retired but kept (``service/engine/kept/``): every reason's label set at zero."""

    retired_kept_pods = gauge(
        "retired_pod_gc_retired_kept_pods",
        "Cached pods whose execution row is retired (inactive) but that are kept, by the "
        "classifier's skip reason.",
        ["reason"],
        zero=product(KEPT_REASONS),
    )
    retired_kept_oldest = gauge(
        "retired_pod_gc_retired_kept_oldest_seconds",
        "Age of the oldest retired-but-kept pod of each reason: since its row's retired_at, else "
        "the retirement notification's arrival, else first seen (0: none).",
        ["reason"],
        zero=product(KEPT_REASONS),
    )
    retired_kept_bound = gauge(
        "retired_pod_gc_retired_kept_bound_seconds",
        "KEPT_BOUND_SECONDS: how long a retired pod may be kept before its Event and the alert "
        "RetiredPodGcRetiredPodsKept.",
    )
    retired_kept_sweep_duration = latency(
        "retired_pod_gc_retired_kept_sweep_duration_seconds",
        "Duration of one retired-but-kept sweep of a namespace (one row query).",
    )
    retired_kept_sweep_errors = counter(
        "retired_pod_gc_retired_kept_sweep_errors",
        "Retired-but-kept row queries (sweep, notification, Event check) that failed.",
    )


class ServiceMetrics(Group):
    """The service's settings, as set at start (``service/app/service.py``)."""

    enabled = gauge("retired_pod_gc_enabled", "1 when ENABLED is true.")
    dry_run = gauge("retired_pod_gc_dry_run", "1 when DRY_RUN is true.")
    threshold = gauge(
        "retired_pod_gc_threshold_seconds",
        "THRESHOLD_SECONDS: how long a pod must be seen reapable before it is deleted.",
    )


class Metrics:
    """Every group on one registry (tests pass their own; production the default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.kube, self.pg, self.queue = KubeMetrics(r), PgMetrics(r), QueueMetrics(r)
        self.engine, self.kept, self.service = EngineMetrics(r), KeptMetrics(r), ServiceMetrics(r)
