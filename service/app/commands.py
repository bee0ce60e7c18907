"""The commands of ``retired-pod-gc``: each takes the effective settings and returns an exit code.

Every command takes its adapters from the composition root (``service/app/service.py``), so the
controller and the one-shot commands build their parts one way. A failure of the outside world
or a failed operation is one line on stderr naming the cause and, where known, the fix
(:class:`CommandError`, or an uncaught :class:`ExternalError`), exit 1; only a bug shows a
traceback. Parsing the command line is ``service/cli.py``'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import asyncpg
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry

from service import config, logs
from service.app import service, signals
from service.app.cancel_create import CancelOutcome, cancel_create
from service.app.inspect import (
    NamespaceNotConfigured,
    explain,
    explanation_lines,
    list_pods,
    scan,
    scan_lines,
)
from service.app.pending import (
    PendingUnavailable,
    fetch_pending,
    live_clock_lines,
    live_kept_lines,
    pending_lines,
)
from service.kit.backoff import Backoff
from service.kit.errors import ExternalError, Unavailable
from service.kube.api import ApiConfigError
from service.kube.errors import KubeApiError
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics, Metrics, PgMetrics
from service.pg.errors import DRIVER_ERRORS, describe
from service.pg.migrate import LockNotGranted, migrate

logger = logging.getLogger(__name__)


MIGRATE_LOCK_NOT_GRANTED = 3
"""``migrate``'s exit code when a lock was not granted by its deadline (nothing changed)."""


class CommandError(Exception):
    """A failure worth one line on stderr (exit code 1)."""


def _run_async(fn: Callable[[], Awaitable[int]]) -> int:
    """A one-shot command's event loop: cancelled by SIGTERM or SIGINT (``signals``)."""
    return _one_line_on_error(lambda: signals.run_async(lambda stop: fn()))


def _one_line_on_error(call: Callable[[], int]) -> int:
    try:
        return call()
    except CommandError as exc:
        print(f"retired-pod-gc: {exc}", file=sys.stderr)
        return 1
    except ExternalError as exc:
        # A failure of the outside world that no command put in its own words.
        print(f"retired-pod-gc: {describe(exc)}", file=sys.stderr)
        return 1


_DATABASE_HINTS = {
    "3D000": "check the database name at the end of the URL",
    "28P01": "check the user and password in the URL (or its Secret)",
    "28000": "the server refuses this user from here (pg_hba.conf), or the user does not exist",
    "42P01": (
        "this database lacks the platform's tables (sandboxes, sandbox_k8s_executions): "
        "check the database name in the URL"
    ),
    "42501": "the role lacks a grant: apply deploy/db-role/role.sql (docs/operations.md)",
}
"""The fix of a database failure, by SQLSTATE (one the server sent)."""


def _database_failure(what: str, settings: config.Settings, exc: BaseException) -> CommandError:
    """One line for a failed database call: what failed, the masked URL, the cause (the server's
    own error when it sent one, found at the end of the ``__cause__`` chain) and, when known, the
    fix."""
    chain = [exc]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    sqlstate = str(getattr(root, "sqlstate", "") or "")
    hint = _DATABASE_HINTS.get(sqlstate)
    if sqlstate:
        text = describe(root)
    elif isinstance(exc, TimeoutError):
        text = str(exc) or "no answer in time"
    else:
        text = describe(exc)
    if any(isinstance(e, TimeoutError) for e in chain):
        hint = (
            "are the host and port right, and does every firewall and NetworkPolicy let them "
            f"through? ({config.PREFIX}DB_CONNECT_TIMEOUT_SECONDS and "
            "DB_STATEMENT_TIMEOUT_SECONDS bound the wait)"
        )
    elif isinstance(root, ConnectionRefusedError):
        hint = "is PostgreSQL running there, and are the host and port right?"
    return CommandError(
        f"{what} ({settings.database.masked_url}): {text}" + (f"; {hint}" if hint else "")
    )


_CONNECT_FAILURES: tuple[type[Exception], ...] = (*DRIVER_ERRORS, ExternalError)
"""What opening a connection raises for a failure of the database (asyncpg's own, or a kit's)."""


async def _connect(settings: config.Settings, what: str = "database") -> asyncpg.Connection:
    """One connection to the database (the composition root's), or one line saying why not."""
    try:
        return await service.new_connection(settings, PgMetrics())
    except TimeoutError as exc:
        # The configured bound gave up (DB_CONNECT_TIMEOUT_SECONDS): say which.
        late = TimeoutError(f"no connection within {settings.database.connect_timeout_s:g}s")
        late.__cause__ = exc
        raise _database_failure(what, settings, late) from None
    except _CONNECT_FAILURES as exc:
        raise _database_failure(what, settings, exc) from None


