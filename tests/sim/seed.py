"""One simulated seed: draw everything from the seed, run the real service on the models, judge.

Everything a seed does is drawn from the seed up front or in order while it runs, each from its
own stream (so that shrinking the schedule leaves the other streams as they were): the
service's configuration variant, the schedule of steps, the latencies and faults of every call,
the loop's scheduling choices, the product's own random choices. The trace (every model event
with its virtual time) is hashed; the same seed gives the same hash.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import random
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from service.config import PREFIX, Settings, load
from service.domain import split_key
from service.metrics import Metrics
from tests.chaos.checker import RECONNECT_CAP_S
from tests.chaos.model import NAMESPACE
from tests.chaos.schedule import Step, seed_mode
from tests.sim.checker import Checker, Violation
from tests.sim.engine import Service, build, environment, new_api, run
from tests.sim.loop import VirtualLoop
from tests.sim.net import Net, Trace
from tests.sim.pg import Asyncpg
from tests.sim.world import World, make_schedule

THRESHOLD_S = 1.0
WATCH_SILENCE_S = 4.0
"""Above the model's bookmark interval (3 s), below its watch's read timeout, which alone would
end a dead stream without the bound: timeoutSeconds 5 to 5.5 s once bookmarks are known, 3 s
before (the bound less its margin, a quarter of it), + API_TIMEOUT_SECONDS 2 s."""
RECOVERY_BOUND_S = 8.0
"""As the campaign's (tests/chaos/schedule.py): a key's requeue backoff, a sync, first checks."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    steps: int = 12
    sandboxes: int = 5


@dataclass(frozen=True, slots=True)
class Variant:
    """The service's configuration and the fault profile of one seed."""

    mode: str
    list_mode: str
    deletes_per_minute: int
    workers: int
    reconcile_timeout_s: float
    resync_s: float
    heartbeat_s: float
    p_fail: float
    p_slow: float
    hold_p: float
    batch_rows: int
    """At most this many pod names in one of the trigger's payloads (``tests/sim/pg.py``,
    ``Database.batch_rows``): 1, a payload a change; 3 or 100, a commit's changes grouped."""
    pooler: str
    """The listener behind a transaction-mode pooler, which drops notifications
    (``tests/sim/pg.py``, ``ListenConn.drops``; :meth:`World.pooler_fault`): "" never;
    "connection" the listening connection starts dropping them at an instant of the steps;
    "window" every listener connection opened during a window of the steps drops them; "start"
    the same from the start (the first connection drops them)."""

    odd: int
    """How many sandboxes of :meth:`World.oddities` the world has beside the steps' (none in
    two seeds of five: their worlds are the steps' alone)."""

    silent: str = ""
    """The watch's connection dies silently (:meth:`World.silent_fault`): "" never (three
    seeds of four), "once" or "twice" at instants of the steps."""

    rotate: str = ""
    """The service account's token is replaced and the old one revoked
    (:meth:`World.rotate_token`): "" never (three seeds of four), "revoked" revoked as the file
    changes, "later" revoked a moment after, "twice" two rotations."""

    @classmethod
    def draw(cls, seed: int) -> Variant:
        rng = random.Random(f"{seed}:variant")
        return cls(
            mode=seed_mode(seed),
            list_mode=rng.choice(("auto", "stream", "list")),
            deletes_per_minute=rng.choice((20, 60, 60, 60)),
            workers=rng.choice((1, 2, 4)),
            reconcile_timeout_s=rng.choice((5.0, 15.0)),
            resync_s=rng.choice((5.0, 600.0)),
            heartbeat_s=rng.choice((1.0, 4.0)),
            p_fail=rng.choice((0.0, 0.02, 0.08)),
            p_slow=rng.choice((0.0, 0.05)),
            hold_p=rng.choice((0.0, 0.1, 0.3)),
            batch_rows=rng.choice((1, 1, 3, 100, 100)),
            pooler=rng.choice(("",) * 9 + ("connection", "window", "start")),
            odd=rng.choice((0, 0, 1, 2, 3)),
            silent=rng.choice(("",) * 6 + ("once", "twice")),
            rotate=rng.choice(("",) * 9 + ("revoked", "later", "twice")),
        )


_settings: dict[tuple[object, ...], Settings] = {}


