"""Keep asyncpg's TLS probe from leaving an exception nobody retrieves on the event loop.

With ``sslmode=prefer`` (asyncpg's default) every connection, and every out-of-band cancel
request, starts with an ``SSLRequest`` answered through ``asyncpg.connect_utils.TLSUpgradeProto``.
A connection lost before the answer sets ``ConnectionError`` on the probe's ``on_data`` future;
when the task that would await it was cancelled first (a timeout while the server restarts),
nobody retrieves it and the loop reports "Future exception was never retrieved".
:func:`install` wraps ``connection_lost`` to mark that exception retrieved as it is set: a
coroutine still awaiting the future gets it as before.
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
