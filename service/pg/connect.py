"""Opening a connection: the one place that knows what the service asks of a server.

Every connection of the service (the query pool's, the notify listener's, a one-shot command's)
is opened here, so that each:

* reads its URL when it is opened: a URL file rewritten in place (a rotated Secret) takes
  effect at the next connection;
* goes to the primary: ``target_session_attrs=primary`` whatever the URL asks (``read-write``
  would match no server for a login whose sessions are read-only by default,
  ``deploy/db-role/role.sql``); a hot standby is refused with :class:`NotPrimary`;
* sends no startup parameter a pooler refuses, only ``application_name`` (the statement timeout
  is the role's on the server, ``DB_STATEMENT_TIMEOUT_SECONDS`` on the client);
* keeps no server-side prepared statement behind a transaction-mode pooler
  (``DB_TRANSACTION_POOLER``): asyncpg then prepares unnamed statements, which live for one query.

A login the server refuses (SQLSTATE class 28) is counted (``database_login_failures``) and
raised as :class:`LoginFailed`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg

from service.config import ConfigError, DatabaseSettings, listener_url_now, pool_url
from service.kit.errors import Unavailable
from service.metrics import PgMetrics
from service.pg.errors import DatabaseError, describe

TARGET_SESSION_ATTRS = "primary"
_LOGIN_REFUSED = "28"
"""SQLSTATE class 28: invalid authorization specification (a wrong password among them)."""


class NotPrimary(Unavailable):
    """No server the URL names is the primary: each one reached is in recovery (a hot standby)."""


class LoginFailed(DatabaseError):
    """The server refused the login (wrong password, unknown role, pg_hba rule)."""


class UrlUnusable(Unavailable):
    """The URL's file can no longer be read or no longer holds a usable URL."""


async def open_connection(url: str, *, metrics: PgMetrics, **kwargs: Any) -> asyncpg.Connection:
    """``asyncpg.connect``, raising this module's errors; any other failure as asyncpg raised it."""
    try:
        conn: asyncpg.Connection = await asyncpg.connect(url, **kwargs)
    except asyncpg.TargetServerAttributeNotMatched as exc:
        raise NotPrimary(
            "the server is in recovery (a hot standby), not the primary: retired-pod-gc needs "
            "the primary (LISTEN, and re-reads that see the latest commit). Point the URL at the "
            "primary, or list every server (host1:port1,host2:port2): the primary is picked"
        ) from exc
    except asyncpg.PostgresError as exc:
        if str(getattr(exc, "sqlstate", "") or "").startswith(_LOGIN_REFUSED):
            metrics.database_login_failures.inc()
            raise LoginFailed(
                f"login refused: {describe(exc)} (a URL file is read again for every new "
                "connection: a rotated password takes effect once the file holds it)",
                sqlstate=str(exc.sqlstate),
            ) from exc
        raise
    return conn


def _url(read: Callable[[DatabaseSettings], str], settings: DatabaseSettings) -> str:
    try:
        return read(settings)
    except ConfigError as exc:
        raise UrlUnusable(str(exc)) from exc


async def connect(
    settings: DatabaseSettings, *, metrics: PgMetrics, application_name: str
) -> asyncpg.Connection:
    """The listener's own connection (its URL, read now)."""
    options = pool_options(settings, application_name)
    options.pop("statement_cache_size", None)  # never through a transaction pooler: LISTEN
    return await open_connection(_url(listener_url_now, settings), metrics=metrics, **options)


async def connect_once(
    settings: DatabaseSettings, *, metrics: PgMetrics, application_name: str
) -> asyncpg.Connection:
    """A connection of its own for a one-shot command: the pool's URL and connect options."""
    return await open_connection(
        _url(pool_url, settings), metrics=metrics, **pool_options(settings, application_name)
    )


def pool_connector(settings: DatabaseSettings, *, metrics: PgMetrics) -> Any:
    """The ``connect`` callback of the query pool: each new pooled connection reads the pool's
    URL now (asyncpg's own arguments and the pool's connect options are kept)."""

    async def connect_pooled(_dsn: object = None, **kwargs: Any) -> asyncpg.Connection:
        return await open_connection(_url(pool_url, settings), metrics=metrics, **kwargs)

    return connect_pooled


def pool_options(settings: DatabaseSettings, application_name: str) -> dict[str, Any]:
    """The connect options of every pooled connection (see the module docstring)."""
    options: dict[str, Any] = {
        "timeout": settings.connect_timeout_s,
        "target_session_attrs": TARGET_SESSION_ATTRS,
        "server_settings": {"application_name": application_name},
    }
    if settings.transaction_pooler:
        options["statement_cache_size"] = 0
    return options
