"""Randomized fault campaigns against the real service wiring, checked against ground truth.

This module runs a campaign: many seeds, at most ``concurrency`` at a time (:func:`run_campaign`).
Its command line prints each seed's verdict and the campaign's totals: ``python -m
tests.chaos.campaign --seeds 50`` (``make chaos SEEDS=50``) or ``--seed 1234``.

The parts of a seed, one module each:

* :mod:`tests.chaos.schedule`: what a seed does, and when, drawn from the seed up front;
* :mod:`tests.chaos.driver`: runs one seed (its emulator, database and service instance);
* :mod:`tests.chaos.steps`: what each kind of step does to the seed's world;
* :mod:`tests.chaos.world`: every change to pods and rows, made and recorded as ground truth;
* :mod:`tests.chaos.model`: the ground truth's timelines, and the oracle restating
  docs/architecture.md;
* :mod:`tests.chaos.checker`: judges a seed, safety after every step, liveness at the end;
* :mod:`tests.chaos.pgserver`, :mod:`tests.chaos.pglog`, :mod:`tests.chaos.pgproxy`: the
  PostgreSQL server the seeds share, its statement log, the proxy that stalls the listener.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio

from tests.chaos.checker import SeedResult
from tests.chaos.driver import REPORT_LOGGER, ReportCollector, run_seed
from tests.chaos.pgserver import SharedPostgres
from tests.chaos.schedule import CampaignConfig


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
    report_logger = logging.getLogger(REPORT_LOGGER)
    old_level = report_logger.level
    report_logger.setLevel(logging.DEBUG)  # the per-report lines (ReportCollector)
    report_logger.addHandler(collector)
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
        report_logger.removeHandler(collector)
        report_logger.setLevel(old_level)
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
