"""Runs one seed: its emulator, database and service instance, through its schedule to the end.

One *seed* is one campaign: its own API server emulator (in process, over HTTP), its own
database on a shared throwaway PostgreSQL (:mod:`tests.chaos.pgserver`, reached through a
:class:`tests.chaos.pgproxy.PgProxy`), and its own service instance built by
``service.app.service.build`` and run by ``run``, exactly as the CLI does.

Phases of a seed (:func:`run_seed`):

1. **chaos**: the seed's schedule (:mod:`tests.chaos.schedule`), ``steps`` steps ~20-200 ms
   apart, each applied by :func:`tests.chaos.steps.apply_step`. After every step the checker
   (:class:`tests.chaos.checker.Checker`) runs.
2. **quiet**: faults are lifted, and :func:`tests.chaos.checker.quiet_phase` judges liveness.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import time

import anyio
from prometheus_client import CollectorRegistry

from devtools.emulator import Emulator, start_emulator
from devtools.pg.throwaway import with_database
from service.app.service import build, run
from service.config import PREFIX, load
from service.kube.api import new_api_client
from service.metrics import Metrics
from tests.chaos.checker import Checker, SeedResult, quiet_phase
from tests.chaos.model import NAMESPACE
from tests.chaos.pgproxy import PgProxy
from tests.chaos.pgserver import SharedPostgres
from tests.chaos.schedule import CampaignConfig, make_schedule, seed_mode
from tests.chaos.steps import apply_step
from tests.chaos.world import World

logger = logging.getLogger(__name__)
REPORT_LOGGER = "service.engine.delete"


class ReportCollector(logging.Handler):
    """Collects the dry-run "would reap" records (engine/delete.py) (debug: one a report; at info
    only a summary an interval), by seed (from the pod name)."""

    _SEED = re.compile(r"space-sbx-s(\d+)n")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
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
    metrics = Metrics(CollectorRegistry())
    api = await new_api_client(host=running.url, metrics=metrics.kube)
    try:
        await world.populate(cfg.sandboxes, rng)
        settings = load(service_env(mode=mode, db_url=service_db, cfg=cfg))
        parts = build(settings, api=api, metrics=metrics)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(run, parts, stop=stop))
            try:
                for n, step in enumerate(schedule):
                    await apply_step(world, step, rng, result.stats)
                    if world.stall_until and time.time() >= world.stall_until:
                        world.end_stall()
                    checker.check(f"step {n} {step.kind}")
                    await anyio.sleep(step.pause_s)
                world.lift_faults()
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
