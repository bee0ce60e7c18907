"""B8 retired but kept: the view's cost at a large cache (``python -m benchmarks.kept``).

docs/architecture.md, "Retired but kept": the view sweeps each namespace with ONE row query per
resync period, whatever the cache size. At ``--pods`` cached pods (150,000 by default: a
quarter Running, half Succeeded, a quarter Pending, every row active, as B1-B5's population),
``--retired`` of the Running pods have their row retired (each is then a kept ``pod_running``)
and the table also holds ``--history`` retired rows of pods long gone (the history a
production table carries). Measured, in this process (the emulator and PostgreSQL run in their
own; each measured variant runs in a process of its own):

- the sweep's row query alone (``RETIRED_SQL`` with every cached name), ``--repeats`` times;
- the view's whole sweep (query and applying the answer: ``retired_kept_sweep_duration``);
- the service's extra memory: RSS once synced and idle, with the view running against the same
  service with the view's task not started (two processes), and the view's own structures
  (``sys.getsizeof`` over them);
- idle row queries per minute, over ``--idle-s``, at the default resync period (600 s) and at
  ``--short-period-s``.

Results go to ``benchmarks/results/kept.json`` (key ``B8``) and are printed; ``python -m
benchmarks.report`` renders them into RESULTS.md (``CANONICAL["B8"]``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from benchmarks.harness import (
    NAMESPACE,
    EmulatorProcess,
    Population,
    counter_total,
    create_pods,
    insert_rows,
    load_average,
    machine,
    pod_name,
    rss_kib,
    running_service,
    seed_rows,
    settings,
)
from devtools.pg.throwaway import ThrowawayPostgres
from service.app import service
from service.kit.memory import trim_heap

HERE = Path(__file__).resolve().parent


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _retire(db_url: str, population: Population, retired: int, history: int) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        names = [pod_name(i) for i in list(population.running)[:retired]]
        await conn.execute(
            """UPDATE sandbox_k8s_executions
                  SET active = false, execution_state = 'suspended', retired_at = now()
                WHERE pod_name = ANY($1::text[])""",
            names,
        )
        await insert_rows(
            conn, [f"h{i:011x}" for i in range(history)], state="suspended", active=False
        )
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


def _deep_size(parts: service.Parts) -> int:
    """Bytes of the view's own structures: its dicts and every entry they hold."""
    kept = parts.kept
    assert kept is not None
    total = 0
    for name in ("_retired", "_kept", "_suspects", "_evented"):
        table = getattr(kept, name)
        total += sys.getsizeof(table)
        for value in table.values():
            total += sys.getsizeof(value)
            row = getattr(value, "row", None)
            if row is not None:
                total += sys.getsizeof(row)
    return total


async def _settled_rss() -> int:
    gc.collect()
    trim_heap()
    await anyio.sleep(1.0)
    return rss_kib()


async def _run(emulator_url: str, db_url: str, *, with_view: bool, args: Any) -> dict[str, Any]:
    cfg = settings(db_url)
    out: dict[str, Any] = {"with_view": with_view}

    def instrument(parts: service.Parts) -> None:
        if not with_view:
            parts.kept = None  # handlers registered, its task (sweeps, confirmations) not run

    async with running_service(emulator_url, cfg, instrument=instrument) as parts:
        out["pods"] = len(parts.informer)
        if with_view:
            assert parts.kept is not None
            with anyio.fail_after(600):
                while parts.kept.last_sweep(NAMESPACE) is None:
                    await anyio.sleep(0.1)
            out["kept"] = len(parts.kept)
            out["view_bytes"] = _deep_size(parts)
            hist = parts.metrics.registry
            out["first_sweep_s"] = hist.get_sample_value(
                "retired_pod_gc_retired_kept_sweep_duration_seconds_sum"
            )
            names = [key.partition("/")[2] for key in list(parts.informer.keys())]
            query_s = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                found = await parts.store.retired_rows(NAMESPACE, names, kind="bench")
                query_s.append(time.perf_counter() - started)
            out["query_rows"] = len(found)
            out["query_s"] = query_s
            sweep_s = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                await parts.kept.sweep(NAMESPACE)
                sweep_s.append(time.perf_counter() - started)
            out["sweep_s"] = sweep_s
        out["rss_kib"] = await _settled_rss()
        q0 = counter_total(parts.metrics, "retired_pod_gc_row_queries_total")
        t0 = time.perf_counter()
        await anyio.sleep(args.idle_s)
        minutes = (time.perf_counter() - t0) / 60
        q1 = counter_total(parts.metrics, "retired_pod_gc_row_queries_total")
        out["idle_row_queries_per_min"] = (q1 - q0) / minutes
    return out


