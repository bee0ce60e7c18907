"""The reflector's decisions, one expected protocol event at a time, against a scripted fake of
its requests (``ListerWatcher``) and virtual time.

Each script is the exact sequence of requests the reflector must make; a request out of order
fails the test (the fake raises, which is a bug to the reflector, so it propagates). Virtual time
shows which steps waited for a backoff: the backoff policy has no jitter here, so the n-th
consecutive failure waits exactly ``2**n`` seconds.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import anyio
import msgspec
import pytest
from prometheus_client import CollectorRegistry

from service import config
from service.domain import LabelKeys
from service.kit import clock
from service.kit.backoff import Attempts, Backoff
from service.kit.errors import Unavailable
from service.kube.decode import PodDecodeError, PodDecoder
from service.kube.errors import KubeApiError
from service.kube.informer import BACKOFF_MAX_S, default_backoff
from service.kube.listwatch import Page
from service.kube.reachability import Reachability
from service.kube.reflector import Reflector, SyncMode, end_margin_s, short_timeout_s
from service.kube.store import PodStore, SyncState
from service.kube.watchstream import EventStream, LineReader, WatchDecoder
from service.metrics import KubeMetrics
from tests.kubefixtures import SANDBOX_NAMESPACE, SANDBOX_SELECTOR, RecordingHandler, sandbox_pod
from tests.virtualtime import settle

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
DEFAULTS = config.load({}).kube
"""The declared defaults, which each test replaces where it sets its own."""
DECODER = PodDecoder()


# ---------------------------------------------------------------------------- wire lines


def pod(name: str, rv: int, *, uid: str | None = None) -> dict[str, Any]:
    body = sandbox_pod(name)
    body["metadata"].update(
        {"namespace": NS, "uid": uid or f"uid-{name}", "resourceVersion": str(rv)}
    )
    return body


def key(name: str) -> str:
    return f"{NS}/space-sbx-{name}-g1"


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"type": kind, "object": obj}) + b"\n"


def added(name: str, rv: int) -> bytes:
    return event("ADDED", pod(name, rv))


def modified(name: str, rv: int) -> bytes:
    return event("MODIFIED", pod(name, rv))


def bookmark(rv: int, *, end: bool = False) -> bytes:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return event("BOOKMARK", {"kind": "Pod", "metadata": meta})


def error(code: int, message: str = "boom") -> bytes:
    return event("ERROR", {"kind": "Status", "code": code, "message": message})


# ---------------------------------------------------------------------------- the fake


class FakeStream:
    """A watch response whose lines are scripted; ``fail`` is raised once they are read, and a
    ``silent`` stream then sends nothing more, without ending (a dead connection). ``gaps`` are
    the seconds of virtual time before each line (none: at once). A stream that ``honours`` its
    ``timeoutSeconds`` stays open after its lines until then, and ends there as a server ends
    it, whatever is left (lines not yet sent, a silence)."""

    def __init__(
        self,
        lines: Sequence[bytes],
        *,
        fail: BaseException | None = None,
        silent: bool = False,
        gaps: Sequence[float] = (),
        honours: bool = False,
    ) -> None:
        self._lines = deque(lines)
        self._gaps = deque(gaps)
        self._fail = fail
        self._silent = silent
        self._honours = honours
        self._ends_at = math.inf
        self.closed = False

    def opened(self, timeout_s: int) -> None:
        """The server has answered, asked for ``timeout_s``."""
        if self._honours:
            self._ends_at = clock.now() + timeout_s

    @property
    def content(self) -> LineReader:
        return self

    async def readline(self) -> bytes:
        with anyio.CancelScope(deadline=self._ends_at):
            return await self._readline()
        return b""  # the server's end, at its timeoutSeconds

    async def _readline(self) -> bytes:
        await anyio.lowlevel.checkpoint()
        if self._gaps:
            await anyio.sleep(self._gaps.popleft())
        if self._lines:
            return self._lines.popleft()
        if self._fail is not None:
            raise self._fail
        if self._silent or self._honours:
            await anyio.sleep_forever()
        return b""

    def close(self) -> None:
        self.closed = True


@dataclasses.dataclass(frozen=True)
class Listing:
    rv: str
    pods: Sequence[dict[str, Any]] = ()
    continue_: str = ""
    """The next page's token (``""``: the last page)."""


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    """``stream``, ``watch``, ``list_cached``, ``list_quorum`` or ``list_next`` (a list's next
    page)."""
    arg: str | None = None
    """The version asked for (``known`` or ``rv``; ``None`` for the newest state), or the
    continue token of ``list_next``."""
    answer: object = None
    """A FakeStream, a Listing, or an exception to raise (an answer with another status is the
    ``KubeApiError`` of :func:`failed`, as the real ListWatch raises it)."""


