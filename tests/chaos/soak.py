"""Bounded soak: 10k sandbox pods with steady churn against the real service wiring (~10 min).

One service instance (``build``/``run``), the emulator and a throwaway PostgreSQL, all in this
process. Every second: ~100 pod status changes, ~30 retirements, ~10 re-activations, and every
pod the service deleted is replaced by the next generation (new pod + new active row), so the
population stays at ``--pods``. Every 60 s the watches are dropped; every 90 s the listener's
connection is killed. Every 10 s a sample: RSS (this process: service *and* emulator, whose audit log is cleared every second), asyncio
task count, tracked observation clocks, work-queue depth, cache size, deletes so far.

Fails (exit 1) on a growth trend after the warm-up (the first quarter): RSS slope above
``--rss-slope-mib-per-min`` (default 2 MiB/min) or growth above ``--rss-growth-mib`` (48 MiB);
task count growing by more than 20; tracked clocks or queue depth above the pod count.

``python -m tests.chaos.soak [--seconds 600] [--pods 10000]`` (``make soak``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import random
import sys
import time
from dataclasses import dataclass

import anyio
import asyncpg
from prometheus_client import CollectorRegistry

from service.app.service import build, run
from service.config import load
from service.emulator import Emulator, start_emulator
from service.emulator.core import DEFAULT_POD_TEMPLATE
from service.kube.api import new_api_client
from service.metrics import Metrics
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from service.pg.throwaway import ThrowawayPostgres
from tests.chaos.campaign import PREFIX
from tests.chaos.model import NAMESPACE, PodShape, pod_status

SAMPLE_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    rss_mib: float
    tasks: int
    clocks: int
    queue: int
    cache: int
    deletes: int


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


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
    emu = Emulator(bookmark_interval_s=5.0, kubelet_finish_after_s=1.0)
    running = await start_emulator(emulator=emu)
    api = await new_api_client(host=running.url)
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
        emu.bulk_create_pods(namespace=NAMESPACE, count=args.pods, template=template)
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
            metrics=Metrics(CollectorRegistry()),
        )
        stop = anyio.Event()
        samples: list[Sample] = []
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
                    pod = emu.get_pod(NAMESPACE, name)
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
                        emu.bulk_create_pods(
                            namespace=NAMESPACE,
                            count=1,
                            start=int(sid, 16),
                            template=template,
                            generation=generation[sid],
                        )
                    elif not pod["metadata"].get("deletionTimestamp"):
                        emu.set_status(NAMESPACE, name, pod_status(rng.choice(shapes)))
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
                # The emulator's audit log keeps every DELETE (~1 KiB each): it is the harness's
                # memory, not the service's, so it is not allowed to accumulate.
                emu.audit.clear()
                if tick % 60 == 0:
                    emu.drop_watches(abrupt=True)
                if tick % 90 == 0:
                    await conn.execute(
                        """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                           WHERE application_name = 'retired-pod-gc-listener'"""
                    )
                if now >= next_sample:
                    next_sample += SAMPLE_EVERY_S
                    deletes = parts.metrics.registry.get_sample_value(
                        "retired_pod_gc_deletes_total", {"result": "deleted"}
                    )
                    sample = Sample(
                        t_s=now - started,
                        rss_mib=rss_mib(),
                        tasks=len(asyncio.all_tasks()),
                        clocks=len(parts.clocks),
                        queue=len(parts.queue)
                        + int(
                            parts.metrics.registry.get_sample_value("retired_pod_gc_queue_delayed")
                            or 0
                        ),
                        cache=len(parts.informer),
                        deletes=int(deletes or 0),
                    )
                    samples.append(sample)
                    print(
                        f"t={sample.t_s:6.0f}s rss={sample.rss_mib:7.1f}MiB tasks={sample.tasks:4d} "
                        f"clocks={sample.clocks:5d} queue={sample.queue:5d} "
                        f"cache={sample.cache:6d} deletes={sample.deletes}",
                        flush=True,
                    )
                await anyio.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
            stop.set()
        failures.extend(judge(samples, args))
    finally:
        await conn.close()
        await api.close()
        await running.aclose()
        await anyio.to_thread.run_sync(server.stop)
    return failures


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    failures = anyio.run(soak, args)
    for f in failures:
        print(f"SOAK FAILURE: {f}")
    print("soak " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
