"""Keep asyncpg's TLS probe from leaving an exception nobody retrieves on the event loop.

With ``sslmode=prefer`` (asyncpg's default when the URL names none) every connection — and every
out-of-band cancel request asyncpg opens when a query is cancelled — starts with an
``SSLRequest`` answered through ``asyncpg.connect_utils.TLSUpgradeProto``. When the connection is
lost before the answer, ``connection_lost`` sets ``ConnectionError("unexpected connection_lost()
call")`` on the probe's ``on_data`` future. If the task that would await that future was
cancelled first (a timeout while the server restarts or a middlebox drops the link: the
connect or the cancel request is then abandoned), nobody ever retrieves it, and the event loop's
exception handler reports "Future exception was never retrieved" from a future no caller owns.

:func:`install` wraps ``connection_lost`` so that the exception is also marked retrieved when it
is set. A coroutine that still awaits the future gets it raised exactly as before; an abandoned
probe is dropped quietly. Applied once, when the adapter is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from asyncpg import connect_utils

_MARK = "_retired_pod_gc_marks_retrieved"


def install() -> None:
    """Idempotent; does nothing if asyncpg no longer has the probe class."""
    proto: Any = getattr(connect_utils, "TLSUpgradeProto", None)
    if proto is None or getattr(proto.connection_lost, _MARK, False):
        return
    original: Callable[[Any, BaseException | None], None] = proto.connection_lost

    @functools.wraps(original)
    def connection_lost(self: Any, exc: BaseException | None) -> None:
        original(self, exc)
        future: asyncio.Future[Any] | None = getattr(self, "on_data", None)
        if future is not None and future.done() and not future.cancelled():
            with contextlib.suppress(BaseException):
                future.exception()

    setattr(connection_lost, _MARK, True)
    proto.connection_lost = connection_lost