def failed(status: int, message: str, retry_after_s: float | None = None) -> KubeApiError:
    """A failed answer, as the real ListWatch raises it."""
    return KubeApiError(status, message, retry_after_s=retry_after_s)


class ScriptError(AssertionError):
    pass


WATCH_TIMEOUT_S = 300
"""The ``timeoutSeconds`` of a watch asked for without a cap (``WATCH_TIMEOUT_SECONDS``'s
default; the fake does not jitter it)."""


class FakeListWatch:
    """Answers each request with the next step of the script, and records when it came and, for
    a stream, the ``timeoutSeconds`` it asked for. It only answers: every decision about what an
    answer means is the reflector's."""

    def __init__(self, script: Sequence[Call], metrics: KubeMetrics) -> None:
        self._script = deque(script)
        self._decoder = WatchDecoder(DECODER, metrics)
        self.calls: list[tuple[str, str | None, float]] = []
        self.limits: list[int | None] = []
        self.timeouts: list[int] = []
        """The ``timeoutSeconds`` of each stream or watch request, in order."""
        self.exhausted = anyio.Event()
        self.streams: list[FakeStream] = []

    async def _stream(self, op: str, arg: str | None, timeout_cap: int | None) -> EventStream:
        timeout_s = WATCH_TIMEOUT_S if timeout_cap is None else min(WATCH_TIMEOUT_S, timeout_cap)
        self.timeouts.append(timeout_s)
        answer = await self._next(op, arg)
        assert isinstance(answer, FakeStream)
        answer.opened(timeout_s)
        return EventStream(answer, self._decoder, op)

    async def _next(self, op: str, arg: str | None) -> object:
        self.calls.append((op, arg, clock.now()))
        if not self._script:
            self.exhausted.set()
            await anyio.sleep_forever()
        step = self._script.popleft()
        if (step.op, step.arg) != (op, arg):
            raise ScriptError(f"expected {step.op}({step.arg!r}), got {op}({arg!r})")
        if isinstance(step.answer, BaseException):
            raise step.answer
        if isinstance(step.answer, FakeStream):
            self.streams.append(step.answer)
        return step.answer

    async def list(
        self,
        *,
        resource_version: str = "",
        match: str = "",
        token: str | None = None,
        limit: int | None = None,
    ) -> Page:
        if token is not None:
            op, arg = "list_next", token
        elif (resource_version, match) == ("0", ""):
            op, arg = "list_cached", None
        elif match == "NotOlderThan":
            op, arg = "list_cached", resource_version
        elif (resource_version, match) == ("", ""):
            op, arg = "list_quorum", None
        else:
            raise ScriptError(f"a list of version {resource_version!r} match {match!r}")
        self.limits.append(limit)
        answer = await self._next(op, arg)
        assert isinstance(answer, Listing)
        pods = [DECODER.decode(msgspec.json.encode(body)) for body in answer.pods]
        return Page(pods, answer.rv, answer.continue_)

    async def stream(self, known: str | None, *, timeout_cap: int | None) -> EventStream:
        return await self._stream("stream", known, timeout_cap)

    async def watch(self, rv: str, *, timeout_cap: int | None) -> EventStream:
        return await self._stream("watch", rv, timeout_cap)