async def _check_tables(settings: config.Settings) -> None:
    """Both of the platform's tables are there (else the first row lookup would fail)."""
    conn = await _connect(settings)
    try:
        missing = await conn.fetchval(
            "SELECT array_agg(t) FROM unnest(ARRAY['sandboxes', 'sandbox_k8s_executions']) t "
            "WHERE to_regclass(t) IS NULL"
        )
    except DRIVER_ERRORS as exc:
        raise _database_failure("database", settings, exc) from None
    finally:
        await conn.close()
    if missing:
        raise CommandError(
            f"database ({settings.database.masked_url}) has no table {', '.join(missing)}: "
            "point the URL at the platform's database (its name is at the end of the URL)"
        )


async def _api(metrics: KubeMetrics | None = None) -> ApiTransport:
    """The composition root's API client, or one line saying why there is none."""
    try:
        return await service.new_api(metrics if metrics is not None else KubeMetrics())
    except ApiConfigError as exc:
        raise CommandError(f"Kubernetes API: {exc}") from None


async def _probe_api(api: ApiTransport, settings: config.Settings) -> None:
    """One cheap list call in each sandbox namespace, so that an unreachable or refusing API
    server fails a one-shot command at once (the informer would retry quietly until
    ``--timeout``)."""
    for namespace in settings.kube.namespaces:
        lw = service.new_list_watch(settings, api, KubeMetrics(), namespace=namespace)
        try:
            await lw.list(limit=1)
        except Unavailable as exc:
            raise CommandError(
                f"Kubernetes API unreachable ({api.configuration.host}): {describe(exc)}"
            ) from None
        except KubeApiError as exc:
            raise CommandError(
                f"Kubernetes API answered {exc.status} listing pods in {namespace}: {exc.message}"
            ) from None
        except ExternalError as exc:
            raise CommandError(
                f"Kubernetes API: listing pods in {namespace}: {describe(exc)}"
            ) from None


def run(settings: config.Settings) -> int:
    """The controller, until SIGTERM or SIGINT (then drained; a second signal cuts the drain
    short: ``signals``)."""
    logs.setup(settings.log_level, settings.log_format)
    for warning in settings.warnings:
        logger.warning(warning)

    async def main(stop: anyio.Event) -> int:
        registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
        metrics = Metrics(registry)
        api = await _api(metrics.kube)
        try:
            parts = service.build(settings, api=api, metrics=metrics)
            await service.run(parts, stop=stop)
        except Exception as exc:
            logger.critical("service failed: %s", describe(exc), exc_info=exc)
            return 1
        finally:
            with anyio.move_on_after(5, shield=True):
                await api.close()
        return 0

    return _one_line_on_error(lambda: signals.run_async(main, drains=True))


def migrate_database(settings: config.Settings, *, with_schema: bool) -> int:
    """Install or update the change-notify trigger (and the dev schema with ``with_schema``).

    Exit 3 when a lock was not granted by ``MIGRATE_DEADLINE_SECONDS``: nothing changed, and
    the line names the lock and the sessions holding it (docs/operations.md). Logs at warning
    level and above: each attempt that was not granted its lock, naming the holders."""
    logs.setup("warning", settings.log_format)
    db = settings.database

    async def main() -> int:
        conn = await _connect(settings, "migrate failed")
        try:
            # The run bounds itself (no attempt after the deadline, each lock and statement
            # bounded on the server); this bound is for a server that stops answering.
            with anyio.fail_after(
                db.migrate_deadline_s + db.migrate_lock_timeout_s + db.statement_timeout_s
            ):
                applied = await migrate(
                    conn,
                    channel=db.notify_channel,
                    with_schema=with_schema,
                    lock_timeout_s=db.migrate_lock_timeout_s,
                    deadline_s=db.migrate_deadline_s,
                    statement_timeout_s=db.statement_timeout_s,
                )
        except LockNotGranted as exc:
            print(
                f"retired-pod-gc: migrate stopped: {exc}; end or wait out those transactions "
                "and run it again (docs/operations.md, migrate and the platform's writers)",
                file=sys.stderr,
            )
            return MIGRATE_LOCK_NOT_GRANTED
        except Exception as exc:
            raise _database_failure("migrate failed", settings, exc) from None
        finally:
            await conn.close()
        if applied:
            print("applied: " + ", ".join(applied))
        else:
            print("nothing to apply: the database is up to date")
        return 0

    return _run_async(main)


@contextlib.asynccontextmanager
async def _store_and_api(settings: config.Settings) -> AsyncIterator[tuple[Any, Any]]:
    """The execution store (its database checked first: a failure is one line naming the cause)
    and an API client, both closed on the way out."""
    await _check_tables(settings)
    store = service.new_store(settings, PgMetrics())
    await store.start()
    try:
        api = await _api()
        try:
            yield store, api
        finally:
            await api.close()
    finally:
        await store.aclose()


