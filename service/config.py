"""Configuration: every knob, read once from the environment into a frozen settings object.

Each variable is declared once below (name, default, range, documentation); that table drives
parsing, ``retired-pod-gc config`` and the consistency test against ``docs/configuration.md``.
Values that cannot be parsed raise :class:`ConfigError` naming the variable; numbers outside
their range are clamped with a warning naming the variable, the raw value and the value used (returned in
``Settings.warnings`` for the caller to log once logging is configured).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from service.domain import LabelKeys

PREFIX = "SPACE_RETIRED_EXECUTION_POD_GC_"
T = TypeVar("T")


class ConfigError(ValueError):
    """A variable that cannot be parsed. ``str()`` is one line naming the variable."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected a boolean (true/false, yes/no, on/off, 1/0)")


def _parse_int(raw: str) -> int:
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ValueError("expected an integer") from None


def _parse_float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def _regex(pattern: re.Pattern[str], what: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip()
        if not pattern.fullmatch(value):
            raise ValueError(f"expected {what}")
        return value

    return parse


def _parse_text(raw: str) -> str:
    return raw.strip()


def _parse_selector(raw: str) -> str:
    value = raw.strip()
    for term in filter(None, (t.strip() for t in value.split(","))):
        key = re.split(r"!=|==|=| in | notin ", term, maxsplit=1)[0].lstrip("!").strip()
        if not _LABEL_KEY.fullmatch(key):
            raise ValueError(f"expected a label selector, bad term {term!r}")
    return value


def _parse_bind(raw: str) -> tuple[str, int]:
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected HOST:PORT with a port from 0 to 65535")
    return host.strip("[]") or "0.0.0.0", int(port)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return value

    return parse


MAX_NAMESPACES = 64
"""Most sandbox namespaces one replica watches (each is a list+watch and a label value)."""


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


def _optional_int(raw: str) -> int | None:
    return None if not raw.strip() else _parse_int(raw)


VARIABLES: list[Var[Any]] = []


@dataclass(frozen=True)
class Var(Generic[T]):
    """One environment variable: its parser, default, range and documentation."""

    suffix: str
    default: T
    parse: Callable[[str], T]
    doc: str
    lo: float | None = None
    hi: float | None = None
    secret: bool = False

    @property
    def name(self) -> str:
        return PREFIX + self.suffix

    def read(self, env: Mapping[str, str], warnings: list[str]) -> T:
        raw = env.get(self.name)
        if raw is None or (raw.strip() == "" and self.default is not None):
            return self.default
        try:
            value = self.parse(raw)
        except ValueError as exc:
            shown = "***" if self.secret else repr(raw)
            raise ConfigError(self.name, f"{exc}, got {shown}") from None
        return self._clamp(raw, value, warnings)

    def _clamp(self, raw: str, value: T, warnings: list[str]) -> T:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return value
        clamped: float = value
        if self.lo is not None and clamped < self.lo:
            clamped = self.lo
        if self.hi is not None and clamped > self.hi:
            clamped = self.hi
        if clamped == value:
            return value
        used: Any = int(clamped) if isinstance(value, int) else float(clamped)
        message = f"{self.name}={raw!r} is outside [{self.lo}, {self.hi}]; using {used}"
        warnings.append(message)
        return used  # type: ignore[no-any-return]


def _var(
    suffix: str,
    default: T,
    parse: Callable[[str], T],
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    secret: bool = False,
) -> Var[T]:
    var = Var(suffix=suffix, default=default, parse=parse, doc=doc, lo=lo, hi=hi, secret=secret)
    VARIABLES.append(var)
    return var


# fmt: off
ENABLED = _var("ENABLED", False, _parse_bool, "Master switch. False: nothing is deleted or reported; health and metrics still served.")
DRY_RUN = _var("DRY_RUN", True, _parse_bool, "When enabled, verify candidates and report each would-be reap once per pod UID, but send no DELETE.")
THRESHOLD_SECONDS = _var("THRESHOLD_SECONDS", 300.0, _parse_float, "How long a pod must be seen continuously in a reapable shape before it is deleted.", lo=1, hi=86400)
DELETES_PER_MINUTE = _var("DELETES_PER_MINUTE", 120, _parse_int, "Delete budget: at most this many DELETEs in any rolling 60 s window.", lo=1, hi=6000)
RECONCILE_TIMEOUT_SECONDS = _var("RECONCILE_TIMEOUT_SECONDS", 45.0, _parse_float, "Time budget of one key's reconcile; each API and database call inside it is bounded too.", lo=1, hi=600)
NAMESPACE = _var("NAMESPACE", "sandboxes", _regex(_DNS_NAME, "a namespace name"), "The sandbox namespace, when there is one: the only namespace watched and the scope of every row lookup. Exclusive with NAMESPACES.")
NAMESPACES: Var[tuple[str, ...]] = _var("NAMESPACES", (), _parse_namespaces, "Several sandbox namespaces, comma-separated (a,b): one pod cache (a namespaced list+watch) each, every row lookup scoped to the pod's own namespace; one listener, one Lease and one delete budget for them all. Exclusive with NAMESPACE; empty means NAMESPACE.")
LABEL_SELECTOR = _var("LABEL_SELECTOR", "app.kubernetes.io/managed-by=space-sandbox", _parse_selector, "Label selector of the sandbox pods to watch.")
SANDBOX_ID_LABEL = _var("SANDBOX_ID_LABEL", "space.sandbox-id", _regex(_LABEL_KEY, "a label key"), "Pod label that carries the sandbox id.")
GENERATION_LABEL = _var("GENERATION_LABEL", "space.generation", _regex(_LABEL_KEY, "a label key"), "Pod label that carries the execution generation.")
POD_KIND_LABEL = _var("POD_KIND_LABEL", "space.pod-kind", _regex(_LABEL_KEY, "a label key"), "Pod label that carries the pod kind (create or restore).")
WORKERS = _var("WORKERS", 32, _parse_int, "Concurrent reconcile workers (coroutines). Concurrent row lookups share one query, so more workers means larger batches.", lo=1, hi=256)
RESYNC_PERIOD_SECONDS = _var("RESYNC_PERIOD_SECONDS", 600.0, _parse_float, "Backstop period: every cached candidate is enqueued again this often.", lo=1, hi=86400)
SHUTDOWN_TIMEOUT_SECONDS = _var("SHUTDOWN_TIMEOUT_SECONDS", 20.0, _parse_float, "On SIGTERM, how long in-flight reconciles may take to finish.", lo=0, hi=300)
API_TIMEOUT_SECONDS = _var("API_TIMEOUT_SECONDS", 10.0, _parse_float, "Timeout of one Kubernetes API call (GET, DELETE, list page, lease).", lo=0.1, hi=120)
WATCH_TIMEOUT_SECONDS = _var("WATCH_TIMEOUT_SECONDS", 300.0, _parse_float, "Server-side timeoutSeconds of a watch request (jittered up to +10%).", lo=5, hi=3600)
LIST_PAGE_SIZE = _var("LIST_PAGE_SIZE", 500, _parse_int, "Pods per page when listing.", lo=1, hi=10000)
LIST_MODE = _var("LIST_MODE", "auto", _choice("auto", "stream", "list"), "How the pod cache is filled at start and on every relist: stream (a streaming list, the state as watch events), list (a list from the API server's watch cache, a quorum list as the last resort) or auto (stream, falling back to list for good when the server rejects or does not honour it).")
WATCH_SILENCE_SECONDS = _var("WATCH_SILENCE_SECONDS", 75.0, _parse_float, "A watch that has received no event and no bookmark for this long is taken for dead (a silently dropped connection): closed, counted and resumed from the last resourceVersion. Applies once the API server is known to send bookmarks (a real one sends one every 60 s); keep it above that.", lo=1, hi=3600)
STREAM_SYNC_TIMEOUT_SECONDS = _var("STREAM_SYNC_TIMEOUT_SECONDS", 30.0, _parse_float, "A streaming list that goes this long without an event before its initial-events-end bookmark is not honoured by the server (auto: fall back to list).", lo=1, hi=600)
DELETE_GRACE_PERIOD_SECONDS = _var("DELETE_GRACE_PERIOD_SECONDS", None, _optional_int, "gracePeriodSeconds sent with each DELETE; empty means the pod's own.", lo=0, hi=3600)
DATABASE_URL = _var("DATABASE_URL", "", _parse_text, "PostgreSQL URL of the primary (postgresql://user:password@host:port/db, or libpq's multi-host form host1:port1,host2:port2 for a failover pair: the primary is picked). Never logged unmasked.", secret=True)
DATABASE_URL_FILE = _var("DATABASE_URL_FILE", "", _parse_text, "Path of a file holding the database URL (a mounted Secret); exclusive with DATABASE_URL. Read again for every new connection, so a rotated Secret takes effect at the next reconnect.")
LISTENER_DATABASE_URL = _var("LISTENER_DATABASE_URL", "", _parse_text, "URL of the notify listener's own connection, when it must differ from the database URL (the query pool behind a transaction-mode pooler, the listener direct or through a session-mode pool). Empty: the database URL. Never logged unmasked.", secret=True)
LISTENER_DATABASE_URL_FILE = _var("LISTENER_DATABASE_URL_FILE", "", _parse_text, "Path of a file holding the listener's URL; exclusive with LISTENER_DATABASE_URL. Read again for every new connection.")
DB_TRANSACTION_POOLER = _var("DB_TRANSACTION_POOLER", False, _parse_bool, "The database URL goes through a transaction-mode pooler (PgBouncer pool_mode=transaction or a proxy that pools by transaction): the pool keeps no server-side prepared statement. The listener can never work through one (LISTENER_DATABASE_URL).")
DB_POOL_SIZE = _var("DB_POOL_SIZE", 4, _parse_int, "Maximum connections in the lookup pool (the listener has its own).", lo=1, hi=64)
DB_CONNECT_TIMEOUT_SECONDS = _var("DB_CONNECT_TIMEOUT_SECONDS", 5.0, _parse_float, "Timeout to open one database connection (the service's and every command's, migrate included).", lo=0.1, hi=120)
DB_STATEMENT_TIMEOUT_SECONDS = _var("DB_STATEMENT_TIMEOUT_SECONDS", 5.0, _parse_float, "Timeout of one database query.", lo=0.1, hi=120)
NOTIFY_CHANNEL = _var("NOTIFY_CHANNEL", "sandbox_execution_changed", _regex(_IDENTIFIER, "an SQL identifier"), "LISTEN/NOTIFY channel the trigger publishes execution changes on.")
LISTENER_HEARTBEAT_SECONDS = _var("LISTENER_HEARTBEAT_SECONDS", 10.0, _parse_float, "How often the listener proves delivery: a NOTIFY sent through the query pool on a channel of its own must come back on the listening connection.", lo=0.1, hi=300)
LISTENER_HEARTBEAT_TIMEOUT_SECONDS = _var("LISTENER_HEARTBEAT_TIMEOUT_SECONDS", 5.0, _parse_float, "A delivery probe (heartbeat, or the barrier before a DELETE) that has not come back within this declares the listener connection dead (no DELETE until a new one proves delivery).", lo=0.1, hi=120)
LOOKUP_BATCH_SIZE = _var("LOOKUP_BATCH_SIZE", 500, _parse_int, "Most pod names one batched row lookup carries.", lo=1, hi=10000)
METRICS_BIND_ADDRESS = _var("METRICS_BIND_ADDRESS", ("0.0.0.0", 8080), _parse_bind, "HOST:PORT of the /metrics, /healthz and /readyz server.")
DEBUG_PENDING = _var("DEBUG_PENDING", False, _parse_bool, "Serve GET /debug/pending on the DEBUG_BIND_ADDRESS listener (never on the METRICS_BIND_ADDRESS port): every pod whose observation clock runs (key, UID, verdict, since, due at, what it waits for), as JSON. Off by default: it names pods, which /metrics never does.")
DEBUG_BIND_ADDRESS = _var("DEBUG_BIND_ADDRESS", ("127.0.0.1", 8081), _parse_bind, "HOST:PORT of the /debug/* listener (DEBUG_PENDING), apart from the metrics port. Loopback by default: reached with kubectl port-forward, never from the cluster network; 0.0.0.0:PORT opens it to every pod the NetworkPolicy lets in.")
LEADER_ELECTION = _var("LEADER_ELECTION", True, _parse_bool, "Elect one active replica through a coordination.k8s.io/v1 Lease; only the leader deletes or reports.")
LEASE_NAME = _var("LEASE_NAME", "retired-pod-gc", _regex(_DNS_NAME, "a Lease name"), "Name of the Lease.")
LEASE_NAMESPACE = _var("LEASE_NAMESPACE", "", _parse_text, "Namespace of the Lease; empty means this pod's namespace (service account), else the (first) sandbox namespace.")
LEASE_DURATION_SECONDS = _var("LEASE_DURATION_SECONDS", 15.0, _parse_float, "How long a lease holds without renewal before another replica may take it.", lo=1, hi=300)
RENEW_DEADLINE_SECONDS = _var("RENEW_DEADLINE_SECONDS", 10.0, _parse_float, "A leader that has not renewed for this long stops deleting (kept below LEASE_DURATION_SECONDS).", lo=0.5, hi=300)
RETRY_PERIOD_SECONDS = _var("RETRY_PERIOD_SECONDS", 2.0, _parse_float, "How often the lease is renewed or its acquisition retried (kept below RENEW_DEADLINE_SECONDS).", lo=0.1, hi=60)
EVENTS_ENABLED = _var("EVENTS_ENABLED", True, _parse_bool, "Record a Kubernetes Event (events.k8s.io/v1) on every deleted pod and every dry-run report; never delays a delete.")
LEADER_IDENTITY = _var("LEADER_IDENTITY", "", _parse_text, "Holder identity written to the Lease; empty means hostname and process id.")
LOG_LEVEL = _var("LOG_LEVEL", "info", _choice("debug", "info", "warning", "error"), "Log level.")
LOG_FORMAT = _var("LOG_FORMAT", "json", _choice("json", "text"), "json: one JSON object a line; text: for humans.")
KEPT_BOUND_SECONDS = _var("KEPT_BOUND_SECONDS", 1800.0, _parse_float, "Retired but kept: a pod whose execution is retired but that is kept longer than this gets one RetiredPodKept Warning Event (at most one a pod a day); the alert RetiredPodGcRetiredPodsKept uses the same bound (deploy/monitoring).", lo=1, hi=604800)
# fmt: on


@dataclass(frozen=True, slots=True)
class KubeSettings:
    namespaces: tuple[str, ...]
    """The sandbox namespaces (at least one, no duplicates), in the order configured."""
    label_selector: str
    label_keys: LabelKeys
    api_timeout_s: float
    watch_timeout_s: float
    list_page_size: int
    delete_grace_period_s: int | None
    """``None``: the pod's own grace period."""
    list_mode: str = "auto"
    """``auto``, ``stream`` or ``list`` (see ``service.kube.informer``)."""
    stream_sync_timeout_s: float = 30.0
    """Longest silence of a streaming list before its initial-events-end bookmark."""
    watch_silence_s: float = 75.0
    """Longest silence (no event, no bookmark) of a watch from a server known to send
    bookmarks before it is taken for dead."""


@dataclass(frozen=True, slots=True)
class DatabaseSettings:
    url: str = field(repr=False)
    """The query pool's URL as given or as its file held at start; never print it, use
    :attr:`masked_url`. :meth:`pool_url` is the one a new connection uses."""
    pool_size: int
    connect_timeout_s: float
    statement_timeout_s: float
    notify_channel: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    batch_max_size: int
    url_file: str = ""
    """DATABASE_URL_FILE: read again for every new connection (a rotated Secret)."""
    listener_url: str = field(default="", repr=False)
    """The listener's URL when it has its own (empty: the pool's)."""
    listener_url_file: str = ""
    """LISTENER_DATABASE_URL_FILE: read again for every new listener connection."""
    transaction_pooler: bool = False
    """The pool's URL goes through a transaction-mode pooler: no server-side prepared
    statement outlives its query."""

    @property
    def masked_url(self) -> str:
        return mask_dsn(self.url)

    def pool_url(self) -> str:
        """The URL a new pooled connection uses now. Raises :class:`ConfigError` when its file
        can no longer be read or holds no usable URL."""
        if self.url_file:
            return read_url_file(self.url_file, DATABASE_URL_FILE.name)
        return self.url

    def listener_url_now(self) -> str:
        """The URL a new listener connection uses now (its own, else the pool's). Raises
        :class:`ConfigError` as :meth:`pool_url` does."""
        if self.listener_url_file:
            return read_url_file(self.listener_url_file, LISTENER_DATABASE_URL_FILE.name)
        return self.listener_url or self.pool_url()


@dataclass(frozen=True, slots=True)
class LeaderSettings:
    enabled: bool
    lease_name: str
    lease_namespace: str
    """Empty: resolved at start (service-account namespace, else the first sandbox namespace)."""
    lease_duration_s: float
    renew_deadline_s: float
    retry_period_s: float
    identity: str


@dataclass(frozen=True, slots=True)
class Settings:
    enabled: bool
    dry_run: bool
    threshold_s: float
    deletes_per_minute: int
    reconcile_timeout_s: float
    workers: int
    resync_period_s: float
    shutdown_timeout_s: float
    kube: KubeSettings
    database: DatabaseSettings
    leader: LeaderSettings
    bind_host: str
    bind_port: int
    events_enabled: bool
    """Record Kubernetes Events for deletes and dry-run reports."""
    log_level: str
    log_format: str
    debug_pending: bool = False
    """Serve ``GET /debug/pending`` on the debug listener."""
    debug_host: str = "127.0.0.1"
    debug_port: int = 8081
    """DEBUG_BIND_ADDRESS: the debug listener, apart from the metrics port."""
    kept_bound_s: float = 1800.0
    """Retired but kept: how long a retired pod may be kept before its ``RetiredPodKept``
    Event."""
    warnings: tuple[str, ...] = ()
    """Clamp warnings produced while loading (also logged)."""

    @property
    def mode(self) -> str:
        """``disabled``, ``dry_run`` or ``live``."""
        if not self.enabled:
            return "disabled"
        return "dry_run" if self.dry_run else "live"


def mask_dsn(url: str) -> str:
    """Hide the password of a PostgreSQL URL or keyword DSN."""
    if "://" in url:
        try:
            parts = urlsplit(url)
        except ValueError:
            return "***"
        if parts.password is not None:
            userinfo = f"{parts.username or ''}:***"
            host = parts.netloc.rpartition("@")[2]
            return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}"))
        masked = re.sub(r"(password=)[^&]*", r"\1***", url)
        return masked
    return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", url)


