"""A ten-minute outage of the database or of the API server, on virtual time, and the log it costs.

The whole service as ``service.app.service.build`` and ``run`` wire it — the informer, the
listener, the store, the engine, and also the leader elector and the Event writer, which the
seeds of the simulator leave out — runs on the simulator's models (``tests/sim``) with its
default settings but a faster delete budget. A cache of :data:`PODS` pods is synced, each pod
reapable; shortly before they fall due (``THRESHOLD_SECONDS`` after they were first observed)
the database or the API server goes away for :data:`OUTAGE_S`, then comes back, and every pod
must then be deleted. Every record the ``service`` loggers make at the default level is kept as
the product's JSON logging prints it (``service.logs.JsonFormatter``), with its virtual time.

The outage is total: a database whose every backend is gone and whose connections are refused
(``Database.restart``), or an API server whose connections are refused (its open watches reset)
or black-holed (no answer ever comes back: every call, the open watches included, waits out its
timeout). Nothing is drawn at random but the product's own choices (backoff jitter), from a
fixed seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio
import msgspec
from kubernetes_asyncio import client as k8s_client

from service.app.service import wire_engine
from service.config import PREFIX, Settings, load
from service.engine.activation import Activation
from service.engine.gates import dependency_backoff
from service.kit.backoff import Backoff
from service.kube import informer as informer_module
from service.kube.errors import parse_retry_after
from service.kube.events import KubeEventRecorder
from service.kube.informer import MultiNamespaceInformer, PodInformer
from service.kube.leaderelection import LeaderElector
from service.kube.listwatch import ListWatch
from service.kube.transport import ApiTransport
from service.logs import JsonFormatter
from service.metrics import KubeMetrics, Metrics
from service.pg import listener as listener_module
from service.pg.listener import RetirementListener
from service.pg.store import PgExecutionStore
from tests.chaos.model import NAMESPACE, PodShape, RowTruth
from tests.chaos.world import SELECTOR_LABEL
from tests.sim.engine import PROBE_CHANNEL, environment
from tests.sim.kube import ApiServer, Response, SimSessions, _Fault
from tests.sim.loop import VirtualLoop
from tests.sim.net import Call, Net, Trace
from tests.sim.pg import Asyncpg, Database, ListenConn, Pool, PoolConn

PODS = 11_500
"""Pods made: a few hundred are deleted before the outage, 10,000 or more are left."""
WHATS = ("database", "database_blackhole", "api", "api_blackhole")
OUTAGE_S = 600.0
THRESHOLD_S = 300.0
"""``THRESHOLD_SECONDS``'s default."""
INTO_S = 5.0
"""The outage starts this long after the pods fell due: deletes and their Events are under way
(a few hundred at the budget's pace), every other pod is being verified or waits its turn."""
PROBE_EVERY_S = 10.0
"""How often readiness is asked (a kubelet's default ``periodSeconds``), which pings the
database."""
REAPED_LOGGER = "service.engine.reaped"
"""The logger of the deletes' summary lines (one an interval, ``service/engine/reaped.py``): the
record of the work, not a line about the outage."""


def settings() -> Settings:
    """The defaults, but for what has no default and a delete budget that deletes the pods in
    100 s of virtual time (it is the CPU a run takes, not the virtual time)."""
    env = {
        "ENABLED": "true",
        "DRY_RUN": "false",
        "NAMESPACE": NAMESPACE,
        "DELETES_PER_MINUTE": "6000",
        "DATABASE_URL": "postgresql://sim@127.0.0.1:1/sim",
        "METRICS_BIND_ADDRESS": "127.0.0.1:0",
        "LEASE_NAMESPACE": NAMESPACE,
        "LEADER_IDENTITY": "replica-a",
    }
    return load({PREFIX + k: v for k, v in env.items()})


# -- the API server's state of being down -----------------------------------------------------


class Outage:
    """Whether the API server answers: ``""`` it does, ``"refused"`` every connection is refused,
    ``"blackhole"`` nothing ever comes back."""

    def __init__(self) -> None:
        self.api = ""
        self.attempts: Counter[str] = Counter()
        """Requests sent to the server while it is down, by what sent them."""

    def fail(self, net: Net, call: Call, what: str) -> bool:
        """Fail ``call`` (a request of ``what``) as the outage does; ``False`` when the server
        is up."""
        if self.api:
            self.attempts[what] += 1
        if self.api == "refused":
            call.fail(
                aiohttp.ClientConnectionError(
                    "Cannot connect to host 10.96.0.1:443 ssl:default [Connection refused]"
                )
            )
            return True
        if self.api == "blackhole":
            call.hang()
            return True
        return False


