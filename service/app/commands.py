"""The commands of ``retired-pod-gc``: each takes the effective settings and returns an exit code.

``run`` (the controller), ``scan``, ``explain``, ``pending``, ``migrate``, ``cancel-create`` and
``config``.
Every adapter a command needs comes from the composition root (``service/app/service.py``), so
the controller and the one-shot commands build their parts one way. Exit codes: 0 success, 1
runtime failure (the API server or the database unreachable, a failed operation); errors are
one line on stderr, never a traceback. Parsing the command line is ``service/cli.py``'s job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import anyio
import asyncpg
from kubernetes_asyncio.client import CoreV1Api
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry

from service import config, logs
from service.app import service, signals
from service.app.cancel_create import CancelOutcome, cancel_create
from service.app.inspect import explain, explanation_lines, list_pods, scan
from service.app.pending import PendingUnavailable, fetch_pending, live_clock_lines, pending_lines
from service.kit.backoff import Backoff
from service.kube.api import ApiConfigError, new_api_client
from service.kube.errors import read_whole, status_message
from service.metrics import Metrics
from service.pg.migrate import migrate

logger = logging.getLogger("service.cli")


class CommandError(Exception):
    """A failure worth one line on stderr (exit code 1)."""


def _run_async(fn: Callable[[], Awaitable[int]]) -> int:
    """A one-shot command's event loop: cancelled by SIGTERM or SIGINT (``signals``)."""
    return _one_line_on_error(lambda: signals.run_async(lambda stop: fn()))


def _run_draining(fn: Callable[[anyio.Event], Awaitable[int]]) -> int:
    """``run``'s event loop: the first SIGTERM or SIGINT sets ``stop`` (``signals``)."""
    return _one_line_on_error(lambda: signals.run_async(fn, drains=True))


def _one_line_on_error(call: Callable[[], int]) -> int:
    try:
        return call()
    except CommandError as exc:
        print(f"retired-pod-gc: {exc}", file=sys.stderr)
        return 1


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


async def _api(settings: config.Settings) -> Any:

    try:
        return await new_api_client()
    except ApiConfigError as exc:
        raise CommandError(f"Kubernetes API: {exc}") from None


async def _probe_api(api: Any, settings: config.Settings) -> None:
    """One cheap list call in each sandbox namespace, so that an unreachable or refusing API
    server fails a one-shot command at once (the informer would retry quietly until
    ``--timeout``)."""
    for namespace in settings.kube.namespaces:
        try:
            response, body = await read_whole(
                CoreV1Api(api).list_namespaced_pod(
                    namespace,
                    limit=1,
                    label_selector=settings.kube.label_selector,
                    _preload_content=False,
                    _request_timeout=aiohttp.ClientTimeout(total=settings.kube.api_timeout_s),
                )
            )
        except Exception as exc:
            raise CommandError(
                f"Kubernetes API unreachable ({api.configuration.host}): {_describe(exc)}"
            ) from None
        if response.status != 200:
            raise CommandError(
                f"Kubernetes API answered {response.status} listing pods in {namespace}: "
                f"{status_message(body)}"
            )


# ------------------------------------------------------------------------------------ run


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
        api = await _api(settings)
        try:
            parts = service.build(settings, api=api, metrics=Metrics(registry))
            await service.run(parts, stop=stop)
        except Exception as exc:
            logger.critical("service failed: %s", _describe(exc), exc_info=exc)
            return 1
        finally:
            with anyio.move_on_after(5, shield=True):
                await api.close()
        return 0

    return _run_draining(main)


# ---------------------------------------------------------------------------------- migrate


def migrate_database(settings: config.Settings, *, with_schema: bool) -> int:
    """Install or update the change-notify trigger (and the dev schema with ``with_schema``)."""

    async def main() -> int:
        try:
            with anyio.fail_after(max(30.0, settings.database.connect_timeout_s * 3)):
                applied = await migrate(
                    settings.database.url,
                    channel=settings.database.notify_channel,
                    with_schema=with_schema,
                    connect_timeout_s=settings.database.connect_timeout_s,
                )
        except Exception as exc:
            raise CommandError(
                f"migrate failed ({settings.database.masked_url}): {_describe(exc)}"
            ) from None
        if applied:
            print("applied: " + ", ".join(applied))
        else:
            print("nothing to apply: the database is up to date")
        return 0

    return _run_async(main)


# ------------------------------------------------------------------------------ scan/explain


