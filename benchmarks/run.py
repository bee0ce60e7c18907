"""The benchmark runner: ``python -m benchmarks.run [--pods N]`` (``make bench`` / ``bench-large``).

Starts a throwaway PostgreSQL and emulator subprocesses, runs B1-B7, writes the raw results to
``benchmarks/results/<name>.json`` (``default`` or ``large``, or ``--name``), then renders the
plots and ``benchmarks/RESULTS.md`` from the canonical run of each benchmark
(``benchmarks/report.py``, ``CANONICAL``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from benchmarks import report, scenarios, share, writer
from benchmarks.harness import (
    EmulatorProcess,
    Population,
    create_pods,
    load_average,
    machine,
    seed_rows,
)
from devtools.pg.throwaway import ThrowawayPostgres

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "tests" / "fixtures" / "wire"
ALL = ("B1", "B2", "B3", "B4", "B5", "B6", "B7")
LIMIT = "B1L"
"""B1 at the limit (``--limit-pods``): the three list modes side by side, with a forced relist."""
MASS = "B2B"
"""B2b (in ``--only``): one statement retiring 10,000 rows at ``--pods`` cached, at least five
repeats, the service's CPU-seconds per retirement burst, polling beside it."""


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument("--pods", type=int, default=20_000, help="population for B2-B5, top of B1")
    p.add_argument("--name", default=None, help="results file name (default: default|large)")
    p.add_argument(
        "--only", default=",".join(ALL), help=f"comma-separated subset of B1..B7, {LIMIT}, {MASS}"
    )
    p.add_argument(
        "--profile", action="store_true", help=f"cProfile the first {MASS} burst (results/*.prof)"
    )
    p.add_argument("--b7-rows", type=int, default=10_000, help="rows of B7's table (and statement)")
    p.add_argument("--b7-rounds", type=int, default=5, help="turns each B7 variant takes")
    p.add_argument(
        "--b7-trigger",
        type=Path,
        action="append",
        default=[],
        help="another text of the trigger file, measured beside the shipped one in B7's "
        "trigger share (repeatable)",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats of B1 and of B2 (event-driven)")
    p.add_argument("--tick-s", type=float, default=10.0, help="polling baseline tick")
    p.add_argument("--idle-s", type=float, default=None, help="B4 window per design")
    p.add_argument("--backlog-s", type=float, default=None, help="B3 backlog run length")
    p.add_argument("--churn-rates", default="2500,5000,10000,15000,20000,30000")
    p.add_argument("--churn-step-s", type=float, default=3.0)
    p.add_argument(
        "--limit-pods", type=int, default=150_000, help=f"population of {LIMIT} (in --only)"
    )
    return p.parse_args()


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    only = {s.strip().upper() for s in args.only.split(",")}
    large = args.pods >= 100_000
    idle_s = args.idle_s or (120.0 if large else 30.0)
    backlog_s = args.backlog_s or (75.0 if large else 30.0)
    results: dict[str, Any] = {
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m benchmarks.run", *sys.argv[1:]]),
        "pods": args.pods,
        "load_average_start": load_average(),
        "config": {
            "repeats": args.repeats,
            "tick_s": args.tick_s,
            "idle_s": idle_s,
            "backlog_s": backlog_s,
        },
    }
    started = time.perf_counter()
    if "B6" in only:
        scenarios._progress("B6 decode")
        results["B6"] = await scenarios.b6_decode(FIXTURES)
        scenarios._progress(
            f"B6 msgspec {results['B6']['median_msgspec_us']:.1f} us "
            f"vs model {results['B6']['median_model_us']:.0f} us"
        )
    needs_env = only & {"B1", "B2", "B3", "B4", "B5", MASS}
    if not (needs_env or only & {LIMIT, "B7"}):
        return results
    with ThrowawayPostgres() as pg:
        if "B7" in only:
            scenarios._progress(f"B7 writer overhead, {args.b7_rows} rows")
            results["B7"] = await writer.b7_writer(
                pg.create_database("bench_b7"), rows=args.b7_rows, rounds=args.b7_rounds
            )
            for line in writer.summary_lines(results["B7"]):
                scenarios._progress(line)
            scenarios._progress("B7 trigger share, the wheel's server and Debian's")
            results["B7_share"] = await share.b7_share(
                rows=args.b7_rows, rounds=args.b7_rounds, others=args.b7_trigger
            )
            for line in share.summary_lines(results["B7_share"]):
                scenarios._progress(line)
        if LIMIT in only:
            emulator = await EmulatorProcess().start()
            try:
                db = pg.create_database("bench_limit")
                population = Population(args.limit_pods)
                create_s = await create_pods(emulator, population)
                seed_s = await seed_rows(db, population)
                scenarios._progress(
                    f"population {args.limit_pods}: pods {create_s:.1f}s rows {seed_s:.1f}s"
                )
                results[LIMIT] = await scenarios.b1_limit(emulator, db, args.limit_pods)
            finally:
                await emulator.aclose()
        if not needs_env:
            results["elapsed_s"] = time.perf_counter() - started
            results["load_average_end"] = load_average()
            return results
        sizes = sorted({s for s in (1_000, 10_000, args.pods) if s <= args.pods})
        if "B1" not in only:
            sizes = [args.pods]
        main_emulator: EmulatorProcess | None = None
        main_db = ""
        b1: list[dict[str, Any]] = []
        try:
            for size in sizes:
                emulator = await EmulatorProcess().start()
                db = pg.create_database(f"bench_{size}")
                population = Population(size)
                create_s = await create_pods(emulator, population)
                seed_s = await seed_rows(db, population)
                scenarios._progress(f"population {size}: pods {create_s:.1f}s rows {seed_s:.1f}s")
                if "B1" in only:
                    runs = [scenarios.b1_child(emulator.url, db) for _ in range(args.repeats)]
                    b1.append(scenarios.b1_summarise(size, runs, emulator.rss_kib()))
                    s = b1[-1]
                    scenarios._progress(
                        f"B1 {size}: synced {s['synced_s']:.2f}s "
                        f"catch-up {s['catchup_done_s']:.2f}s "
                        f"rss/pod {s['rss_per_pod_bytes']:.0f} B"
                    )
                if size == args.pods:
                    main_emulator, main_db = emulator, db
                else:
                    await emulator.aclose()
            if b1:
                results["B1"] = b1
            assert main_emulator is not None
            population = Population(args.pods)
            if "B2" in only:
                results["B2"] = await scenarios.b2_retirement(
                    main_emulator,
                    main_db,
                    population,
                    sizes=(1, 100, 10_000),
                    repeats=args.repeats,
                    tick_s=args.tick_s,
                )
                # The same with more workers (a configuration choice, see NOTES.md).
                results["B2_workers32"] = await scenarios.b2_retirement(
                    main_emulator,
                    main_db,
                    population,
                    sizes=(1, 100, 10_000),
                    repeats=args.repeats,
                    tick_s=args.tick_s,
                    with_baseline=False,
                    overrides={"WORKERS": "32"},
                )
            if MASS in only:
                results[MASS] = await scenarios.b2_retirement(
                    main_emulator,
                    main_db,
                    population,
                    sizes=(10_000,),
                    repeats=max(5, args.repeats),
                    baseline_repeats=max(5, args.repeats),
                    tick_s=args.tick_s,
                    profile=(HERE / "results" / f"{args.name or MASS}.prof")
                    if args.profile
                    else None,
                )
            if "B3" in only:
                results["B3"] = await scenarios.b3_expiry(
                    main_emulator,
                    main_db,
                    population,
                    count=50,
                    threshold_s=2.0,
                    tick_s=args.tick_s,
                    backlog=1200 if large else 600,
                    backlog_cap_per_min=600,
                    backlog_s=backlog_s,
                )
            if "B4" in only:
                results["B4"] = await scenarios.b4_idle(
                    main_emulator, main_db, idle_s=idle_s, tick_s=args.tick_s
                )
            if "B5" in only:
                results["B5"] = await scenarios.b5_churn(
                    main_emulator,
                    main_db,
                    rates=[int(r) for r in args.churn_rates.split(",")],
                    step_s=args.churn_step_s,
                    start_index=0,
                )
        finally:
            if main_emulator is not None:
                await main_emulator.aclose()
    results["elapsed_s"] = time.perf_counter() - started
    results["load_average_end"] = load_average()
    return results


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    args = _args()
    results = anyio.run(_main, args)
    name = args.name or ("large" if args.pods >= 100_000 else "default")
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=float) + "\n")
    scenarios._progress(f"wrote {path} ({results.get('elapsed_s', 0):.0f}s)")
    report.render(HERE)


if __name__ == "__main__":
    main()
