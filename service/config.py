"""Configuration: every knob, read once from the environment into frozen settings.

Each variable is declared once below: name, default, parser, range, documentation and the
attribute of :class:`Settings` it fills. :func:`load` reads them all, :func:`effective` for
``retired-pod-gc config``, ``devtools/configdoc.py`` and ``chartschema.py`` for the docs' table
and the chart's schema. The rules that tie variables together (lease timings in order, NAMESPACE
or NAMESPACES, a URL inline or in a file) are written out in :func:`load`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from service import settings as _settings
from service.domain import LabelKeys
from service.kit import env
from service.kit.dsn import check_dsn, mask_dsn, read_url_file

# Named here too: the service imports its settings, and their error, from where they are built.
ConfigError = env.ConfigError
Settings = _settings.Settings
KubeSettings = _settings.KubeSettings
DatabaseSettings = _settings.DatabaseSettings
LeaderSettings = _settings.LeaderSettings

PREFIX = "SPACE_RETIRED_EXECUTION_POD_GC_"
MAX_NAMESPACES = 64
"""Most sandbox namespaces one replica watches (each is a list+watch and a label value)."""
T = TypeVar("T")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_KEY_PARSER = env.matching(_LABEL_KEY, "a label key")


def _parse_selector(raw: str) -> str:
    value = raw.strip()
    for term in filter(None, (t.strip() for t in value.split(","))):
        key = re.split(r"!=|==|=| in | notin ", term, maxsplit=1)[0].lstrip("!").strip()
        if not _LABEL_KEY.fullmatch(key):
            raise ValueError(f"expected a label selector, bad term {term!r}")
    return value


def _parse_namespaces(raw: str) -> tuple[str, ...]:
    names = [part.strip() for part in raw.split(",")]
    if not any(names):
        return ()
    out: list[str] = []
    for name in names:
        if not _DNS_NAME.fullmatch(name) or len(name) > 63:
            raise ValueError(f"expected comma-separated namespace names, bad entry {name!r}")
        if name in out:
            raise ValueError(f"namespace {name!r} is listed twice")
        out.append(name)
    if len(out) > MAX_NAMESPACES:
        raise ValueError(f"at most {MAX_NAMESPACES} namespaces, got {len(out)}")
    return tuple(out)


VARIABLES: list[env.Var[Any]] = []
"""Every variable, in the order of docs/configuration.md."""


def _var(suffix: str, default: T, parse: Callable[[str], T], path: str, **kw: Any) -> env.Var[T]:
    """Declare ``PREFIX + suffix``; ``kw`` are the rest of :class:`env.Var` (doc, range, ...)."""
    VARIABLES.append(var := env.Var(suffix, default, parse, path=path, prefix=PREFIX, **kw))
    return var


# fmt: off
ENABLED = _var("ENABLED", False, env.boolean, "enabled",
    doc="Master switch. False: nothing is deleted or reported; health and metrics still served.")
DRY_RUN = _var("DRY_RUN", True, env.boolean, "dry_run",
    doc="When enabled, verify candidates and report each would-be reap once per pod UID, but send "
        "no DELETE.")
THRESHOLD_SECONDS = _var("THRESHOLD_SECONDS", 300.0, env.number, "threshold_s", lo=1, hi=86400,
    doc="How long a pod must be seen continuously in a reapable shape before it is deleted.")
DELETES_PER_MINUTE = _var("DELETES_PER_MINUTE", 120, env.integer,
    "deletes_per_minute", lo=1, hi=6000,
    doc="Delete budget: at most this many DELETEs in any rolling 60 s window.")
RECONCILE_TIMEOUT_SECONDS = _var("RECONCILE_TIMEOUT_SECONDS", 45.0, env.number,
    "reconcile_timeout_s", lo=1, hi=600,
    doc="Time budget of one key's reconcile; each API and database call inside it is bounded too.")
NAMESPACE = _var("NAMESPACE", "sandboxes", env.matching(_DNS_NAME, "a namespace name"),
    "kube.namespaces", show=lambda s: s.kube.namespaces[0] if len(s.kube.namespaces) == 1 else "",
    doc="The sandbox namespace, when there is one: the only namespace watched and the scope of "
        "every row lookup. Exclusive with NAMESPACES.")
NAMESPACES: env.Var[tuple[str, ...]] = _var("NAMESPACES", (), _parse_namespaces,
    "kube.namespaces", show=lambda s: ",".join(s.kube.namespaces),
    doc="Several sandbox namespaces, comma-separated (a,b): one pod cache (a namespaced list+watch)"
        " each, every row lookup scoped to the pod's own namespace; one listener, one Lease and one"
        " delete budget for them all. Exclusive with NAMESPACE; empty means NAMESPACE.")
LABEL_SELECTOR = _var(
    "LABEL_SELECTOR", "app.kubernetes.io/managed-by=space-sandbox", _parse_selector,
    "kube.label_selector", doc="Label selector of the sandbox pods to watch.")
SANDBOX_ID_LABEL = _var("SANDBOX_ID_LABEL", "space.sandbox-id", _LABEL_KEY_PARSER,
    "kube.label_keys.sandbox_id", doc="Pod label that carries the sandbox id.")
GENERATION_LABEL = _var("GENERATION_LABEL", "space.generation", _LABEL_KEY_PARSER,
    "kube.label_keys.generation", doc="Pod label that carries the execution generation.")
POD_KIND_LABEL = _var("POD_KIND_LABEL", "space.pod-kind", _LABEL_KEY_PARSER,
    "kube.label_keys.pod_kind", doc="Pod label that carries the pod kind (create or restore).")
WORKERS = _var("WORKERS", 32, env.integer, "workers", lo=1, hi=256,
    doc="Concurrent reconcile workers (coroutines). Concurrent row lookups share one query, so more"
        " workers means larger batches.")
RESYNC_PERIOD_SECONDS = _var("RESYNC_PERIOD_SECONDS", 600.0, env.number,
    "resync_period_s", lo=1, hi=86400,
    doc="Backstop period: every cached candidate is enqueued again this often.")
SHUTDOWN_TIMEOUT_SECONDS = _var("SHUTDOWN_TIMEOUT_SECONDS", 20.0, env.number,
    "shutdown_timeout_s", lo=0, hi=300,
    doc="On SIGTERM, how long in-flight reconciles may take to finish.")
API_TIMEOUT_SECONDS = _var("API_TIMEOUT_SECONDS", 10.0, env.number,
    "kube.api_timeout_s", lo=0.1, hi=120,
    doc="Timeout of one Kubernetes API call (GET, DELETE, list page, lease).")
WATCH_TIMEOUT_SECONDS = _var("WATCH_TIMEOUT_SECONDS", 300.0, env.number,
    "kube.watch_timeout_s", lo=5, hi=3600,
    doc="Server-side timeoutSeconds of a watch request (jittered up to +10%), once the API server "
        "is known to send bookmarks; until then a watch asks for a shorter one (see "
        "WATCH_SILENCE_SECONDS).")
LIST_PAGE_SIZE = _var("LIST_PAGE_SIZE", 500, env.integer, "kube.list_page_size", lo=1, hi=10000,
    doc="Pods per page when listing.")
LIST_MODE = _var("LIST_MODE", "auto", env.Choice(("auto", "stream", "list")), "kube.list_mode",
    doc="How the pod cache is filled at start and on every relist: stream (a streaming list, the "
        "state as watch events), list (a list from the API server's watch cache, a quorum list as "
        "the last resort) or auto (stream, falling back to list for good when the server rejects or"
        " does not honour it).")
WATCH_SILENCE_SECONDS = _var("WATCH_SILENCE_SECONDS", 75.0, env.number,
    "kube.watch_silence_s", lo=1, hi=3600,
    doc="A watch that has received nothing for this long after its last line is taken for dead (a "
        "silently dropped connection): closed, counted and resumed from the last resourceVersion; "
        "from the first second of every watch. Once the API server is known to send bookmarks (a "
        "real one sends one every 60 s: keep this above that), silence itself is the evidence; "
        "until then a watch asks for a timeoutSeconds this long less a margin (API_TIMEOUT_SECONDS,"
        " at most a quarter of it; 65 s at the defaults), and one that the server has not ended "
        "and that stays silent for the margin past it is dead.")
STREAM_SYNC_TIMEOUT_SECONDS = _var("STREAM_SYNC_TIMEOUT_SECONDS", 30.0, env.number,
    "kube.stream_sync_timeout_s", lo=1, hi=600,
    doc="A streaming list that goes this long without an event before its initial-events-end "
        "bookmark is not honoured by the server (auto: fall back to list).")
DELETE_GRACE_PERIOD_SECONDS = _var("DELETE_GRACE_PERIOD_SECONDS", None, env.optional_integer,
    "kube.delete_grace_period_s", lo=0, hi=3600,
    doc="gracePeriodSeconds sent with each DELETE; empty means the pod's own.")
DATABASE_URL = _var("DATABASE_URL", "", env.text, "database.url", secret=True,
    doc="PostgreSQL URL of the primary (postgresql://user:password@host:port/db, or libpq's multi-"
        "host form host1:port1,host2:port2 for a failover pair: the primary is picked). Never "
        "logged unmasked.")
DATABASE_URL_FILE = _var("DATABASE_URL_FILE", "", env.text, "database.url_file",
    doc="Path of a file holding the database URL (a mounted Secret); exclusive with DATABASE_URL. "
        "Read again for every new connection, so a rotated Secret takes effect at the next "
        "reconnect.")
LISTENER_DATABASE_URL = _var("LISTENER_DATABASE_URL", "", env.text,
    "database.listener_url", secret=True,
    show=lambda s: "" if s.database.listener_url_file else s.database.listener_url,
    doc="URL of the notify listener's own connection, when it must differ from the database URL "
        "(the query pool behind a transaction-mode pooler, the listener direct or through a "
        "session-mode pool). Empty: the database URL. Never logged unmasked.")
LISTENER_DATABASE_URL_FILE = _var("LISTENER_DATABASE_URL_FILE", "", env.text,
    "database.listener_url_file",
    doc="Path of a file holding the listener's URL; exclusive with LISTENER_DATABASE_URL. Read "
        "again for every new connection.")
DB_TRANSACTION_POOLER = _var("DB_TRANSACTION_POOLER", False, env.boolean,
    "database.transaction_pooler",
    doc="The database URL goes through a transaction-mode pooler (PgBouncer pool_mode=transaction "
        "or a proxy that pools by transaction): the pool keeps no server-side prepared statement. "
        "The listener can never work through one (LISTENER_DATABASE_URL).")
DB_POOL_SIZE = _var("DB_POOL_SIZE", 4, env.integer, "database.pool_size", lo=1, hi=64,
    doc="Maximum connections in the lookup pool (the listener has its own).")
DB_CONNECT_TIMEOUT_SECONDS = _var("DB_CONNECT_TIMEOUT_SECONDS", 5.0, env.number,
    "database.connect_timeout_s", lo=0.1, hi=120,
    doc="Timeout to open one database connection (the service's and every command's, migrate "
        "included).")
DB_STATEMENT_TIMEOUT_SECONDS = _var("DB_STATEMENT_TIMEOUT_SECONDS", 5.0, env.number,
    "database.statement_timeout_s", lo=0.1, hi=120, doc="Timeout of one database query.")
MIGRATE_LOCK_TIMEOUT_SECONDS = _var("MIGRATE_LOCK_TIMEOUT_SECONDS", 0.5, env.number,
    "database.migrate_lock_timeout_s", lo=0.01, hi=1,
    doc="migrate: the lock_timeout of each lock it asks for (the migration lock, then each "
        "platform table its steps change): the longest a writer of that table can queue behind "
        "the request. Not granted in time, the attempt is rolled back whole and tried again "
        "(docs/operations.md, migrate and the platform's writers).")
MIGRATE_DEADLINE_SECONDS = _var("MIGRATE_DEADLINE_SECONDS", 120.0, env.number,
    "database.migrate_deadline_s", lo=1, hi=3600,
    doc="migrate: how long it retries a lock it was not granted before it stops (exit 3, naming "
        "the sessions that hold it, nothing changed). The migrate Job's activeDeadlineSeconds is "
        "derived from it.")
NOTIFY_CHANNEL = _var(
    "NOTIFY_CHANNEL", "sandbox_execution_changed", env.matching(_IDENTIFIER, "an SQL identifier"),
    "database.notify_channel",
    doc="LISTEN/NOTIFY channel the trigger publishes execution changes on.")
LISTENER_HEARTBEAT_SECONDS = _var("LISTENER_HEARTBEAT_SECONDS", 10.0, env.number,
    "database.heartbeat_interval_s", lo=0.1, hi=300,
    doc="How often the listener proves delivery: a NOTIFY sent through the query pool on a channel "
        "of its own must come back on the listening connection.")
LISTENER_HEARTBEAT_TIMEOUT_SECONDS = _var("LISTENER_HEARTBEAT_TIMEOUT_SECONDS", 5.0, env.number,
    "database.heartbeat_timeout_s", lo=0.1, hi=120,
    doc="A delivery probe (heartbeat, or the barrier before a DELETE) that has not come back within"
        " this declares the listener connection dead (no DELETE until a new one proves delivery).")
LOOKUP_BATCH_SIZE = _var("LOOKUP_BATCH_SIZE", 500, env.integer,
    "database.batch_max_size", lo=1, hi=10000, doc="Most pod names one batched row lookup carries.")
METRICS_BIND_ADDRESS = _var("METRICS_BIND_ADDRESS", ("0.0.0.0", 8080), env.host_port,
    "bind_host,bind_port", show=lambda s: f"{s.bind_host}:{s.bind_port}",
    doc="HOST:PORT of the /metrics, /healthz and /readyz server.")
DEBUG_PENDING = _var("DEBUG_PENDING", False, env.boolean, "debug_pending",
    doc="Serve GET /debug/pending on the DEBUG_BIND_ADDRESS listener (never on the "
        "METRICS_BIND_ADDRESS port): every pod whose observation clock runs (key, UID, verdict, "
        "since, due at, what it waits for), as JSON. Off by default: it names pods, which /metrics "
        "never does.")
DEBUG_BIND_ADDRESS = _var("DEBUG_BIND_ADDRESS", ("127.0.0.1", 8081), env.host_port,
    "debug_host,debug_port", show=lambda s: f"{s.debug_host}:{s.debug_port}",
    doc="HOST:PORT of the /debug/* listener (DEBUG_PENDING), apart from the metrics port. Loopback "
        "by default: reached with kubectl port-forward, never from the cluster network; "
        "0.0.0.0:PORT opens it to every pod the NetworkPolicy lets in.")
LEADER_ELECTION = _var("LEADER_ELECTION", True, env.boolean, "leader.enabled",
    doc="Elect one active replica through a coordination.k8s.io/v1 Lease; only the leader deletes "
        "or reports.")
LEASE_NAME = _var("LEASE_NAME", "retired-pod-gc", env.matching(_DNS_NAME, "a Lease name"),
    "leader.lease_name", doc="Name of the Lease.")
LEASE_NAMESPACE = _var("LEASE_NAMESPACE", "", env.text, "leader.lease_namespace",
    doc="Namespace of the Lease; empty means this pod's namespace (service account), else the "
        "(first) sandbox namespace.")
LEASE_DURATION_SECONDS = _var("LEASE_DURATION_SECONDS", 15.0, env.number,
    "leader.lease_duration_s", lo=1, hi=300,
    doc="How long a lease holds without renewal before another replica may take it.")
RENEW_DEADLINE_SECONDS = _var("RENEW_DEADLINE_SECONDS", 10.0, env.number,
    "leader.renew_deadline_s", lo=0.5, hi=300,
    doc="A leader that has not renewed for this long stops deleting (kept below "
        "LEASE_DURATION_SECONDS).")
RETRY_PERIOD_SECONDS = _var("RETRY_PERIOD_SECONDS", 2.0, env.number,
    "leader.retry_period_s", lo=0.1, hi=60,
    doc="How often the lease is renewed or its acquisition retried (kept below "
        "RENEW_DEADLINE_SECONDS).")
EVENTS_ENABLED = _var("EVENTS_ENABLED", True, env.boolean, "events_enabled",
    doc="Record a Kubernetes Event (events.k8s.io/v1) on every deleted pod and every dry-run "
        "report; never delays a delete.")
LEADER_IDENTITY = _var("LEADER_IDENTITY", "", env.text, "leader.identity",
    doc="Holder identity written to the Lease; empty means hostname and process id.")
LOG_LEVEL = _var("LOG_LEVEL", "info", env.Choice(("debug", "info", "warning", "error")),
    "log_level", doc="Log level.")
LOG_FORMAT = _var("LOG_FORMAT", "json", env.Choice(("json", "text")), "log_format",
    doc="json: one JSON object a line; text: for humans.")
KEPT_BOUND_SECONDS = _var("KEPT_BOUND_SECONDS", 1800.0, env.number, "kept_bound_s", lo=1, hi=604800,
    doc="Retired but kept: a pod whose execution is retired but that is kept longer than this gets "
        "one RetiredPodKept Warning Event (at most one a pod a day); the alert "
        "RetiredPodGcRetiredPodsKept uses the same bound (deploy/monitoring).")

# fmt: on


_SECTIONS = {
    "kube.label_keys": LabelKeys,
    "kube": KubeSettings,
    "database": DatabaseSettings,
    "leader": LeaderSettings,
}
"""The object each dotted path of a variable lands in under :class:`Settings`, innermost first."""


def _keep_lease_timings_ordered(got: dict[str, Any], w: list[str]) -> None:
    """Renew deadline below the lease, retry period below the deadline (else 2/3, 1/3 of it)."""
    for longer, shorter, thirds in (
        (LEASE_DURATION_SECONDS, RENEW_DEADLINE_SECONDS, 2),
        (RENEW_DEADLINE_SECONDS, RETRY_PERIOD_SECONDS, 1),
    ):
        bound, value = got[longer.name], got[shorter.name]
        if value >= bound:
            got[shorter.name] = used = bound * thirds / 3
            w.append(
                f"{shorter.name}={value:g} must be below {longer.name}={bound:g}; using {used:g}"
            )


def _namespaces(environ: Mapping[str, str], w: list[str]) -> tuple[str, ...]:
    """NAMESPACES when set, else the one NAMESPACE; both set is an error (which one wins would
    be a guess about the scope of every delete)."""
    several = NAMESPACES.read(environ, w)
    if not several:
        return (NAMESPACE.read(environ, w),)
    if environ.get(NAMESPACE.name, "").strip():
        raise ConfigError(NAMESPACES.name, f"set only one of it and {NAMESPACE.name}")
    return several


def _url(got: dict[str, Any], inline: env.Var[str], file: env.Var[str]) -> None:
    """One URL given inline or as a file (exclusive), checked; the file's is read now."""
    url, path = got[inline.name], got[file.name]
    if path and url:
        raise ConfigError(file.name, f"set only one of it and {inline.name}")
    if path:
        got[inline.name] = read_url_file(path, file.name)
    elif url:
        try:
            check_dsn(url)
        except ValueError as exc:
            raise ConfigError(inline.name, str(exc)) from None


