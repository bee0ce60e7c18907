"""The settings the service runs with: frozen, nested, one section per adapter.

``service/config.py`` builds them from the environment and holds every default: a test starts
from ``config.load({})`` and replaces what it sets. Nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.domain import LabelKeys
from service.kit.dsn import mask_dsn


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
    list_mode: str
    """``auto``, ``stream`` or ``list`` (see ``service.kube.informer``)."""
    stream_sync_timeout_s: float
    """Longest silence of a streaming list before its initial-events-end bookmark."""
    watch_silence_s: float
    """Longest silence (no event, no bookmark, no end) of a watch after its last line before it
    is taken for dead; from its first second (docs/architecture.md, "A silent watch")."""


@dataclass(frozen=True, slots=True)
class DatabaseSettings:
    url: str = field(repr=False)
    """The query pool's URL as given or as its file held at start; never print it, use
    :attr:`masked_url`. ``config.pool_url`` gives the one a new connection uses."""
    pool_size: int
    connect_timeout_s: float
    statement_timeout_s: float
    notify_channel: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    batch_max_size: int
    url_file: str
    """DATABASE_URL_FILE: read again for every new connection (a rotated Secret)."""
    listener_url: str = field(repr=False)
    """The listener's URL when it has its own (empty: the pool's)."""
    listener_url_file: str
    """LISTENER_DATABASE_URL_FILE: read again for every new listener connection."""
    transaction_pooler: bool
    """The pool's URL goes through a transaction-mode pooler: no server-side prepared
    statement outlives its query."""
    migrate_lock_timeout_s: float
    """``migrate``: the lock_timeout of each lock it asks for."""
    migrate_deadline_s: float
    """``migrate``: how long it retries a lock it was not granted before it stops."""

    @property
    def masked_url(self) -> str:
        return mask_dsn(self.url)


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
    debug_pending: bool
    """Serve ``GET /debug/pending`` on the debug listener."""
    debug_host: str
    debug_port: int
    """DEBUG_BIND_ADDRESS: the debug listener, apart from the metrics port."""
    kept_bound_s: float
    """Retired but kept: how long a retired pod may be kept before its ``RetiredPodKept``
    Event."""
    warnings: tuple[str, ...] = ()
    """Clamp warnings produced while loading (for the caller to log once logging is set up)."""

    @property
    def mode(self) -> str:
        """``disabled``, ``dry_run`` or ``live``."""
        if not self.enabled:
            return "disabled"
        return "dry_run" if self.dry_run else "live"
