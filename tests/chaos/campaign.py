"""Randomized fault campaigns against the real service wiring, checked against ground truth.

One *seed* is one campaign: its own API server emulator (in process, over HTTP), its own
database on a shared throwaway PostgreSQL (reached through a :class:`PgProxy`), and its own
service instance built by ``service.app.service.build`` and run by ``run``, exactly as the CLI
does. A seed's schedule (what happens, to which pod, with which fault) is drawn from
``random.Random(seed)`` up front, so re-running a seed replays the same schedule; timing is real
(the service runs on the real clock), so a replay is faithful but not bit-exact.

Phases of a seed:

1. **chaos**: ``steps`` steps ~20-200 ms apart — pod creation, phase / IP / condition changes,
   blips (a change and its reversal in the same instant), recreation under the same name,
   deletion by others, row retirement (suspended, replaced, ...), re-activation, new generations,
   bursts of simultaneous retirements; faults: watch drop (abrupt or clean), forced 410,
   compaction, API 500/429, GET latency, ``pg_terminate_backend``, a PostgreSQL restart, a
   silently stalled listener connection; composite scenarios (recreate behind a stale cache;
   re-activate behind a stalled listener; re-activate behind the trigger's back); and, after
   half of the bursts, a change while workers wait for delete tokens that exactly one check of
   the service can see (:func:`while_waiting_for_tokens`). After every step the checker runs.
2. **quiet**: faults are lifted; every pod that is reapable then must be deleted (reported, in
   dry run) within ``threshold + recovery_bound + backlog / pace_rate``, counted from the end of
   the last fault (including another seed's restart of the shared server).

The checker (:class:`Checker`) holds every safety invariant of DESIGN.md against the emulator's
audit log and the driver's ground truth (:mod:`tests.chaos.model`); see docs/reliability.md for
the tolerances and why they are sound.

Run ``python -m tests.chaos.campaign --seeds 50`` (``make chaos SEEDS=50``) or ``--seed 1234``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
from prometheus_client import CollectorRegistry

from service.app.service import build, run
from service.config import load
from service.emulator import Emulator, start_emulator
from service.kube.api import new_api_client
from service.metrics import Metrics
from service.pg.throwaway import with_database
from tests.chaos.checker import Checker, SeedResult, quiet_phase
from tests.chaos.model import (
    NAMESPACE,
)
from tests.chaos.pgproxy import PgProxy
from tests.chaos.pgserver import SharedPostgres
from tests.chaos.schedule import CampaignConfig, make_schedule, seed_mode
from tests.chaos.steps import apply_step
from tests.chaos.world import World

logger = logging.getLogger(__name__)
PREFIX = "SPACE_RETIRED_EXECUTION_POD_GC_"
RECONCILER_LOGGER = "service.engine.reconciler"


class ReportCollector(logging.Handler):
    """Collects the reconciler's dry-run "would reap" records, by seed (from the pod name)."""

    _SEED = re.compile(r"space-sbx-s(\d+)n")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reports: dict[int, list[tuple[float, str, str]]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("dry run: would reap"):
            return
        key = str(getattr(record, "key", ""))
        match = self._SEED.search(key)
        if match is None:
            return
        uid = str(getattr(record, "uid", ""))
        self.reports.setdefault(int(match.group(1)), []).append((record.created, key, uid))


# ------------------------------------------------------------------ running one seed


def service_env(*, mode: str, db_url: str, cfg: CampaignConfig) -> dict[str, str]:
    env = {
        "ENABLED": "false" if mode == "disabled" else "true",
        "DRY_RUN": "true" if mode == "dry_run" else "false",
        "THRESHOLD_SECONDS": str(cfg.threshold_s),
        "DELETES_PER_MINUTE": str(cfg.deletes_per_minute),
        "RECONCILE_TIMEOUT_SECONDS": "5",
        "NAMESPACE": NAMESPACE,
        "WORKERS": "4",
        "RESYNC_PERIOD_SECONDS": "600",
        "SHUTDOWN_TIMEOUT_SECONDS": "2",
        "API_TIMEOUT_SECONDS": "2",
        "WATCH_TIMEOUT_SECONDS": "30",
        "DATABASE_URL": db_url,
        "DB_CONNECT_TIMEOUT_SECONDS": "2",
        "DB_STATEMENT_TIMEOUT_SECONDS": "2",
        # Ten times faster than production (10 s + 5 s), yet slow enough that a silent stall
        # leaves the final re-read as the only defence for a while.
        "LISTENER_HEARTBEAT_SECONDS": "1.0",
        "LISTENER_HEARTBEAT_TIMEOUT_SECONDS": "1.0",
        "METRICS_BIND_ADDRESS": "127.0.0.1:0",
        "LEADER_ELECTION": "false",
        "LOG_LEVEL": "info",
    }
    return {PREFIX + k: v for k, v in env.items()}


async def run_seed(
    seed: int,
    *,
    shared: SharedPostgres,
    collector: ReportCollector,
    cfg: CampaignConfig,
) -> SeedResult:

    mode = seed_mode(seed)
    result = SeedResult(seed, mode)
    started = time.monotonic()
    rng = random.Random(seed ^ 0x5EED)
    schedule = make_schedule(seed, cfg)
    db_name = await shared.new_database(seed)
    upstream_port = shared.server.port
    proxy = await PgProxy("127.0.0.1", upstream_port).start()
    service_db = f"postgresql://postgres@127.0.0.1:{proxy.port}/{db_name}"
    emu = Emulator(bookmark_interval_s=0.5, kubelet_finish_after_s=0.2)
    emu.ensure_namespace(NAMESPACE)
    running = await start_emulator(emulator=emu)
    world = World(
        seed=seed,
        emu=emu,
        db_url=with_database(shared.server.url, db_name),
        proxy=proxy,
        shared=shared,
    )
    world.threshold_s = cfg.threshold_s
    reports = collector.reports.setdefault(seed, [])
    checker = Checker(world=world, cfg=cfg, mode=mode, reports=reports)
    api = await new_api_client(host=running.url)
    try:
        await world.populate(cfg.sandboxes, rng)
        settings = load(service_env(mode=mode, db_url=service_db, cfg=cfg))
        parts = build(settings, api=api, metrics=Metrics(CollectorRegistry()))
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(run, parts, stop=stop))
            try:
                for n, step in enumerate(schedule):
                    await apply_step(world, step, rng, result.stats)
                    if world.stall_until and time.time() >= world.stall_until:
                        world.proxy.unstall()
                        world.stall_until = 0.0
                    checker.check(f"step {n} {step.kind}")
                    await anyio.sleep(step.pause_s)
                result.recovery = await quiet_phase(world, checker, cfg, mode)
            finally:
                stop.set()
    except Exception as exc:  # a crash of the service or the harness fails the seed
        logger.exception("seed %d crashed", seed)
        result.violations.append(f"crashed: {type(exc).__name__}: {exc}")
    finally:
        proxy.unstall()
        await api.close()
        await world.close()
        await proxy.aclose()
        await running.aclose()
    result.violations.extend(checker.violations)
    result.deletes = len(checker.deleted_uids)
    result.reports = len(checker.reported_uids)
    result.race_windows = checker.race_windows
    result.duration_s = time.monotonic() - started
    return result


