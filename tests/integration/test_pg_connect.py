"""How the service opens connections (``service/pg/connect.py``), against a real server: a
refused login is counted each time and logged once per cause, a URL file is read again for every
new connection (a rotated Secret), and the delivery probe's NOTIFY commits and reports the
queue's fill."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from service.metrics import PgMetrics
from service.pg.store import PgExecutionStore
from tests.pgfixtures import NAMESPACE, db_settings, metric

pytestmark = pytest.mark.anyio

LOGIN_FAILURES = "retired_pod_gc_database_login_failures_total"


def _as_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


def _store(url: str, registry: CollectorRegistry, **overrides: object) -> PgExecutionStore:
    return PgExecutionStore(
        db_settings(url, **overrides), namespaces=(NAMESPACE,), metrics=PgMetrics(registry)
    )


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


async def test_a_refused_login_is_counted_each_time_and_logged_once(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="service")
    registry = CollectorRegistry()
    async with _store(_as_user(pg_url, "no_such_role"), registry) as store:
        for _ in range(3):
            assert not await store.ping()
        assert metric(registry, LOGIN_FAILURES) == 3
        assert store.problem is not None and "login refused" in store.problem
        assert len(_warnings(caplog, "login refused")) == 1


async def test_a_rewritten_url_file_is_used_by_the_next_connection(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="service")
    url_file = tmp_path / "url"
    url_file.write_text(_as_user(pg_url, "no_such_role") + "\n")
    registry = CollectorRegistry()
    store = _store(pg_url, registry, url_file=str(url_file))
    async with store:
        assert not await store.ping()
        assert metric(registry, LOGIN_FAILURES) == 1
        url_file.write_text(pg_url + "\n")  # the kubelet updates the mounted Secret
        assert await store.ping()
        assert store.problem is None
        assert metric(registry, LOGIN_FAILURES) == 1
    assert any("works again" in r.getMessage() for r in caplog.records)


async def test_an_unreadable_url_file_fails_the_connection_not_the_process(
    pg_url: str, tmp_path: Path
) -> None:
    url_file = tmp_path / "url"
    registry = CollectorRegistry()
    async with _store(pg_url, registry, url_file=str(url_file)) as store:
        assert not await store.ping()  # the file is missing
        assert store.problem is not None and "DATABASE_URL_FILE" in store.problem
        url_file.write_text(pg_url)
        assert await store.ping()


async def test_the_probe_notify_is_committed_and_reports_the_queue_usage(pg_url: str) -> None:
    listener = await asyncpg.connect(pg_url)
    received: list[str] = []
    arrived = anyio.Event()

    def on_notification(_c: object, _pid: int, _channel: str, payload: str) -> None:
        received.append(payload)
        arrived.set()

    try:
        await listener.add_listener("probe_test", on_notification)
        async with _store(pg_url, CollectorRegistry()) as store:
            usage = await store.notify("probe_test", "42")
            with anyio.fail_after(10):
                await arrived.wait()
        assert received == ["42"]
        assert 0.0 <= usage < 1.0
    finally:
        await listener.close()
