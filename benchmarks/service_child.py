"""B1's service process: cold start against a running emulator and database, measured from
inside (``python -m benchmarks.service_child --emulator URL --db URL``; prints one JSON line).

Measured: RSS and CPU after imports and build (the empty service), time to the informer's
first sync, RSS and CPU then, and the same once the initial catch-up (every cached candidate
reconciled: one batched row lookup each) has drained the work queue.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import anyio

from benchmarks.harness import cpu_s, rss_kib, running_service, settings, wait_queue_idle


async def _main(args: argparse.Namespace) -> dict[str, float]:
    cfg = settings(args.db)
    gc.collect()
    out: dict[str, float] = {}
    out["rss_base_kib"] = rss_kib()
    cpu0 = cpu_s()
    t0 = time.perf_counter()
    async with running_service(args.emulator, cfg, wait_idle=False) as parts:
        out["synced_s"] = time.perf_counter() - t0
        out["cpu_synced_s"] = cpu_s() - cpu0
        out["rss_synced_kib"] = rss_kib()
        out["cached_pods"] = len(parts.informer)
        await wait_queue_idle(parts)
        out["idle_s"] = time.perf_counter() - t0
        out["cpu_idle_s"] = cpu_s() - cpu0
        gc.collect()
        out["rss_idle_kib"] = rss_kib()
        out["row_queries"] = sum(
            s.value
            for fam in parts.metrics.registry.collect()
            for s in fam.samples
            if s.name == "retired_pod_gc_row_queries_total"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--emulator", required=True)
    parser.add_argument("--db", required=True)
    args = parser.parse_args()
    result = anyio.run(_main, args)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