@dataclasses.dataclass
class Run:
    reflector: Reflector
    store: PodStore
    handler: RecordingHandler
    metrics: KubeMetrics
    lw: FakeListWatch

    def count(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value

    def restarts(self, reason: str) -> float:
        return self.count("retired_pod_gc_watch_restarts_total", reason=reason)

    def times(self) -> list[float]:
        """Virtual time of each request, from the first."""
        start = self.lw.calls[0][2]
        return [at - start for _, _, at in self.lw.calls]

    def requests(self) -> list[tuple[str, str | None]]:
        return [(op, arg) for op, arg, _ in self.lw.calls]


async def run_script(
    script: Sequence[Call],
    *,
    list_mode: str = "auto",
    min_watch_s: float = 0.0,
    silence_s: float = 75.0,
    api_timeout_s: float = 5.0,
    reachability: Reachability | None = None,
    meanwhile: Callable[[], Awaitable[None]] | None = None,
) -> Run:
    """Run a reflector until it asks for more than the script holds (virtual time passes
    through every backoff on its own); then stop it."""
    metrics = KubeMetrics(CollectorRegistry())
    lw = FakeListWatch(script, metrics)
    handler = RecordingHandler()
    store = PodStore(metrics, sink=handler, namespace=NS)
    settings = dataclasses.replace(
        DEFAULTS,
        namespaces=(NS,),
        label_selector=SANDBOX_SELECTOR,
        label_keys=LabelKeys(),
        api_timeout_s=api_timeout_s,
        watch_timeout_s=float(WATCH_TIMEOUT_S),
        list_page_size=500,
        delete_grace_period_s=None,
        list_mode=list_mode,
        watch_silence_s=silence_s,
    )
    reflector = Reflector(
        lw,
        store,
        metrics,
        settings=settings,
        backoff=Backoff(initial_s=1.0, max_s=BACKOFF_MAX_S),
        min_watch_s=min_watch_s,
        reachability=reachability,
    )
    with anyio.fail_after(3600):  # virtual: a reflector that never asks for more fails
        async with anyio.create_task_group() as tg:
            tg.start_soon(reflector.run)
            if meanwhile is not None:
                tg.start_soon(meanwhile)
            await lw.exhausted.wait()
            await settle()
            tg.cancel_scope.cancel()
    assert all(s.closed for s in lw.streams), "every stream opened was closed"
    return Run(reflector, store, handler, metrics, lw)


def streamed(*lines: bytes, rv: int, fail: BaseException | None = None) -> FakeStream:
    """A streaming list that sends ``lines`` and ends its initial events at ``rv``."""
    return FakeStream([*lines, bookmark(rv, end=True)], fail=fail)


# ---------------------------------------------------------------------------- the claims


async def test_a_streaming_list_syncs_at_its_end_bookmark_and_goes_on_as_the_watch() -> None:
    run = await run_script(
        [
            Call("stream", None, streamed(added("a", 900), added("b", 800), rv=950)),
        ]
    )
    # The stream was followed after its end bookmark: no second request until it ended.
    assert run.requests()[:2] == [("stream", None), ("watch", "950")]
    assert run.store.state is SyncState.SYNCED
    assert run.reflector.sync_mode is SyncMode.STREAM
    assert run.handler.log == [f"add {key('a')}", f"add {key('b')}", "synced"]


async def test_initial_events_do_not_move_the_resume_version_until_their_end_bookmark() -> None:
    # Initial events are not ordered by resourceVersion: 900 must not become the resume point.
    stream = FakeStream([added("a", 900), added("b", 800)], fail=aiohttp.ClientPayloadError("cut"))
    run = await run_script(
        [
            Call("stream", None, stream),
            Call("stream", None, streamed(added("a", 900), rv=950)),
        ]
    )
    assert run.requests()[2] == ("watch", "950")
    assert run.times()[1] == 1.0  # the cut stream was a failure: backed off


async def test_watch_events_and_bookmarks_advance_the_version_the_next_watch_resumes_from() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            Call("watch", "100", FakeStream([modified("a", 120), bookmark(130)])),
            Call("watch", "130", FakeStream([bookmark(150), modified("a", 160)])),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "160")
    assert run.times() == [0.0, 0.0, 0.0, 0.0]  # a stream that ends is resumed at once
    assert run.restarts("closed") == 2
    assert run.count("retired_pod_gc_relists_total") == 0


async def test_a_410_event_on_the_watch_relists_from_the_version_last_seen() -> None:
    run = await run_script(
        [
            Call("stream", None, FakeStream([added("a", 90), bookmark(100, end=True), error(410)])),
            Call("stream", "100", streamed(added("a", 90), added("c", 105), rv=110)),
        ]
    )
    assert run.requests() == [("stream", None), ("stream", "100"), ("watch", "110")]
    assert run.times() == [0.0, 0.0, 0.0]  # a 410 is not a failure: no backoff
    assert run.handler.log == [f"add {key('a')}", "synced", "cold", f"add {key('c')}", "synced"]
    assert run.restarts("expired") == 1
    assert run.count("retired_pod_gc_relists_total") == 1


async def test_a_410_on_the_sync_asks_the_next_sync_for_the_newest_and_then_known_again() -> None:
    run = await run_script(
        [
            Call("stream", None, FakeStream([bookmark(100, end=True), error(410)])),
            Call("stream", "100", failed(410, "too old")),
            Call("stream", None, FakeStream([bookmark(300, end=True), error(410)])),
            Call("stream", "300", streamed(rv=400)),
        ]
    )
    assert run.requests()[-1] == ("watch", "400")
    assert run.times()[-1] == 0.0
    assert run.restarts("expired") == 3


