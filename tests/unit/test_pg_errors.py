"""The PostgreSQL adapter's error mapping (``service/pg/errors.py``), over asyncpg's own classes.

A server error is built the way asyncpg builds it from the server's ErrorResponse
(``PostgresError.new`` with the S, C and M fields); an error asyncpg raises itself is built with
its constructor, as asyncpg does.
"""

from __future__ import annotations

import asyncio
import inspect
import socket

import asyncpg
import asyncpg.exceptions
import pytest

from service.kit.errors import ExternalError, Unavailable
from service.pg.errors import (
    DatabaseError,
    ListenerUnavailable,
    StoreClosed,
    database_errors,
    describe,
    to_external,
)

# InterfaceErrors that are also ValueErrors. (The top-level name DataError is the SQLSTATE class
# 22 one, which asyncpg also raises itself for an argument it cannot encode.)
_ArgumentError = asyncpg.exceptions._base.DataError
_ConfigError = asyncpg.exceptions._base.ClientConfigurationError

_SQLSTATE_CLASSES = [
    cls
    for cls in vars(asyncpg.exceptions).values()
    if inspect.isclass(cls)
    and issubclass(cls, asyncpg.PostgresError)
    and isinstance(cls.__dict__.get("sqlstate"), str)
]


def _sent(sqlstate: str, message: str = "message", severity: str = "ERROR") -> Exception:
    """An error as asyncpg builds it from the server's ErrorResponse."""
    exc: Exception = asyncpg.PostgresError.new({"S": severity, "C": sqlstate, "M": message})
    return exc


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle"),
        _sent("08006", "connection failure", "FATAL"),
        _sent("57P01", "terminating connection due to administrator command", "FATAL"),
        _sent("57P02", "terminating connection because of crash of another process", "FATAL"),
        _sent("57P03", "the database system is starting up", "FATAL"),
        asyncpg.InterfaceError("connection is closed"),
        asyncpg.exceptions.ProtocolError("unexpected message"),
        asyncpg.InternalClientError("inconsistent state"),
        ConnectionRefusedError(111, "Connection refused"),
        ConnectionResetError(104, "Connection reset by peer"),
        socket.gaierror(-2, "Name or service not known"),
        TimeoutError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_no_answer_from_the_database_is_unavailable_with_the_cause_chained(
    exc: BaseException,
) -> None:
    err = to_external(exc)
    assert type(err) is Unavailable
    assert err.__cause__ is exc


@pytest.mark.parametrize(
    ("exc", "sqlstate"),
    [
        (_sent("42501", "permission denied for table sandboxes"), "42501"),
        (_sent("42P01", "relation does not exist"), "42P01"),
        (_sent("57014", "canceling statement due to statement timeout"), "57014"),
        (_sent("53300", "sorry, too many clients already", "FATAL"), "53300"),
        (_sent("40001", "could not serialize access"), "40001"),
        (_sent("ZZ999", "a code asyncpg does not know"), "ZZ999"),
        (asyncpg.exceptions.OutdatedSchemaCacheError("cached statement plan is invalid"), ""),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v,
)
def test_an_error_the_server_answered_with_is_a_database_error_with_its_sqlstate(
    exc: BaseException, sqlstate: str
) -> None:
    err = to_external(exc)
    assert isinstance(err, DatabaseError) and not isinstance(err, Unavailable)
    assert err.sqlstate == sqlstate
    assert err.__cause__ is exc


@pytest.mark.parametrize("cls", _SQLSTATE_CLASSES, ids=lambda c: c.__name__)
def test_every_error_the_server_can_send_maps_to_an_external_error(
    cls: type[asyncpg.PostgresError],
) -> None:
    sqlstate = cls.__dict__["sqlstate"]
    exc = _sent(sqlstate)
    assert type(exc) is cls
    err = to_external(exc)
    assert isinstance(err, ExternalError)
    assert err.__cause__ is exc
    if isinstance(err, DatabaseError):
        assert err.sqlstate == sqlstate


@pytest.mark.parametrize(
    "exc",
    [
        # What asyncpg raises itself for a misuse: no severity, the server never saw it.
        asyncpg.exceptions.DataError("invalid input for query argument $1: 1 (expected str)"),
        asyncpg.exceptions.NoActiveSQLTransactionError("cursor cannot be created outside"),
        _ArgumentError("invalid input for query argument $1"),
        _ConfigError("sslmode is not a valid value"),
        TypeError("a bug"),
        ValueError("a bug"),
        KeyError("pod_name"),
        RuntimeError("a bug"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_bug_is_not_a_database_failure_and_passes_through_unchanged(exc: Exception) -> None:
    assert to_external(exc) is None
    with pytest.raises(type(exc)) as raised, database_errors():
        raise exc
    assert raised.value is exc


def test_database_errors_raises_the_kit_error_from_the_original() -> None:
    original = _sent("42P01", "relation does not exist")
    with pytest.raises(DatabaseError) as raised, database_errors():
        raise original
    assert raised.value.__cause__ is original and raised.value.sqlstate == "42P01"


def test_database_errors_lets_a_cancellation_through() -> None:
    with pytest.raises(asyncio.CancelledError), database_errors():
        raise asyncio.CancelledError


def test_the_adapters_own_errors_are_kit_unavailable() -> None:
    assert issubclass(StoreClosed, Unavailable)
    assert issubclass(ListenerUnavailable, Unavailable)
    assert issubclass(DatabaseError, ExternalError) and not issubclass(DatabaseError, Unavailable)


def test_describe_is_one_line_per_exception() -> None:
    # Logs and the commands' stderr line: the class, the message's first line, each exception
    # of a group.
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(OSError("  ")) == "OSError"
    assert describe(ValueError("bad value\n  detail")) == "ValueError: bad value"
    group = ExceptionGroup("two", [OSError("refused"), BaseExceptionGroup("in", [KeyError("k")])])
    assert describe(group) == "OSError: refused; KeyError: 'k'"