_DSN_SCHEMES = frozenset({"postgresql", "postgres"})
TARGET_SESSION_ATTRS = frozenset({"any", "primary", "read-write"})
"""The ``target_session_attrs`` a URL may ask for. Every connection of the service goes to the
primary whatever the URL says (LISTEN and the final re-read need it); ``read-write`` means the
same for a login whose sessions are read-only by default (``deploy/db-role/role.sql``)."""


def _check_hosts(hostlist: str) -> None:
    """libpq's host list: ``host[:port]`` or ``[v6addr][:port]``, comma-separated."""
    for spec in hostlist.split(","):
        if spec.startswith("["):
            addr, sep, rest = spec[1:].partition("]")
            if not sep or not addr or (rest and not rest.startswith(":")):
                raise ValueError(f"bad host {spec!r}")
            port = rest[1:]
        else:
            addr, _, port = spec.partition(":")
        if not addr and len(hostlist.split(",")) > 1:
            raise ValueError("an empty host in the host list")
        if port and not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
            raise ValueError(
                f"port {port!r} of host {addr or spec!r} is not a number from 1 to 65535"
            )


def check_dsn(url: str) -> None:
    """Raise ``ValueError`` (its message safe to print) unless ``url`` parses as a PostgreSQL
    URL the driver accepts: one host or libpq's multi-host list, and a ``target_session_attrs``
    the service can honour. Reachability is not checked: an unreachable server is retried."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _DSN_SCHEMES:
        raise ValueError(
            f"expected a URL starting with postgresql:// or postgres://, got {mask_dsn(url)!r}"
        )
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    hostlist = netloc.rpartition("@")[2]
    try:
        _check_hosts(hostlist)
        query = urlsplit(url).query
    except ValueError as exc:
        raise ValueError(f"{exc} in {mask_dsn(url)!r}") from None
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "target_session_attrs" and value not in TARGET_SESSION_ATTRS:
            raise ValueError(
                f"target_session_attrs={value!r}: retired-pod-gc needs the primary "
                f"(use one of {', '.join(sorted(TARGET_SESSION_ATTRS))})"
            )


def read_url_file(path: str, variable: str) -> str:
    """The URL held by the file at ``path`` (``variable`` names it in errors). Raises
    :class:`ConfigError`."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(variable, f"cannot read {path!r}: {exc.strerror}") from None
    except ValueError as exc:  # e.g. a NUL byte in the path
        raise ConfigError(variable, f"not a usable path: {exc}") from None
    if not text:
        raise ConfigError(variable, f"{path!r} is empty")
    try:
        check_dsn(text)
    except ValueError as exc:
        raise ConfigError(variable, f"{path!r} holds no usable URL: {exc}") from None
    return text