async def test_a_refused_cache_list_falls_back_to_a_quorum_list_until_a_sync_completes() -> None:
    run = await run_script(
        [
            Call("list_cached", None, failed(410, "too old")),
            Call("list_quorum", None, Unavailable("reset")),  # the quorum list fails ...
            Call("list_quorum", None, Listing("200", [pod("a", 150)])),  # ... and is retried
            Call("watch", "200", FakeStream([error(410)])),
            Call("list_cached", "200", Listing("300", [pod("a", 150)])),  # then the cache again
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "300")
    assert run.reflector.sync_mode is SyncMode.LIST_CACHE
    assert run.times()[:3] == [0.0, 0.0, 1.0]
    assert run.handler.added_keys() == [key("a")]  # listed twice, reported once


async def test_auto_mode_falls_back_to_a_list_in_the_same_sync_and_never_streams_again() -> None:
    run = await run_script(
        [
            Call("stream", None, failed(422, "sendInitialEvents forbidden")),
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            Call("watch", "100", FakeStream([error(410)])),
            Call("list_cached", "100", Listing("200", [pod("a", 90)])),
        ]
    )
    assert run.requests()[-1] == ("watch", "200")
    assert run.times() == [0.0] * 5  # falling back is not a failure
    assert run.restarts("error") == 0
    assert run.count("retired_pod_gc_relists_total") == 1
    assert run.reflector.sync_mode is SyncMode.LIST_CACHE


async def test_a_plain_bookmark_before_the_end_bookmark_is_a_stream_not_honoured() -> None:
    run = await run_script(
        [
            Call("stream", None, FakeStream([added("a", 90), bookmark(95)])),
            Call("list_cached", None, Listing("100", [pod("a", 90), pod("b", 92)])),
        ]
    )
    assert run.requests()[-1] == ("watch", "100")
    assert run.reflector.sync_mode is SyncMode.LIST_CACHE
    # What the stream applied is reconciled by the list, not reported twice.
    assert run.handler.log == [f"add {key('a')}", f"add {key('b')}", "synced"]


async def test_stream_mode_backs_off_and_streams_again_when_the_stream_is_rejected() -> None:
    run = await run_script(
        [
            Call("stream", None, failed(422, "forbidden")),
            Call("stream", None, failed(422, "forbidden")),
            Call("stream", None, streamed(added("a", 90), rv=100)),
        ],
        list_mode="stream",
    )
    assert [op for op, _ in run.requests()] == ["stream", "stream", "stream", "watch"]
    assert run.times()[:3] == [0.0, 1.0, 3.0]
    assert run.restarts("error") == 2


async def test_an_error_event_backs_off_and_resumes_the_watch_without_a_relist() -> None:
    run = await run_script(
        [
            Call(
                "stream",
                None,
                FakeStream([bookmark(100, end=True), modified("a", 110), error(500)]),
            ),
            Call("watch", "110", FakeStream([error(503)])),
            Call("watch", "110", FakeStream([modified("a", 120)])),
            Call("watch", "120", FakeStream([error(500)])),
        ]
    )
    assert run.times() == [0.0, 1.0, 3.0, 3.0, 4.0]  # the event between reset the backoff
    assert run.restarts("error") == 3
    assert run.count("retired_pod_gc_relists_total") == 0
    assert run.handler.cold == 0


async def test_an_error_event_with_a_4xx_relists_after_the_backoff() -> None:
    run = await run_script(
        [
            Call("stream", None, FakeStream([bookmark(100, end=True), error(400, "bad rv")])),
            Call("stream", "100", streamed(rv=200)),
        ]
    )
    assert run.requests()[-1] == ("watch", "200")
    assert run.times()[1] == 1.0
    assert run.handler.log == ["synced", "cold", "synced"]


async def test_an_end_bookmark_without_a_version_breaks_the_stream_and_the_sync_is_retried() -> (
    None
):
    no_version = event(
        "BOOKMARK", {"metadata": {"annotations": {"k8s.io/initial-events-end": "true"}}}
    )
    run = await run_script(
        [
            Call("stream", None, FakeStream([added("a", 90), no_version])),
            Call("stream", None, streamed(added("a", 90), rv=100)),
        ]
    )
    assert run.requests()[-1] == ("watch", "100")
    assert run.times()[1] == 1.0
    assert run.handler.log == [f"add {key('a')}", "synced"]


async def test_a_stream_that_ends_before_its_initial_events_do_is_retried_after_a_backoff() -> None:
    run = await run_script(
        [
            Call("stream", None, FakeStream([added("a", 90)])),
            Call("stream", None, streamed(added("a", 90), rv=100)),
        ]
    )
    assert run.requests()[-1] == ("watch", "100")
    assert run.times()[1] == 1.0
    assert run.reflector.sync_mode is SyncMode.STREAM  # not a reason to stop streaming


async def test_a_watch_closed_at_once_without_events_backs_off_one_with_events_does_not() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            Call("watch", "100", FakeStream([])),
            Call("watch", "100", FakeStream([bookmark(110)])),
            Call("watch", "110", FakeStream([])),
        ],
        list_mode="list",
        min_watch_s=1.0,
    )
    # Virtual time stands still while a stream is read: "at once" every time.
    assert run.times() == [0.0, 0.0, 1.0, 1.0, 2.0]
    assert run.restarts("error") == 2
    assert run.restarts("closed") == 1