def settings_for(v: Variant) -> Settings:
    """The service's settings for a variant, loaded once a process for each distinct
    environment (keyed by the variant fields the environment is made of: the others, the fault
    profile among them, are not in it, and loading is what costs)."""
    key = (
        v.mode,
        v.list_mode,
        v.deletes_per_minute,
        v.workers,
        v.reconcile_timeout_s,
        v.resync_s,
        v.heartbeat_s,
    )
    s = _settings.get(key)
    if s is None:
        s = _settings[key] = load({PREFIX + k: val for k, val in _environment(v).items()})
    return s


def _environment(v: Variant) -> dict[str, str]:
    """The service's environment for a variant (without the ``PREFIX``)."""
    return {
        "ENABLED": "false" if v.mode == "disabled" else "true",
        "DRY_RUN": "true" if v.mode == "dry_run" else "false",
        "THRESHOLD_SECONDS": str(THRESHOLD_S),
        "DELETES_PER_MINUTE": str(v.deletes_per_minute),
        "RECONCILE_TIMEOUT_SECONDS": str(v.reconcile_timeout_s),
        "NAMESPACE": NAMESPACE,
        "WORKERS": str(v.workers),
        "RESYNC_PERIOD_SECONDS": str(v.resync_s),
        "SHUTDOWN_TIMEOUT_SECONDS": "2",
        "API_TIMEOUT_SECONDS": "2",
        "WATCH_TIMEOUT_SECONDS": "5",
        "WATCH_SILENCE_SECONDS": str(WATCH_SILENCE_S),
        "LIST_MODE": v.list_mode,
        "LIST_PAGE_SIZE": "2",
        "DATABASE_URL": "postgresql://sim@127.0.0.1:1/sim",
        "DB_CONNECT_TIMEOUT_SECONDS": "2",
        "DB_STATEMENT_TIMEOUT_SECONDS": "2",
        "LISTENER_HEARTBEAT_SECONDS": str(v.heartbeat_s),
        "LISTENER_HEARTBEAT_TIMEOUT_SECONDS": "1.0",
        "METRICS_BIND_ADDRESS": "127.0.0.1:0",
        "LEADER_ELECTION": "false",
        "EVENTS_ENABLED": "false",
        "LOG_LEVEL": "info",
    }


@dataclass
class SimResult:
    seed: int
    mode: str
    violations: list[Violation] = field(default_factory=list)
    deletes: int = 0
    reports: int = 0
    virtual_s: float = 0.0
    trace_hash: str = ""
    trace: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.violations


def token_file() -> str:
    """The service account's token file of this process's seeds (one process runs one seed at a
    time; each seed writes its own token first and removes the file at its end), in memory
    where there is a tmpfs (a write and rename there costs 12 us; on the disk's /tmp 0.5-4 ms,
    a third of a seed)."""
    folder = Path("/dev/shm")
    if not folder.is_dir():
        folder = Path(tempfile.gettempdir())
    return str(folder / f"retired-pod-gc-sim-token-{os.getpid()}")


_metrics: Metrics | None = None


def shared_metrics() -> Metrics:
    """One registry for every seed of a process: the engine only writes metrics, so sharing
    them changes nothing a seed does (a registry costs a millisecond to build)."""
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics


class _LogTap(logging.Handler):
    """Replay only: the product's log lines, with their virtual time, beside the trace."""

    def __init__(self, loop: VirtualLoop, out: list[str]) -> None:
        super().__init__(logging.INFO)
        self.loop = loop
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        key = getattr(record, "key", "")
        self.out.append(
            f"{self.loop.time():.6f} # {record.levelname.lower()} {record.name}: "
            f"{record.getMessage()}{f' [{key}]' if key else ''}"
        )


def schedule_for(seed: int, cfg: SimConfig) -> list[Step]:
    return make_schedule(random.Random(f"{seed}:schedule"), cfg.steps, cfg.sandboxes)