class DownableSessions(SimSessions):
    """The simulator's pod requests with the API server's outage in front of them."""

    def __init__(self, server: ApiServer, outage: Outage) -> None:
        super().__init__(server)
        self.outage = outage

    def _fault(self, op: str) -> _Fault | None:
        return None

    async def _call(
        self, op: str, timeout: aiohttp.ClientTimeout | None, handler: Callable[[], Any]
    ) -> Any:
        if not self.outage.api:
            return await super()._call(op, timeout, handler)
        net = self.net
        call = Call(net, timeout.total if timeout is not None else None)
        self.outage.fail(net, call, op)
        return await call.wait()


@dataclass
class Leases:
    """The Lease API as the elector calls it, on the same server."""

    net: Net
    outage: Outage
    leases: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    rv: int = 0

    async def request(self, method: str, path: str, body: Any, timeout_s: float | None) -> Response:
        call = Call(self.net, timeout_s)
        if not self.outage.fail(self.net, call, "lease"):
            self.net.at(self.net.latency(), lambda: call.answer(self._serve(path, method, body)))
        result: Response = await call.wait()
        return result

    def _serve(self, path: str, method: str, body: Any) -> Response:
        if method == "POST":
            name = body["metadata"]["name"]
            path = f"{path}/{name}"
            if path in self.leases:
                return Response(409, b"{}")
            return self._store(path, body, 201)
        current = self.leases.get(path)
        if method == "GET":
            if current is None:
                return Response(404, b'{"kind":"Status","code":404}')
            return Response(200, msgspec.json.encode(current[1]))
        assert method == "PUT", method
        if current is None:
            return Response(404, b"{}")
        if body["metadata"].get("resourceVersion") != str(current[0]):
            return Response(409, b"{}")
        return self._store(path, body, 200)

    def _store(self, path: str, body: Any, status: int) -> Response:
        self.rv += 1
        lease = json.loads(json.dumps(body))
        lease["metadata"]["resourceVersion"] = str(self.rv)
        self.leases[path] = (self.rv, lease)
        return Response(status, msgspec.json.encode(lease))


@dataclass
class Events:
    """The creation of Events, on the same server."""

    net: Net
    outage: Outage
    created: int = 0

    async def create(self, timeout_s: float | None) -> Response:
        call = Call(self.net, timeout_s)
        if not self.outage.fail(self.net, call, "event"):
            self.net.at(self.net.latency(), self._create, call)
        result: Response = await call.wait()
        return result

    def _create(self, call: Call) -> None:
        self.created += 1
        call.answer(Response(201, b"{}"))