def _url(
    env: Mapping[str, str], warnings: list[str], inline: Var[str], file: Var[str]
) -> tuple[str, str]:
    """(URL, file path) of one URL setting given inline or as a file (exclusive)."""
    url = inline.read(env, warnings)
    path = file.read(env, warnings)
    if path and url:
        raise ConfigError(file.name, f"set only one of it and {inline.name}")
    if path:
        return read_url_file(path, file.name), path
    if url:
        try:
            check_dsn(url)
        except ValueError as exc:
            raise ConfigError(inline.name, str(exc)) from None
    return url, ""


def _namespaces(env: Mapping[str, str], warnings: list[str]) -> tuple[str, ...]:
    """NAMESPACES when set, else the one NAMESPACE; both set is an error (which one wins would
    be a guess about the scope of every delete)."""
    several = NAMESPACES.read(env, warnings)
    if not several:
        return (NAMESPACE.read(env, warnings),)
    if env.get(NAMESPACE.name, "").strip():
        raise ConfigError(NAMESPACES.name, f"set only one of it and {NAMESPACE.name}")
    return several


def load(env: Mapping[str, str]) -> Settings:
    """Build the settings from ``env`` (usually ``os.environ``). Raises :class:`ConfigError`."""
    w: list[str] = []
    lease_duration = LEASE_DURATION_SECONDS.read(env, w)
    renew = RENEW_DEADLINE_SECONDS.read(env, w)
    retry = RETRY_PERIOD_SECONDS.read(env, w)
    if renew >= lease_duration:
        used = lease_duration * 2 / 3
        w.append(
            f"{RENEW_DEADLINE_SECONDS.name}={renew:g} must be below "
            f"{LEASE_DURATION_SECONDS.name}={lease_duration:g}; using {used:g}"
        )
        renew = used
    if retry >= renew:
        used = renew / 3
        w.append(
            f"{RETRY_PERIOD_SECONDS.name}={retry:g} must be below "
            f"{RENEW_DEADLINE_SECONDS.name}={renew:g}; using {used:g}"
        )
        retry = used
    namespaces = _namespaces(env, w)
    host, port = METRICS_BIND_ADDRESS.read(env, w)
    debug_host, debug_port = DEBUG_BIND_ADDRESS.read(env, w)
    url, url_file = _url(env, w, DATABASE_URL, DATABASE_URL_FILE)
    listener_url, listener_url_file = _url(
        env, w, LISTENER_DATABASE_URL, LISTENER_DATABASE_URL_FILE
    )
    settings = Settings(
        enabled=ENABLED.read(env, w),
        dry_run=DRY_RUN.read(env, w),
        threshold_s=THRESHOLD_SECONDS.read(env, w),
        deletes_per_minute=DELETES_PER_MINUTE.read(env, w),
        reconcile_timeout_s=RECONCILE_TIMEOUT_SECONDS.read(env, w),
        workers=WORKERS.read(env, w),
        resync_period_s=RESYNC_PERIOD_SECONDS.read(env, w),
        shutdown_timeout_s=SHUTDOWN_TIMEOUT_SECONDS.read(env, w),
        kube=KubeSettings(
            namespaces=namespaces,
            label_selector=LABEL_SELECTOR.read(env, w),
            label_keys=LabelKeys(
                sandbox_id=SANDBOX_ID_LABEL.read(env, w),
                generation=GENERATION_LABEL.read(env, w),
                pod_kind=POD_KIND_LABEL.read(env, w),
            ),
            api_timeout_s=API_TIMEOUT_SECONDS.read(env, w),
            watch_timeout_s=WATCH_TIMEOUT_SECONDS.read(env, w),
            list_page_size=LIST_PAGE_SIZE.read(env, w),
            delete_grace_period_s=DELETE_GRACE_PERIOD_SECONDS.read(env, w),
            list_mode=LIST_MODE.read(env, w),
            stream_sync_timeout_s=STREAM_SYNC_TIMEOUT_SECONDS.read(env, w),
            watch_silence_s=WATCH_SILENCE_SECONDS.read(env, w),
        ),
        database=DatabaseSettings(
            url=url,
            url_file=url_file,
            listener_url=listener_url,
            listener_url_file=listener_url_file,
            transaction_pooler=DB_TRANSACTION_POOLER.read(env, w),
            pool_size=DB_POOL_SIZE.read(env, w),
            connect_timeout_s=DB_CONNECT_TIMEOUT_SECONDS.read(env, w),
            statement_timeout_s=DB_STATEMENT_TIMEOUT_SECONDS.read(env, w),
            notify_channel=NOTIFY_CHANNEL.read(env, w),
            heartbeat_interval_s=LISTENER_HEARTBEAT_SECONDS.read(env, w),
            heartbeat_timeout_s=LISTENER_HEARTBEAT_TIMEOUT_SECONDS.read(env, w),
            batch_max_size=LOOKUP_BATCH_SIZE.read(env, w),
        ),
        leader=LeaderSettings(
            enabled=LEADER_ELECTION.read(env, w),
            lease_name=LEASE_NAME.read(env, w),
            lease_namespace=LEASE_NAMESPACE.read(env, w),
            lease_duration_s=lease_duration,
            renew_deadline_s=renew,
            retry_period_s=retry,
            identity=LEADER_IDENTITY.read(env, w),
        ),
        bind_host=host,
        bind_port=port,
        debug_pending=DEBUG_PENDING.read(env, w),
        debug_host=debug_host,
        debug_port=debug_port,
        kept_bound_s=KEPT_BOUND_SECONDS.read(env, w),
        events_enabled=EVENTS_ENABLED.read(env, w),
        log_level=LOG_LEVEL.read(env, w),
        log_format=LOG_FORMAT.read(env, w),
        warnings=(),
    )
    names = {v.name for v in VARIABLES}
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in names)
    w.extend(f"{name} is not a known variable and is ignored" for name in unknown)
    # Not logged here: logging is configured from these very settings; callers report them.
    return replace(settings, warnings=tuple(w))


