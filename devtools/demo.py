"""``python -m devtools.demo`` (``make demo``): the whole loop on a throwaway PostgreSQL and the
API emulator.

Seeds a realistic sandbox namespace, then runs the real service wiring (informer, listener,
leader election, workers, budget, preconditioned deletes) through the rollout an operator would
do: disabled → dry run → live, with a short threshold. Shows a live view while it runs and a
summary at the end; exits 0 only when exactly the two retired shapes were deleted.

A dev tool (``devtools/__init__.py``): the product's command line does not offer it, since the
image carries neither the emulator nor a PostgreSQL server.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from devtools.emulator.core import Emulator
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.emulator.selectors import compile_selector
from devtools.emulator.server import RunningEmulator, start_emulator
from devtools.pg.devdata import seed_execution, seed_sandbox
from devtools.pg.throwaway import ThrowawayPostgres
from service import config, logs
from service.app import service
from service.app.inspect import explain
from service.domain import Verdict
from service.kube.api import new_api_client
from service.metrics import LOOP, KubeMetrics, Metrics, PgMetrics
from service.pg.migrate import migrate

NAMESPACE = "sandboxes"
LEASE_NAMESPACE = "retired-pod-gc"
_PROG = "python -m devtools.demo"


@dataclass(frozen=True)
class DemoPod:
    label: str
    sandbox_id: str
    generation: int
    kind: str
    shape: Shape
    state: str
    active: bool
    expect_deleted: bool

    @property
    def name(self) -> str:
        return pod_name(self.sandbox_id, self.generation)


POPULATION = (
    DemoPod(
        "idle-suspended, Succeeded",
        "idle0001",
        1,
        "create",
        Shape.SUCCEEDED,
        "suspended",
        False,
        True,
    ),
    DemoPod(
        "replaced, never started (Pending, no IP)",
        "roll0001",
        2,
        "create",
        Shape.PENDING_STUCK,
        "replaced",
        False,
        True,
    ),
    DemoPod(
        "replaced, Pending with an IP",
        "wip00001",
        1,
        "create",
        Shape.PENDING_WITH_IP,
        "replaced",
        False,
        False,
    ),
    DemoPod("running live sandbox", "live0001", 1, "create", Shape.RUNNING, "active", True, False),
    DemoPod(
        "Pending restore pod (retired)",
        "rest0001",
        3,
        "restore",
        Shape.PENDING_STUCK,
        "replaced",
        False,
        False,
    ),
)
UNRELATED = "unrelated-web-0"


class _Events(logging.Handler):
    """Shows the reconciler's would-reap and delete lines as they happen (debug lines: a
    service at info logs them summarised, one line a minute, ``service/engine/reaped.py``)."""

    def __init__(self, started: float) -> None:
        super().__init__(logging.DEBUG)
        self.started = started

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(("dry run: would reap", "deleted ")):
            print(f"  [{time.monotonic() - self.started:5.1f}s] {message.rsplit(': ', 1)[0]}")


def _counts(metrics: Metrics, mode: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for verdict in ("terminal_retired", "replaced_never_started"):
        value = metrics.registry.get_sample_value(
            "cluster_reconciler_outcome_total", {"loop": LOOP, "mode": mode, "verdict": verdict}
        )
        out[verdict] = int(value or 0)
    return out


def _present(emulator: Emulator) -> dict[str, str]:
    states = {}
    for pod in emulator.pods(NAMESPACE):
        meta = pod["metadata"]
        phase = (pod.get("status") or {}).get("phase", "?")
        states[meta["name"]] = f"{phase}{' (terminating)' if meta.get('deletionTimestamp') else ''}"
    return states


def _view(phase: str, elapsed: float, emulator: Emulator, counts: dict[str, int]) -> str:
    present = _present(emulator)
    sandbox = sum(1 for p in POPULATION if p.name in present)
    return (
        f"  [{phase:<8} {elapsed:5.1f}s] sandbox pods present {sandbox}/{len(POPULATION)}"
        f" (+{int(UNRELATED in present)} unrelated)"
        f" | would-reap/reaped: terminal_retired={counts['terminal_retired']}"
        f" replaced_never_started={counts['replaced_never_started']}"
    )


async def seed_population(url: str, emulator: Emulator) -> dict[str, dict[str, Any]]:
    """Rows (schema and trigger migrated first) and pods of :data:`POPULATION`, plus the unrelated
    pod; returns name → pod as created (uid and resourceVersion included)."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrate(conn, channel="sandbox_execution_changed", with_schema=True)
        await seed_population_rows(conn)
    finally:
        await conn.close()
    return create_population_pods(emulator)


