"""The ``retired-pod-gc`` command line.

Commands: ``run`` (the controller), ``scan``, ``explain``, ``migrate``, ``cancel-create``,
``config`` and ``demo``. Exit codes: 0 success, 1 runtime failure (the API server or the
database unreachable, a failed operation), 2 bad configuration or usage. Errors are one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import anyio
import asyncpg
from kubernetes_asyncio.client import CoreV1Api
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry

from service import config, logs
from service.app import service
from service.app.cancel_create import CancelOutcome, cancel_create
from service.app.demo import run_demo
from service.app.inspect import explain, explanation_lines, list_pods, scan
from service.domain import split_key
from service.kit.backoff import Backoff
from service.kube.api import ApiConfigError, new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.errors import read_whole, status_message
from service.kube.informer import PodInformer
from service.metrics import Metrics
from service.pg.migrate import migrate
from service.pg.store import PgExecutionStore

logger = logging.getLogger("service.cli")


class CommandError(Exception):
    """A failure worth one line on stderr (exit code 1)."""


def _settings_or_exit(*, need_database: bool = True) -> config.Settings | int:
    try:
        settings = config.load(os.environ)
    except config.ConfigError as exc:
        print(f"retired-pod-gc: configuration error: {exc}", file=sys.stderr)
        return 2
    if need_database and not settings.database.url:
        print(
            f"retired-pod-gc: configuration error: {config.DATABASE_URL.name} (or "
            f"{config.DATABASE_URL_FILE.name}) is required",
            file=sys.stderr,
        )
        return 2
    return settings


def _run_async(fn: Callable[[], Awaitable[int]]) -> int:
    try:
        return anyio.run(fn)
    except CommandError as exc:
        print(f"retired-pod-gc: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


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
    """One cheap list call, so that an unreachable or refusing API server fails a one-shot
    command at once (the informer would retry quietly until ``--timeout``)."""
    namespace = settings.kube.namespace
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


def _cmd_run(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    if isinstance(settings, int):
        return settings
    logs.setup(settings.log_level, settings.log_format)
    for warning in settings.warnings:
        logger.warning(warning)

    async def main() -> int:
        registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
        api = await _api(settings)
        try:
            parts = service.build(settings, api=api, metrics=Metrics(registry))
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def on_signal() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for signum in signals:
                            logger.info("received %s", signal.Signals(signum).name)
                            stop.set()
                            return

                tg.start_soon(on_signal)
                await service.run(parts, stop=stop)
                tg.cancel_scope.cancel()
        except Exception as exc:
            logger.critical("service failed: %s", _describe(exc), exc_info=exc)
            return 1
        finally:
            with anyio.move_on_after(5, shield=True):
                await api.close()
        return 0

    return _run_async(main)


# ---------------------------------------------------------------------------------- migrate


def _cmd_migrate(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    if isinstance(settings, int):
        return settings

    async def main() -> int:
        try:
            with anyio.fail_after(max(30.0, settings.database.connect_timeout_s * 3)):
                applied = await migrate(
                    settings.database.url,
                    channel=settings.database.notify_channel,
                    with_schema=args.with_schema,
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
    store = PgExecutionStore(
        settings.database, namespace=settings.kube.namespace, metrics=Metrics()
    )
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


def _cmd_scan(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    if isinstance(settings, int):
        return settings
    logs.setup("warning", settings.log_format)

    async def main() -> int:
        async with _store_and_api(settings) as (store, api):
            await _probe_api(api, settings)
            informer = PodInformer(
                api,
                settings.kube,
                PodDecoder(settings.kube.label_keys),
                Metrics(),
                backoff=Backoff(initial_s=0.5, max_s=1.0, jitter=0.5),
            )
            try:
                pods = await list_pods(informer, timeout_s=args.timeout)
            except TimeoutError:
                raise CommandError(
                    f"Kubernetes API: could not list pods within {args.timeout:g}s"
                ) from None
            report = await scan(settings, pods=pods, store=store)
        if args.output == "json":
            print(json.dumps(report.to_json(), indent=2))
            return 0
        print(f"namespace {report.namespace}: {report.pods} pods")
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


def _cmd_explain(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    if isinstance(settings, int):
        return settings

    try:
        split_key(args.pod)
    except ValueError:
        print("retired-pod-gc: explain takes NAMESPACE/POD", file=sys.stderr)
        return 2
    logs.setup("warning", settings.log_format)

    async def main() -> int:
        async with _store_and_api(settings) as (store, api):
            client = KubePodClient(
                api, settings.kube, PodDecoder(settings.kube.label_keys), Metrics()
            )
            try:
                exp = await explain(settings, key=args.pod, pods=client, store=store)
            except Exception as exc:
                raise CommandError(f"explain failed: {_describe(exc)}") from None
        print("\n".join(explanation_lines(exp)))
        return 0

    return _run_async(main)


# ----------------------------------------------------------------------------- cancel-create


def _cmd_cancel_create(args: argparse.Namespace) -> int:
    settings = _settings_or_exit()
    if isinstance(settings, int):
        return settings
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
                client = KubePodClient(
                    api, settings.kube, PodDecoder(settings.kube.label_keys), Metrics()
                )
                report = await cancel_create(
                    conn=conn,
                    pods=client,
                    namespace=settings.kube.namespace,
                    sandbox_id=args.sandbox_id,
                    generation=args.generation,
                    activation_attempt=args.activation_attempt,
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
            CancelOutcome.NO_EXECUTION,
        }
        return 0 if report.outcome in ok else 1

    return _run_async(main)


# ------------------------------------------------------------------------------------ config


def _cmd_config(args: argparse.Namespace) -> int:
    settings = _settings_or_exit(need_database=False)
    if isinstance(settings, int):
        return settings
    for warning in settings.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rows = config.effective(settings, os.environ)
    width = max(len(name) for name, _, _ in rows)
    print(f"# mode: {settings.mode}")
    for name, value, source in rows:
        print(f"{name:<{width}}  {value}  ({source})")
    return 0


# -------------------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:

    return run_demo(threshold_s=args.threshold, phase_s=args.phase_seconds)


# ------------------------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retired-pod-gc",
        description=(
            "Delete sandbox pods whose execution was retired in PostgreSQL, safely. "
            f"Configured through {config.PREFIX}* environment variables "
            "(see docs/configuration.md); the Kubernetes connection comes from the "
            "in-cluster service account or KUBECONFIG."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "run",
        help="run the controller",
        description=(
            "Run the controller: watch pods, LISTEN for execution changes, and delete pods "
            "that stayed in a reapable shape for the threshold. Off unless ENABLED=true; "
            "dry run unless DRY_RUN=false. Serves /metrics, /healthz and /readyz. SIGTERM "
            "drains in-flight work and releases the lease."
        ),
    )
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "scan",
        help="classify every pod now against the database (read-only)",
        description=(
            "List every sandbox pod, look up its execution row, and classify it with the "
            "controller's own rules: counts by verdict and skip reason, and the candidates. "
            "Read-only; use it before enabling, and to compare with dry-run counts."
        ),
    )
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to list pods")
    p.set_defaults(func=_cmd_scan)

    p = sub.add_parser(
        "explain",
        help="show every input of one pod's decision and the rule that decided",
        description=(
            "GET one pod, read its execution row, and print every input the classifier uses "
            "and the rule that decided. Read-only."
        ),
    )
    p.add_argument("pod", metavar="NAMESPACE/POD")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser(
        "migrate",
        help="install the change-notify trigger (idempotent)",
        description=(
            "Install or update the trigger that NOTIFYs execution changes on NOTIFY_CHANNEL. "
            "Running it again changes nothing. --with-schema also creates the development "
            "schema (never needed against a production database)."
        ),
    )
    p.add_argument("--with-schema", action="store_true", help="also create the dev schema")
    p.set_defaults(func=_cmd_migrate)

    p = sub.add_parser(
        "cancel-create",
        help="retire a cancelled create (fenced) and delete its pod if retired",
        description=(
            "Retire the execution of SANDBOX_ID/GENERATION fenced on ACTIVATION_ATTEMPT. If the "
            "execution naming the pod is retired (by this call or earlier), delete the pod "
            "under its UID precondition; if it is still active (a newer activation owns the "
            "pod), leave the pod alone. Needs the UPDATE grant (deploy/db-role)."
        ),
    )
    p.add_argument("sandbox_id")
    p.add_argument("generation", type=int)
    p.add_argument("activation_attempt", type=int)
    p.set_defaults(func=_cmd_cancel_create)

    p = sub.add_parser(
        "config",
        help="print the effective configuration (secrets masked)",
        description=(
            "Read the environment like `run` does and print every variable's effective value "
            "and whether it came from the environment or the default. Exit 2 naming the "
            "variable when one cannot be parsed."
        ),
    )
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "demo",
        help="the whole loop on a throwaway PostgreSQL and API emulator",
        description=(
            "Start a throwaway PostgreSQL and the Kubernetes API emulator, seed a realistic "
            "sandbox namespace, and run the real service through the rollout: disabled, dry "
            "run, live. Leaves nothing running."
        ),
    )
    p.add_argument("--threshold", type=float, default=4.0, help="threshold seconds")
    p.add_argument("--phase-seconds", type=float, default=10.0, help="seconds per phase")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
