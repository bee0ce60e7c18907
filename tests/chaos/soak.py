"""Bounded soak: 10k sandbox pods with steady churn against the real service wiring (~10 min).

One service instance (``build``/``run``) and a throwaway PostgreSQL in this process; the API
server emulator in a child process (``python -m devtools.emulator``), driven over HTTP, so that
the RSS sampled is the service's alone. Every second: ~100 pod status changes, ~30
retirements, ~10 re-activations, and every pod the service deleted is replaced by the next
generation (new pod + new active row), so the population stays near ``--pods``. Every 60 s the
watches are dropped; every 90 s the listener's connection is killed. Every 10 s a sample: RSS
of this process (the service) and of the emulator, allocated Python blocks, asyncio task count,
tracked observation clocks, work-queue depth, cache size, deletes so far.

Fails (exit 1) on a growth trend of the service after the warm-up (the first quarter): RSS slope
above ``--rss-slope-mib-per-min`` (default 2 MiB/min) or growth above ``--rss-growth-mib`` (48
MiB); task count growing by more than 20; tracked clocks or queue depth above the pod count.

``python -m tests.chaos.soak [--seconds 600] [--pods 10000] [--trace-memory]`` (``make soak``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import random
import sys
import time
import tracemalloc
from dataclasses import dataclass

import anyio
import asyncpg
from prometheus_client import CollectorRegistry

from benchmarks.harness import EmulatorProcess, rss_kib
from devtools.emulator.core import DEFAULT_POD_TEMPLATE
from devtools.pg.throwaway import ThrowawayPostgres
from service.app.service import Parts, build, run
from service.config import PREFIX, load
from service.kube.api import new_api_client
from service.metrics import Metrics
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from tests.chaos.model import NAMESPACE, PodShape
from tests.chaos.world import pod_status

SAMPLE_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    rss_mib: float
    emulator_rss_mib: float
    blocks: int
    tasks: int
    clocks: int
    queue: int
    cache: int
    deletes: int


def rss_mib() -> float:
    return rss_kib() / 1024


def slope_per_min(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return (
        0.0
        if var == 0
        else 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    )


async def soak(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    server = ThrowawayPostgres(settings={"max_connections": "100"})
    await anyio.to_thread.run_sync(server.start)
    emu = await EmulatorProcess(bookmark_interval_s=5, kubelet_finish_after_s=1).start()
    metrics = Metrics(CollectorRegistry())
    api = await new_api_client(host=emu.url, metrics=metrics.kube)
    conn = await asyncpg.connect(server.url)
    failures: list[str] = []
    try:
        await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
        ids = [f"{i:012x}" for i in range(args.pods)]
        generation = dict.fromkeys(ids, 1)
        await conn.executemany(
            "INSERT INTO sandboxes (id, namespace, managed_by) VALUES ($1, $2, 'kubernetes')",
            [(i, NAMESPACE) for i in ids],
        )
        await conn.executemany(
            """INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,
               pod_name, pod_kind, execution_state, active) VALUES ($1, 1, 0, $2, 'create',
               'active', true)""",
            [(i, f"space-sbx-{i}-g1") for i in ids],
        )
        template = dict(DEFAULT_POD_TEMPLATE)
        template["status"] = pod_status(PodShape.SUCCEEDED)
        await emu.bulk(count=args.pods, start=0, template=template)
        env = {
            "ENABLED": "true",
            "DRY_RUN": "false",
            "THRESHOLD_SECONDS": "5",
            "DELETES_PER_MINUTE": "1200",
            "NAMESPACE": NAMESPACE,
            "DATABASE_URL": server.url,
            "METRICS_BIND_ADDRESS": "127.0.0.1:0",
            "LEADER_ELECTION": "false",
            "RESYNC_PERIOD_SECONDS": "120",
            "LISTENER_HEARTBEAT_SECONDS": "2",
            "LISTENER_HEARTBEAT_TIMEOUT_SECONDS": "2",
        }
        parts = build(
            load({PREFIX + k: v for k, v in env.items()}),
            api=api,
            metrics=metrics,
        )
        stop = anyio.Event()
        samples: list[Sample] = []
        baseline: tracemalloc.Snapshot | None = None
        if args.trace_memory:
            tracemalloc.start(1)
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(run, parts, stop=stop))
            started = time.monotonic()
            next_sample = started
            tick = 0
            while (now := time.monotonic()) - started < args.seconds:
                tick += 1
                shapes = [PodShape.SUCCEEDED, PodShape.RUNNING, PodShape.PENDING_STUCK]
                for sid in rng.sample(ids, 100):
                    name = f"space-sbx-{sid}-g{generation[sid]}"
                    pod = await emu.get_pod(name)
                    if pod is None:
                        # Deleted by the service: the sandbox moves to its next generation.
                        generation[sid] += 1
                        new = f"space-sbx-{sid}-g{generation[sid]}"
                        await conn.execute(
                            """INSERT INTO sandbox_k8s_executions (sandbox_id, generation,
                               activation_attempt, pod_name, pod_kind, execution_state, active)
                               VALUES ($1, $2, 0, $3, 'create', 'active', true)""",
                            sid,
                            generation[sid],
                            new,
                        )
                        await emu.bulk(
                            count=1,
                            start=int(sid, 16),
                            template=template,
                            generation=generation[sid],
                        )
                    elif not pod["metadata"].get("deletionTimestamp"):
                        await emu.replace_status(pod, pod_status(rng.choice(shapes)))
                names = [f"space-sbx-{s}-g{generation[s]}" for s in rng.sample(ids, 40)]
                await conn.execute(
                    """UPDATE sandbox_k8s_executions SET active = false,
                       execution_state = 'suspended' WHERE pod_name = ANY($1::text[])""",
                    names[:30],
                )
                await conn.execute(
                    """UPDATE sandbox_k8s_executions SET active = true,
                       execution_state = 'active' WHERE pod_name = ANY($1::text[])""",
                    names[30:],
                )
                # The emulator's audit log keeps every DELETE: it is not allowed to accumulate.
                await emu.clear_audit()
                if tick % 60 == 0:
                    await emu.drop_watches()
                if tick % 90 == 0:
                    await conn.execute(
                        """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                           WHERE application_name = 'retired-pod-gc-listener'"""
                    )
                if now >= next_sample:
                    next_sample += SAMPLE_EVERY_S
                    sample = take_sample(parts, now - started, emu.rss_kib() / 1024)
                    samples.append(sample)
                    print(
                        f"t={sample.t_s:6.0f}s rss={sample.rss_mib:6.1f}MiB "
                        f"(emulator {sample.emulator_rss_mib:6.1f}) blocks={sample.blocks:8d} "
                        f"tasks={sample.tasks:3d} clocks={sample.clocks:5d} "
                        f"queue={sample.queue:5d} cache={sample.cache:6d} "
                        f"deletes={sample.deletes}",
                        flush=True,
                    )
                    if args.trace_memory:
                        baseline = report_allocations(baseline, sample.t_s, args.seconds)
                await anyio.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
            stop.set()
        failures.extend(judge(samples, args))
    finally:
        await conn.close()
        await api.close()
        await emu.aclose()
        await anyio.to_thread.run_sync(server.stop)
    return failures


def take_sample(parts: Parts, t_s: float, emulator_rss_mib: float) -> Sample:
    registry = parts.metrics.registry
    deletes = sum(
        registry.get_sample_value(
            "retired_pod_gc_deletes_total", {"sandbox_namespace": ns, "result": "deleted"}
        )
        or 0.0
        for ns in parts.settings.kube.namespaces
    )
    delayed = registry.get_sample_value("retired_pod_gc_queue_delayed")
    return Sample(
        t_s=t_s,
        rss_mib=rss_mib(),
        emulator_rss_mib=emulator_rss_mib,
        blocks=sys.getallocatedblocks(),
        tasks=len(asyncio.all_tasks()),
        clocks=len(parts.clocks),
        queue=len(parts.queue) + int(delayed or 0),
        cache=len(parts.informer),
        deletes=int(deletes or 0),
    )


def report_allocations(
    baseline: tracemalloc.Snapshot | None, t_s: float, seconds: float
) -> tracemalloc.Snapshot | None:
    """``--trace-memory``: the source lines whose live allocations grew most since the first
    sample after the warm-up (a quarter of the run)."""
    if t_s < seconds / 4:
        return baseline
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    if baseline is None:
        return snapshot
    top = snapshot.compare_to(baseline, "lineno")[:12]
    total = sum(stat.size_diff for stat in snapshot.compare_to(baseline, "filename"))
    print(f"  traced growth since warm-up: {total / 2**20:+.1f} MiB; top lines:")
    for stat in top:
        frame = stat.traceback[0]
        print(
            f"    {stat.size_diff / 2**10:+9.0f} KiB {stat.count_diff:+7d} blocks "
            f"{frame.filename}:{frame.lineno}"
        )
    return baseline


def judge(samples: list[Sample], args: argparse.Namespace) -> list[str]:
    failures = []
    steady = samples[len(samples) // 4 :]
    if len(steady) < 3:
        return ["too few samples to judge a trend (run longer)"]
    xs = [s.t_s for s in steady]
    rss_slope = slope_per_min(xs, [s.rss_mib for s in steady])
    growth = steady[-1].rss_mib - steady[0].rss_mib
    print(f"after warm-up: RSS slope {rss_slope:+.2f} MiB/min, growth {growth:+.1f} MiB")
    if rss_slope > args.rss_slope_mib_per_min:
        failures.append(f"RSS grows {rss_slope:.2f} MiB/min (bound {args.rss_slope_mib_per_min})")
    if growth > args.rss_growth_mib:
        failures.append(f"RSS grew {growth:.1f} MiB after warm-up (bound {args.rss_growth_mib})")
    tasks = [s.tasks for s in steady]
    if max(tasks) - min(tasks) > 20 or slope_per_min(xs, [float(t) for t in tasks]) > 2:
        failures.append(f"task count drifts: {tasks}")
    for s in steady:
        if s.clocks > args.pods or s.queue > args.pods:
            failures.append(
                f"clocks {s.clocks} / queue {s.queue} exceed the pod count at {s.t_s:.0f}s"
            )
            break
    if steady[-1].deletes <= steady[0].deletes:
        failures.append("no deletes during the steady phase: the service stopped acting")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rss-slope-mib-per-min", type=float, default=2.0)
    parser.add_argument("--rss-growth-mib", type=float, default=48.0)
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="tracemalloc: print the lines whose allocations grew since the warm-up (slow)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    failures = anyio.run(soak, args)
    for f in failures:
        print(f"SOAK FAILURE: {f}")
    print("soak " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
