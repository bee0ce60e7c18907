"""B9, a throttled priority level: ``python -m benchmarks.throttled [--rows 300] [--seats 1]``.

The emulator answers 429 with ``Retry-After`` beyond ``--seats`` concurrent requests of one user
(a priority level of API Priority and Fairness with that many seats that rejects instead of
queueing). Two clients delete ``--rows`` Succeeded pods each, side by side in one run, on that
level:

1. **one sequential client**: for each pod a GET, a preconditioned DELETE and an Event, one
   request at a time (it never exceeds one seat, so it is never throttled): the rate the level
   admits to a careful client;
2. **the controller** (the real wiring, 32 workers, ``DELETES_PER_MINUTE=6000``, Events on),
   whose ``--rows`` rows are retired in one statement once its cache is synced: every pod must be
   deleted, each with its ``RetiredPodDeleted`` Event.

Every request holds its seat ``--latency-ms`` (5 ms) beyond its handling, as a real server's
work on it (the in-process emulator would otherwise answer without yielding, and no two
requests would ever overlap).

Reported: each client's delete rate (deletes over the span from its first to its last DELETE),
the controller's rate as a fraction of the sequential one (the goal: at least half), the time
until the controller's last Event, the 429s each drew, the concurrency limit at the end, and the
log lines the controller wrote at the default level (info). Results go to
``benchmarks/results/throttled.json`` (B9 of ``benchmarks/RESULTS.md``, rendered again).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import asyncpg

from benchmarks.harness import (
    NAMESPACE,
    Population,
    load_average,
    machine,
    running_service,
    seed_rows,
    settings,
)
from devtools.emulator import Emulator, start_emulator
from devtools.emulator.flowcontrol import FlowControl
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from devtools.pg.throwaway import ThrowawayPostgres
from service.domain import ExecutionState, Verdict
from service.kube.api import new_api_client
from service.kube.client import KubePodClient
from service.kube.decode import PodDecoder
from service.kube.events import REASON_DELETED, event_body
from service.metrics import KubeMetrics
from service.ports import ReapReport

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "throttled.json"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throttled", description=__doc__)
    p.add_argument("--rows", type=int, default=300, help="pods each client deletes")
    p.add_argument("--seats", type=int, default=1, help="concurrent requests the level admits")
    p.add_argument(
        "--latency-ms",
        type=float,
        default=5.0,
        help="how long the emulator takes for each request (it holds its seat that long)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p.parse_args()


_DEFAULTS = {"rows": 300, "seats": 1, "latency_ms": 5.0, "timeout_s": 600.0}


def throttle(emu: Emulator, *, seats: int, seat_time_s: float) -> FlowControl:
    """The emulator's priority level: 429 beyond ``seats`` concurrent requests of a user, each
    request holding its seat ``seat_time_s`` beyond its handling."""
    emu.flow_control = FlowControl(seats=seats, seat_time_s=seat_time_s)
    return emu.flow_control


def _progress(message: str) -> None:
    print(f"[B9 {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _rejected(flow: FlowControl) -> int:
    return sum(flow.rejected.values())


def pod_name(index: int) -> str:
    return f"space-sbx-{index:012x}-g1"


class LineCounter(logging.Handler):
    """Counts the records of the service's loggers at INFO and above (what the default level
    writes)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("service"):
            self.records.append(record)

    def summary(self) -> dict[str, Any]:
        by_level: dict[str, int] = {}
        for record in self.records:
            by_level[record.levelname] = by_level.get(record.levelname, 0) + 1
        warnings = sorted({r.getMessage()[:160] for r in self.records if r.levelno >= 30})
        return {"lines": len(self.records), "by_level": by_level, "warnings": warnings}