@contextlib.asynccontextmanager
async def _store_and_api(settings: config.Settings) -> AsyncIterator[tuple[Any, Any]]:
    """The execution store (pinged: an unreachable database is one error line) and an API
    client, both closed on the way out."""
    store = service.new_store(settings, Metrics())
    await store.start()
    try:
        if not await store.ping():
            raise CommandError(f"database unreachable: {settings.database.masked_url}")
        api = await _api(settings)
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
                settings, api, Metrics(), backoff=Backoff(initial_s=0.5, max_s=1.0, jitter=0.5)
            )
            try:
                pods = await list_pods(informer, timeout_s=timeout_s)
            except TimeoutError:
                raise CommandError(
                    f"Kubernetes API: could not list pods within {timeout_s:g}s"
                ) from None
            report = await scan(settings, pods=pods, store=store)
        if output == "json":
            print(json.dumps(report.to_json(), indent=2))
            return 0
        for namespace, count in report.pods_by_namespace.items():
            print(f"namespace {namespace}: {count} pods")
        print("reapable shapes (a clock would run; deletion after the threshold):")
        for verdict, count in report.verdicts.items() or [("(none)", 0)]:
            print(f"  {verdict:<34} {count}")
        print("skipped, by reason:")
        for reason, count in report.skips.items() or [("(none)", 0)]:
            print(f"  {reason:<34} {count}")
        if report.candidates:
            print("candidates:")
            for c in report.candidates:
                print(f"  {c['pod']:<50} {c['verdict']:<24} age {c['age_s']}s")
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
            client = service.new_pod_client(settings, api, Metrics())
            try:
                exp = await explain(settings, key=key, pods=client, store=store)
            except Exception as exc:
                raise CommandError(f"explain failed: {_describe(exc)}") from None
        live: dict[str, Any] | str | None = None
        if url is not None:
            try:
                live = await fetch_pending(url, timeout_s=timeout_s, key=key)
            except PendingUnavailable as exc:
                live = str(exc)
        print("\n".join([*explanation_lines(exp), *live_clock_lines(key, url, live)]))
        return 0

    return _run_async(main)


# ----------------------------------------------------------------------------------- pending


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


# ----------------------------------------------------------------------------- cancel-create


def cancel_create_execution(
    settings: config.Settings, *, sandbox_id: str, generation: int, activation_attempt: int
) -> int:
    """Retire a cancelled create (fenced) and delete its pod under a UID precondition."""
    logs.setup(settings.log_level, settings.log_format)

    async def main() -> int:
        try:
            conn = await asyncpg.connect(
                settings.database.url, timeout=settings.database.connect_timeout_s
            )
        except Exception as exc:
            raise CommandError(
                f"database unreachable ({settings.database.masked_url}): {_describe(exc)}"
            ) from None
        try:
            api = await _api(settings)
            try:
                client = service.new_pod_client(settings, api, Metrics())
                report = await cancel_create(
                    conn=conn,
                    pods=client,
                    namespaces=settings.kube.namespaces,
                    sandbox_id=sandbox_id,
                    generation=generation,
                    activation_attempt=activation_attempt,
                    timeout_s=settings.kube.api_timeout_s,
                )
            except CommandError:
                raise
            except Exception as exc:
                raise CommandError(f"cancel-create failed: {_describe(exc)}") from None
            finally:
                await api.close()
        finally:
            await conn.close()
        print(
            f"{report.outcome}: pod {report.pod_name or '-'} "
            f"(retired by this call: {'yes' if report.retired_now else 'no'})"
            + (f" {report.detail}" if report.detail else "")
        )
        ok = {
            CancelOutcome.DELETED,
            CancelOutcome.POD_ABSENT,
            CancelOutcome.LEFT_ALONE_ACTIVE,
            CancelOutcome.LEFT_ALONE_OTHER_POD,
            CancelOutcome.LEFT_ALONE_KEPT,
            CancelOutcome.NO_EXECUTION,
        }
        return 0 if report.outcome in ok else 1

    return _run_async(main)


# ------------------------------------------------------------------------------------ config


def show_config(settings: config.Settings, environ: Mapping[str, str]) -> int:
    """Every variable's effective value and where it came from (secrets masked)."""
    for warning in settings.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rows = config.effective(settings, environ)
    width = max(len(name) for name, _, _ in rows)
    print(f"# mode: {settings.mode}")
    for name, value, source in rows:
        print(f"{name:<{width}}  {value}  ({source})")
    return 0
