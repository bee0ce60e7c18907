"""B1-B6: each scenario returns plain JSON-able dicts; the event-driven service and the polling
baseline run in the same harness, on the same emulator and database, one after the other."""

from __future__ import annotations

import cProfile
import functools
import gc
import io
import json
import logging
import pstats
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import msgspec
from kubernetes_asyncio import client as k8s_client

from benchmarks import baseline as polling
from benchmarks.harness import (
    ROOT,
    EmulatorProcess,
    Population,
    counter_total,
    cpu_s,
    load_average,
    median,
    pod_name,
    reactivate,
    retire,
    running_service,
    settings,
    summary_ms,
    template,
    wait_queue_idle,
)
from devtools.emulator.sandboxpods import Shape
from service.app import service
from service.domain import Verdict
from service.kube.decode import PodDecoder

logger = logging.getLogger(__name__)
KEY_PREFIX = "sandboxes/"


def _progress(message: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- B1 cold start


def b1_child(emulator_url: str, db_url: str, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.service_child",
            "--emulator",
            emulator_url,
            "--db",
            db_url,
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"service child failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


LIST_MODES = (
    ("streaming list", "stream", False),
    ("list from the watch cache", "list", False),
    ("quorum list", "list", True),
)
"""B1 at the limit: (label, LIST_MODE, refuse the cache list so that a quorum list is made)."""


async def b1_limit(emulator: EmulatorProcess, db_url: str, size: int) -> dict[str, Any]:
    """Cold sync, steady RSS and a forced relist (peak RSS) in each list mode, one after the
    other against the same emulator, each service in its own process."""
    modes = []
    for label, mode, quorum in LIST_MODES:
        if quorum:
            # The initial list's resourceVersion=0 (watch cache) is refused: quorum list.
            await emulator.fail_next(code=410, method="GET", query={"resourceVersion": "0"})
        run = b1_child(
            emulator.url, db_url, "--list-mode", mode, "--relist", *(["--quorum"] if quorum else [])
        )
        await emulator.clear_faults()
        steady = (run["rss_idle_kib"] - run["rss_base_kib"]) * 1024 / size
        run.update(
            label=label,
            pods=size,
            rss_per_pod_bytes=steady,
            relist_peak_ratio=run["peak_rss_relist_kib"] / run["rss_before_relist_kib"],
            load_average=load_average(),
        )
        modes.append(run)
        _progress(
            f"B1 {size} {label}: synced {run['synced_s']:.2f}s cpu {run['cpu_synced_s']:.2f}s "
            f"rss/pod {steady:.0f} B requests {run['sync']['api_requests']}; relist "
            f"{run['relist_synced_s']:.2f}s peak {run['relist_peak_ratio']:.2f}x steady"
        )
    return {"pods": size, "modes": modes, "emulator_rss_mib": emulator.rss_kib() / 1024}


def b1_summarise(size: int, runs: list[dict[str, float]], emulator_rss_kib: int) -> dict[str, Any]:
    def med(key: str) -> float:
        return median([r[key] for r in runs])

    return {
        "pods": size,
        "runs": runs,
        "synced_s": med("synced_s"),
        "cpu_synced_s": med("cpu_synced_s"),
        "catchup_done_s": med("idle_s"),
        "cpu_catchup_s": med("cpu_idle_s"),
        "rss_base_mib": med("rss_base_kib") / 1024,
        "rss_synced_mib": med("rss_synced_kib") / 1024,
        "rss_after_catchup_mib": med("rss_idle_kib") / 1024,
        "rss_per_pod_bytes": median(
            [(r["rss_idle_kib"] - r["rss_base_kib"]) * 1024 / size for r in runs]
        ),
        "rss_per_pod_synced_bytes": median(
            [(r["rss_synced_kib"] - r["rss_base_kib"]) * 1024 / size for r in runs]
        ),
        "catchup_row_queries": med("row_queries"),
        "emulator_rss_mib": emulator_rss_kib / 1024,
        "load_average": load_average(),
    }


# --------------------------------------------------------------------------- instrumentation


class ClockStarts:
    """Wall-clock time each key's observation clock started (wraps ``ObservationClocks.observe``
    in the harness only; the service is unchanged)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}

    def instrument(self, parts: service.Parts) -> None:
        original = parts.clocks.observe
        started = self.started
        # ``now`` is the monotonic instant the reconciler judged; mapped to wall time by one
        # offset, read here (two clock reads a key would load the burst this measures).
        to_wall = time.time() - time.monotonic()

        def observe(uid: str, key: str, verdict: Verdict, now: float) -> float | None:
            elapsed = original(uid, key, verdict, now)
            if elapsed == 0.0 and key not in started:
                started[key] = now + to_wall
            return elapsed

        parts.clocks.observe = observe  # type: ignore[method-assign]

    def record(self, key: str) -> None:
        self.started.setdefault(key, time.time())


class GcTime:
    """CPU seconds and collections of the garbage collector (``gc.callbacks``) while enabled."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __enter__(self) -> GcTime:
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.seconds += time.process_time() - self._started
            self.collections[info["generation"]] += 1


async def _wait_for(keys: Sequence[str], started: dict[str, float], timeout_s: float) -> None:
    # The count first: scanning 10,000 keys every 5 ms would load the event loop it measures.
    with anyio.move_on_after(timeout_s):
        while len(started) < len(keys) or not all(k in started for k in keys):
            await anyio.sleep(0.005)


def _latencies(keys: Sequence[str], started: dict[str, float], t0: float) -> list[float]:
    return [started[k] - t0 for k in keys if k in started]


# --------------------------------------------------------------------------- B2 retirement


async def b2_retirement(
    emulator: EmulatorProcess,
    db_url: str,
    population: Population,
    *,
    sizes: Sequence[int],
    repeats: int,
    tick_s: float,
    with_baseline: bool = True,
    baseline_repeats: int = 1,
    overrides: dict[str, str] | None = None,
    profile: Path | None = None,
) -> dict[str, Any]:
    """Retire ``sizes`` rows in one statement each, ``repeats`` times, and time each key's
    clock start; the polling baseline beside it, ``baseline_repeats`` times a size (each at a
    random phase of its tick; the median run is its figure). With ``profile``, the first run of
    the largest size is profiled (cProfile, from before the COMMIT until the burst is reconciled)
    and the stats written there, the top of them printed."""
    rng = random.Random(2)
    eligible = population.reapable_shaped
    sizes = [min(s, len(eligible)) for s in sizes]
    conn = await asyncpg.connect(db_url)
    out: dict[str, Any] = {"sizes": sizes, "event": {}, "baseline": {}, "tick_s": tick_s}
    try:
        # Event-driven.
        clocks = ClockStarts()
        async with running_service(
            emulator.url, settings(db_url, **(overrides or {})), instrument=clocks.instrument
        ) as parts:
            for size in sizes:
                runs = []
                for _ in range(repeats):
                    names = [pod_name(i) for i in rng.sample(eligible, size)]
                    keys = [KEY_PREFIX + n for n in names]
                    clocks.started.clear()
                    profiler = (
                        cProfile.Profile()
                        if profile is not None and size == max(sizes) and not runs
                        else None
                    )
                    if profiler is not None:
                        profiler.enable()
                    cpu_before = cpu_s()
                    notified = counter_total(parts.metrics, "retired_pod_gc_notifications_total")
                    with GcTime() as gc_time:
                        before, after = await retire(conn, names)
                        await _wait_for(keys, clocks.started, timeout_s=60)
                        cpu_started = cpu_s()
                        # Every key of the burst reconciled (the whole of what it cost the
                        # service).
                        await wait_queue_idle(parts)
                        cpu_idle = cpu_s()
                    if profiler is not None and profile is not None:
                        profiler.disable()
                        profiler.dump_stats(profile)
                        text = io.StringIO()
                        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
                        _progress(f"profile of the first {size}-row burst ({profile}):")
                        sys.stderr.write(text.getvalue())
                    lat = _latencies(keys, clocks.started, before)
                    runs.append(
                        {
                            **summary_ms(lat),
                            "all_started_s": max(lat) if lat else float("nan"),
                            "missing": len(keys) - len(lat),
                            "commit_ms": (after - before) * 1000,
                            # This process runs the service (and the benchmark's own waiting).
                            "cpu_to_all_started_s": cpu_started - cpu_before,
                            "cpu_to_idle_s": cpu_idle - cpu_before,
                            # Of which the garbage collector (collections by generation).
                            "gc_s": gc_time.seconds,
                            "gc_collections": gc_time.collections,
                            "notifications": counter_total(
                                parts.metrics, "retired_pod_gc_notifications_total"
                            )
                            - notified,
                            "latencies_s": lat if size <= 10_000 else lat[:10_000],
                        }
                    )
                    await reactivate(conn, names)
                    with anyio.fail_after(60):
                        while len(parts.clocks):
                            await anyio.sleep(0.01)
                    await wait_queue_idle(parts)
                    await anyio.sleep(0.2)
                out["event"][str(size)] = _median_runs(runs)
                event = out["event"][str(size)]
                _progress(
                    f"B2 event  {size:>6} retirements: p50 {event['p50_ms']:.1f} ms "
                    f"p99 {event['p99_ms']:.1f} ms all {event['all_started_s']:.2f} s; "
                    f"CPU-s per run {[round(r['cpu_to_idle_s'], 3) for r in runs]} "
                    f"(gc {[round(r['gc_s'], 3) for r in runs]})"
                )
        if not with_baseline:
            return out
        # Polling baseline: disjoint sets (its first-seen memory lasts one tick).
        pool = rng.sample(eligible, min(len(eligible), sum(sizes) * baseline_repeats))
        base_clocks = ClockStarts()
        cfg = settings(db_url)
        async with anyio.create_task_group() as tg:
            await tg.start(
                functools.partial(
                    polling.run_baseline,
                    emulator.url,
                    cfg,
                    tick_s=tick_s,
                    on_clock_start=base_clocks.record,
                )
            )
            offset = 0
            for size in sizes:
                base_runs = []
                for _ in range(baseline_repeats):
                    if offset + size > len(pool):
                        # A small population: sets reused, once it has seen them active for a
                        # tick (its first-seen memory forgets them).
                        offset = 0
                        await anyio.sleep(tick_s)
                    names = [pod_name(i) for i in pool[offset : offset + size]]
                    offset += size
                    keys = [KEY_PREFIX + n for n in names]
                    base_clocks.started.clear()
                    # Retire at a random phase of the tick, as production would.
                    await anyio.sleep(rng.uniform(0, tick_s))
                    before, after = await retire(conn, names)
                    await _wait_for(keys, base_clocks.started, timeout_s=3 * tick_s + 30)
                    lat = _latencies(keys, base_clocks.started, before)
                    run = {
                        **summary_ms(lat),
                        "all_started_s": max(lat) if lat else float("nan"),
                        "missing": len(keys) - len(lat),
                        "commit_ms": (after - before) * 1000,
                        "latencies_s": lat,
                    }
                    base_runs.append(run)
                    _progress(
                        f"B2 polling {size:>6} retirements: p50 {run['p50_ms']:.0f} ms "
                        f"p99 {run['p99_ms']:.0f} ms all {run['all_started_s']:.2f} s"
                    )
                    await reactivate(conn, names)
                out["baseline"][str(size)] = (
                    base_runs[0] if len(base_runs) == 1 else _median_runs(base_runs)
                )
            tg.cancel_scope.cancel()
        await reactivate(conn, [pod_name(i) for i in eligible])
    finally:
        await conn.close()
    out["load_average"] = load_average()
    return out


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"repeats": len(runs), "runs": [_drop(r) for r in runs]}
    for key in ("p50_ms", "p99_ms", "max_ms", "all_started_s", "commit_ms", "count", "missing"):
        merged[key] = median([r[key] for r in runs])
    for key in ("cpu_to_all_started_s", "cpu_to_idle_s", "gc_s", "notifications"):
        if all(key in r for r in runs):
            merged[key] = median([r[key] for r in runs])
    # The CDF plot uses the run with the median p99.
    runs_sorted = sorted(runs, key=lambda r: r["p99_ms"])
    merged["latencies_s"] = runs_sorted[len(runs_sorted) // 2]["latencies_s"]
    return merged


def _drop(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "latencies_s"}


# --------------------------------------------------------------------------- B3 expiry


def _deleted_at(entries: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in entries:
        if e.get("status") == 200:
            out.setdefault(KEY_PREFIX + e["path"].rsplit("/", 1)[-1], float(e["time_s"]))
    return out


async def b3_expiry(
    emulator: EmulatorProcess,
    db_url: str,
    population: Population,
    *,
    count: int,
    threshold_s: float,
    tick_s: float,
    backlog: int,
    backlog_cap_per_min: int,
    backlog_s: float,
) -> dict[str, Any]:
    rng = random.Random(3)
    # Terminal pods only: they disappear at once on DELETE, so nothing lingers afterwards.
    pool = rng.sample(list(population.succeeded), 2 * count + backlog)
    event_set, base_set, backlog_set = pool[:count], pool[count : 2 * count], pool[2 * count :]
    conn = await asyncpg.connect(db_url)
    out: dict[str, Any] = {"count": count, "threshold_s": threshold_s, "tick_s": tick_s}
    try:
        live = {"DRY_RUN": "false", "THRESHOLD_SECONDS": str(threshold_s)}
        # Event-driven, budget not binding (6000/min, retirements spread 100 ms apart).
        clocks = ClockStarts()
        await emulator.clear_audit()
        async with running_service(
            emulator.url, settings(db_url, **live), instrument=clocks.instrument
        ):
            for i in event_set:
                await retire(conn, [pod_name(i)])
                await anyio.sleep(0.1)
            keys = [KEY_PREFIX + pod_name(i) for i in event_set]
            deadline = time.monotonic() + threshold_s + 20
            while time.monotonic() < deadline:
                if len(_deleted_at(await emulator.deletes())) >= count:
                    break
                await anyio.sleep(0.25)
        deleted = _deleted_at(await emulator.deletes())
        lat = [
            deleted[k] - (clocks.started[k] + threshold_s)
            for k in keys
            if k in deleted and k in clocks.started
        ]
        out["event"] = {**summary_ms(lat), "deleted": len(lat), "latencies_s": lat}
        _progress(
            f"B3 event   expiry->DELETE p50 {out['event']['p50_ms']:.1f} ms "
            f"p99 {out['event']['p99_ms']:.1f} ms ({len(lat)}/{count})"
        )
        # Polling baseline.
        base_clocks = ClockStarts()
        await emulator.clear_audit()
        cfg = settings(db_url, **live)
        async with anyio.create_task_group() as tg:
            await tg.start(
                functools.partial(
                    polling.run_baseline,
                    emulator.url,
                    cfg,
                    tick_s=tick_s,
                    on_clock_start=base_clocks.record,
                )
            )
            for i in base_set:
                await retire(conn, [pod_name(i)])
                await anyio.sleep(0.1)
            deadline = time.monotonic() + threshold_s + 3 * tick_s + 20
            while time.monotonic() < deadline:
                if len(_deleted_at(await emulator.deletes())) >= count:
                    break
                await anyio.sleep(0.25)
            tg.cancel_scope.cancel()
        deleted = _deleted_at(await emulator.deletes())
        keys = [KEY_PREFIX + pod_name(i) for i in base_set]
        lat = [
            deleted[k] - (base_clocks.started[k] + threshold_s)
            for k in keys
            if k in deleted and k in base_clocks.started
        ]
        out["baseline"] = {**summary_ms(lat), "deleted": len(lat), "latencies_s": lat}
        _progress(
            f"B3 polling expiry->DELETE p50 {out['baseline']['p50_ms']:.0f} ms "
            f"p99 {out['baseline']['p99_ms']:.0f} ms ({len(lat)}/{count})"
        )
        # Backlog against the cap (event-driven).
        await emulator.clear_audit()
        cfg = settings(
            db_url,
            DRY_RUN="false",
            THRESHOLD_SECONDS=str(threshold_s),
            DELETES_PER_MINUTE=str(backlog_cap_per_min),
        )
        async with running_service(emulator.url, cfg):
            await retire(conn, [pod_name(i) for i in backlog_set])
            await anyio.sleep(backlog_s + threshold_s)
        times = sorted(_deleted_at(await emulator.deletes()).values())
        out["backlog"] = _window_stats(
            times, cap=backlog_cap_per_min, backlog=backlog, run_s=backlog_s
        )
        _progress(f"B3 backlog { ({k: v for k, v in out['backlog'].items() if k != 'times_s'}) }")
        await reactivate(conn, [pod_name(i) for i in backlog_set])
    finally:
        await conn.close()
    out["load_average"] = load_average()
    return out


def _window_stats(times: list[float], *, cap: int, backlog: int, run_s: float) -> dict[str, Any]:
    if not times:
        return {"deletes": 0, "cap_per_min": cap, "backlog": backlog}
    span = times[-1] - times[0]
    max_60 = 0
    lo = 0
    for hi, t in enumerate(times):
        while t - times[lo] >= 60.0:
            lo += 1
        max_60 = max(max_60, hi - lo + 1)
    # Steady state: after the pacer's initial burst (its capacity, cap // 10).
    burst = max(1, cap // 10)
    steady = times[burst:]
    steady_rate = (
        (len(steady) - 1) / (steady[-1] - steady[0]) * 60 if len(steady) > 2 else float("nan")
    )
    return {
        "backlog": backlog,
        "cap_per_min": cap,
        "run_s": run_s,
        "deletes": len(times),
        "span_s": span,
        "max_in_any_60s_window": max_60,
        "steady_rate_per_min": steady_rate,
        "steady_utilisation": steady_rate / cap,
        "times_s": [t - times[0] for t in times],
    }


# --------------------------------------------------------------------------- B4 idle


async def b4_idle(
    emulator: EmulatorProcess, db_url: str, *, idle_s: float, tick_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"idle_s": idle_s, "tick_s": tick_s}
    async with running_service(emulator.url, settings(db_url)) as parts:
        await anyio.sleep(1.0)
        out["event"] = await _idle_window(emulator, parts.metrics, idle_s, pods=len(parts.informer))
    _progress(f"B4 event   {out['event']}")
    cfg = settings(db_url)
    async with anyio.create_task_group() as tg:
        running = await tg.start(
            functools.partial(
                polling.run_baseline, emulator.url, cfg, tick_s=tick_s, on_clock_start=None
            )
        )
        while running.gc.ticks < 1:
            await anyio.sleep(0.05)
        out["baseline"] = await _idle_window(
            emulator, running.metrics, idle_s, pods=len(running.informer)
        )
        out["baseline"]["tick_durations_s"] = running.gc.tick_durations_s
        tg.cancel_scope.cancel()
    _progress(f"B4 polling {out['baseline']}")
    out["load_average"] = load_average()
    return out


async def _idle_window(
    emulator: EmulatorProcess, metrics: Any, idle_s: float, *, pods: int
) -> dict[str, Any]:
    q0 = counter_total(metrics, "retired_pod_gc_row_queries_total")
    r0 = (await emulator.state())["requests"]
    c0, t0 = cpu_s(), time.perf_counter()
    await anyio.sleep(idle_s)
    c1, t1 = cpu_s(), time.perf_counter()
    r1 = (await emulator.state())["requests"]
    q1 = counter_total(metrics, "retired_pod_gc_row_queries_total")
    minutes = (t1 - t0) / 60
    return {
        "pods": pods,
        "row_queries_per_min": (q1 - q0) / minutes,
        # Minus the one admin /state request of ours inside the window.
        "api_requests_per_min": max(0, r1 - r0 - 1) / minutes,
        "cpu_percent": (c1 - c0) / (t1 - t0) * 100,
    }


# --------------------------------------------------------------------------- B5 churn


async def b5_churn(
    emulator: EmulatorProcess, db_url: str, *, rates: Sequence[int], step_s: float, start_index: int
) -> dict[str, Any]:
    processed = [0]
    batch_s = 0.1

    def instrument(parts: service.Parts) -> None:
        original = parts.controller.pod_changed

        def pod_changed(old: Any, new: Any) -> None:
            processed[0] += 1
            original(old, new)

        parts.controller.pod_changed = pod_changed  # type: ignore[method-assign]

    tpl = template(Shape.RUNNING)
    steps = []
    index = start_index
    async with running_service(emulator.url, settings(db_url), instrument=instrument) as parts:
        for rate in rates:
            per_batch = max(1, int(rate * batch_s))
            posted = 0
            base = processed[0]
            max_backlog = 0
            samples: list[tuple[float, int]] = []
            c0 = cpu_s()
            t0 = time.perf_counter()
            n_batches = int(step_s / batch_s)
            for b in range(n_batches):
                target = t0 + b * batch_s
                now = time.perf_counter()
                if target > now:
                    await anyio.sleep(target - now)
                await emulator.bulk(
                    count=per_batch, start=index, template=tpl, name_prefix="churn-"
                )
                index += per_batch
                posted += per_batch
                backlog = posted - (processed[0] - base)
                max_backlog = max(max_backlog, backlog)
                samples.append((time.perf_counter() - t0, backlog))
            t_end = time.perf_counter()
            end_backlog = posted - (processed[0] - base)
            with anyio.move_on_after(60):
                while processed[0] - base < posted:
                    await anyio.sleep(0.005)
            drained = time.perf_counter()
            c1 = cpu_s()
            offered = posted / (t_end - t0)
            step = {
                "target_rate": rate,
                "offered_rate": offered,
                "processed_rate": (processed[0] - base) / (drained - t0),
                "events": posted,
                "end_backlog": end_backlog,
                "max_backlog": max_backlog,
                "drain_after_end_s": drained - t_end,
                "cpu_percent": (c1 - c0) / (drained - t0) * 100,
                "queue_depth_end": len(parts.queue),
                "backlog_samples": samples,
            }
            # "Sustained": whatever arrived was processed within about two batches' time.
            step["sustained"] = step["drain_after_end_s"] < 2 * batch_s + 0.1 and (
                offered >= 0.9 * rate
            )
            steps.append(step)
            _progress(
                f"B5 target {rate:>6}/s offered {offered:>8.0f}/s "
                f"processed {step['processed_rate']:>8.0f}/s end backlog {end_backlog} "
                f"drain {step['drain_after_end_s']:.2f}s cpu {step['cpu_percent']:.0f}%"
            )
            await anyio.sleep(0.5)
    sustained = [s["offered_rate"] for s in steps if s["sustained"]]
    return {
        "steps": steps,
        "batch_s": batch_s,
        "step_s": step_s,
        "highest_sustained_rate": max(sustained) if sustained else 0.0,
        "load_average": load_average(),
    }


# --------------------------------------------------------------------------- B6 decode


async def b6_decode(fixtures: Path, *, repeats: int = 5) -> dict[str, Any]:
    decoder = PodDecoder()
    api = k8s_client.ApiClient()

    class _Response:
        def __init__(self, data: bytes) -> None:
            self.data = data

    rows = []
    for path in sorted(fixtures.glob("pod-*.json")):
        # The fixture wraps the exact body; the wire form is compact JSON.
        raw = msgspec.json.encode(msgspec.json.decode(path.read_bytes())["body"])
        msgspec_us = _per_call_us(lambda raw=raw: decoder.decode(raw), n=20_000, repeats=repeats)
        response = _Response(raw)
        model_us = _per_call_us(
            lambda response=response: api.deserialize(response, "V1Pod"), n=300, repeats=repeats
        )
        rows.append(
            {
                "fixture": path.name,
                "bytes": len(raw),
                "msgspec_us": msgspec_us,
                "model_us": model_us,
                "speedup": model_us / msgspec_us,
            }
        )
    await api.close()
    return {
        "pods": rows,
        "median_msgspec_us": median([r["msgspec_us"] for r in rows]),
        "median_model_us": median([r["model_us"] for r in rows]),
        "median_speedup": median([r["speedup"] for r in rows]),
    }


def _per_call_us(fn: Callable[[], object], *, n: int, repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        timings.append((time.perf_counter() - t0) / n * 1e6)
    return median(timings)