async def seed_population_rows(conn: asyncpg.Connection) -> None:
    """The sandboxes and execution rows of :data:`POPULATION` (the tables must exist)."""
    for p in POPULATION:
        await seed_sandbox(conn, p.sandbox_id, namespace=NAMESPACE)
        await seed_execution(
            conn,
            pod_name=p.name,
            sandbox_id=p.sandbox_id,
            generation=p.generation,
            pod_kind=p.kind,
            execution_state=p.state,
            active=p.active,
        )


def create_population_pods(emulator: Emulator) -> dict[str, dict[str, Any]]:
    """The pods of :data:`POPULATION` and the unrelated pod (the Lease's namespace made too);
    returns name → pod as created."""
    created = {
        p.name: emulator.create_pod(
            sandbox_pod(
                sandbox_id=p.sandbox_id,
                generation=p.generation,
                kind=p.kind,
                shape=p.shape,
                namespace=NAMESPACE,
            )
        )
        for p in POPULATION
    }
    emulator.ensure_namespace(LEASE_NAMESPACE)
    created[UNRELATED] = emulator.create_pod(
        {
            "metadata": {"name": UNRELATED, "namespace": NAMESPACE, "labels": {"app": "web"}},
            "spec": {"containers": [{"name": "web", "image": "nginx"}], "nodeName": "node-a"},
            "status": {"phase": "Running", "podIP": "10.0.0.99"},
        }
    )
    return created


def _settings(url: str, *, enabled: bool, dry_run: bool, threshold_s: float) -> config.Settings:
    p = config.PREFIX
    return config.load(
        {
            p + "ENABLED": str(enabled),
            p + "DRY_RUN": str(dry_run),
            p + "THRESHOLD_SECONDS": str(threshold_s),
            p + "DATABASE_URL": url,
            p + "NAMESPACE": NAMESPACE,
            p + "METRICS_BIND_ADDRESS": "127.0.0.1:0",
            p + "LEASE_NAMESPACE": LEASE_NAMESPACE,
            p + "LEASE_DURATION_SECONDS": "4",
            p + "RENEW_DEADLINE_SECONDS": "3",
            p + "RETRY_PERIOD_SECONDS": "0.5",
            p + "LISTENER_HEARTBEAT_SECONDS": "1",
            p + "RESYNC_PERIOD_SECONDS": "30",
        }
    )


async def _phase(
    name: str,
    settings: config.Settings,
    running: RunningEmulator,
    *,
    min_s: float,
    max_s: float,
    done: Any,
) -> dict[str, int]:
    metrics = Metrics()
    api = await new_api_client(host=running.url, metrics=metrics.kube)
    mode = "dry_run" if settings.dry_run else "live"
    started = time.monotonic()
    handler = _Events(started)
    logging.getLogger("service.engine").addHandler(handler)
    print(
        f"\n== {name}: ENABLED={str(settings.enabled).lower()}"
        f"{'' if not settings.enabled else f' DRY_RUN={str(settings.dry_run).lower()}'} =="
    )
    try:
        parts = service.build(settings, api=api, metrics=metrics)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(service.run, parts, stop=stop))
            last_print = -10.0
            while True:
                elapsed = time.monotonic() - started
                counts = _counts(metrics, mode)
                if elapsed - last_print >= 2.0:
                    print(_view(name, elapsed, running.emulator, counts))
                    last_print = elapsed
                if elapsed >= max_s or (elapsed >= min_s and done(counts)):
                    break
                await anyio.sleep(0.2)
            stop.set()
        print(_view(name, time.monotonic() - started, running.emulator, counts))
        return counts
    finally:
        logging.getLogger("service.engine").removeHandler(handler)
        await api.close()


GONE_WITHIN_S = 30.0
"""How long the demo waits for the server's processes to exit before it kills what is left."""