async def test_failures_back_off_exponentially_with_retry_after_as_the_least_delay() -> None:
    run = await run_script(
        [
            Call("stream", None, failed(500, "down")),
            Call("stream", None, Unavailable("refused")),
            Call("stream", None, failed(429, "slow down", retry_after_s=30.0)),
            Call("stream", None, failed(429, "slow down", retry_after_s=0.5)),
            Call("stream", None, streamed(rv=100)),
        ]
    )
    assert run.times() == [0.0, 1.0, 3.0, 33.0, 41.0, 41.0]
    assert run.restarts("error") == 4


async def test_a_rejected_watch_request_relists_and_a_server_error_resumes() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            Call("watch", "100", failed(503, "unavailable")),
            Call("watch", "100", failed(400, "cannot parse resourceVersion")),
            Call("list_cached", "100", Listing("200")),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "200")
    assert run.count("retired_pod_gc_relists_total") == 1


async def test_a_connection_broken_while_reading_is_unavailable_a_timeout_counted_as_one() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            Call(
                "watch", "100", FakeStream([bookmark(110)], fail=aiohttp.ClientPayloadError("cut"))
            ),
            Call("watch", "110", FakeStream([], fail=aiohttp.SocketTimeoutError("silent"))),
            Call("watch", "110", FakeStream([], fail=ConnectionResetError())),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "110")
    assert run.restarts("error") == 2
    assert run.restarts("timeout") == 1
    assert run.count("retired_pod_gc_relists_total") == 0


async def test_anything_but_an_external_error_is_a_bug_that_ends_the_loop() -> None:
    for bug in (ValueError("a bug"), KeyError("a bug"), RuntimeError("a bug")):
        with pytest.raises(BaseExceptionGroup) as raised:
            await run_script([Call("stream", None, bug)])
        assert raised.value.exceptions == (bug,)


def test_the_informer_default_backoff_doubles_to_its_cap_each_delay_in_its_upper_half() -> None:
    policy = default_backoff()
    policy.rng = random.Random(1)
    attempts = Attempts(policy)
    for failures in range(12):
        base = min(BACKOFF_MAX_S, 0.5 * 2.0**failures)
        assert base / 2 <= attempts.next_delay() <= base
    assert attempts.next_delay(floor_s=60.0) == 60.0
    attempts.reset()
    assert 0.25 <= attempts.next_delay() <= 0.5


async def test_a_quorum_list_is_read_page_by_page_at_the_version_of_its_first_page() -> None:
    run = await run_script(
        [
            Call("list_cached", None, failed(410, "too old")),
            Call("list_quorum", None, Listing("200", [pod("a", 150)], continue_="t1")),
            Call("list_next", "t1", Listing("201", [pod("b", 160)], continue_="t2")),
            Call("list_next", "t2", Listing("202", [pod("c", 170)])),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "200")
    assert run.reflector.sync_mode is SyncMode.LIST_QUORUM
    assert run.handler.added_keys() == [key("a"), key("b"), key("c")]
    # Pages of the configured size; a list NotOlderThan a known version would not be paged.
    assert run.lw.limits == [500, 500, 500, 500]


async def test_a_list_not_older_than_a_known_version_is_not_paged() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            Call("watch", "100", FakeStream([error(410)])),
            Call("list_cached", "100", Listing("200", [pod("a", 90)])),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "200")
    assert run.lw.limits == [500, None]


