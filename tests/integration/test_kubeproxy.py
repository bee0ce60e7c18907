"""The emulator's TCP proxy (tests/kubeproxy.py) fails connections exactly as it says, at the
byte level: reset is a RST, a black-holed connection passes no byte either way and is not
closed, new connections after ``blackhole_existing`` work, ``blackhole_all`` accepts and holds.

Raw HTTP/1.1 over asyncio streams shows the bytes; the real ``kubernetes_asyncio`` client shows
what a pooled connection in a black hole does to a request.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s_client

from devtools.emulator.statuses import PODS
from tests.kubefixtures import (
    SANDBOX_NAMESPACE,
    ProxiedEmulator,
    eventually,
    library_client,
    sandbox_pod,
)
from tests.kubeproxy import KubeProxy

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
WATCH = f"/api/v1/namespaces/{NS}/pods?watch=true&allowWatchBookmarks=false"


class Conn:
    """One raw HTTP/1.1 keep-alive connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, proxy: KubeProxy) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        return cls(reader, writer)

    def send_get(self, path: str) -> None:
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: kube\r\n\r\n".encode())

    async def head(self) -> tuple[int, dict[str, str]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode().split("\r\n")
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        return int(lines[0].split()[1]), headers

    async def get(self, path: str) -> tuple[int, bytes]:
        self.send_get(path)
        status, headers = await self.head()
        body = await self.reader.readexactly(int(headers["content-length"]))
        return status, body

    async def nothing_arrives(self) -> bool:
        """True when no byte arrives for a while (a check that can only pass wrongly, never
        fail wrongly: the callers first prove the bytes reached the proxy)."""
        try:
            await asyncio.wait_for(self.reader.read(1), 0.3)
        except TimeoutError:
            return True
        return False

    def close(self) -> None:
        self.writer.transport.abort()


def ns_path(name: str = NS) -> str:
    return f"/api/v1/namespaces/{name}"


def requests_to(pe: ProxiedEmulator, path: str) -> int:
    return sum(1 for r in pe.emulator.requests if r.path == path)


async def test_bytes_pass_both_ways_and_the_counters_count(
    proxied_emulator: ProxiedEmulator,
) -> None:
    proxy = proxied_emulator.proxy
    a, b = await Conn.open(proxy), await Conn.open(proxy)
    try:
        status, body = await a.get(ns_path())
        assert status == 200 and b'"name":"sandboxes"' in body
        assert (await b.get(ns_path()))[0] == 200
        assert (await a.get(ns_path()))[0] == 200  # keep-alive: the same connection again
        assert (proxy.accepted, proxy.open, proxy.black_holed, proxy.resets) == (2, 2, 0, 0)
        assert proxy.links[0].upstream_bytes > len(body)
    finally:
        a.close()
        b.close()
    await eventually(lambda: proxy.open == 0)
    assert proxy.accepted == 2


async def test_reset_sends_a_rst_to_both_sides_and_new_connections_work(
    proxied_emulator: ProxiedEmulator,
) -> None:
    proxy, emu = proxied_emulator.proxy, proxied_emulator.emulator
    watch = await Conn.open(proxy)
    idle = await Conn.open(proxy)
    try:
        watch.send_get(WATCH)
        assert (await watch.head())[0] == 200
        assert (await idle.get(ns_path()))[0] == 200
        await eventually(lambda: emu.open_watch_count() == 1)
        assert proxy.reset() == 2
        # A RST, not a FIN: the read fails rather than ending the stream.
        with pytest.raises(ConnectionResetError):
            await watch.reader.read(65536)
        with pytest.raises(ConnectionResetError):
            await idle.reader.read(65536)
        # The server's side was reset too: its watch ended.
        await eventually(lambda: emu.open_watch_count() == 0)
        await eventually(lambda: proxy.open == 0)
        fresh = await Conn.open(proxy)
        try:
            assert (await fresh.get(ns_path()))[0] == 200
        finally:
            fresh.close()
        assert (proxy.accepted, proxy.resets) == (3, 2)
    finally:
        watch.close()
        idle.close()


async def test_blackhole_existing_holds_every_byte_closes_nothing_and_new_connections_work(
    proxied_emulator: ProxiedEmulator,
) -> None:
    proxy, emu = proxied_emulator.proxy, proxied_emulator.emulator
    watch = await Conn.open(proxy)
    idle = await Conn.open(proxy)
    try:
        watch.send_get(WATCH)
        assert (await watch.head())[0] == 200
        assert (await idle.get(ns_path()))[0] == 200
        await eventually(lambda: emu.open_watch_count() == 1)
        watch_link, idle_link = proxy.links
        assert proxy.blackhole_existing() == 2

        # Server to client: the watch event reaches the proxy and stops there.
        emu.create(PODS, NS, sandbox_pod("held1"))
        await eventually(lambda: watch_link.held_from_upstream > 0)
        # Client to server: the request reaches the proxy and stops there.
        idle.send_get(ns_path("held-request"))
        await eventually(lambda: idle_link.held_from_client > 0)

        # A new connection works meanwhile, end to end.
        fresh = await Conn.open(proxy)
        try:
            assert (await fresh.get(ns_path()))[0] == 200
        finally:
            fresh.close()
        assert requests_to(proxied_emulator, ns_path("held-request")) == 0
        assert await watch.nothing_arrives()
        assert await idle.nothing_arrives()
        # Nothing was closed on either side: no EOF at the clients, the server's watch is open.
        assert not watch.reader.at_eof() and not idle.reader.at_eof()
        assert emu.open_watch_count() == 1
        assert (proxy.open, proxy.black_holed) >= (2, 2)

        # restore() leaves them dead (as a forgotten conntrack entry); heal passes the held
        # bytes, which shows they were held, not lost.
        proxy.restore()
        assert proxy.black_holed == 2
        assert await watch.nothing_arrives()
        proxy.restore(heal=True)
        assert proxy.black_holed == 0
        await watch.reader.readuntil(b"space-sbx-held1-g1")  # the held watch event
        assert (await idle.head())[0] == 404
        await eventually(lambda: requests_to(proxied_emulator, ns_path("held-request")) == 1)
    finally:
        watch.close()
        idle.close()


async def test_blackhole_all_accepts_new_connections_and_holds_them_until_restore(
    proxied_emulator: ProxiedEmulator,
) -> None:
    proxy = proxied_emulator.proxy
    old = await Conn.open(proxy)
    try:
        assert (await old.get(ns_path()))[0] == 200
        assert proxy.blackhole_all() == 1
        # The handshake completes (the proxy accepted), but the request goes nowhere.
        new = await Conn.open(proxy)
        await eventually(lambda: proxy.accepted == 2 and proxy.open == 2)
        new.send_get(ns_path("during-the-hole"))
        await eventually(lambda: proxy.links[1].held_from_client > 0)
        assert proxy.black_holed == 2
        assert requests_to(proxied_emulator, ns_path("during-the-hole")) == 0
        assert await new.nothing_arrives()
        assert not new.reader.at_eof()

        proxy.restore()
        after = await Conn.open(proxy)
        try:
            assert (await after.get(ns_path()))[0] == 200
        finally:
            after.close()
        # Black-holed during the hole: dead after it too.
        assert proxy.black_holed == 2
        assert requests_to(proxied_emulator, ns_path("during-the-hole")) == 0
        new.close()
    finally:
        old.close()


async def test_a_pooled_client_connection_in_the_hole_stalls_while_a_new_client_gets_through(
    proxied_emulator: ProxiedEmulator,
) -> None:
    # The failure of issue 39: a black-holed keep-alive connection stalls every request sent on
    # it until the request's timeout; the server never sees the request.
    pooled = library_client(proxied_emulator.url)
    fresh = library_client(proxied_emulator.url)
    try:
        core = k8s_client.CoreV1Api(pooled)
        assert (await core.read_namespace(NS)).metadata.name == NS
        assert proxied_emulator.proxy.blackhole_existing() == 1
        before = requests_to(proxied_emulator, ns_path())
        with pytest.raises((TimeoutError, aiohttp.ServerTimeoutError)):
            await core.read_namespace(NS, _request_timeout=0.5)
        assert requests_to(proxied_emulator, ns_path()) == before
        ns = await k8s_client.CoreV1Api(fresh).read_namespace(NS)
        assert ns.metadata.name == NS
        assert requests_to(proxied_emulator, ns_path()) == before + 1
    finally:
        await pooled.close()
        await fresh.close()


async def test_a_pooled_client_connection_that_was_reset_is_replaced_by_a_new_one(
    proxied_emulator: ProxiedEmulator,
) -> None:
    # The contrast with the black hole: a reset pooled connection costs nothing, since the
    # client sees it closed before reusing it.
    api = library_client(proxied_emulator.url)
    try:
        core = k8s_client.CoreV1Api(api)
        assert (await core.read_namespace(NS)).metadata.name == NS
        assert proxied_emulator.proxy.reset() == 1
        await eventually(lambda: proxied_emulator.proxy.open == 0)
        assert (await core.read_namespace(NS, _request_timeout=30)).metadata.name == NS
        assert proxied_emulator.proxy.accepted == 2
    finally:
        await api.close()
