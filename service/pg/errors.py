"""What a failed database call raises: asyncpg's exceptions typed as the kit's, in one place.

::

    ExternalError (kit)        the database did not give an expected answer
    ├── Unavailable (kit)      no answer: refused, reset, timed out, connection lost
    │   ├── StoreClosed        the execution store was closed before it could answer
    │   └── ListenerUnavailable  the notify listener cannot vouch for the notifications
    └── DatabaseError          the server answered with an error (``sqlstate``): permission
                               denied, undefined table, statement timeout, ...

:func:`database_errors` raises the kit error each of :data:`DRIVER_ERRORS` stands for
(:func:`to_external`), the original chained as ``__cause__``:

* **Unavailable**: ``OSError`` (refused, reset, unreachable, ``TimeoutError``), asyncpg's
  ``InterfaceError`` (connection or pool closed) and ``InternalClientError`` (the driver lost
  track of the connection, as after a server restart), and the server errors that end the
  connection: SQLSTATE class 08, 57P01, 57P02 and 57P03.
* **DatabaseError**: every other ``asyncpg.PostgresError`` the server sent, and a schema that
  changed under a cached statement (``OutdatedSchemaCacheError``).
* **Not a failure of the database**: asyncpg's own errors for a misuse of the driver — a
  ``PostgresError`` without a ``severity`` (the server sends one with every error: ``DataError``
  for an argument it cannot encode, ``NoActiveSQLTransactionError``) and an ``InterfaceError``
  that is also a ``ValueError`` (a bad connection option). That is a bug of the caller: it passes
  through unchanged, as does every exception outside :data:`DRIVER_ERRORS`, so the engine's
  worker loop reports it as a bug (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import asyncpg

from service.kit.errors import ExternalError, Unavailable

DRIVER_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)
"""What a database call raises when the call fails (caught at the adapter's edge only)."""

_CONNECTION_ENDED = frozenset({"57P01", "57P02", "57P03"})
"""admin_shutdown (pg_terminate_backend, a fast shutdown), crash_shutdown, cannot_connect_now."""


class DatabaseError(ExternalError):
    """The server answered with an error. ``sqlstate`` is its code (empty when it sent none)."""

    def __init__(self, message: str, *, sqlstate: str = "") -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class StoreClosed(Unavailable):
    """The execution store was closed (shutdown) before it could answer."""


class ListenerUnavailable(Unavailable):
    """Not connected, or the listener's connection did not answer in time."""


def to_external(exc: BaseException) -> ExternalError | None:
    """The kit error ``exc`` stands for (with ``exc`` as its ``__cause__``), or ``None`` when
    ``exc`` is not a failure of the database (a bug: let it propagate unchanged)."""
    err: ExternalError
    if isinstance(exc, asyncpg.InterfaceError) and isinstance(exc, ValueError):
        return None
    if isinstance(exc, asyncpg.OutdatedSchemaCacheError):
        err = DatabaseError(describe(exc))
    elif isinstance(exc, asyncpg.PostgresError):
        sqlstate = str(getattr(exc, "sqlstate", "") or "")
        if sqlstate.startswith("08") or sqlstate in _CONNECTION_ENDED:
            # asyncpg raises ConnectionDoesNotExistError itself when the connection drops.
            err = Unavailable(describe(exc))
        elif getattr(exc, "severity", None) is None:
            return None  # raised by asyncpg, not sent by the server
        else:
            err = DatabaseError(describe(exc), sqlstate=sqlstate)
    elif isinstance(exc, TimeoutError):
        err = Unavailable(f"no answer in time: {exc}" if str(exc) else "no answer in time")
    elif isinstance(exc, DRIVER_ERRORS):
        err = Unavailable(describe(exc))
    else:
        return None
    err.__cause__ = exc
    return err


@contextlib.contextmanager
def database_errors() -> Iterator[None]:
    """Raise a failed database call inside as its kit error (:func:`to_external`)."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        err = to_external(exc)
        if err is None:
            raise
        raise err from exc


def describe(exc: BaseException) -> str:
    """``Class: first line of the message`` (just the class when there is none); an exception
    group, each of its exceptions joined by ``; ``."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)
    lines = str(exc).strip().splitlines()
    name = type(exc).__name__
    return f"{name}: {lines[0]}" if lines else name