def scan_pods(settings: config.Settings, *, output: str, timeout_s: float) -> int:
    """Classify every pod now against the database (read-only)."""
    logs.setup("warning", settings.log_format)

    async def main() -> int:
        async with _store_and_api(settings) as (store, api):
            await _probe_api(api, settings)
            informer = service.new_informer(
                settings, api, KubeMetrics(), backoff=Backoff(initial_s=0.5, max_s=1.0, jitter=0.5)
            )
            try:
                pods = await list_pods(informer, timeout_s=timeout_s)
            except TimeoutError:
                raise CommandError(
                    f"Kubernetes API: could not list pods within {timeout_s:g}s"
                ) from None
            try:
                report = await scan(settings, pods=pods, store=store, retired=store)
            except ExternalError as exc:
                raise _database_failure("scan: row lookup", settings, exc) from None
        if output == "json":
            print(json.dumps(dataclasses.asdict(report), indent=2))
        else:
            print("\n".join(scan_lines(report)))
        return 0

    return _run_async(main)


def explain_pod(
    settings: config.Settings, *, key: str, url: str | None = None, timeout_s: float = 5.0
) -> int:
    """Every input of one pod's decision and the rule that decided (read-only); with ``url``,
    the live clock of the running replica there too."""
    logs.setup("warning", settings.log_format)

    async def main() -> int:
        async with _store_and_api(settings) as (store, api):
            client = service.new_pod_client(settings, api, KubeMetrics())
            try:
                exp = await explain(settings, key=key, pods=client, store=store, rows=store)
            except NamespaceNotConfigured as exc:
                raise CommandError(str(exc)) from None
            except ExternalError as exc:
                if isinstance(exc.__cause__, asyncpg.PostgresError | OSError):
                    raise _database_failure("explain: row read", settings, exc) from None
                raise CommandError(f"explain: {describe(exc)}") from None
            except TimeoutError:
                raise CommandError(
                    "explain: no answer in time from the API server or the database"
                ) from None
        live: dict[str, Any] | str | None = None
        if url is not None:
            try:
                live = await fetch_pending(url, timeout_s=timeout_s, key=key)
            except PendingUnavailable as exc:
                live = str(exc)
        print(
            *explanation_lines(exp),
            *live_clock_lines(key, url, live),
            *live_kept_lines(key, url, live),
            sep="\n",
        )
        return 0

    return _run_async(main)


def show_pending(
    settings: config.Settings, *, url: str, output: str, timeout_s: float, limit: int | None
) -> int:
    """The pods whose clock runs in the replica at ``url`` (``GET /debug/pending``)."""
    logs.setup("warning", settings.log_format)

    async def main() -> int:
        try:
            document = await fetch_pending(url, timeout_s=timeout_s, limit=limit)
        except PendingUnavailable as exc:
            raise CommandError(str(exc)) from None
        if output == "json":
            print(json.dumps(document, indent=2))
        else:
            print("\n".join(pending_lines(document)))
        return 0

    return _run_async(main)


def cancel_create_execution(
    settings: config.Settings, *, sandbox_id: str, generation: int, activation_attempt: int
) -> int:
    """Retire a cancelled create (fenced) and delete its pod under a UID precondition."""
    logs.setup(settings.log_level, settings.log_format)

    async def main() -> int:
        conn = await _connect(settings)
        try:
            api = await _api()
            try:
                client = service.new_pod_client(settings, api, KubeMetrics())
                report = await cancel_create(
                    conn=conn,
                    pods=client,
                    namespaces=settings.kube.namespaces,
                    sandbox_id=sandbox_id,
                    generation=generation,
                    activation_attempt=activation_attempt,
                    timeout_s=settings.kube.api_timeout_s,
                )
            except (ExternalError, TimeoutError) as exc:
                raise CommandError(
                    f"cancel-create failed: {describe(exc) if str(exc) else 'no answer in time'}"
                    "; running it again is safe"
                ) from None
            finally:
                await api.close()
        finally:
            await conn.close()
        print(
            f"{report.outcome}: pod {report.pod_name or '-'} "
            f"(retired by this call: {'yes' if report.retired_now else 'no'})"
            + (f" {report.detail}" if report.detail else "")
        )
        return 1 if report.outcome is CancelOutcome.CONFLICT else 0

    return _run_async(main)


def show_config(settings: config.Settings, environ: Mapping[str, str]) -> int:
    """Every variable's effective value and where it came from (secrets masked)."""
    for warning in settings.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    defaults = {var.name: var.default for var in config.VARIABLES}
    # An empty default is shown as docs/configuration.md shows it (NAMESPACES then means
    # NAMESPACE: the namespaces served are in the header).
    rows = [
        (
            name,
            "(empty)" if source == "default" and defaults[name] in ("", (), None) else value,
            source,
        )
        for name, value, source in config.effective(settings, environ)
    ]
    width = max(len(name) for name, _, _ in rows)
    print(f"# mode: {settings.mode}")
    print(f"# sandbox namespaces: {', '.join(settings.kube.namespaces)}")
    if not settings.database.url:
        print(
            f"# no database URL: run, scan, explain, migrate and cancel-create refuse to start "
            f"(exit 2) until {config.DATABASE_URL.name} or {config.DATABASE_URL_FILE.name} is set"
        )
    for name, value, source in rows:
        print(f"{name:<{width}}  {value}  ({source})")
    return 0