async def test_an_expired_continue_token_starts_the_list_over_at_most_three_times() -> None:
    run = await run_script(
        [
            Call("list_cached", None, failed(410, "too old")),
            Call("list_quorum", None, Listing("200", [pod("a", 150)], continue_="t1")),
            Call("list_next", "t1", failed(410, "continue expired")),
            Call("list_quorum", None, Listing("300", [pod("b", 250)], continue_="t2")),
            Call("list_next", "t2", Listing("300", [pod("c", 260)])),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "300")
    assert run.times()[-1] == 0.0  # started over at once: not a failure
    # The first attempt's "a" was not in the list that completed: reported deleted.
    assert run.handler.log == [
        f"add {key('a')}",
        f"add {key('b')}",
        f"add {key('c')}",
        f"delete {key('a')}",
        "synced",
    ]
    expired = [Call("list_next", "t", failed(410, "continue expired"))]
    quorum = [Call("list_quorum", None, Listing("200", continue_="t"))]
    run = await run_script(
        [
            Call("list_cached", None, failed(410, "too old")),
            *(quorum + expired) * 4,  # the fourth expiry is a failure: backed off, resynced
            Call("list_quorum", None, Listing("400")),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "400")
    assert run.times()[-2:] == [1.0, 1.0]
    assert run.restarts("error") == 1


async def test_a_version_too_large_is_a_refusal_of_the_cache_list_and_an_expiry_of_a_watch() -> (
    None
):
    too_large = failed(504, "Too large resource version: 300, current: 200")
    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            Call("watch", "100", too_large),
            Call("list_cached", "100", too_large),
            Call("list_quorum", None, Listing("200")),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "200")
    assert run.times() == [0.0] * 5  # neither is a failure
    assert run.restarts("expired") == 1
    assert run.reflector.sync_mode is SyncMode.LIST_QUORUM


async def test_a_server_error_on_the_cache_list_backs_off_and_asks_the_cache_again() -> None:
    run = await run_script(
        [
            Call("list_cached", None, failed(503, "unavailable", retry_after_s=2.0)),
            Call("list_cached", None, Listing("100")),
        ],
        list_mode="list",
    )
    assert run.requests() == [("list_cached", None), ("list_cached", None), ("watch", "100")]
    assert run.times()[1] == 2.0  # the server's Retry-After
    assert run.reflector.sync_mode is SyncMode.LIST_CACHE


async def test_an_undecodable_list_page_is_an_expected_failure_backed_off_and_retried() -> None:
    run = await run_script(
        [
            Call("list_cached", None, PodDecodeError("undecodable pod list")),
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "100")
    assert run.times()[1] == 1.0
    assert run.restarts("error") == 1
    assert run.handler.log == [f"add {key('a')}", "synced"]


# ---------------------------------------------------------------------------- silence


async def test_a_silent_watch_is_abandoned_at_the_bound_and_resumed_from_the_last_version() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            # A bookmark, an event, then nothing, and no end: a connection dropped silently.
            Call("watch", "100", FakeStream([bookmark(110), modified("a", 120)], silent=True)),
            Call("watch", "120", FakeStream([modified("a", 130)], gaps=[10.0])),
        ],
        list_mode="list",
    )
    # Abandoned exactly the bound after its last line, and watched again at once (no backoff),
    # from the version of that line: the event after the silence is in the cache.
    assert run.requests() == [
        ("list_cached", None),
        ("watch", "100"),
        ("watch", "120"),
        ("watch", "130"),
    ]
    assert run.times() == [0.0, 0.0, 75.0, 85.0]
    assert run.restarts("silent") == 1
    assert run.lw.streams[0].closed
    assert run.store.get(key("a")).resource_version == "130"  # type: ignore[union-attr]
    assert run.count("retired_pod_gc_relists_total") == 0


async def test_the_stream_of_a_streaming_list_is_bounded_once_its_initial_events_end() -> None:
    run = await run_script(
        [
            Call(
                "stream",
                None,
                FakeStream(
                    [added("a", 90), bookmark(100, end=True), bookmark(105)],
                    gaps=[0.0, 0.0, 10.0],
                    silent=True,
                ),
            ),
            Call("watch", "105", FakeStream([modified("a", 110)], gaps=[1.0])),
        ],
        silence_s=20.0,
    )
    assert run.requests()[:3] == [("stream", None), ("watch", "105"), ("watch", "110")]
    assert run.times()[:3] == [0.0, 30.0, 31.0]
    assert run.restarts("silent") == 1
    assert run.reflector.sync_mode is SyncMode.STREAM  # no relist: the cache stayed synced
    assert run.handler.log == [f"add {key('a')}", "synced", f"update {key('a')}"]