class ProbedDatabase(Database):
    """The database model, answering the readiness ping (``SELECT 1``) too, and able to be
    black-holed: nothing sent to it is answered, no connection opens, and no connection learns
    that its backend is gone until the network is back (its reset arrives then)."""

    def __init__(self, net: Net) -> None:
        super().__init__(net)
        self.blackholed = False
        self._cut: list[Any] = []
        self.attempts: Counter[str] = Counter()
        """Statements (each a pooled connection's acquire) and listener connects sent to the
        database while it is down."""

    @property
    def down(self) -> bool:
        return self.blackholed or self.net.loop.time() < self.down_until

    def run(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if sql == "SELECT 1":
            return [(1,)]
        return super().run(sql, args)

    def blackhole(self) -> None:
        self.blackholed = True
        for conn in list(self.conns):
            # The backend is gone (say the server was restarted behind the partition), and the
            # client is not told: its requests wait out their timeouts.
            conn.server_closed = True
            self.conns.pop(conn, None)
            if isinstance(conn, ListenConn):
                conn.stalled = True
                self.listening.pop(conn, None)
            self._cut.append(conn)

    def heal(self) -> None:
        self.blackholed = False
        for conn in self._cut:
            conn._reset_reaches_client()
        self._cut.clear()

    async def hang_if_blackholed(self, timeout_s: float | None) -> None:
        if self.blackholed:
            call = Call(self.net, timeout_s)
            call.hang()
            await call.wait()


class _Pool(Pool):
    db: ProbedDatabase

    async def acquire(self) -> PoolConn:
        if self.db.down:
            self.db.attempts["statement"] += 1
        await self.db.hang_if_blackholed(None)
        return await super().acquire()


class _Asyncpg(Asyncpg):
    db: ProbedDatabase

    async def connect(self, dsn: str, *, timeout: float | None = None, **kw: Any) -> ListenConn:
        if self.db.down:
            self.db.attempts["listener_connect"] += 1
        await self.db.hang_if_blackholed(timeout)
        return await super().connect(dsn, timeout=timeout, **kw)

    async def create_pool(self, dsn: str | None, **_: Any) -> Pool:
        return _Pool(self.db)


# -- the service ------------------------------------------------------------------------------


class OutageTransport(ApiTransport):
    """The ``ApiTransport`` the adapters are built with: each request goes through its request
    path (judged, counted, failures turned into kit errors) but is sent straight to the models,
    without the transport's own policy (request slots, 429 retries, the re-read of a token, pool
    replacement: the seeds exercise those, ``tests/sim/kube.py``)."""

    def __init__(
        self, pods: DownableSessions, leases: Leases, events: Events, metrics: KubeMetrics
    ) -> None:
        configuration = k8s_client.Configuration()
        configuration.host = "https://10.96.0.1:443"
        super().__init__(configuration, pool_size=32, metrics=metrics, sessions=pods)
        self._pods = pods
        self._leases = leases
        self._events = events

    def slot(self) -> AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def _exchange(self, method: str, url: str, *parts: Any, watch: bool) -> Any:
        headers, data, timeouts = parts
        path = urlsplit(url).path
        if "/leases" in path:
            body = json.loads(data) if data else None
            response = await self._leases.request(method, path, body, timeouts.total)
        elif path.endswith("/events"):
            response = await self._events.create(timeouts.total)
        else:
            response = await self._pods.request(
                method, url, headers=headers, data=data, timeout=timeouts
            )
        return response, parse_retry_after(response.headers.get("Retry-After"))


@dataclass
class Service:
    settings: Settings
    metrics: Metrics
    store: PgExecutionStore
    informer: MultiNamespaceInformer
    listener: RetirementListener
    elector: LeaderElector
    recorder: KubeEventRecorder
    controller: Any


def build(
    s: Settings, *, pods: DownableSessions, leases: Leases, events: Events, rng: random.Random
) -> Service:
    """``service.app.service.build`` on the models (its engine by the same ``wire_engine``)."""
    from service.app.service import new_pod_client, new_store  # noqa: PLC0415

    metrics = Metrics()
    api = OutageTransport(pods, leases, events, metrics.kube)
    store = new_store(s, metrics.pg)

    def namespace_informer(namespace: str) -> PodInformer:
        lw = ListWatch(
            api,
            settings=s.kube,
            metrics=metrics.kube,
            namespace=namespace,
            rng=random.Random(rng.random()),
        )
        return PodInformer(
            lw,
            settings=s.kube,
            metrics=metrics.kube,
            backoff=_seeded(informer_module.default_backoff(), rng),
        )

    informer = MultiNamespaceInformer(s.kube.namespaces, namespace_informer)
    pods = new_pod_client(s, api, metrics.kube)
    elector = LeaderElector(
        api,
        settings=s.leader,
        namespace=NAMESPACE,
        metrics=metrics.kube,
        request_timeout_s=s.kube.api_timeout_s,
    )
    listener = RetirementListener(
        s.database,
        metrics=metrics.pg,
        probe=store.notify,
        backoff=_seeded(listener_module.default_backoff(), rng),
        namespaces=s.kube.namespaces,
        probe_channel=PROBE_CHANNEL,
    )
    recorder = KubeEventRecorder(
        api,
        instance=s.leader.identity,
        metrics=metrics.kube,
        timeout_s=s.kube.api_timeout_s,
        deletes_per_minute=s.deletes_per_minute,
    )
    from service.app.service import default_queue_backoff  # noqa: PLC0415

    engine = wire_engine(
        s,
        informer=informer,
        pods=pods,
        store=store,
        listener=listener,
        activation=Activation(enabled=s.enabled, leader_check=elector.is_leader),
        recorder=recorder,
        metrics=metrics,
        queue_backoff=_seeded(default_queue_backoff(), rng),
        gate_backoff=_seeded(dependency_backoff(), rng),
    )
    elector.add_handler(engine.controller.set_leader)
    return Service(s, metrics, store, informer, listener, elector, recorder, engine.controller)


def _seeded(policy: Backoff, rng: random.Random) -> Backoff:
    policy.rng = random.Random(rng.random())
    return policy


async def run(service: Service, *, stop: anyio.Event) -> None:
    """As ``service.app.service.run`` (without the HTTP server and the watchdog: readiness is
    asked by :func:`probe_readiness`)."""
    s = service.settings
    await service.store.start()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(service.informer.run)
            await tg.start(service.recorder.run)
            tg.start_soon(service.listener.run)
            await tg.start(service.controller.run_workers, s.workers)
            await tg.start(service.controller.run_resync, s.resync_period_s)
            await tg.start(service.controller.reaped.run)
            await tg.start(service.elector.run)
            tg.start_soon(probe_readiness, service)
            await stop.wait()
            await service.controller.stop(s.shutdown_timeout_s)
            await service.recorder.flush()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await service.store.aclose()


async def probe_readiness(service: Service) -> None:
    """What the kubelet's readiness probe makes the service do: ping the database."""
    while True:
        await service.store.ping()
        await anyio.sleep(PROBE_EVERY_S)


# -- one run ----------------------------------------------------------------------------------


@dataclass
class Line:
    at: float
    """Virtual seconds since the outage began."""
    record: logging.LogRecord
    json: str

    @property
    def text(self) -> str:
        return f"{self.at:8.1f} {self.json}"


@dataclass
class Result:
    lines: list[Line]
    """Every line from the outage's start on, but the deletes' summary lines."""
    summary_lines: int
    """Summary lines of the deletes (one an interval) from the outage's start to its end."""
    summarised: int
    """Deletes those summary lines name, the shutdown's summary included."""
    samples: dict[str, float]
    """Every metric sample after the shutdown (read on the loop: some read its clock), by name
    and labels."""
    deleted: int
    """Pods the API server deleted."""
    events: int
    outage_end: float
    """Virtual seconds from the outage's start to the end of the run."""
    candidates: int
    """Pods cached (none deleted yet) when the outage began."""
    attempts: dict[str, int]
    """Requests sent to the dependency that was down while it was, by what sent them (the
    database: ``statement``, ``listener_connect``; the API server: the operation)."""


class _Tap(logging.Handler):
    def __init__(self, loop: VirtualLoop, out: list[tuple[float, logging.LogRecord, str]]) -> None:
        super().__init__(logging.INFO)
        self.loop = loop
        self.out = out
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append((self.loop.time(), record, self.format(record)))


def run_outage(what: str, *, pods: int = PODS, seed: int = 1) -> Result:
    """``what``: ``database`` or ``api`` (refused), or ``database_blackhole`` or
    ``api_blackhole``."""
    loop = VirtualLoop(random.Random(f"{seed}:loop"), hold_p=0.0, permute=False)
    trace = _NoTrace(loop)
    net = Net(loop, random.Random(f"{seed}:net"), trace)
    server = ApiServer(net)
    server.bookmark_every_s = 60.0
    db = ProbedDatabase(net)
    outage = Outage()
    s = settings()
    db.channel = s.database.notify_channel
    for i in range(pods):
        name = f"space-sbx-{i}-g1"
        db.commit({name: RowTruth(str(i), 1, "create", "stopped", False, True)}, silent=True)
        labels = {
            SELECTOR_LABEL[0]: SELECTOR_LABEL[1],
            "space.sandbox-id": str(i),
            "space.generation": "1",
            "space.pod-kind": "create",
        }
        server.create(name, labels, PodShape.SUCCEEDED)
    leases = Leases(net, outage)
    events = Events(net, outage)
    records: list[tuple[float, logging.LogRecord, str]] = []
    tap = _Tap(loop, records)
    root = logging.getLogger("service")
    saved_level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(tap)
    started = 0.0
    ended = 0.0
    candidates = 0
    samples: dict[str, float] = {}

    def deleted() -> int:
        return sum(1 for d in server.deletes if d.status == 200)

    async def main() -> None:
        nonlocal started, ended, candidates
        service = build(
            s,
            pods=DownableSessions(server, outage),
            leases=leases,
            events=events,
            rng=random.Random(f"{seed}:service"),
        )
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(run, service, stop=stop))
            await asyncio.sleep(THRESHOLD_S + INTO_S)
            candidates = len(service.informer)
            started = loop.time()
            if what == "database":
                db.restart(OUTAGE_S)
            elif what == "database_blackhole":
                db.blackhole()
            else:
                outage.api = "refused" if what == "api" else "blackhole"
                if what == "api":
                    server.drop_watches(abrupt=True)
                else:
                    server.stall_watches()
            await asyncio.sleep(OUTAGE_S)
            outage.api = ""
            if db.blackholed:
                db.heal()
            for watch in list(server.watches):
                watch.unstall()
            # Back: every pod is deleted (the budget's 100/s), each Event written.
            until = loop.time() + 4 * THRESHOLD_S
            while (deleted() < pods or events.created < pods) and loop.time() < until:
                await asyncio.sleep(5)
            ended = loop.time()
            stop.set()
        samples.update(
            (sample.name + json.dumps(sample.labels, sort_keys=True), sample.value)
            for family in service.metrics.registry.collect()
            for sample in family.samples
        )

    try:
        with environment(_Asyncpg(db)):
            try:
                loop.run_until_complete(main())
            finally:
                loop.finish_tasks()
    finally:
        loop.close_quietly()
        root.removeHandler(tap)
        root.setLevel(saved_level)
    kept = [Line(at - started, r, text) for at, r, text in records if started <= at < ended]
    return Result(
        lines=[line for line in kept if line.record.name != REAPED_LOGGER],
        summary_lines=sum(1 for line in kept if line.record.name == REAPED_LOGGER),
        # From the outage's start to the shutdown's summary of what no interval summarised yet.
        summarised=sum(
            int(getattr(r, "reaped", 0))
            for at, r, _ in records
            if at >= started and r.name == REAPED_LOGGER
        ),
        samples=samples,
        deleted=deleted(),
        events=events.created,
        outage_end=ended - started,
        candidates=candidates,
        attempts=dict(db.attempts if what.startswith("database") else outage.attempts),
    )


