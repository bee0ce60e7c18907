"""B10: a silent connection to the API server, and B11: every connection black-holed for 3
minutes, at the default settings (``python -m benchmarks.blackhole [--only B10|B11] [--name N]``;
minutes, not in ``make test``; results in ``blackhole.json`` and ``blackhole-all.json`` by
default).

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
  a timeout, ``service/kube/sessions.py``).

Nothing else may be deleted (the other pods' rows stay active). The figures, the service's
watch restarts and pool replacements go to ``benchmarks/results/<name>.json`` under ``B10``, and
``RESULTS.md`` is rendered again.

B11 starts the same way; then every connection is black-holed, the new ones too (accepted, never
a byte: an unreachable control plane behind a load balancer), and the row of a cached pod is
retired at once. ``/readyz`` and ``retired_pod_gc_api_reachable`` are read every 0.2 s: when each
said the API server cannot be reached (target: within ``RETRY_PERIOD_SECONDS`` + the Lease attempt
bound, docs/operations.md). After :data:`OUTAGE_S` the proxy is restored (the black-holed
connections stay dead) and the time from the restore to the pod's DELETE is measured (target:
threshold + 10 s), and to readiness again; every warning line of the run is kept.
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
OUTAGE_S = 180.0
RESTORE_TARGET_S = THRESHOLD_S + 10.0


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


async def b10(pg: ThrowawayPostgres, tmp: Path, *, everything: bool = False) -> dict[str, Any]:
    url = pg.create_database("bench_blackhole_all" if everything else "bench_blackhole")
    emu = Emulator(bookmark_interval_s=BOOKMARK_INTERVAL_S, kubelet_finish_after_s=0.5)
    emu.ensure_namespace(NAMESPACE)
    emu.ensure_namespace(LEASE_NAMESPACE)
    cached = await _seed(url, emu)
    running = await start_emulator(emulator=emu)
    try:
        async with proxied(running) as proxy:
            launcher = ServiceLauncher(tmp_path=tmp, emulator_url=proxy.url, database_url=url)
            try:
                if everything:
                    return await _outage(launcher, proxy, emu, url, cached)
                return await _scenario(launcher, proxy, emu, url, cached)
            except BaseException:
                for p in launcher.processes:
                    _progress(f"service log tail:\n{p.log_tail(60)}")
                raise
            finally:
                launcher.close()
    finally:
        await running.aclose()


def _start(launcher: ServiceLauncher) -> ServiceProcess:
    # Every connectivity setting at its default: the launcher's test timings put back.
    return launcher.start(
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


async def _leading_with_bookmarks(service: ServiceProcess, emu: Emulator) -> float:
    """Wait until ``service`` is ready, leads and has had a periodic bookmark; the seconds the
    bookmark took after that."""
    await service.wait_for("/readyz", 200, timeout_s=60)
    await _wait("the Lease", lambda: lease_holder(emu) == "blackhole", timeout_s=60)
    _progress("ready and leading; waiting for a periodic bookmark (up to a minute)")
    return await _wait(
        "a periodic bookmark",
        lambda: _bookmarks(service),
        timeout_s=BOOKMARK_INTERVAL_S * 2 + 10,
        interval_s=0.5,
    )


async def _scenario(
    launcher: ServiceLauncher, proxy: Any, emu: Emulator, url: str, cached: list[str]
) -> dict[str, Any]:
    service = _start(launcher)
    bookmark_wait_s = await _leading_with_bookmarks(service, emu)
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


async def _outage(
    launcher: ServiceLauncher, proxy: Any, emu: Emulator, url: str, cached: list[str]
) -> dict[str, Any]:
    service = _start(launcher)
    bookmark_wait_s = await _leading_with_bookmarks(service, emu)
    warnings_before = len(_warnings(service))
    pool_before = await _metric(service, "retired_pod_gc_api_pool_replacements_total")
    held = proxy.blackhole_all()
    t0 = time.monotonic()
    _progress(f"black-holed every connection ({held} open); restoring in {OUTAGE_S:.0f}s")
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await set_execution(conn, cached[0], active=False, execution_state="replaced")
    finally:
        await conn.close()
    unready_s: float | None = None
    unreachable_s: float | None = None
    readyz_body = ""
    while time.monotonic() - t0 < OUTAGE_S:
        status, body = await service.get("/readyz")
        if unready_s is None and status == 503 and "kubernetes api" in body:
            unready_s, readyz_body = time.monotonic() - t0, body.strip()
            _progress(f"/readyz 503 after {unready_s:.1f}s: {readyz_body}")
        if unreachable_s is None and await _metric(service, "retired_pod_gc_api_reachable") == 0:
            unreachable_s = time.monotonic() - t0
        await anyio.sleep(0.2)
    deleted_in_outage = pod_gone_or_terminating(emu, cached[0])
    status, body = await service.get("/readyz")
    readyz_at_restore = f"{status} {body.strip()}"
    age_at_restore = await _metric(service, "retired_pod_gc_api_last_answer_age_seconds")
    proxy.restore()
    t_restore = time.monotonic()
    _progress("restored; waiting for the DELETE")
    delete_s: float | None = None
    ready_s: float | None = None
    while (delete_s is None or ready_s is None) and time.monotonic() - t_restore < GIVE_UP_S:
        if delete_s is None and pod_gone_or_terminating(emu, cached[0]):
            delete_s = time.monotonic() - t_restore
            _progress(f"pod deleted {delete_s:.1f}s after the restore")
        if ready_s is None and (await service.get("/readyz"))[0] == 200:
            ready_s = time.monotonic() - t_restore
        await anyio.sleep(0.05)
    service.assert_running()
    metrics = await service.metrics()
    return {
        "settings": {
            "THRESHOLD_SECONDS": THRESHOLD_S,
            "API_TIMEOUT_SECONDS": API_TIMEOUT_S,
            "WATCH_SILENCE_SECONDS": 75.0,
            "RETRY_PERIOD_SECONDS": 2.0,
            "bookmark_interval_s": BOOKMARK_INTERVAL_S,
        },
        "outage_s": OUTAGE_S,
        "bookmark_wait_s": bookmark_wait_s,
        "connections_black_holed": held,
        "unready_after_s": unready_s,
        "unreachable_gauge_after_s": unreachable_s,
        "readyz_body": readyz_body,
        "readyz_at_restore": readyz_at_restore,
        "last_answer_age_at_restore_s": age_at_restore,
        "deleted_during_outage": deleted_in_outage,
        "restore_to_delete_s": delete_s,
        "restore_target_s": RESTORE_TARGET_S,
        "restore_to_ready_s": ready_s,
        "wrongly_deleted": [n for n in cached[1:] if pod_gone_or_terminating(emu, n)],
        "pool_replacements": sample(metrics, "retired_pod_gc_api_pool_replacements_total")
        - pool_before,
        "watch_restarts": {
            reason: sample(metrics, "retired_pod_gc_watch_restarts_total", reason=reason)
            for reason in ("silent", "timeout", "error", "closed", "expired")
        },
        "relists": sample(metrics, "retired_pod_gc_relists_total"),
        "warnings": _warnings(service)[warnings_before:],
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
    parser.add_argument("--only", choices=("B10", "B11"), default="B10")
    parser.add_argument(
        "--name", default=None, help="results/<name>.json (blackhole, blackhole-all)"
    )
    return parser.parse_args()


async def _main(only: str) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m benchmarks.blackhole", *sys.argv[1:]]),
        "load_average_start": load_average(),
        "config": {"repeats": 1},
    }
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory() as tmp:
        results[only] = await b10(pg, Path(tmp), everything=only == "B11")
    results["load_average_end"] = load_average()
    return results


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    args = _args()
    results = anyio.run(_main, args.only)
    name = args.name or ("blackhole" if args.only == "B10" else "blackhole-all")
    out = HERE / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=float) + "\n")
    _progress(f"wrote {out}: {json.dumps(results[args.only])}")
    try:
        from benchmarks import report  # noqa: PLC0415 (matplotlib: the bench extra)
    except ImportError as exc:
        _progress(f"RESULTS.md not rendered ({exc}): python -m benchmarks.report")
        return
    report.render(HERE)


if __name__ == "__main__":
    main()