async def test_a_watch_whose_lines_come_closer_than_the_bound_is_never_abandoned() -> None:
    # A bookmark every 74 s against a bound of 75 s, with events between them at the instants
    # that would defeat a deadline moved only now and then (half a bound after the last move).
    lines, gaps = [], []
    for i in range(10):
        lines += [modified("a", 200 + 2 * i), bookmark(201 + 2 * i)]
        gaps += [38.0, 36.0]
    run = await run_script(
        [
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            Call("watch", "100", FakeStream([bookmark(150), *lines], gaps=[0.0, 74.0, *gaps])),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "219")
    assert run.times()[-1] == 74.0 + 10 * 74.0  # it ended when its lines did
    assert run.restarts("silent") == 0
    assert run.restarts("closed") == 1


async def test_a_server_without_bookmarks_ends_every_short_watch_and_it_is_resumed_not_cut() -> (
    None
):
    # No bookmark ever: each watch asks for timeoutSeconds 70 (75 s bound, 5 s margin), and a
    # quiet one is ended by the server there, cleanly, never taken for dead.
    run = await run_script(
        [
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            Call("watch", "100", FakeStream([modified("a", 110)], gaps=[60.0], honours=True)),
            Call("watch", "110", FakeStream([], honours=True)),
            Call("watch", "110", FakeStream([], honours=True)),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "110")
    assert run.times() == [0.0, 0.0, 70.0, 140.0, 210.0]
    assert run.lw.timeouts == [70, 70, 70, 70]
    assert run.restarts("closed") == 3
    assert run.restarts("silent") == 0


async def test_an_initial_events_end_bookmark_alone_does_not_prove_bookmarks() -> None:
    # A server may end a streaming list with its bookmark and send no periodic ones: the stream
    # is bounded by its own end, and the next watch is as short.
    run = await run_script(
        [
            Call(
                "stream",
                None,
                FakeStream(
                    [added("a", 90), bookmark(100, end=True), modified("a", 110)],
                    gaps=[0.0, 0.0, 50.0],
                    honours=True,
                ),
            ),
        ]
    )
    assert run.requests() == [("stream", None), ("watch", "110")]
    assert run.times() == [0.0, 70.0]
    assert run.lw.timeouts == [70, 70]
    assert run.restarts("silent") == 0


async def test_a_stream_that_lives_the_bound_without_a_bookmark_disarms_it_until_the_next() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            # A bookmark proves the server sends them: the bound is silence from then on, and
            # this stream dies silently.
            Call("watch", "100", FakeStream([bookmark(110)], silent=True)),
            # A long watch, bounded by silence from its start; it sends no bookmark either: cut.
            Call("watch", "110", FakeStream([], silent=True)),
            # No bookmark for the bound: the server is no longer known to send them, so the
            # watch is short again and its server's end bounds it ...
            Call("watch", "110", FakeStream([modified("a", 120)], gaps=[60.0], honours=True)),
            # ... until a bookmark proves them again: silence bounds it from that line.
            Call("watch", "120", FakeStream([bookmark(130)], gaps=[1.0], silent=True)),
        ],
        list_mode="list",
    )
    assert run.requests()[-1] == ("watch", "130")
    assert run.times() == [0.0, 0.0, 75.0, 150.0, 220.0, 296.0]
    assert run.lw.timeouts == [70, WATCH_TIMEOUT_S, 70, 70, WATCH_TIMEOUT_S]
    assert run.restarts("silent") == 3
    assert run.restarts("closed") == 1


# ------------------------------------------------------- silence before bookmarks are proven


@pytest.mark.parametrize(
    ("silence_s", "api_timeout_s", "cap"),
    [
        (75.0, 5.0, 70),  # the margin is API_TIMEOUT_SECONDS ...
        (75.0, 10.0, 65),
        (20.0, 10.0, 15),  # ... at most a quarter of the bound
        (4.0, 2.0, 3),
    ],
)
async def test_until_bookmarks_are_proven_every_stream_asks_for_a_timeout_within_the_bound(
    silence_s: float, api_timeout_s: float, cap: int
) -> None:
    # The streaming list, the watch after it and a watch resumed after the server ended one all
    # ask for `cap` seconds; the first periodic bookmark makes the next watch long again.
    run = await run_script(
        [
            Call("stream", None, FakeStream([bookmark(100, end=True)], honours=True)),
            Call("watch", "100", FakeStream([], honours=True)),
            Call("watch", "100", FakeStream([bookmark(110)], honours=True)),
            Call("watch", "110", FakeStream([modified("a", 120)])),
        ],
        silence_s=silence_s,
        api_timeout_s=api_timeout_s,
    )
    assert run.lw.timeouts == [cap, cap, cap, WATCH_TIMEOUT_S, WATCH_TIMEOUT_S]
    assert run.times() == [0.0, cap, 2 * cap, 3 * cap, 3 * cap]
    assert run.restarts("silent") == 0


def test_the_short_timeout_and_its_margin_stay_within_the_silence_bound() -> None:
    # Over the settings' ranges (WATCH_SILENCE_SECONDS 1-3600, API_TIMEOUT_SECONDS 0.1-120):
    # a whole second at least, the margin no more than API_TIMEOUT_SECONDS, and the two within
    # the bound unless a bound under 4/3 s leaves less than a second for the timeout.
    for silence_s in (1.0, 1.3, 1.4, 2.0, 3.0, 4.0, 7.5, 60.0, 75.0, 600.0, 3600.0):
        for api_timeout_s in (0.1, 1.0, 2.0, 10.0, 120.0):
            settings = dataclasses.replace(
                DEFAULTS,
                namespaces=(NS,),
                label_selector=SANDBOX_SELECTOR,
                label_keys=LabelKeys(),
                api_timeout_s=api_timeout_s,
                watch_timeout_s=300.0,
                list_page_size=500,
                delete_grace_period_s=None,
                watch_silence_s=silence_s,
            )
            cap, margin_s = short_timeout_s(settings), end_margin_s(settings)
            assert cap >= 1
            assert 0 < margin_s <= api_timeout_s
            assert cap + margin_s <= silence_s or (cap == 1 and silence_s < 4 / 3)