async def _short_period(emulator_url: str, db_url: str, args: Any) -> dict[str, Any]:
    cfg = settings(db_url, RESYNC_PERIOD_SECONDS=str(args.short_period_s))
    async with running_service(emulator_url, cfg) as parts:
        assert parts.kept is not None
        with anyio.fail_after(600):
            while parts.kept.last_sweep(NAMESPACE) is None:
                await anyio.sleep(0.1)
        metrics = parts.metrics
        q0 = counter_total(metrics, "retired_pod_gc_row_queries_total")
        s0 = metrics.registry.get_sample_value(
            "retired_pod_gc_row_queries_total", {"kind": "kept_sweep"}
        )
        t0 = time.perf_counter()
        await anyio.sleep(args.idle_s)
        minutes = (time.perf_counter() - t0) / 60
        q1 = counter_total(metrics, "retired_pod_gc_row_queries_total")
        s1 = metrics.registry.get_sample_value(
            "retired_pod_gc_row_queries_total", {"kind": "kept_sweep"}
        )
        return {
            "period_s": args.short_period_s,
            "row_queries_per_min": (q1 - q0) / minutes,
            "sweeps_per_min": ((s1 or 0) - (s0 or 0)) / minutes,
        }


def _child(variant: str, emulator_url: str, db_url: str, args: argparse.Namespace) -> Any:
    """One variant in a process of its own (so that no run's memory shows in another's RSS)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.kept",
            *("--child", variant, "--emulator", emulator_url, "--db", db_url),
            *("--repeats", str(args.repeats), "--idle-s", str(args.idle_s)),
            *("--short-period-s", str(args.short_period_s)),
        ],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{variant} child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _child_main(args: argparse.Namespace) -> dict[str, Any]:
    if args.child == "short":
        return await _short_period(args.emulator, args.db, args)
    return await _run(args.emulator, args.db, with_view=args.child == "with", args=args)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"args": vars(args)}
    with ThrowawayPostgres() as pg:
        db = pg.create_database("bench_kept")
        emulator = await EmulatorProcess().start()
        try:
            population = Population(args.pods)
            _progress(f"population {args.pods}")
            await create_pods(emulator, population)
            await seed_rows(db, population)
            await _retire(db, population, args.retired, args.history)
            for variant, key in (
                ("without", "without"),
                ("with", "with"),
                ("short", "short_period"),
            ):
                _progress(f"{variant} (a process of its own)")
                results[key] = await anyio.to_thread.run_sync(
                    _child, variant, emulator.url, db, args
                )
                _progress(f"  { {k: v for k, v in results[key].items() if k != 'query_s'} }")
        finally:
            await emulator.aclose()
    return results


def summary_lines(r: dict[str, Any]) -> list[str]:
    w, wo, short = r["with"], r["without"], r["short_period"]
    return [
        f"cached pods {w['pods']:,}, retired and kept {w['kept']:,}, "
        f"history rows {r['args']['history']:,}",
        f"sweep query (RETIRED_SQL, {w['pods']:,} names): median "
        f"{statistics.median(w['query_s']) * 1000:.0f} ms "
        f"(min {min(w['query_s']) * 1000:.0f}, max {max(w['query_s']) * 1000:.0f})",
        f"  from its 7th execution on (PostgreSQL switched the prepared statement to a generic "
        f"plan): median {statistics.median(w['query_s'][5:] or w['query_s']) * 1000:.0f} ms",
        f"whole sweep (query + applying): median {statistics.median(w['sweep_s']) * 1000:.0f} ms",
        f"RSS idle: {wo['rss_kib'] / 1024:.1f} MiB without the view, "
        f"{w['rss_kib'] / 1024:.1f} MiB with it ({(w['rss_kib'] - wo['rss_kib']) / 1024:+.1f} MiB)"
        f"; the view's structures {w['view_bytes'] / 1024:.0f} KiB",
        f"idle row queries/min at the default period (600 s): {w['idle_row_queries_per_min']:.1f}"
        f" (without the view {wo['idle_row_queries_per_min']:.1f}); at {short['period_s']:g} s: "
        f"{short['row_queries_per_min']:.1f} ({short['sweeps_per_min']:.1f} sweeps)",
    ]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kept", description=__doc__)
    p.add_argument("--pods", type=int, default=150_000)
    p.add_argument("--retired", type=int, default=1_500, help="Running pods whose row is retired")
    p.add_argument("--history", type=int, default=150_000, help="retired rows of gone pods")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--idle-s", type=float, default=60.0)
    p.add_argument("--short-period-s", type=float, default=10.0)
    p.add_argument("--name", default="kept")
    p.add_argument("--child", choices=("with", "without", "short"), help=argparse.SUPPRESS)
    p.add_argument("--emulator", help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(anyio.run(_child_main, args)))
        return
    run: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_average_start": load_average(),
        "machine": machine(),
        "command": " ".join(["python -m benchmarks.kept", *sys.argv[1:]]),
        "config": {"repeats": args.repeats},
    }
    run["B8"] = anyio.run(_main, args)
    run["load_average_end"] = load_average()
    (HERE / "results" / f"{args.name}.json").write_text(json.dumps(run, indent=2) + "\n")
    for line in summary_lines(run["B8"]):
        print(line)


if __name__ == "__main__":
    main()