def _status_counts(emu: Emulator, since: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in list(emu.requests)[since:]:
        counts[str(record.status)] = counts.get(str(record.status), 0) + 1
    return counts


def _delete_times(emu: Emulator, names: set[str]) -> list[float]:
    return sorted(
        e.time_s
        for e in emu.audit_log(method="DELETE", path_contains="/pods/")
        if e.status in (200, 202) and e.path.rsplit("/", 1)[-1] in names
    )


async def sequential(url: str, emu: Emulator, rows: range) -> dict[str, Any]:
    """GET, DELETE, Event for each pod, one request at a time."""
    metrics = KubeMetrics()
    api = await new_api_client(host=url, metrics=metrics)
    cfg = settings("postgresql://unused@127.0.0.1/x")
    pods = KubePodClient(api, cfg.kube, PodDecoder(cfg.kube.label_keys), metrics)
    first = len(emu.requests)
    started = time.perf_counter()
    written = 0
    try:
        for i in rows:
            fresh = await pods.get_pod(NAMESPACE, pod_name(i))
            assert fresh is not None
            await pods.delete_pod(
                NAMESPACE, fresh.name, uid=fresh.uid, resource_version=fresh.resource_version
            )
            report = ReapReport(
                pod=fresh,
                verdict=Verdict.TERMINAL_RETIRED,
                rule="benchmark",
                reapable_for_s=0.0,
                row_state=ExecutionState.REPLACED,
                dry_run=False,
            )
            answer = await api.request(
                "POST",
                f"/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events",
                op=None,
                body=event_body(report, instance="bench", at_s=time.time()),
                timeouts=aiohttp.ClientTimeout(total=cfg.kube.api_timeout_s),
                expect=(201,),
            )
            written += answer.status == 201
    finally:
        await api.close()
    elapsed = time.perf_counter() - started
    times = _delete_times(emu, {pod_name(i) for i in rows})
    span = times[-1] - times[0]
    return {
        "deleted": len(times),
        "events": written,
        "elapsed_s": round(elapsed, 3),
        "delete_span_s": round(span, 3),
        "deletes_per_s": round((len(times) - 1) / span, 1),
        "statuses": _status_counts(emu, first),
    }


async def controller(
    url: str, emu: Emulator, db_url: str, rows: range, timeout_s: float
) -> dict[str, Any]:
    names = [pod_name(i) for i in rows]
    cfg = settings(
        db_url, DRY_RUN="false", THRESHOLD_SECONDS="1", LOG_LEVEL="info", EVENTS_ENABLED="true"
    )
    counter = LineCounter()
    service_logger = logging.getLogger("service")
    service_logger.setLevel(logging.INFO)
    service_logger.addHandler(counter)
    first = len(emu.requests)
    try:
        async with running_service(url, cfg) as parts:
            conn = await asyncpg.connect(db_url)
            try:
                await conn.execute(
                    """UPDATE sandbox_k8s_executions
                          SET active = false, execution_state = 'replaced', retired_at = now()
                        WHERE pod_name = ANY($1::text[])""",
                    names,
                )
            finally:
                await conn.close()
            retired_at = time.time()
            _progress("rows retired")
            wanted = set(names)
            with anyio.fail_after(timeout_s):
                while True:
                    events = [
                        e
                        for e in emu.events.events(NAMESPACE)
                        if e.get("reason") == REASON_DELETED and e["regarding"]["name"] in wanted
                    ]
                    if len(_delete_times(emu, wanted)) == len(names) and len(events) == len(names):
                        break
                    await anyio.sleep(0.05)
            last_event_s = time.time() - retired_at
            registry = parts.metrics.registry
            limit = registry.get_sample_value("retired_pod_gc_api_concurrency_limit")
            outcomes = {
                s.labels["verdict"]: s.value
                for f in registry.collect()
                for s in f.samples
                if s.name == "cluster_reconciler_outcome_total" and s.value
            }
    finally:
        service_logger.removeHandler(counter)
    times = _delete_times(emu, set(names))
    span = times[-1] - times[0]
    return {
        "deleted": len(times),
        "events": len(events),
        "first_delete_after_retire_s": round(times[0] - retired_at, 3),
        "delete_span_s": round(span, 3),
        "deletes_per_s": round((len(times) - 1) / span, 1),
        "last_event_after_retire_s": round(last_event_s, 3),
        "statuses": _status_counts(emu, first),
        "concurrency_limit_at_end": limit,
        "outcomes": outcomes,
        "log": counter.summary(),
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    rows = args.rows
    with ThrowawayPostgres() as pg:
        db_url = pg.url
        await seed_rows(db_url, Population(2 * rows))
        emu = Emulator(bookmark_interval_s=60.0, history_size=100_000)
        emu.ensure_namespace(NAMESPACE)
        for i in range(2 * rows):
            pod = sandbox_pod(
                sandbox_id=f"{i:012x}", generation=1, shape=Shape.SUCCEEDED, namespace=NAMESPACE
            )
            emu.create_pod(pod, namespace=NAMESPACE)
        running = await start_emulator(emulator=emu)
        try:
            # A request holds its seat while the server works on it; the in-process emulator
            # would answer without ever yielding, so no two requests would ever overlap.
            flow = throttle(emu, seats=args.seats, seat_time_s=args.latency_ms / 1000)
            before = _rejected(flow)
            _progress(f"sequential client: {rows} pods")
            seq = await sequential(running.url, emu, range(rows))
            seq["answers_429"] = _rejected(flow) - before
            before = _rejected(flow)
            _progress(f"sequential: {seq['deletes_per_s']} deletes/s; controller: {rows} rows")
            ctl = await controller(running.url, emu, db_url, range(rows, 2 * rows), args.timeout_s)
            ctl["answers_429"] = _rejected(flow) - before
        finally:
            await running.aclose()
    return {
        "rows": rows,
        "seats": args.seats,
        "latency_ms": args.latency_ms,
        "sequential": seq,
        "controller": ctl,
        "controller_vs_sequential": round(ctl["deletes_per_s"] / seq["deletes_per_s"], 2),
    }


def main() -> None:
    args = _args()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = load_average()
    result = anyio.run(_main, args)
    command = "python -m benchmarks.throttled" + "".join(
        f" --{k.replace('_', '-')} {v:g}" for k, v in vars(args).items() if v != _DEFAULTS[k]
    )
    run = {
        "machine": machine(),
        "started": started,
        "command": command,
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "config": {"repeats": 1},
        "B9": result,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(run, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    try:
        from benchmarks import report  # noqa: PLC0415 (matplotlib: the bench extra)
    except ImportError:
        print("benchmarks/RESULTS.md not rendered: python -m benchmarks.report needs matplotlib")
        return
    report.render(HERE)


if __name__ == "__main__":
    main()