def run_seed(
    seed: int,
    cfg: SimConfig = SimConfig(),
    *,
    steps: list[Step] | None = None,
    keep_trace: bool = False,
    logs: bool = False,
    variant: Variant | None = None,
) -> SimResult:
    """Run one seed (``steps``: another schedule than the seed's; ``variant``: another
    configuration and fault profile than the seed's)."""
    variant = Variant.draw(seed) if variant is None else variant
    schedule = schedule_for(seed, cfg) if steps is None else steps
    result = SimResult(seed, variant.mode, steps=schedule)
    loop = VirtualLoop(random.Random(f"{seed}:loop"), hold_p=variant.hold_p)
    trace = Trace(loop)
    net = Net(loop, random.Random(f"{seed}:net"), trace)
    net.p_fail = variant.p_fail
    net.p_slow = variant.p_slow
    world = World(loop, net, threshold_s=THRESHOLD_S)
    world.db.batch_rows = variant.batch_rows
    world.pooler_fault(variant.pooler, random.Random(f"{seed}:pooler"))
    world.silent_fault(variant.silent, random.Random(f"{seed}:silent"))
    world.token_file = token_file()
    world.rotate_token(variant.rotate, random.Random(f"{seed}:token"), seed=seed)
    world.populate(cfg.sandboxes, random.Random(f"{seed}:populate"))
    world.oddities(variant.odd, random.Random(f"{seed}:odd"))
    settings = settings_for(variant)
    world.db.channel = settings.database.notify_channel
    metrics = shared_metrics()
    bugs_before = metrics.engine.reconcile_bugs._value.get()
    refusals_before = metrics.kube.api_unauthorized_answers._value.get()
    service = build(
        settings,
        loop=loop,
        api=new_api(world.server, token_file=world.token_file, metrics=metrics.kube),
        rng=random.Random(f"{seed}:service"),
        metrics=metrics,
    )
    world.hooks.set_leader = service.controller.set_leader
    checker = Checker(
        world,
        mode=variant.mode,
        threshold_s=THRESHOLD_S,
        deletes_per_minute=variant.deletes_per_minute,
        uplink_slack_s=1e-9,
    )
    acted = asyncio.Event()
    service.recorder.on_record = acted.set
    log_lines: list[str] = []
    tap = None
    if logs:
        tap = _LogTap(loop, log_lines)
        logging.getLogger("service").addHandler(tap)

    async def main() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(run, service, stop=stop))
            await asyncio.sleep(0.3)
            for step in schedule:
                await world.apply(step)
                await asyncio.sleep(step.pause_s)
            world.lift_faults()
            trace("faults lifted")
            await quiet(world, checker, service, acted)
            await kept_phase(world, checker, service)
            stop.set()

    world.server.on_delete = acted.set
    try:
        with environment(Asyncpg(world.db)):
            try:
                loop.run_until_complete(main())
            finally:
                loop.finish_tasks()
    except Exception as exc:  # a crash of the service (a bug ends a loop) fails the seed
        result.violations.append((loop.time(), f"crashed: {_describe(exc)}"))
    finally:
        loop.close_quietly()
        Path(world.token_file).unlink(missing_ok=True)
        if tap is not None:
            logging.getLogger("service").removeHandler(tap)
    checker.check(service.recorder.reports)
    checker.check_silence(settings.kube.watch_silence_s, end=loop.time())
    checker.check_tokens(
        settings.kube.api_timeout_s,
        problem=service.api.transport.problem,
        refusals=int(metrics.kube.api_unauthorized_answers._value.get() - refusals_before),
        end=loop.time(),
    )
    bugs = metrics.engine.reconcile_bugs._value.get() - bugs_before
    if bugs:
        result.violations.append((loop.time(), f"{bugs:.0f} reconcile(s) raised (a bug)"))
    result.violations.extend(checker.violations)
    result.violations.sort(key=lambda v: v[0])
    result.deletes = sum(1 for d in world.server.deletes if d.status == 200)
    result.reports = len(checker.reported)
    result.virtual_s = loop.time()
    result.trace_hash = hashlib.blake2b("\n".join(trace.lines).encode(), digest_size=8).hexdigest()
    result.stats = world.stats
    if keep_trace:
        merged = trace.lines + log_lines
        merged.sort(key=lambda line: float(line.split(" ", 1)[0]))
        result.trace = merged
    return result


KEPT_SETTLE_S = 3.0
"""How long the world must have been still before the retired-but-kept view is judged (the
watch's and the listener's latencies, a confirmation's coalescing and query, a tick)."""
KEPT_SWEEPS_WITHIN_S = 12.0
"""Beyond the resync period, how long the sweep that starts after the stillness may take
(a failed sweep is retried within the period; the models answer within seconds)."""


def cache_caught_up(world: World, service: Service) -> bool:
    """The service's pod cache holds exactly the API server model's pods (UID and
    resourceVersion): what the view is judged on is then the models' truth."""
    pods = world.server.pods
    cache = service.informer
    keys = {split_key(key)[1] for key in list(cache.keys())}
    for name in keys | set(pods):
        cached = cache.get(f"{NAMESPACE}/{name}")
        pod = pods.get(name)
        if (cached is None) != (pod is None):
            return False
        if (
            cached is not None
            and pod is not None
            and (cached.uid, cached.resource_version) != (pod.uid, str(pod.rv))
        ):
            return False
    return True


