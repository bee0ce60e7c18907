"""A TCP proxy in front of the Kubernetes API emulator that resets or black-holes connections.

The service (or a test's ``kubernetes_asyncio`` client) talks to the proxy; each connection is
piped to the emulator (``tests/tcpproxy.py`` does the piping). The failures of a real control
plane behind a load balancer, switched at run time:

- :meth:`KubeProxy.reset` — RST every open connection (an apiserver killed, a node gone); new
  connections are accepted normally.
- :meth:`KubeProxy.blackhole_existing` — every connection open at that moment stops passing
  bytes in both directions, and nothing is closed: no FIN, no RST (a dropped conntrack entry, a
  NAT or load balancer idle timeout). Connections accepted afterwards work normally.
- :meth:`KubeProxy.blackhole_all` — the open connections as above, and every new one is
  accepted (the handshake completes, as a load balancer's does) but never passes a byte.
- :meth:`KubeProxy.restore` — new connections work again. The black-holed ones stay dead, as
  in reality after conntrack or a load balancer forgot them: the client must notice and
  reconnect. ``restore(heal=True)`` instead lets them pass bytes again, the held bytes first
  (a partition that healed before TCP gave up).

Counters: ``accepted`` (so far), ``open`` (now), ``black_holed`` (open and passing nothing),
``resets`` (so far); ``links`` are the open connections themselves (``tests/tcpproxy.Link``).

What a loopback proxy cannot imitate: TCP keepalive probes are answered by the proxy's kernel,
so keepalive never finds a black-holed connection dead here (with the kernel's default two-hour
keepalive time it would not in a test's span anyway). The application must notice the silence.

Use (one line with the fixture of ``tests/kubefixtures.py``)::

    async def test_x(proxied_emulator: ProxiedEmulator) -> None:
        api = await new_api_client(host=proxied_emulator.url)   # through the proxy
        proxied_emulator.proxy.blackhole_existing()
        proxied_emulator.emulator.create(...)                    # the emulator's state

or, without the fixture, ``async with proxied(running_emulator) as kube_proxy:`` gives a
started :class:`KubeProxy` whose ``url`` leads to that emulator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol
from urllib.parse import urlsplit

from tests.tcpproxy import Link, TcpProxy

__all__ = ["KubeProxy", "Link", "proxied"]


class KubeProxy(TcpProxy):
    """The proxy; ``url`` (``http://127.0.0.1:<port>``) once started."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        super().__init__(upstream_host, upstream_port)
        self._hole_new = False

    @property
    def url(self) -> str:
        assert self.port, "start() the proxy first"
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> KubeProxy:
        await super().start()
        return self

    def black_hole_on_accept(self) -> bool:
        return self._hole_new

    def reset(self) -> int:
        """RST every open connection (black-holed ones included); the number reset."""
        return self.reset_all()

    def blackhole_existing(self) -> int:
        """Black-hole every open connection; new ones work. The number black-holed now."""
        for link in self.links:
            link.black_hole()
        return self.black_holed

    def blackhole_all(self) -> int:
        """Black-hole every open connection and every one accepted until :meth:`restore`."""
        self._hole_new = True
        return self.blackhole_existing()

    def restore(self, *, heal: bool = False) -> None:
        """New connections pass bytes again. Black-holed ones stay dead unless ``heal``."""
        self._hole_new = False
        if heal:
            for link in self.links:
                link.heal()


class _Served(Protocol):
    url: str


@asynccontextmanager
async def proxied(running: _Served) -> AsyncIterator[KubeProxy]:
    """A started :class:`KubeProxy` in front of a served emulator (``RunningEmulator``),
    closed on exit."""
    target = urlsplit(running.url)
    proxy = await KubeProxy(target.hostname or "127.0.0.1", target.port or 80).start()
    try:
        yield proxy
    finally:
        await proxy.aclose()
