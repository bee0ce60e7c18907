"""B1's service process: cold start against a running emulator and database, measured from
inside (``python -m benchmarks.service_child --emulator URL --db URL``; prints one JSON line).

Measured: RSS and CPU after imports and build (the empty service), time to the informer's
first sync, RSS and CPU then, and the same once the initial catch-up (every cached candidate
reconciled: one batched row lookup each) has drained the work queue; the API requests the sync
made. With ``--relist``, then a forced relist (watches dropped, the next watch answered 410):
its time, its requests, and the **peak** RSS while it ran (the kernel's high-water mark, reset
just before it).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

import aiohttp
import anyio

from benchmarks.harness import (
    counter_total,
    cpu_s,
    rss_kib,
    running_service,
    settings,
    wait_queue_idle,
)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


async def _admin(
    session: aiohttp.ClientSession, url: str, method: str, path: str, body: Any = None
) -> Any:
    async with session.request(method, f"{url}/_emulator/{path}", json=body) as response:
        response.raise_for_status()
        return await response.json()


def _summarise_requests(entries: list[dict[str, Any]]) -> dict[str, Any]:
    pods = [e for e in entries if "/pods" in e.get("path", "")]
    return {
        "api_requests": len(entries),
        "pod_requests": len(pods),
        "streaming_requests": sum(1 for e in pods if "sendInitialEvents" in (e.get("query") or {})),
        "requests": [
            {"method": e.get("method"), "path": e.get("path"), "query": e.get("query")}
            for e in entries[:20]
        ],
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    cfg = settings(args.db, LIST_MODE=args.list_mode)
    gc.collect()
    out: dict[str, Any] = {"list_mode": args.list_mode}
    async with aiohttp.ClientSession() as session:
        seen = len(await _admin(session, args.emulator, "GET", "requests"))
        out["rss_base_kib"] = rss_kib()
        _reset_peak_rss()
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
            out["peak_rss_sync_kib"] = _status_kib("VmHWM")
            gc.collect()
            out["rss_idle_kib"] = rss_kib()
            out["row_queries"] = counter_total(parts.metrics, "retired_pod_gc_row_queries_total")
            entries = await _admin(session, args.emulator, "GET", "requests")
            out["sync"] = _summarise_requests(entries[seen:])
            seen = len(entries)
            if args.relist:
                if args.quorum:
                    await _admin(
                        session,
                        args.emulator,
                        "POST",
                        "faults",
                        {
                            "count": 1,
                            "code": 410,
                            "method": "GET",
                            "query": {"resourceVersionMatch": "NotOlderThan"},
                        },
                    )
                relists = counter_total(parts.metrics, "retired_pod_gc_relists_total")
                await anyio.sleep(1.0)
                gc.collect()
                out["rss_before_relist_kib"] = rss_kib()
                _reset_peak_rss()
                cpu1, t1 = cpu_s(), time.perf_counter()
                await _admin(session, args.emulator, "POST", "watches/drop", {"abrupt": False})
                await _admin(session, args.emulator, "POST", "watches/expire-next", {"count": 1})
                with anyio.fail_after(300):
                    while counter_total(parts.metrics, "retired_pod_gc_relists_total") <= relists:
                        await anyio.sleep(0.01)
                    await anyio.sleep(0.05)
                    await parts.informer.wait_synced()
                out["relist_synced_s"] = time.perf_counter() - t1
                await wait_queue_idle(parts)
                out["relist_done_s"] = time.perf_counter() - t1
                out["cpu_relist_s"] = cpu_s() - cpu1
                out["peak_rss_relist_kib"] = _status_kib("VmHWM")
                out["cached_pods_after_relist"] = len(parts.informer)
                entries = await _admin(session, args.emulator, "GET", "requests")
                out["relist"] = _summarise_requests(entries[seen:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--emulator", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--list-mode", default="auto", choices=("auto", "stream", "list"))
    parser.add_argument("--relist", action="store_true", help="then force a relist and measure it")
    parser.add_argument(
        "--quorum", action="store_true", help="refuse the relist's cache list (410): quorum list"
    )
    args = parser.parse_args()
    result = anyio.run(_main, args)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