async def _poll(done: Callable[[], bool], deadline: float, loop: VirtualLoop) -> bool:
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.25)
    return done()


async def kept_phase(world: World, checker: Checker, service: Service) -> None:
    """Retired but kept: after the quiet phase the world is still. Once the pod cache has
    caught up with it, with a short resync period, wait for a sweep that begins after that
    (within the period and a bound, else a violation); with the long one (600 s), whose next
    sweep is beyond the run, run one sweep of the view's now. Then judge the view against the
    models' truth as of that sweep (``Checker.judge_kept``). A cache that does not catch up in
    time is the informer's to answer for (the delete oracle judges it): not judged here."""
    loop = world.loop
    kept = service.kept
    period = service.settings.resync_period_s
    await asyncio.sleep(KEPT_SETTLE_S)
    if not await _poll(
        lambda: cache_caught_up(world, service), loop.time() + KEPT_SWEEPS_WITHIN_S, loop
    ):
        return
    caught_up = loop.time()
    if period <= KEPT_SWEEPS_WITHIN_S:

        def swept() -> bool:
            started = kept.last_sweep(NAMESPACE)
            return started is not None and started >= caught_up

        if not await _poll(swept, caught_up + period + KEPT_SWEEPS_WITHIN_S, loop):
            checker.violations.append(
                (loop.time(), f"[kept] no sweep began within {period + KEPT_SWEEPS_WITHIN_S}s")
            )
            return
    else:
        await kept.sweep(NAMESPACE)
    started = kept.last_sweep(NAMESPACE)
    await asyncio.sleep(KEPT_SETTLE_S)  # confirmations and pod events in flight
    if not cache_caught_up(world, service):
        return
    reported = {split_key(k.key)[1]: str(k.reason) for k in kept.kept()}
    checker.judge_kept(
        reported,
        now=loop.time(),
        sweep_started=float("-inf") if started is None else started,
        settle_s=KEPT_SETTLE_S,
    )


def _describe(exc: BaseException) -> str:
    """The exception and, for a group, its leaves, with where each was raised."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    where = traceback.extract_tb(exc.__traceback__)[-3:] if exc.__traceback__ else []
    return f"{type(exc).__name__}: {exc} at " + " < ".join(
        f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(where)
    )


async def quiet(world: World, checker: Checker, service: object, acted: asyncio.Event) -> None:
    """The quiet phase: faults are lifted; every pod reapable now must be acted on in time."""
    loop = world.loop
    t_quiet = loop.time()
    if checker.mode == "disabled":
        await asyncio.sleep(THRESHOLD_S + 1.5)
        return
    due = checker.due_now()
    bound_s = checker.liveness_bound_s(len(due), RECOVERY_BOUND_S)
    server, db = world.server, world.db
    informer_back = t_quiet if server.watches else None
    listener_back = t_quiet if db.listening else None

    def links_back() -> float:
        inf = informer_back
        if inf is None:
            inf = next((t for t in server.syncs if t >= t_quiet), float("inf"))
        connects = [t for t in db.listener_connects if t >= t_quiet]
        lis = max(connects) if connects else (listener_back or float("inf"))
        return max(t_quiet, inf, lis)

    def done() -> bool:
        acted_uids = (
            {d.uid for d in server.deletes if d.status == 200}
            if checker.mode == "live"
            else {r.pod.uid for _, r in service.recorder.reports}  # type: ignore[attr-defined]
        )
        return all(uid in acted_uids for uid in due)

    until = t_quiet + RECONNECT_CAP_S + bound_s
    while not done() and loop.time() < until:
        acted.clear()
        try:
            await asyncio.wait_for(acted.wait(), until - loop.time())
        except TimeoutError:
            break
    if checker.mode == "live":
        for d in server.deletes:
            if d.status == 200 and d.uid is not None:
                checker.deleted.setdefault(d.uid, d.time)
    else:
        for t, r in service.recorder.reports:  # type: ignore[attr-defined]
            checker.reported.setdefault(r.pod.uid, t)
    checker.judge_liveness(due, t_quiet=t_quiet, bound_s=bound_s, links_back=links_back)
    checker.deleted.clear()
    checker.reported.clear()