class _NoTrace(Trace):
    """The models' trace is not kept (nothing replays these runs; 10,000 pods make it large)."""

    __slots__ = ()

    def __call__(self, line: str) -> None:
        pass


def summary(what: str, result: Result, pods: int) -> dict[str, Any]:
    """What a run showed, as JSON (``--json``): every line, every metric sample, the counts."""
    return {
        "what": what,
        "pods": pods,
        "candidates": result.candidates,
        "deleted": result.deleted,
        "summary_lines": result.summary_lines,
        "summarised": result.summarised,
        "outage_end": result.outage_end,
        "events": result.events,
        "attempts": result.attempts,
        "lines": [
            {
                "at": round(line.at, 3),
                "level": line.record.levelname.lower(),
                "logger": line.record.name,
                "template": str(line.record.msg),
                "failing": getattr(line.record, "failing", None),
                "cause": getattr(line.record, "cause", None),
                "failures": getattr(line.record, "failures", None),
                "json": line.json,
            }
            for line in result.lines
        ],
        "metrics": result.samples,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.sim.outage [--json] [--pods N] WHAT``: the lines of one outage."""
    import argparse  # noqa: PLC0415
    import time  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m tests.sim.outage", description=__doc__)
    parser.add_argument("what", choices=WHATS)
    parser.add_argument("--pods", type=int, default=PODS)
    parser.add_argument("--json", action="store_true", help="one JSON document (the test's)")
    args = parser.parse_args(argv)
    began = time.process_time()
    result = run_outage(args.what, pods=args.pods)
    if args.json:
        print(json.dumps(summary(args.what, result, args.pods)))
        return 0
    for line in result.lines:
        print(line.text)
    print(
        f"{args.what}: {len(result.lines)} lines, {result.deleted} of {args.pods} deleted "
        f"({result.summary_lines} delete summary lines naming {result.summarised} deletes; "
        f"{result.candidates} candidates cached when "
        f"it began), {result.events} Events, {result.outage_end:.0f} virtual s, "
        f"{sum(result.attempts.values())} attempts on the dependency while down "
        f"{json.dumps(result.attempts, sort_keys=True)}, "
        f"{time.process_time() - began:.1f} s CPU"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
