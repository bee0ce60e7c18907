"""A generic TCP proxy on 127.0.0.1 whose connections can be reset or black-holed one by one.

The core of ``tests/kubeproxy.py`` (the Kubernetes API emulator's proxy) and
``tests/chaos/pgproxy.py`` (PostgreSQL's). Each accepted connection is a :class:`Link`: the
client's socket, a fresh connection to the upstream, and two pipes between them. A link can be

- **black-holed** (:meth:`Link.black_hole`): its pipes stop passing bytes in both directions and
  nothing is closed, no FIN and no RST (a dropped conntrack entry, a load balancer's idle timeout,
  a half-dead network). The pipes stop reading, so each peer's writes pile up in the kernel
  buffers, as unacknowledged segments do. Bytes already read are held, not dropped; an end of
  stream is not passed on either. :meth:`Link.heal` lets them through again, in order, as TCP's
  retransmissions would after a partition that healed;
- **reset** (:meth:`Link.reset`): both of its sockets are closed with ``SO_LINGER`` 0, so each
  peer gets a RST (an apiserver or node that went away abruptly).

What the proxy cannot imitate: on loopback, TCP keepalive probes are answered by the proxy's
own kernel, so a black-holed link is never found dead by keepalive (a real one would be, after
the kernel's keepalive time, two hours by default), and a peer's writes never time out
(``tcp_retries2``) since the proxy's kernel acknowledges them. Only the application can notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class Link:
    """One accepted connection and its connection to the upstream."""

    def __init__(self, number: int, client: asyncio.StreamWriter) -> None:
        self.number = number
        """1 for the first connection the proxy accepted, and so on."""
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.reset_done = False
        self.client_bytes = 0
        """Bytes passed from the client to the upstream."""
        self.upstream_bytes = 0
        """Bytes passed from the upstream to the client."""
        self.held_from_client = 0
        """Bytes the client sent that the proxy read and holds (the link is black-holed; an
        end of stream held counts 1)."""
        self.held_from_upstream = 0
        """Bytes the upstream sent that the proxy read and holds."""

    @property
    def black_holed(self) -> bool:
        return not self.flowing.is_set()

    def black_hole(self) -> None:
        """Pass no byte in either direction from now on, closing nothing, until :meth:`heal`."""
        self.flowing.clear()

    def heal(self) -> None:
        """Pass bytes again, the held ones first."""
        self.flowing.set()

    def reset(self) -> None:
        """RST both sides (``SO_LINGER`` 0, then abort: no FIN, no buffered bytes sent)."""
        self.reset_done = True
        self.flowing.set()  # the pipes wake, find the sockets gone and end
        for w in (self.client, self.upstream):
            if w is not None:
                _abort_with_rst(w)


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy:
    """Listens on 127.0.0.1 (``port``; 0 picks a free one) and pipes each connection to the
    upstream. Subclasses may look at the bytes (:meth:`on_client_bytes`) and black-hole new
    links (:meth:`black_hole_on_accept`)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.links: list[Link] = []
        """The connections open now (both sides still held by the proxy), oldest first."""
        self.accepted = 0
        """Connections accepted so far."""
        self.resets = 0
        """Connections reset so far."""

    @property
    def open(self) -> int:
        """Connections open now (a black-holed one stays open until its client resets it or
        the proxy closes)."""
        return len(self.links)

    @property
    def black_holed(self) -> int:
        """Open connections that pass no bytes now."""
        return sum(1 for link in self.links if link.black_holed)

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def black_hole_on_accept(self) -> bool:
        """Whether a newly accepted connection is black-holed from its first byte."""
        return False

    def on_client_bytes(self, link: Link, data: bytes) -> None:
        """Called with each chunk the client sent, before it is passed on (or held)."""

    def reset_all(self) -> int:
        """RST every open connection; the number reset."""
        links = list(self.links)
        for link in links:
            link.reset()
        self.resets += len(links)
        return len(links)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for link in self.links:
            # A held link's buffers may be full: closing politely could wait on them.
            for w in (link.client, link.upstream):
                if w is not None and link.black_holed:
                    w.transport.abort()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        link = Link(self.accepted, writer)
        if self.black_hole_on_accept():
            link.black_hole()
        self.links.append(link)
        try:
            try:
                up_reader, link.upstream = await asyncio.open_connection(*self._upstream)
            except OSError:
                return
            if link.reset_done:
                link.reset()
                return
            pipes = [
                asyncio.ensure_future(self._pipe(reader, link.upstream, link, from_client=True)),
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
            with contextlib.suppress(ValueError):
                self.links.remove(link)
            for w in (writer, link.upstream):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 1.0)
            self._tasks.discard(task)

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        link: Link,
        *,
        from_client: bool,
    ) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                data = await src.read(65536)
                if from_client and data:
                    self.on_client_bytes(link, data)
                if link.black_holed:
                    # Hold what this read got (an end of stream too), countably, so a test sees
                    # the bytes reached the hole, and read nothing more: the peer's next bytes
                    # wait in the kernel's buffers.
                    held = len(data) or 1
                    if from_client:
                        link.held_from_client += held
                    else:
                        link.held_from_upstream += held
                    await link.flowing.wait()
                    if from_client:
                        link.held_from_client -= held
                    else:
                        link.held_from_upstream -= held
                if not data or link.reset_done:
                    return
                dst.write(data)
                await dst.drain()
                if from_client:
                    link.client_bytes += len(data)
                else:
                    link.upstream_bytes += len(data)