async def test_a_watch_still_silent_past_its_timeout_and_the_margin_is_taken_for_dead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="service.kube.reflector")
    run = await run_script(
        [
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            # No bookmark yet; lines at 10 s and at 72 s, past its timeoutSeconds (70) but
            # within the margin (5 s): cut once silent for the margin, at 77 s.
            Call(
                "watch",
                "100",
                FakeStream(
                    [modified("a", 110), modified("a", 120)], gaps=[10.0, 62.0], silent=True
                ),
            ),
            # Dead from its start: cut at its timeoutSeconds and the margin, 75 s after it opened.
            Call("watch", "120", FakeStream([], silent=True)),
            Call("watch", "120", FakeStream([modified("a", 130)], gaps=[1.0])),
        ],
        list_mode="list",
    )
    # Restarted as for any silence: at once, from the last version, the cache kept.
    assert run.requests() == [
        ("list_cached", None),
        ("watch", "100"),
        ("watch", "120"),
        ("watch", "120"),
        ("watch", "130"),
    ]
    assert run.times() == [0.0, 0.0, 77.0, 152.0, 153.0]
    assert run.lw.timeouts == [70, 70, 70, 70]
    assert run.restarts("silent") == 2
    assert run.count("retired_pod_gc_relists_total") == 0
    assert "cold" not in run.handler.log
    assert run.store.get(key("a")).resource_version == "130"  # type: ignore[union-attr]
    lines = [r.getMessage() for r in caplog.records if "pod watch of namespace" in r.getMessage()]
    assert lines == [
        f"pod watch of namespace {NS}: no end of the stream and no line 5s past its "
        "timeoutSeconds (at most 70s), and no bookmark yet: the connection is taken for dead",
        f"pod watch of namespace {NS}: works again after 2 failures",
    ]


async def test_once_bookmarks_are_proven_the_watch_is_long_and_bounded_by_its_silence() -> None:
    run = await run_script(
        [
            Call("list_cached", None, Listing("100", [pod("a", 90)])),
            # Short (no bookmark yet); the server's bookmark at 60 s proves them, and it ends
            # the watch at 70 s.
            Call("watch", "100", FakeStream([bookmark(110)], gaps=[60.0], honours=True)),
            # Long; lines 74 s apart, past where the short one would have ended, are not cut;
            # then silence for the bound is.
            Call(
                "watch",
                "110",
                FakeStream([modified("a", 120), bookmark(130)], gaps=[74.0, 74.0], silent=True),
            ),
        ],
        list_mode="list",
    )
    assert run.requests() == [
        ("list_cached", None),
        ("watch", "100"),
        ("watch", "110"),
        ("watch", "130"),
    ]
    assert run.lw.timeouts == [70, WATCH_TIMEOUT_S, WATCH_TIMEOUT_S]
    assert run.times() == [0.0, 0.0, 70.0, 70.0 + 148.0 + 75.0]
    assert (run.restarts("closed"), run.restarts("silent")) == (1, 1)


async def test_a_silent_watch_is_logged_once_per_cause_and_once_when_a_stream_ends_well(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="service.kube.reflector")
    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            Call("watch", "100", FakeStream([bookmark(110)], silent=True)),
            Call("watch", "110", FakeStream([bookmark(120)], silent=True)),
            Call("watch", "120", FakeStream([bookmark(130)], silent=True)),
            Call("watch", "130", FakeStream([bookmark(140)])),
        ],
        list_mode="list",
    )
    assert run.restarts("silent") == 3
    lines = [r.getMessage() for r in caplog.records if "pod watch of namespace" in r.getMessage()]
    assert lines == [
        f"pod watch of namespace {NS}: no event and no bookmark for 75s: "
        "the connection is taken for dead",
        f"pod watch of namespace {NS}: works again after 3 failures",
    ]


async def test_the_backoff_after_failures_without_an_answer_ends_when_the_server_answers() -> None:
    # Watches that get no answer back off 1, 2, 4, 8, 16 s, then the cap (30 s); the server
    # answers another request (a Lease renewal) 9 s into that last wait: the watch follows then,
    # not 21 s later.
    reach = Reachability()

    async def server_back() -> None:
        await anyio.sleep(40)
        reach.answered()

    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            *[Call("watch", "100", Unavailable("no answer")) for _ in range(6)],
            Call("watch", "100", FakeStream([bookmark(110)])),
        ],
        list_mode="list",
        reachability=reach,
        meanwhile=server_back,
    )
    assert run.times() == [0, 0, 1, 3, 7, 15, 31, 40, 40]


async def test_the_backoff_after_an_answer_that_is_an_error_is_not_shortened() -> None:
    # A 500 is an answer: the server is up and refuses; other answers do not end the wait.
    reach = Reachability()

    async def answers() -> None:
        while True:
            await anyio.sleep(0.5)
            reach.answered()

    run = await run_script(
        [
            Call("list_cached", None, Listing("100")),
            *[Call("watch", "100", failed(500, "boom", None)) for _ in range(3)],
        ],
        list_mode="list",
        reachability=reach,
        meanwhile=answers,
    )
    assert run.times() == [0, 0, 1, 3, 7]