@dataclass(frozen=True)
class Started:
    """What the demo started outside its own process, to make sure it has all stopped: the
    PostgreSQL server (its postmaster leads a session of its own, so every process of the server
    carries the postmaster's pid as its session id) and the emulator's port (the service and the
    emulator run in the demo's own process)."""

    postgres_pid: int
    data_dir: Path
    api: str = ""
    """The emulator's URL, once it serves (closed with the demo's event loop)."""

    def server_processes(self) -> list[int]:
        """Live (not zombie) processes of the server's session, from ``/proc``."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:
                continue  # exited while we looked
            state, session = fields[0], int(fields[3])
            if session == self.postgres_pid and state != "Z":
                found.append(int(stat.parent.name))
        return found

    async def wait_gone(self) -> None:
        """Return once no process of the server runs; past ``GONE_WITHIN_S`` kill what is left."""
        deadline = time.monotonic() + GONE_WITHIN_S
        while left := self.server_processes():
            if time.monotonic() > deadline:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            await anyio.sleep(0.05)

    def stopped_line(self) -> str:
        return (
            f"stopped: PostgreSQL (pid {self.postgres_pid}, {self.data_dir}) and the API "
            f"emulator ({self.api}); no process of the demo is left"
        )


async def _demo(threshold_s: float, phase_s: float) -> int:
    started = time.monotonic()
    print("starting a throwaway PostgreSQL and the Kubernetes API emulator ...")
    started_here: Started | None = None
    try:
        with ThrowawayPostgres() as pg:
            assert pg.pid is not None and pg.root_dir is not None
            started_here = Started(postgres_pid=pg.pid, data_dir=pg.root_dir)
            url = pg.create_database("demo")
            emulator = Emulator(bookmark_interval_s=5.0, kubelet_finish_after_s=2.0)
            running = await start_emulator(emulator=emulator)
            started_here = replace(started_here, api=running.url)
            try:
                await seed_population(url, emulator)
                print(f"seeded namespace {NAMESPACE!r} (API {running.url}):")
                for p in POPULATION:
                    print(f"  {p.name:<26} {p.label:<42} row: {p.state}, active={p.active}")
                print(f"  {UNRELATED:<26} unrelated pod (not selected by the label selector)")
                print(f"threshold {threshold_s:g}s")

                disabled = await _phase(
                    "disabled",
                    _settings(url, enabled=False, dry_run=True, threshold_s=threshold_s),
                    running,
                    min_s=phase_s,
                    max_s=phase_s,
                    done=lambda c: False,
                )
                dry = await _phase(
                    "dry run",
                    _settings(url, enabled=True, dry_run=True, threshold_s=threshold_s),
                    running,
                    min_s=min(phase_s, threshold_s + 3),
                    max_s=threshold_s + phase_s + 10,
                    done=lambda c: sum(c.values()) >= 2,
                )
                after_dry = _present(emulator)
                # Every pod is still there after the dry run: each one's decision, as the
                # controller makes it (a verdict, or the reason it is kept).
                why = await _decisions(
                    _settings(url, enabled=True, dry_run=True, threshold_s=threshold_s), running
                )
                live = await _phase(
                    "live",
                    _settings(url, enabled=True, dry_run=False, threshold_s=threshold_s),
                    running,
                    min_s=2.0,
                    max_s=threshold_s + phase_s + 15,
                    done=lambda c: (
                        sum(c.values()) >= 2
                        and not any(
                            p.expect_deleted and p.name in _present(emulator) for p in POPULATION
                        )
                    ),
                )
                final = _present(emulator)
                deletes = emulator.audit_log(method="DELETE")
                events = emulator.events.events(NAMESPACE)
            finally:
                await running.aclose()
    finally:
        # ThrowawayPostgres has stopped its postmaster; the result is printed only once every
        # process of the server (its backends, checkpointer, ...) has exited too.
        if started_here is not None:
            await started_here.wait_gone()
    assert started_here is not None
    print(started_here.stopped_line())
    ok = _summary(
        why=why,
        disabled=disabled,
        dry=dry,
        live=live,
        after_dry=after_dry,
        final=final,
        deletes=deletes,
        events=events,
    )
    print(f"\ndemo finished in {time.monotonic() - started:.0f}s: {'OK' if ok else 'UNEXPECTED'}")
    return 0 if ok else 1


async def _decisions(settings: config.Settings, running: RunningEmulator) -> dict[str, str]:
    """Each pod's decision by ``retired-pod-gc explain``'s code (the controller's classifier on
    a fresh GET and row read): a verdict, or the skip reason that keeps it. A pod the label
    selector does not select is never looked at by the controller: "not selected"."""
    selected = compile_selector(settings.kube.label_selector)
    api = await new_api_client(host=running.url)
    store = service.new_store(settings, PgMetrics())
    await store.start()
    try:
        pods = service.new_pod_client(settings, api, KubeMetrics())
        out = {}
        for pod in running.emulator.pods(NAMESPACE):
            name = pod["metadata"]["name"]
            if selected is not None and not selected(pod["metadata"].get("labels") or {}):
                out[name] = "not selected (LABEL_SELECTOR)"
                continue
            exp = await explain(settings, key=f"{NAMESPACE}/{name}", pods=pods, store=store)
            decision = exp.decision
            out[name] = "gone" if decision is None else decision.label
        return out
    finally:
        await store.aclose()
        await api.close()


def _summary(
    *,
    why: dict[str, str],
    disabled: dict[str, int],
    dry: dict[str, int],
    live: dict[str, int],
    after_dry: dict[str, str],
    final: dict[str, str],
    deletes: list[Any],
    events: list[dict[str, Any]],
) -> bool:
    print("\n== summary ==")
    print(
        f"{'pod':<26} {'shape':<42} {'after dry run':<15} {'after live':<12} {'expected':<10} "
        "why (the controller's verdict, or the reason it keeps the pod)"
    )
    ok = True
    for p in POPULATION:
        kept_dry = "kept" if p.name in after_dry else "GONE"
        kept_live = "kept" if p.name in final else "deleted"
        expected = "deleted" if p.expect_deleted else "kept"
        reason = why.get(p.name, "?")
        ok &= kept_dry == "kept" and kept_live == expected
        ok &= (reason in _VERDICTS) == p.expect_deleted
        print(f"{p.name:<26} {p.label:<42} {kept_dry:<15} {kept_live:<12} {expected:<10} {reason}")
    unrelated = "kept" if UNRELATED in final else "deleted"
    ok &= unrelated == "kept"
    print(
        f"{UNRELATED:<26} {'unrelated pod':<42} {'kept':<15} {unrelated:<12} {'kept':<10} "
        f"{why.get(UNRELATED, '?')}"
    )
    print(f"\noutcome counters   disabled: {disabled}")
    print(f"                   dry run:  {dry}")
    print(f"                   live:     {live}")
    ok &= sum(disabled.values()) == 0
    ok &= dry == {"terminal_retired": 1, "replaced_never_started": 1}
    ok &= live == {"terminal_retired": 1, "replaced_never_started": 1}
    print("DELETE requests the API server received (emulator audit log):")
    for entry in deletes:
        pre = (entry.body or {}).get("preconditions") if isinstance(entry.body, dict) else None
        print(f"  {entry.status} {entry.path.rsplit('/', 1)[-1]:<26} preconditions={pre}")
        ok &= bool(pre and pre.get("uid") and pre.get("resourceVersion"))
    controller_deletes = [e for e in deletes if (e.body or {}).get("preconditions")]
    ok &= len({e.path for e in controller_deletes}) == 2
    _print_events(events)
    reaped = {p.name for p in POPULATION if p.expect_deleted}
    for reason in ("RetiredPodWouldDelete", "RetiredPodDeleted"):
        regarding = sorted(e["regarding"]["name"] for e in events if e["reason"] == reason)
        ok &= regarding == sorted(reaped)
    return ok


_VERDICTS = frozenset(str(v) for v in Verdict)


def _print_events(events: list[dict[str, Any]]) -> None:
    """The Events the API server received, as ``kubectl get events`` shows them."""
    print(f"\nEvents the API server received (kubectl -n {NAMESPACE} get events):")
    print(f"  {'TYPE':<8} {'REASON':<23} {'OBJECT':<30} MESSAGE")
    for e in events:
        obj = f"pod/{e['regarding']['name']}"
        print(f"  {e['type']:<8} {e['reason']:<23} {obj:<30} {e['note']}")


def run_demo(*, threshold_s: float, phase_s: float) -> int:
    logs.setup("warning", "text")
    logging.getLogger("service.engine").setLevel(logging.INFO)
    logging.getLogger("service.engine").propagate = False
    logging.getLogger("service.engine.delete").setLevel(logging.DEBUG)  # one line a pod
    try:
        return anyio.run(_demo, threshold_s, phase_s)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        print(f"{_PROG}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description=(
            "Start a throwaway PostgreSQL and the Kubernetes API emulator, seed a realistic "
            "sandbox namespace, and run the real service through the rollout: disabled, dry "
            "run, live. Leaves nothing running."
        ),
    )
    parser.add_argument("--threshold", type=float, default=4.0, help="threshold seconds")
    parser.add_argument("--phase-seconds", type=float, default=10.0, help="seconds per phase")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_demo(threshold_s=args.threshold, phase_s=args.phase_seconds)


if __name__ == "__main__":
    sys.exit(main())
