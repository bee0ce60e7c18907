"""B10: a silent connection to the API server, at the default settings
(``python -m benchmarks.blackhole [--name blackhole]``; minutes, not in ``make test``).

The real service (``python -m service.cli run``, started as the end-to-end tests start it,
``tests/e2e/harness.py``) talks to the emulator through the TCP proxy of ``tests/kubeproxy.py``;
a throwaway PostgreSQL holds the rows. ``THRESHOLD_SECONDS=5``; every connectivity setting at its
default (``WATCH_SILENCE_SECONDS`` 75, ``API_TIMEOUT_SECONDS`` 10, ``WATCH_TIMEOUT_SECONDS`` 300,
leader election with its default Lease timings, heartbeat 10 s); the emulator sends a watch a
bookmark every 60 s, as a kube-apiserver does.

Once the service is ready, leads, and has received a periodic bookmark (so that its silence bound
applies: docs/architecture.md, "A silent watch"), every open connection is black-holed (no reset,
no bytes; new connections accepted), and at that instant:

- **new pod**: a pod is created whose execution row is already retired; the time from the black
  hole to its DELETE at the emulator (target: 90 s + threshold);
- **cached pod**: the row of a pod the service has cached is retired; the time to its DELETE
  (target: threshold + ``API_TIMEOUT_SECONDS`` + 5 s; it needs the keep-alive pool replaced after
  a timeout, ``service/kube/transport.py``).

Nothing else may be deleted (the other pods' rows stay active). The figures, the service's
watch restarts and pool replacements go to ``benchmarks/results/<name>.json`` under ``B10``, and
``RESULTS.md`` is rendered again.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from benchmarks.harness import load_average, machine
from devtools.emulator import Emulator, start_emulator
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.pg.devdata import NAMESPACE, seed_execution, seed_sandbox, set_execution
from devtools.pg.throwaway import ThrowawayPostgres
from service.pg.migrate import migrate
from tests.e2e.harness import (
    LEASE_NAMESPACE,
    ServiceLauncher,
    ServiceProcess,
    lease_holder,
    pod_gone_or_terminating,
    sample,
)
from tests.kubeproxy import proxied

HERE = Path(__file__).resolve().parent
THRESHOLD_S = 5.0
API_TIMEOUT_S = 10.0
"""The default ``API_TIMEOUT_SECONDS`` (the service runs with it; named here for the target)."""
BOOKMARK_INTERVAL_S = 60.0
CACHED = 4
"""Sandboxes with a pod cached before the black hole; the first one's row is retired in it."""
NEW_POD_TARGET_S = 90.0 + THRESHOLD_S
CACHED_POD_TARGET_S = THRESHOLD_S + API_TIMEOUT_S + 5.0
GIVE_UP_S = 400.0


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _seed(url: str, emu: Emulator) -> list[str]:
    """``CACHED`` Succeeded pods with active rows; their names."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrate(conn, channel="sandbox_execution_changed", with_schema=True)
        names = []
        for i in range(CACHED):
            sandbox_id = f"cached{i:02d}"
            await seed_sandbox(conn, sandbox_id, namespace=NAMESPACE)
            await seed_execution(conn, pod_name=pod_name(sandbox_id, 1), sandbox_id=sandbox_id)
            emu.create_pod(
                sandbox_pod(sandbox_id=sandbox_id, generation=1, shape=Shape.SUCCEEDED),
                namespace=NAMESPACE,
            )
            names.append(pod_name(sandbox_id, 1))
        return names
    finally:
        await conn.close()


async def _metric(service: ServiceProcess, name: str, **labels: str) -> float:
    return sample(await service.metrics(), name, **labels)


async def _wait(what: str, predicate: Any, *, timeout_s: float, interval_s: float = 0.05) -> float:
    """Wait until ``await predicate()`` (or ``predicate()``) holds; seconds taken."""
    started = time.monotonic()
    while True:
        value = predicate()
        if hasattr(value, "__await__"):
            value = await value
        if value:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await anyio.sleep(interval_s)


async def b10(pg: ThrowawayPostgres, tmp: Path) -> dict[str, Any]:
    url = pg.create_database("bench_blackhole")
    emu = Emulator(bookmark_interval_s=BOOKMARK_INTERVAL_S, kubelet_finish_after_s=0.5)
    emu.ensure_namespace(NAMESPACE)
    emu.ensure_namespace(LEASE_NAMESPACE)
    cached = await _seed(url, emu)
    running = await start_emulator(emulator=emu)
    try:
        async with proxied(running) as proxy:
            launcher = ServiceLauncher(tmp_path=tmp, emulator_url=proxy.url, database_url=url)
            try:
                return await _scenario(launcher, proxy, emu, url, cached)
            except BaseException:
                for p in launcher.processes:
                    _progress(f"service log tail:\n{p.log_tail(60)}")
                raise
            finally:
                launcher.close()
    finally:
        await running.aclose()


async def _scenario(
    launcher: ServiceLauncher, proxy: Any, emu: Emulator, url: str, cached: list[str]
) -> dict[str, Any]:
    # Every connectivity setting at its default: the launcher's test timings put back.
    service = launcher.start(
        "blackhole",
        ENABLED=True,
        DRY_RUN=False,
        THRESHOLD_SECONDS=THRESHOLD_S,
        API_TIMEOUT_SECONDS=API_TIMEOUT_S,
        LEASE_DURATION_SECONDS=15,
        RENEW_DEADLINE_SECONDS=10,
        RETRY_PERIOD_SECONDS=2,
        LISTENER_HEARTBEAT_SECONDS=10,
        SHUTDOWN_TIMEOUT_SECONDS=20,
    )
    await service.wait_for("/readyz", 200, timeout_s=60)
    await _wait("the Lease", lambda: lease_holder(emu) == "blackhole", timeout_s=60)
    _progress("ready and leading; waiting for a periodic bookmark (up to a minute)")
    bookmark_wait_s = await _wait(
        "a periodic bookmark",
        lambda: _bookmarks(service),
        timeout_s=BOOKMARK_INTERVAL_S * 2 + 10,
        interval_s=0.5,
    )
    before = {
        reason: await _metric(service, "retired_pod_gc_watch_restarts_total", reason=reason)
        for reason in ("silent", "timeout", "error", "closed", "expired")
    }
    pool_before = await _metric(service, "retired_pod_gc_api_pool_replacements_total")

    held = proxy.blackhole_existing()
    t0 = time.monotonic()
    _progress(f"black-holed {held} connection(s)")
    conn = await asyncpg.connect(url, timeout=10)
    try:
        new_id = "created00"
        await seed_sandbox(conn, new_id, namespace=NAMESPACE)
        await seed_execution(
            conn,
            pod_name=pod_name(new_id, 1),
            sandbox_id=new_id,
            execution_state="replaced",
            active=False,
        )
        emu.create_pod(
            sandbox_pod(sandbox_id=new_id, generation=1, shape=Shape.SUCCEEDED),
            namespace=NAMESPACE,
        )
        await set_execution(conn, cached[0], active=False, execution_state="replaced")
    finally:
        await conn.close()
    new_name = pod_name(new_id, 1)
    done: dict[str, float] = {}
    while len(done) < 2 and time.monotonic() - t0 < GIVE_UP_S:
        for label, name in (("cached", cached[0]), ("new", new_name)):
            if label not in done and pod_gone_or_terminating(emu, name):
                done[label] = time.monotonic() - t0
                _progress(f"{label} pod deleted {done[label]:.1f}s after the black hole")
        await anyio.sleep(0.05)
    service.assert_running()
    metrics = await service.metrics()
    others = [n for n in cached[1:] if pod_gone_or_terminating(emu, n)]
    return {
        "settings": {
            "THRESHOLD_SECONDS": THRESHOLD_S,
            "API_TIMEOUT_SECONDS": API_TIMEOUT_S,
            "WATCH_SILENCE_SECONDS": 75.0,
            "WATCH_TIMEOUT_SECONDS": 300.0,
            "bookmark_interval_s": BOOKMARK_INTERVAL_S,
        },
        "bookmark_wait_s": bookmark_wait_s,
        "connections_black_holed": held,
        "new_pod_delete_s": done.get("new"),
        "new_pod_target_s": NEW_POD_TARGET_S,
        "cached_pod_delete_s": done.get("cached"),
        "cached_pod_target_s": CACHED_POD_TARGET_S,
        "wrongly_deleted": others,
        "watch_restarts": {
            reason: sample(metrics, "retired_pod_gc_watch_restarts_total", reason=reason)
            - before[reason]
            for reason in before
        },
        "pool_replacements": sample(metrics, "retired_pod_gc_api_pool_replacements_total")
        - pool_before,
        "relists": sample(metrics, "retired_pod_gc_relists_total"),
        "warnings": _warnings(service),
    }


def _warnings(service: ServiceProcess) -> list[str]:
    """The service's warning lines (logger: message)."""
    out = []
    for line in service.log_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("level") == "warning":
            out.append(f"{doc.get('logger')}: {doc.get('msg')}")
    return out


async def _bookmarks(service: ServiceProcess) -> bool:
    # The initial-events-end bookmark of the streaming list, then a periodic one.
    return await _metric(service, "retired_pod_gc_watch_events_total", type="BOOKMARK") >= 2


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.blackhole", description=__doc__)
    parser.add_argument("--name", default="blackhole", help="results/<name>.json")
    return parser.parse_args()


async def _main() -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m benchmarks.blackhole", *sys.argv[1:]]),
        "load_average_start": load_average(),
        "config": {"repeats": 1},
    }
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory() as tmp:
        results["B10"] = await b10(pg, Path(tmp))
    results["load_average_end"] = load_average()
    return results


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    args = _args()
    results = anyio.run(_main)
    out = HERE / "results" / f"{args.name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=float) + "\n")
    _progress(f"wrote {out}: {json.dumps(results['B10'])}")
    try:
        from benchmarks import report  # noqa: PLC0415 (matplotlib: the bench extra)
    except ImportError as exc:
        _progress(f"RESULTS.md not rendered ({exc}): python -m benchmarks.report")
        return
    report.render(HERE)


if __name__ == "__main__":
    main()
