"""A TCP proxy between the service and PostgreSQL that can silently stall the listener's link.

The service connects to the proxy; each connection is piped to the real server. A connection
whose startup message names the listener's ``application_name`` is a *listener* connection:
:meth:`PgProxy.stall` makes the proxy hold every byte of those connections in both directions
without closing anything (a frozen middlebox / black-holed path), until :meth:`unstall`. Only
the listener's heartbeat can notice that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

LISTENER_APPLICATION_NAME = b"retired-pod-gc-listener"


class PgProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.port = 0
        self.listener_connected_at: list[float] = []
        """Wall-clock times at which listener connections sent their startup message."""

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    async def start(self) -> PgProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stall(self) -> None:
        self._flowing.clear()

    def unstall(self) -> None:
        self._flowing.set()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            except OSError:
                return
            link = _Link()
            pipes = [
                asyncio.ensure_future(self._pipe(reader, up_writer, link, from_client=True)),
                asyncio.ensure_future(self._pipe(up_reader, writer, link, from_client=False)),
            ]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for p in pipes:
                    p.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Only aclose() cancels a connection's task: end it normally. On Python 3.11 the
            # streams server's done-callback calls ``task.exception()``, which raises on a
            # cancelled task, into the loop's exception handler.
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 1.0)
            self._tasks.discard(task)

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        link: _Link,
        *,
        from_client: bool,
    ) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                data = await src.read(65536)
                if not data:
                    return
                if from_client and link.early is not None:
                    # asyncpg may send an SSLRequest first: the startup message (which names
                    # the application) comes in a later packet.
                    link.early += data
                    if LISTENER_APPLICATION_NAME in link.early:
                        link.is_listener = True
                        self.listener_connected_at.append(time.time())
                        link.early = None
                    elif len(link.early) > 8192:
                        link.early = None
                if link.is_listener:
                    # Silently hold the bytes: nothing is closed, nothing is answered.
                    await self._flowing.wait()
                dst.write(data)
                await dst.drain()


class _Link:
    """What the proxy knows about one client connection."""

    def __init__(self) -> None:
        self.is_listener = False
        self.early: bytes | None = b""
