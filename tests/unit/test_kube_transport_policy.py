"""The transport's decisions that need no server (``service/kube/transport.py``): which
answers are throttling, when a throttled request is sent again and when its answer goes back to
the caller, which requests are watches; and TCP keepalive (``service/kube/sessions.py``) and the
token file read at a 401 and once a minute."""

from __future__ import annotations

import socket
from pathlib import Path

import anyio
import pytest
from kubernetes_asyncio import client as k8s_client

from service.kit import clock
from service.kube.api import TokenFile
from service.kube.sessions import (
    KEEPALIVE_IDLE_S,
    KEEPALIVE_INTERVAL_S,
    KEEPALIVE_PROBES,
    keepalive_socket,
)
from service.kube.transport import (
    BEARER_TOKEN,
    DEFAULT_RETRY_AFTER_S,
    MAX_THROTTLE_RETRIES,
    is_throttled,
    is_watch,
    throttle_wait,
)

pytestmark = pytest.mark.anyio


def test_a_429_and_a_503_with_retry_after_are_throttling_nothing_else() -> None:
    assert is_throttled(429, None)
    assert is_throttled(429, 3.0)
    assert is_throttled(503, 1.0)
    assert not is_throttled(503, None)
    assert not is_throttled(500, 1.0)
    assert not is_throttled(200, None)
    assert not is_throttled(401, None)


def test_a_throttled_request_waits_its_retry_after_and_then_the_default() -> None:
    assert throttle_wait(4.0, delete=False, retries=0, now=0.0, deadline=10.0) == 4.0
    assert throttle_wait(0.0, delete=False, retries=0, now=0.0, deadline=10.0) == 0.0
    assert (
        throttle_wait(None, delete=False, retries=0, now=0.0, deadline=10.0)
        == DEFAULT_RETRY_AFTER_S
    )


def test_a_delete_is_never_sent_again() -> None:
    assert throttle_wait(0.0, delete=True, retries=0, now=0.0, deadline=None) is None


def test_retries_are_bounded_in_count_and_by_the_requests_own_timeout() -> None:
    waits = [
        throttle_wait(1.0, delete=False, retries=n, now=0.0, deadline=None)
        for n in range(MAX_THROTTLE_RETRIES + 1)
    ]
    assert waits == [1.0] * MAX_THROTTLE_RETRIES + [None]
    # A wait that would end at or past the deadline hands the 429 back instead.
    assert throttle_wait(2.0, delete=False, retries=0, now=8.0, deadline=10.0) is None
    assert throttle_wait(1.9, delete=False, retries=0, now=8.0, deadline=10.0) == 1.9


@pytest.mark.parametrize(
    ("query", "watch"),
    [
        ({"watch": True, "labelSelector": "a=b"}, True),
        ({"watch": "true"}, True),
        ({"watch": "True"}, True),
        ({"watch": False}, False),
        ({"limit": 500}, False),
        (None, False),
    ],
)
def test_watches_are_told_by_their_query(query: object, watch: bool) -> None:
    assert is_watch(query) is watch  # type: ignore[arg-type]


async def test_the_token_file_is_read_at_once_on_reload_and_by_the_hook_once_a_period(
    tmp_path: Path,
) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    configuration = k8s_client.Configuration()
    source = TokenFile(path)  # read again after a minute
    source.install(configuration)
    assert configuration.api_key[BEARER_TOKEN] == "Bearer first"
    path.write_text("second")
    hook = configuration.refresh_api_key_hook
    hook(configuration)
    assert configuration.api_key[BEARER_TOKEN] == "Bearer first"  # within the period
    await source.reload(configuration)
    assert configuration.api_key[BEARER_TOKEN] == "Bearer second"  # a 401: at once
    path.write_text("third")
    await anyio.sleep(60.0)
    start = clock.now()
    hook(configuration)
    assert configuration.api_key[BEARER_TOKEN] == "Bearer third"  # the periodic read
    assert clock.now() == start
    # A file that cannot be read keeps the token in use; a reload says why.
    path.write_text("")
    await anyio.sleep(60.0)
    hook(configuration)
    assert configuration.api_key[BEARER_TOKEN] == "Bearer third"
    with pytest.raises(ValueError, match="empty"):
        await source.reload(configuration)
    path.unlink()
    with pytest.raises(OSError):
        await source.reload(configuration)


def test_every_connection_has_tcp_keepalive_with_a_minute_to_give_up() -> None:
    sock = keepalive_socket((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("", 0)))
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        tcp = socket.IPPROTO_TCP
        assert sock.getsockopt(tcp, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
        assert sock.getsockopt(tcp, socket.TCP_KEEPINTVL) == KEEPALIVE_INTERVAL_S
        assert sock.getsockopt(tcp, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
        assert KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES == 60
    finally:
        sock.close()