# ------------------------------------------------------------------ campaigns


async def run_campaign(
    seeds: Sequence[int],
    *,
    cfg: CampaignConfig | None = None,
    concurrency: int = 24,
    shared: SharedPostgres | None = None,
) -> list[SeedResult]:
    """Run ``seeds``, at most ``concurrency`` at a time; returns one result per seed."""
    cfg = cfg or CampaignConfig()
    own = shared is None
    shared = shared or SharedPostgres()
    if own:
        await shared.start()
    collector = ReportCollector()
    reconciler_logger = logging.getLogger(RECONCILER_LOGGER)
    old_level = reconciler_logger.level
    reconciler_logger.setLevel(logging.INFO)
    reconciler_logger.addHandler(collector)
    results: dict[int, SeedResult] = {}
    limiter = anyio.Semaphore(concurrency)

    async def one(seed: int) -> None:
        async with limiter:
            results[seed] = await run_seed(seed, shared=shared, collector=collector, cfg=cfg)

    try:
        async with anyio.create_task_group() as tg:
            for seed in seeds:
                tg.start_soon(one, seed)
    finally:
        reconciler_logger.removeHandler(collector)
        reconciler_logger.setLevel(old_level)
        if own:
            await anyio.to_thread.run_sync(shared.stop)
    return [results[s] for s in seeds]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds (from --start)")
    parser.add_argument("--start", type=int, default=1, help="first seed")
    parser.add_argument("--seed", type=int, action="append", help="run just this seed")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--steps", type=int, default=CampaignConfig().steps)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.WARNING)
    seeds = args.seed or list(range(args.start, args.start + args.seeds))
    cfg = CampaignConfig(steps=args.steps)
    started = time.monotonic()
    results, escaped = anyio.run(
        functools.partial(guarded_campaign, seeds, cfg=cfg, concurrency=args.concurrency)
    )
    failed = [r for r in results if not r.ok]
    for r in results:
        print(r.summary())
    for context in escaped:
        print(f"event loop exception handler called: {context}")
    windows = sorted(w for r in results for w in r.race_windows)
    if windows:
        print(
            f"final re-read -> action: p50 {windows[len(windows) // 2] * 1000:.1f} ms, "
            f"p99 {windows[int(len(windows) * 0.99)] * 1000:.1f} ms, "
            f"max {windows[-1] * 1000:.1f} ms over {len(windows)} actions"
        )
    recoveries = [r.recovery for r in results if r.recovery is not None]
    if recoveries:
        back = sorted(rc.links_back_s for rc in recoveries if rc.links_back_s < math.inf)
        early = len(recoveries) - len(back)
        back = back or [0.0]
        done = sorted(rc.done_s for rc in recoveries)
        print(
            f"after the faults stopped: links back p50 {back[len(back) // 2]:.2f} s, "
            f"max {back[-1]:.2f} s ({early} seeds done before theirs were); "
            f"last due pod acted on p50 {done[len(done) // 2]:.2f} s, "
            f"p99 {done[int(len(done) * 0.99)]:.2f} s, max {done[-1]:.2f} s"
        )
    total = Counter[str]()
    for r in results:
        total.update(r.stats)
    print(f"steps: {dict(sorted(total.items()))}")
    print(
        f"{len(results)} seeds, {len(failed)} failed, "
        f"{sum(r.deletes for r in results)} deletes, {sum(r.reports for r in results)} reports, "
        f"{time.monotonic() - started:.1f}s"
    )
    if failed:
        print("failing seeds: " + " ".join(str(r.seed) for r in failed))
    return 1 if failed or escaped else 0


async def guarded_campaign(
    seeds: Sequence[int], *, cfg: CampaignConfig, concurrency: int
) -> tuple[list[SeedResult], list[str]]:
    """:func:`run_campaign`, and every call of the event loop's exception handler meanwhile (an
    exception raised in a callback, or a task's or future's that nobody retrieved)."""
    loop = asyncio.get_running_loop()
    escaped: list[str] = []

    def record(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        escaped.append(f"{context.get('message')}: {type(exc).__name__}: {exc}")
        loop.default_exception_handler(context)

    loop.set_exception_handler(record)
    results = await run_campaign(seeds, cfg=cfg, concurrency=concurrency)
    gc.collect()
    await asyncio.sleep(0)
    return results, escaped


if __name__ == "__main__":
    sys.exit(main())
