"""A model of the API server for one namespace of pods, behind the product's real client code.

The seeds' seam is the transport's HTTP sessions (``service.kube.sessions.Sessions``):
:class:`SimSessions` takes the requests the real ``ApiTransport`` sends (method, URL,
``authorization``, JSON body, aiohttp timeouts) and answers as an aiohttp session does, with
an aiohttp-like response or stream. So everything the product does to make a request and with
its answer — the transport (request slots, 429 retries, the
re-read of the token at a 401), ``KubePodClient`` (the DELETE preconditions it builds, its
status mapping), ``ListWatch`` (the requests), the ``Reflector`` (pages, continue tokens, the
fallback, decoding raw watch lines, bookmarks, 410s, resume and relist), the ``PodStore`` and
the informer's dispatch — runs as in production (``tests/sim/outage.py`` sends its requests to
the same sessions, past the transport's policy).

:class:`ApiServer` is the server side: pods with UIDs and resourceVersions from one counter,
an event history for watches to resume from (compaction makes older versions 410 Gone), watch
streams with bookmarks and a server timeout, streaming lists (``sendInitialEvents`` and the
initial-events-end bookmark), paginated lists, DELETE with preconditions (UID and
resourceVersion; 409 on mismatch, 404 when gone) and graceful deletion (a node-bound pod is
marked terminating, then removed a moment later). A watch's connection can die silently
(:meth:`ApiServer.kill_watches`: black-holed, nothing more arrives, not even its end), and the
model records when the client last read a line from it and when it gave it up. The server
accepts the bearer tokens it issued (:meth:`ApiServer.accept_token`) and answers 401 to a
revoked one (:meth:`ApiServer.revoke_token`), recording every request's token and send time and
when the transport first read a 401 for each token (the checker's revoked-token rule).
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import aiohttp
import msgspec

from tests.chaos.model import NAMESPACE, PodShape
from tests.chaos.world import SELECTOR_LABEL, pod_status
from tests.sim.net import Call, Net

SELECTOR = f"{SELECTOR_LABEL[0]}={SELECTOR_LABEL[1]}"
_encode = msgspec.json.encode


@dataclass(slots=True)
class ServerPod:
    name: str
    uid: str
    rv: int
    labels: dict[str, str]
    shape: PodShape
    terminating: bool = False
    body: bytes = b""
    annotations: dict[str, str] | None = None


@functools.cache
def _status(shape: PodShape) -> dict[str, Any]:
    """``pod_status(shape)``, made once a process for each shape (only ever encoded, never
    changed)."""
    return pod_status(shape)


def _pod_body(pod: ServerPod) -> bytes:
    meta: dict[str, Any] = {
        "name": pod.name,
        "namespace": NAMESPACE,
        "uid": pod.uid,
        "resourceVersion": str(pod.rv),
        "creationTimestamp": "2026-01-01T00:00:00Z",
        "labels": pod.labels,
    }
    if pod.annotations is not None:
        meta["annotations"] = pod.annotations
    if pod.terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
        meta["deletionGracePeriodSeconds"] = 30
    return _encode(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"nodeName": "node-a", "terminationGracePeriodSeconds": 30},
            "status": _status(pod.shape),
        }
    )


def _status_body(code: int, reason: str, message: str) -> bytes:
    return _encode(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }
    )


class Response:
    """An aiohttp response, the parts the product reads."""

    __slots__ = ("_body", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self._body = body
        self.headers = headers or {}

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(slots=True)
class Delete:
    """A DELETE as the server received it (the checker's audit log)."""

    time: float
    """When it reached the server."""
    sent: float
    """When the client handed it to the connection (the budget's grant time)."""
    name: str
    body: dict[str, Any]
    status: int
    uid: str | None = None
    """The UID of the pod it deleted (200 only)."""
    terminating: bool = False
    """The pod it deleted (200 only) was terminating already (someone else deleted it)."""


@dataclass(slots=True)
class Get:
    time: float
    name: str
    uid: str | None
    rv: str | None


_END = object()


class WatchStream:
    """An open watch response: ``content.readline()`` gives the lines as they arrive (FIFO, each
    after a downlink latency), ``b""`` at a clean end; an abrupt end raises as aiohttp does.
    A ``dead`` stream (its connection black-holed) delivers nothing more, ever: only the
    client's own bounds end it (its read timeout, the reflector's silence bound)."""

    def __init__(self, server: ApiServer, sock_read_s: float | None) -> None:
        self.server = server
        self.net = server.net
        self.status = 200
        self.headers: dict[str, str] = {}
        self.content = self
        self.sent_rv = 0
        self._lines: deque[Any] = deque()
        self._last_at = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._sock_read_s = sock_read_s
        self.closed = False
        self.ended = False
        self.stalled = False
        self.dead = False
        self.dead_at = 0.0
        self.last_read_at = self.net.loop.time()
        """When the client last read a line (or received the stream: :meth:`received`)."""
        self.closed_at: float | None = None
        """When the client gave the stream up (``close``)."""
        self.held = False
        """Whether the client has the stream (its answer arrived before the client gave up)."""
        self.watching = True
        """Whether the stream is a watch as the client reads it: a streaming list once the
        client has read its initial-events-end bookmark (before, its own bound applies,
        ``STREAM_SYNC_TIMEOUT_SECONDS``)."""
        self._timers: list[asyncio.TimerHandle] = []

    # -- server side -----------------------------------------------------------------------

    def push(self, item: Any) -> None:
        """A line (bytes), or the end: ``_END`` (clean) or an exception (abrupt)."""
        if self.ended:
            return
        if item is _END or isinstance(item, BaseException):
            self.ended = True
        loop = self.net.loop
        at = max(self._last_at, loop.time() + self.net.latency())
        self._last_at = at
        self._lines.append((at, item))
        if not self.stalled:
            loop.call_at(at, self._wake)

    def unstall(self) -> None:
        if self.dead:
            return
        self.stalled = False
        now = self.net.loop.time()
        self._last_at = max(self._last_at, now)
        self._lines = deque((max(at, now), item) for at, item in self._lines)
        for at, _ in self._lines:
            self.net.loop.call_at(at, self._wake)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _ready(self) -> bool:
        return not self.stalled and bool(self._lines) and self._lines[0][0] <= self.net.loop.time()

    # -- the client's side (aiohttp.ClientResponse / StreamReader) --------------------------

    async def readline(self) -> bytes:
        loop = self.net.loop
        while not self._ready():
            if self.closed:
                return b""
            self._waiter = waiter = loop.create_future()
            timer = (
                loop.call_at(loop.time() + self._sock_read_s, self._read_timeout, waiter)
                if self._sock_read_s is not None
                else None
            )
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        _, item = self._lines.popleft()
        if item is _END:
            self.closed = True
            return b""
        if isinstance(item, BaseException):
            self.closed = True
            raise item
        line: bytes = item
        self.last_read_at = loop.time()
        if not self.watching and b"initial-events-end" in line:
            self.watching = True
        return line

    def received(self) -> None:
        """The client has the answer (its headers): its silence is counted from here."""
        self.held = True
        self.last_read_at = self.net.loop.time()

    def _read_timeout(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError())

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = self.net.loop.time()
        if not self.closed:
            self.closed = True
        self.server.watches.pop(self, None)
        for timer in self._timers:
            timer.cancel()
        self._wake()


class ApiServer:
    """The server side; ``watches`` are the open streams."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.trace = net.trace
        self.rv = 1000
        self.pods: dict[str, ServerPod] = {}
        self.history: list[tuple[int, bytes]] = []
        """(resourceVersion, event line) of every change, oldest first."""
        self.compacted = 0
        """Versions up to this one are gone: a watch from them gets 410."""
        self.watches: dict[WatchStream, None] = {}
        """Open streams, in the order they opened (a dict: iterated in a stable order)."""
        self.dead: list[WatchStream] = []
        """Streams whose connection died silently (:meth:`kill_watches`)."""
        self.deletes: list[Delete] = []
        self.gets: list[Get] = []
        self.syncs: list[float] = []
        """Times of every list and watch request that reached the server."""
        self._uids = 0
        self.bookmark_every_s = 3.0
        self.last_bookmark_s = 0.1
        """How long before its ``timeoutSeconds`` a watch gets its last bookmark (a
        kube-apiserver's 2 s, scaled as the interval is: 3 s for 60)."""
        self.finish_after_s = 0.2
        self.on_change: Callable[[str, ServerPod | None], None] = lambda name, pod: None
        """The world's ground-truth recorder: told every change, at the instant it happens."""
        self.expire_next = 0
        """The next N watch requests are answered 410."""
        self._snapshots: dict[int, list[bytes]] = {}
        """The pods of each list as of its resourceVersion, for its continue tokens."""
        self.fail_after_expire = 0
        """After serving the next 410, the next N list and watch requests fail (500)."""
        self.on_delete: Callable[[], object] = lambda: None
        self.tokens: set[str] = set()
        """The bearer tokens the server accepts now (``authorization`` headers); empty: any."""
        self.revoked: dict[str, float] = {}
        """Tokens the server accepted once and refuses since (401), with when."""
        self.sent: list[tuple[float, str, str]] = []
        """(when the client's transport handed it to its session, its authorization, op) of
        every request, in order."""
        self.refusals_read: dict[str, float] = {}
        """When the transport first read a 401 for each refused authorization."""

    # -- credentials -----------------------------------------------------------------------

    def accept_token(self, authorization: str) -> None:
        self.tokens.add(authorization)

    def revoke_token(self, authorization: str) -> None:
        if authorization in self.tokens:
            self.tokens.discard(authorization)
            self.revoked[authorization] = self.net.loop.time()
            self.trace(f"kube token revoked: {authorization[-8:]}")

    def refuses(self, authorization: str) -> Response | None:
        """The 401 a request with ``authorization`` gets (``None``: accepted)."""
        if not self.tokens or authorization in self.tokens:
            return None
        self.trace(f"kube 401 for {authorization[-8:]}")
        return Response(401, _status_body(401, "Unauthorized", "Unauthorized"))

    # -- changes (the driver's, the kubelet's, the service's DELETE) -----------------------

    def _emit(self, kind: str, pod: ServerPod) -> None:
        line = b'{"type":"%s","object":%s}\n' % (kind.encode(), pod.body)
        self.history.append((pod.rv, line))
        for watch in list(self.watches):
            watch.push(line)
            watch.sent_rv = pod.rv

    def _version(self, pod: ServerPod) -> None:
        self.rv += 1
        pod.rv = self.rv
        pod.body = _pod_body(pod)

    def create(
        self,
        name: str,
        labels: dict[str, str],
        shape: PodShape,
        annotations: dict[str, str] | None = None,
    ) -> ServerPod:
        assert name not in self.pods, name
        self._uids += 1
        pod = ServerPod(name, f"uid-{self._uids:04d}", 0, labels, shape, annotations=annotations)
        self._version(pod)
        self.pods[name] = pod
        self.trace(f"kube create {name} {pod.uid} rv={pod.rv} {shape}")
        self.on_change(name, pod)
        self._emit("ADDED", pod)
        return pod

    def set_shape(self, name: str, shape: PodShape) -> ServerPod:
        pod = self.pods[name]
        pod.shape = shape
        self._version(pod)
        self.trace(f"kube update {name} rv={pod.rv} {shape}")
        self.on_change(name, pod)
        self._emit("MODIFIED", pod)
        return pod

    def set_annotations(self, name: str, annotations: dict[str, str] | None) -> ServerPod:
        pod = self.pods[name]
        pod.annotations = annotations
        self._version(pod)
        self.trace(f"kube update {name} rv={pod.rv} annotations={annotations}")
        self.on_change(name, pod)
        self._emit("MODIFIED", pod)
        return pod

    def delete_by_others(self, name: str, grace_s: float) -> None:
        """Someone else deletes the pod gracefully: it is terminating (``deletionTimestamp``
        set) for ``grace_s``, then gone."""
        pod = self.pods.get(name)
        if pod is not None and not pod.terminating:
            self.trace(f"kube DELETE {name} by others, grace {grace_s:.3f}s")
            self._terminate(pod, grace_s)

    def remove(self, name: str) -> None:
        """The object is gone (grace period over, or deleted with grace 0)."""
        pod = self.pods.pop(name)
        self._version(pod)
        self.trace(f"kube gone {name} {pod.uid} rv={pod.rv}")
        self.on_change(name, None)
        self._emit("DELETED", pod)

    def _terminate(self, pod: ServerPod, grace_s: float | None = None) -> None:
        pod.terminating = True
        self._version(pod)
        self.on_change(pod.name, pod)
        self._emit("MODIFIED", pod)
        uid = pod.uid
        self.net.at(
            self.finish_after_s if grace_s is None else grace_s, self._finish, pod.name, uid
        )

    def _finish(self, name: str, uid: str) -> None:
        pod = self.pods.get(name)
        if pod is not None and pod.uid == uid:
            self.remove(name)

    def finish_terminating(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is not None and pod.terminating:
            self.remove(name)

    def compact(self) -> None:
        self.compacted = self.rv
        self.history.clear()
        self.trace(f"kube compact at {self.rv}")

    def drop_watches(self, *, abrupt: bool) -> None:
        for watch in list(self.watches):
            watch.push(aiohttp.ClientPayloadError("connection reset") if abrupt else _END)
            self.watches.pop(watch, None)
        self.trace(f"kube drop watches abrupt={abrupt}")

    def kill_watches(self) -> list[WatchStream]:
        """The connections of the open streams the client holds die silently (a black hole: no
        reset, no bytes, not even the server's end of the stream), whether or not the client has
        read a bookmark from them: the silence bound holds from a stream's first second
        (docs/architecture.md, "A silent watch"). Not a stream whose answer is still on its way,
        or came after the client gave the request up (the client never reads it), nor a
        streaming list still in its initial events (bounded by ``STREAM_SYNC_TIMEOUT_SECONDS``,
        not by the watch's bound)."""
        killed = [w for w in self.watches if w.held and w.watching and not w.ended and not w.closed]
        now = self.net.loop.time()
        for watch in killed:
            watch.dead = True
            watch.stalled = True
            watch.dead_at = now
            self.watches.pop(watch, None)
            self.dead.append(watch)
            self.trace(f"kube watch dies silently, last line read at {watch.last_read_at:.6f}")
        return killed

    def stall_watches(self) -> list[WatchStream]:
        stalled = list(self.watches)
        for watch in stalled:
            watch.stalled = True
        return stalled

    # -- requests --------------------------------------------------------------------------

    def get(self, name: str) -> Response:
        pod = self.pods.get(name)
        self.gets.append(
            Get(self.net.loop.time(), name, pod.uid if pod else None, str(pod.rv) if pod else None)
        )
        self.trace(f"kube GET {name} -> {pod.rv if pod else 404}")
        if pod is None:
            return Response(404, _status_body(404, "NotFound", f'pods "{name}" not found'))
        return Response(200, pod.body)

    def delete(self, name: str, body: dict[str, Any], sent: float) -> Response:
        pod = self.pods.get(name)
        now = self.net.loop.time()
        pre = body.get("preconditions") or {}
        status = 200
        if pod is None:
            status = 404
        elif ("uid" in pre and pre["uid"] != pod.uid) or (
            "resourceVersion" in pre and pre["resourceVersion"] != str(pod.rv)
        ):
            status = 409
        record = Delete(now, sent, name, body, status)
        self.deletes.append(record)
        self.trace(f"kube DELETE {name} pre={pre} -> {status}")
        if status == 404:
            return Response(404, _status_body(404, "NotFound", f'pods "{name}" not found'))
        assert pod is not None
        if status == 409:
            return Response(
                409,
                _status_body(409, "Conflict", "Precondition failed: UID or resourceVersion"),
            )
        record.uid = pod.uid
        record.terminating = pod.terminating
        self.on_delete()
        if pod.terminating:
            return Response(200, pod.body)
        if body.get("gracePeriodSeconds") == 0:
            self.remove(name)
        else:
            self._terminate(pod)  # the kubelet finishes it a moment later
        return Response(200, pod.body)

    def list_page(
        self, limit: int | None, token: str | None, version: str | None, match: str | None
    ) -> Response:
        self.syncs.append(self.net.loop.time())
        self.trace(f"kube LIST limit={limit} continue={token} rv={version} {match}")
        if token:
            at_rv, offset = (int(x) for x in token.split(":"))
            bodies = self._snapshots.get(at_rv)
            if at_rv < self.compacted or bodies is None:
                # The list's version was compacted away (a list at the compacted version
                # itself is still served: compaction removes what came before it).
                return Response(410, _status_body(410, "Expired", "continue token expired"))
        else:
            if match == "NotOlderThan" and version and int(version) > self.rv:
                return Response(504, _status_body(504, "Timeout", "Too large resource version"))
            at_rv, offset = self.rv, 0
            # Every page of one list is served from the state at its resourceVersion, as the
            # continue token pins it.
            bodies = self._snapshots[at_rv] = [self.pods[n].body for n in sorted(self.pods)]
        end = len(bodies) if not limit else offset + limit
        items = b",".join(bodies[offset:end])
        cont = f"{at_rv}:{end}" if end < len(bodies) else ""
        meta = b'{"resourceVersion":"%d","continue":"%s"}' % (at_rv, cont.encode())
        return Response(200, b'{"kind":"PodList","metadata":%s,"items":[%s]}' % (meta, items))

    def open_watch(
        self,
        *,
        version: str | None,
        initial: bool,
        timeout_s: float,
        sock_read_s: float | None,
    ) -> Response | WatchStream:
        self.syncs.append(self.net.loop.time())
        self.trace(f"kube WATCH rv={version} initial={initial}")
        if self.expire_next > 0:
            self.expire_next -= 1
            if self.fail_after_expire:
                self.net.arm("watch", _Fault(status=500), self.fail_after_expire)
                self.net.arm("list", _Fault(status=500), self.fail_after_expire)
                self.fail_after_expire = 0
            return Response(410, _status_body(410, "Expired", "too old resource version"))
        stream = WatchStream(self, sock_read_s)
        stream.watching = not initial
        if initial:
            for name in sorted(self.pods):
                pod = self.pods[name]
                stream.push(b'{"type":"ADDED","object":%s}\n' % pod.body)
            stream.push(
                b'{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":'
                b'{"resourceVersion":"%d","annotations":{"k8s.io/initial-events-end":"true"}}}}\n'
                % self.rv
            )
        else:
            since = int(version or 0)
            if since < self.compacted:
                if self.net.rng.random() < 0.5:
                    return Response(410, _status_body(410, "Expired", "too old resource version"))
                stream.push(
                    b'{"type":"ERROR","object":%s}\n'
                    % _status_body(410, "Expired", "too old resource version")
                )
                stream.push(_END)
                return stream
            for rv, line in self.history:
                if rv > since:
                    stream.push(line)
        stream.sent_rv = self.rv
        self.watches[stream] = None
        loop = self.net.loop
        now = loop.time()
        stream._timers.append(loop.call_at(now + timeout_s, self._expire, stream))
        # Bookmarks as a kube-apiserver sends them: every interval until the last one, shortly
        # before the watch's end.
        last = now + timeout_s - self.last_bookmark_s
        if last > now:
            stream._timers.append(loop.call_at(last, self._bookmark, stream, None))
        if now + self.bookmark_every_s < last:
            stream._timers.append(
                loop.call_at(now + self.bookmark_every_s, self._bookmark, stream, last)
            )
        return stream

    def _expire(self, stream: WatchStream) -> None:
        if stream in self.watches:
            self.watches.pop(stream, None)
            stream.push(_END)

    def _bookmark(self, stream: WatchStream, last: float | None) -> None:
        """A bookmark; the next periodic one, if it comes before ``last`` (``None``: this is
        the last one)."""
        if stream in self.watches:
            stream.push(
                b'{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":'
                b'{"resourceVersion":"%d"}}}\n' % self.rv
            )
            loop = self.net.loop
            at = loop.time() + self.bookmark_every_s
            if last is not None and at < last:
                stream._timers.append(loop.call_at(at, self._bookmark, stream, last))


@dataclass
class _Fault:
    status: int = 0
    """An HTTP status to answer with (0: none)."""
    reset: bool = False
    """The connection drops: no answer."""
    slow_s: float = 0.0
    retry_after: str | None = None


@dataclass
class KubeFaults:
    """Per-op injected answers consumed by the next calls (``op``: get, delete, list, watch)."""

    armed: dict[str, list[_Fault]] = field(default_factory=dict)


class _Wire:
    """A request's way to :class:`ApiServer` and back: latencies, and faults on the way."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.net = server.net

    def _fault(self, op: str) -> _Fault | None:
        net = self.net
        armed = net.take_armed(op)
        if armed is not None:
            fault: _Fault = armed
            return fault
        if net.fails():
            rng = net.rng
            r = rng.random()
            if r < 0.4:
                return _Fault(reset=True)
            if r < 0.7:
                return _Fault(status=500)
            if r < 0.85:
                return _Fault(status=429, retry_after="1")
            return _Fault(slow_s=rng.uniform(0.5, 3.0))
        return None

    async def _call(
        self, op: str, timeout: aiohttp.ClientTimeout | None, handler: Callable[[], Any]
    ) -> Any:
        net = self.net
        fault = self._fault(op)
        total = timeout.total if timeout is not None else None
        call = Call(net, total)
        up = net.latency() + (fault.slow_s if fault else 0.0)

        def arrive() -> None:
            if fault is not None and fault.reset:
                net.trace(f"kube {op} reset")
                call.fail(aiohttp.ClientConnectionError("Connection reset by peer"), 0.0)
                return
            if fault is not None and fault.status:
                net.trace(f"kube {op} fault {fault.status}")
                headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
                call.answer(
                    Response(fault.status, _status_body(fault.status, "Fault", "injected"), headers)
                )
                return
            call.answer(handler())

        net.at(up, arrive)
        return await call.wait()


_PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"


class SimSessions(_Wire):
    """``service.kube.sessions.Sessions`` on :class:`ApiServer`: the HTTP requests of the real
    ``ApiTransport`` (its 401 re-read, 429 retries, pool replacement, request
    slots) answered by the model, as an aiohttp session answers them (the response headers, then
    the body or the stream). The request is decoded as the server decodes it: method, path,
    query, the ``authorization`` header (:meth:`ApiServer.refuses`), the JSON body."""

    def pool(self) -> SimSessions:
        return self

    def watches(self) -> SimSessions:
        return self

    async def close(self) -> None:
        pass

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str],
        data: Any = None,
        timeout: aiohttp.ClientTimeout,
        **_: Any,
    ) -> Any:
        server = self.server
        sent = self.net.loop.time()
        split = urlsplit(url)
        query = dict(parse_qsl(split.query))
        path = split.path
        authorization = headers.get("authorization", "")
        if path == _PODS_PATH:
            assert method == "GET" and query.get("labelSelector") == SELECTOR, (method, query)
            if query.get("watch", "").lower() == "true":
                op = "watch"
                call_timeout = aiohttp.ClientTimeout(total=timeout.connect)

                def serve() -> Any:
                    return server.open_watch(
                        version=query.get("resourceVersion"),
                        initial=query.get("sendInitialEvents", "").lower() == "true",
                        timeout_s=float(query.get("timeoutSeconds") or 300),
                        sock_read_s=timeout.sock_read,
                    )

            else:
                op, call_timeout = "list", timeout
                limit = query.get("limit")

                def serve() -> Any:
                    return server.list_page(
                        int(limit) if limit else None,
                        query.get("continue"),
                        query.get("resourceVersion"),
                        query.get("resourceVersionMatch"),
                    )

        else:
            assert path.startswith(_PODS_PATH + "/"), path
            name = path[len(_PODS_PATH) + 1 :]
            call_timeout = timeout
            if method == "GET":
                op = "get"

                def serve() -> Any:
                    return server.get(name)

            else:
                assert method == "DELETE", method
                op = "delete"
                body = msgspec.json.decode(data) if data else {}

                def serve() -> Any:
                    return server.delete(name, body, sent)

        server.sent.append((sent, authorization, op))

        def handler() -> Any:
            return server.refuses(authorization) or serve()

        response = await self._call(op, call_timeout, handler)
        if isinstance(response, WatchStream):
            response.received()
        if response.status == 401:
            server.refusals_read.setdefault(authorization, self.net.loop.time())
        return response