def effective(settings: Settings, env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(variable, effective value, source) for every variable; secrets masked."""
    values: dict[str, object] = {
        ENABLED.name: settings.enabled,
        DRY_RUN.name: settings.dry_run,
        THRESHOLD_SECONDS.name: settings.threshold_s,
        DELETES_PER_MINUTE.name: settings.deletes_per_minute,
        RECONCILE_TIMEOUT_SECONDS.name: settings.reconcile_timeout_s,
        NAMESPACE.name: settings.kube.namespaces[0] if len(settings.kube.namespaces) == 1 else "",
        NAMESPACES.name: ",".join(settings.kube.namespaces),
        LABEL_SELECTOR.name: settings.kube.label_selector,
        SANDBOX_ID_LABEL.name: settings.kube.label_keys.sandbox_id,
        GENERATION_LABEL.name: settings.kube.label_keys.generation,
        POD_KIND_LABEL.name: settings.kube.label_keys.pod_kind,
        WORKERS.name: settings.workers,
        RESYNC_PERIOD_SECONDS.name: settings.resync_period_s,
        SHUTDOWN_TIMEOUT_SECONDS.name: settings.shutdown_timeout_s,
        API_TIMEOUT_SECONDS.name: settings.kube.api_timeout_s,
        WATCH_TIMEOUT_SECONDS.name: settings.kube.watch_timeout_s,
        LIST_PAGE_SIZE.name: settings.kube.list_page_size,
        LIST_MODE.name: settings.kube.list_mode,
        STREAM_SYNC_TIMEOUT_SECONDS.name: settings.kube.stream_sync_timeout_s,
        WATCH_SILENCE_SECONDS.name: settings.kube.watch_silence_s,
        DELETE_GRACE_PERIOD_SECONDS.name: (
            ""
            if settings.kube.delete_grace_period_s is None
            else settings.kube.delete_grace_period_s
        ),
        DATABASE_URL.name: settings.database.masked_url,
        DATABASE_URL_FILE.name: settings.database.url_file,
        LISTENER_DATABASE_URL.name: (
            mask_dsn(settings.database.listener_url)
            if settings.database.listener_url and not settings.database.listener_url_file
            else ""
        ),
        LISTENER_DATABASE_URL_FILE.name: settings.database.listener_url_file,
        DB_TRANSACTION_POOLER.name: settings.database.transaction_pooler,
        DB_POOL_SIZE.name: settings.database.pool_size,
        DB_CONNECT_TIMEOUT_SECONDS.name: settings.database.connect_timeout_s,
        DB_STATEMENT_TIMEOUT_SECONDS.name: settings.database.statement_timeout_s,
        NOTIFY_CHANNEL.name: settings.database.notify_channel,
        LISTENER_HEARTBEAT_SECONDS.name: settings.database.heartbeat_interval_s,
        LISTENER_HEARTBEAT_TIMEOUT_SECONDS.name: settings.database.heartbeat_timeout_s,
        LOOKUP_BATCH_SIZE.name: settings.database.batch_max_size,
        METRICS_BIND_ADDRESS.name: f"{settings.bind_host}:{settings.bind_port}",
        DEBUG_PENDING.name: settings.debug_pending,
        DEBUG_BIND_ADDRESS.name: f"{settings.debug_host}:{settings.debug_port}",
        KEPT_BOUND_SECONDS.name: settings.kept_bound_s,
        LEADER_ELECTION.name: settings.leader.enabled,
        LEASE_NAME.name: settings.leader.lease_name,
        LEASE_NAMESPACE.name: settings.leader.lease_namespace,
        LEASE_DURATION_SECONDS.name: settings.leader.lease_duration_s,
        RENEW_DEADLINE_SECONDS.name: settings.leader.renew_deadline_s,
        RETRY_PERIOD_SECONDS.name: settings.leader.retry_period_s,
        EVENTS_ENABLED.name: settings.events_enabled,
        LEADER_IDENTITY.name: settings.leader.identity,
        LOG_LEVEL.name: settings.log_level,
        LOG_FORMAT.name: settings.log_format,
    }
    rows = []
    for var in VARIABLES:
        value = values[var.name]
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        rows.append((var.name, shown, "env" if var.name in env else "default"))
    return rows