def load(environ: Mapping[str, str]) -> Settings:
    """Build the settings from ``environ`` (usually ``os.environ``); raises :class:`ConfigError`."""
    w: list[str] = []
    got: dict[str, Any] = {NAMESPACES.name: _namespaces(environ, w)}
    got[NAMESPACE.name] = got[NAMESPACES.name]
    got.update((v.name, v.read(environ, w)) for v in VARIABLES if v.name not in got)
    _keep_lease_timings_ordered(got, w)
    _url(got, DATABASE_URL, DATABASE_URL_FILE)
    _url(got, LISTENER_DATABASE_URL, LISTENER_DATABASE_URL_FILE)
    known = {v.name for v in VARIABLES}
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    w.extend(f"{name} is not a known variable and is ignored" for name in unknown)
    # Not logged here: logging is configured from these very settings; callers report them.
    values = {v.path: got[v.name] for v in VARIABLES} | {"warnings": tuple(w)}
    return env.assemble(Settings, values, _SECTIONS)


def pool_url(database: DatabaseSettings) -> str:
    """The URL a new pooled connection uses now. Raises :class:`ConfigError` when its file can
    no longer be read or holds no usable URL."""
    if database.url_file:
        return read_url_file(database.url_file, DATABASE_URL_FILE.name)
    return database.url


def listener_url_now(database: DatabaseSettings) -> str:
    """A new listener connection's URL now (its own, else the pool's), as :func:`pool_url`."""
    if database.listener_url_file:
        return read_url_file(database.listener_url_file, LISTENER_DATABASE_URL_FILE.name)
    return database.listener_url or pool_url(database)


def effective(settings: Settings, environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(variable, effective value, source) for every variable; secrets masked."""
    rows = []
    for var in VARIABLES:
        value: Any = var.show(settings) if var.show else env.attribute(settings, var.path)
        if var.secret:
            value = mask_dsn(value)
        elif isinstance(value, bool):
            value = str(value).lower()
        shown = "" if value is None else str(value)
        rows.append((var.name, shown, "env" if var.name in environ else "default"))
    return rows
