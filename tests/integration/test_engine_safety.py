"""The safety invariants (1, 2, 3, 5, 6, 7 of docs/architecture.md) with the real adapters, end
to end in-process.

The whole service is built by ``service.app.service.build`` and run by ``run``: the real
``kubernetes_asyncio`` client over HTTP against the API server emulator, the real informer and
pod client, a real PostgreSQL with the notify trigger, the real listener. Real time is used, so
thresholds are 1 to 2 s. Every "never" is checked strictly against a wall-clock lower bound taken
*before* the event that may start a clock (the clock can only start later, so a correct service
can never act earlier); every "eventually" has a generous bound for a loaded machine.

The DELETEs are read from the emulator's audit log (what reached the server, with its body and
the wall-clock time of the answer); outcomes from the service's own metrics registry.

This module also holds the small harness the other ``test_engine_*`` modules share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import aiohttp
import anyio
import asyncpg
import pytest

from devtools.emulator import AuditEntry, Emulator, RunningEmulator
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from service.app.service import Parts, build, run
from service.config import PREFIX, load
from service.kube.api import new_api_client
from service.metrics import LOOP, Metrics
from tests.kubefixtures import SANDBOX_NAMESPACE
from tests.pgfixtures import metric, seed_execution, seed_sandbox, set_execution

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
OUTCOME = "cluster_reconciler_outcome_total"
TERMINAL = "terminal_retired"
NEVER_STARTED = "replaced_never_started"
EVENTUALLY_S = 15.0
"""Upper bound for anything that must happen "soon" (generous: a loaded 2-core machine)."""


# ---------------------------------------------------------------- harness (shared)


def service_env(db_url: str, **overrides: object) -> dict[str, str]:
    """Environment for ``config.load``: live, fast, leader election off, resync off."""
    values: dict[str, object] = {
        "ENABLED": True,
        "DRY_RUN": False,
        "THRESHOLD_SECONDS": 1,
        "RESYNC_PERIOD_SECONDS": 3600,
        "METRICS_BIND_ADDRESS": "127.0.0.1:0",
        "DEBUG_BIND_ADDRESS": "127.0.0.1:0",
        "LEADER_ELECTION": False,
        "LISTENER_HEARTBEAT_SECONDS": 0.2,
        "LISTENER_HEARTBEAT_TIMEOUT_SECONDS": 1,
        "SHUTDOWN_TIMEOUT_SECONDS": 1,
        "API_TIMEOUT_SECONDS": 5,
        "WATCH_TIMEOUT_SECONDS": 30,
        "DB_CONNECT_TIMEOUT_SECONDS": 2,
        "DB_STATEMENT_TIMEOUT_SECONDS": 2,
        "NAMESPACE": NS,
        "DATABASE_URL": db_url,
        "LOG_FORMAT": "text",
    }
    values.update(overrides)
    return {
        PREFIX + k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in values.items()
    }


@asynccontextmanager
async def running_service(
    emulator: RunningEmulator, db_url: str, *, listening: bool = True, **overrides: object
) -> AsyncIterator[Parts]:
    """The service, built and running in this test's event loop, its cache synced and (with
    ``listening``) its notify listener connected: its first connection's resync, which clears
    every clock, is behind it.

    A crash of any part fails the test (it propagates out of the task group).
    """
    settings = load(service_env(db_url, **overrides))
    assert not settings.warnings, settings.warnings
    metrics = Metrics()
    api = await new_api_client(host=emulator.url, metrics=metrics.kube)
    try:
        parts = build(settings, api=api, metrics=metrics)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(partial(run, parts, stop=stop))
            try:
                with anyio.fail_after(EVENTUALLY_S):
                    await parts.informer.wait_synced()
                    while listening and not parts.listener.connected:
                        await anyio.sleep(0.01)
                yield parts
            finally:
                stop.set()
    finally:
        await api.close()


async def seed_row(
    conn: asyncpg.Connection, sandbox_id: str, *, active: bool, state: str, generation: int = 1
) -> str:
    """A managed sandbox and its execution row; returns the pod name."""
    await seed_sandbox(conn, sandbox_id)
    name = pod_name(sandbox_id, generation)
    await seed_execution(
        conn,
        pod_name=name,
        sandbox_id=sandbox_id,
        generation=generation,
        execution_state=state,
        active=active,
    )
    return name


def create_pod(emu: Emulator, sandbox_id: str, shape: Shape, generation: int = 1) -> dict[str, Any]:
    return emu.create_pod(
        sandbox_pod(sandbox_id=sandbox_id, generation=generation, shape=shape), namespace=NS
    )


def pod_path(name: str) -> str:
    return f"/namespaces/{NS}/pods/{name}"


def deletes(emu: Emulator, name: str | None = None) -> list[AuditEntry]:
    """DELETE requests of sandbox pods (of one pod when ``name`` is given) the server answered."""
    return emu.audit_log(
        method="DELETE", path_contains=pod_path(name) if name else f"/namespaces/{NS}/pods"
    )


def preconditions(entry: AuditEntry) -> tuple[str | None, str | None]:
    """(uid, resourceVersion) preconditions of a DELETE body."""
    body = entry.body if isinstance(entry.body, dict) else {}
    pre = body.get("preconditions") or {}
    return pre.get("uid"), pre.get("resourceVersion")


def requests_for(emu: Emulator, method: str, name: str) -> int:
    return sum(1 for r in emu.requests if r.method == method and r.path.endswith(pod_path(name)))


def outcome(parts: Parts, verdict: str, *, mode: str = "live") -> float:
    return metric(parts.metrics.registry, OUTCOME, loop=LOOP, mode=mode, verdict=verdict)


def sample(parts: Parts, name: str, **labels: str) -> float:
    return metric(parts.metrics.registry, name, **labels)


def all_outcomes(parts: Parts) -> float:
    total = 0.0
    for family in parts.metrics.registry.collect():
        for s in family.samples:
            if s.name == OUTCOME:
                total += s.value
    return total


async def eventually(
    predicate: Callable[[], bool], what: str, timeout_s: float = EVENTUALLY_S
) -> None:
    """Poll ``predicate`` every 10 ms; fail after ``timeout_s``.

    Raises ``AssertionError``, not ``pytest.fail``: inside the service's task group a
    BaseException (pytest's ``Failed``) would take anyio's test runner down with it.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await anyio.sleep(0.01)


async def sleep_until_wall(t_s: float) -> None:
    await anyio.sleep(max(0.0, t_s - time.time()))


async def clock_started(parts: Parts, count: int = 1) -> None:
    await eventually(lambda: len(parts.clocks) >= count, "the observation clock to start")


async def wait_listener(conn: asyncpg.Connection) -> int:
    """The backend pid of the service's LISTEN connection (waits for it to connect)."""
    deadline = time.monotonic() + EVENTUALLY_S
    while True:
        pid = await conn.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'retired-pod-gc-listener'"
            " AND datname = current_database()"
        )
        if isinstance(pid, int):
            return pid
        if time.monotonic() > deadline:
            raise AssertionError("the listener never connected")
        await anyio.sleep(0.02)


def assert_not_before(entries: list[AuditEntry], bound_s: float, what: str) -> None:
    early = [e.time_s - bound_s for e in entries if e.time_s < bound_s]
    assert not early, f"{what}: {len(early)} DELETE(s) before the bound (by {early}s)"


# ---------------------------------------------------------------- invariants 3 and 7


async def test_deletes_only_after_the_threshold_with_uid_and_rv_preconditions(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 1.5
    suspended = await seed_row(pg_conn, "a1", active=False, state="suspended")
    replaced = await seed_row(pg_conn, "a2", active=False, state="replaced")
    pods = {
        suspended: create_pod(emu, "a1", Shape.SUCCEEDED),
        replaced: create_pod(emu, "a2", Shape.PENDING_STUCK),
    }
    before = {n: (p["metadata"]["uid"], p["metadata"]["resourceVersion"]) for n, p in pods.items()}
    t0 = time.time()  # no clock can start before this
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=threshold_s) as parts:
        await clock_started(parts, 2)
        await sleep_until_wall(t0 + threshold_s - 0.15)
        assert deletes(emu) == [], "a DELETE was sent before the threshold"
        await eventually(lambda: all(deletes(emu, n) for n in pods), "both DELETEs")
        # The Pending pod is now terminating: it must not be deleted a second time.
        await anyio.sleep(0.5)
        assert outcome(parts, TERMINAL) == 1
        assert outcome(parts, NEVER_STARTED) == 1
    for name, (uid, rv) in before.items():
        sent = deletes(emu, name)
        assert len(sent) == 1, f"{name}: {len(sent)} DELETEs"
        assert sent[0].status == 200
        assert sent[0].time_s >= t0 + threshold_s
        # Nothing modified the pods, so the fresh GET saw exactly the created version.
        assert preconditions(sent[0]) == (uid, rv)
    assert emu.get_pod(NS, suspended) is None
    terminating = emu.get_pod(NS, replaced)
    assert terminating is not None and terminating["metadata"].get("deletionTimestamp")


# ---------------------------------------------------------------- invariant 5


async def test_dry_run_verifies_but_never_deletes_and_reports_once(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    name = await seed_row(pg_conn, "d1", active=False, state="suspended")
    create_pod(emu, "d1", Shape.SUCCEEDED)
    async with running_service(
        emulator, pg_url, DRY_RUN=True, THRESHOLD_SECONDS=1, RESYNC_PERIOD_SECONDS=1
    ) as parts:
        await eventually(lambda: outcome(parts, TERMINAL, mode="dry_run") >= 1, "the report")
        # More events for the same UID: MODIFIED (labels, annotations) keep its clock...
        emu.patch_pod(NS, name, {"metadata": {"labels": {"touched": "1"}}})
        emu.patch_pod(NS, name, {"metadata": {"annotations": {"touched": "2"}}})
        # ...a listener reconnect clears every clock, which then restarts and expires again.
        old_pid = await wait_listener(pg_conn)
        assert await pg_conn.fetchval("SELECT pg_terminate_backend($1)", old_pid)
        await eventually(
            lambda: sample(parts, "retired_pod_gc_listener_reconnects_total") >= 1, "reconnect"
        )
        t_reconnected = time.time()
        seen = outcome(parts, "already_reported", mode="dry_run")
        # Its clock restarted at the reconnect; it must expire again and be verified again.
        await eventually(
            lambda: outcome(parts, "already_reported", mode="dry_run") > seen,
            "the pod to be verified again after the reconnect",
        )
        await sleep_until_wall(t_reconnected + 2.5)
        assert outcome(parts, TERMINAL, mode="dry_run") == 1
        assert outcome(parts, TERMINAL, mode="live") == 0
        assert (
            sample(
                parts,
                "retired_pod_gc_deletes_total",
                sandbox_namespace=SANDBOX_NAMESPACE,
                result="deleted",
            )
            == 0
        )
    assert emu.audit_log(method="DELETE") == []
    assert emu.get_pod(NS, name) is not None


# ---------------------------------------------------------------- invariant 6


async def test_disabled_sends_nothing_and_counts_no_outcome(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    name = await seed_row(pg_conn, "x1", active=False, state="suspended")
    create_pod(emu, "x1", Shape.SUCCEEDED)
    t0 = time.time()
    async with running_service(
        emulator, pg_url, ENABLED=False, THRESHOLD_SECONDS=1, RESYNC_PERIOD_SECONDS=1
    ) as parts:
        assert parts.informer.get(f"{NS}/{name}") is not None, "the pod was never seen"
        await eventually(lambda: parts.listener.connected, "the LISTEN")
        await set_execution(pg_conn, name, active=False, execution_state="stopped")
        await eventually(
            lambda: sample(parts, "retired_pod_gc_notifications_total") >= 1, "the notification"
        )
        await sleep_until_wall(t0 + 3.5)  # threshold 1 s, resync 1 s: well past both
        port = parts.health.bound_port
        assert port is not None
        async with (  # still serving health
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/healthz") as response,
        ):
            assert response.status == 200
        assert all_outcomes(parts) == 0
        assert sample(parts, "retired_pod_gc_row_queries_total", kind="batch") == 0
        assert sample(parts, "retired_pod_gc_row_queries_total", kind="fresh") == 0
        assert len(parts.clocks) == 0
    assert emu.audit_log(method="DELETE") == []
    assert emu.get_pod(NS, name) is not None


@pytest.mark.parametrize("dry_run", [False, True], ids=["live", "dry_run"])
async def test_with_leader_election_off_the_replica_reports_itself_leader(
    emulator: RunningEmulator, pg_url: str, dry_run: bool
) -> None:
    # LEADER_ELECTION=false: the one replica acts from the start, so retired_pod_gc_is_leader is
    # 1 on /metrics (RetiredPodGcNoLeader and RetiredPodGcTwoLeaders read it).
    async with running_service(emulator, pg_url, DRY_RUN=dry_run) as parts:
        assert parts.controller.active
        port = parts.health.bound_port
        assert port is not None
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/metrics") as response,
        ):
            body = await response.text()
        assert "\nretired_pod_gc_is_leader 1.0\n" in body, body


# ---------------------------------------------------------------- retirement by NOTIFY


async def test_retirement_notification_deletes_after_the_threshold_without_a_resync(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 1.0
    name = await seed_row(pg_conn, "n1", active=True, state="active")
    pod = create_pod(emu, "n1", Shape.SUCCEEDED)
    async with running_service(
        emulator, pg_url, THRESHOLD_SECONDS=threshold_s, RESYNC_PERIOD_SECONDS=3600
    ) as parts:
        await eventually(
            lambda: sample(parts, "retired_pod_gc_skips_total", reason="row_active") >= 1,
            "the first reconcile (row active)",
        )
        await eventually(lambda: parts.listener.connected, "the LISTEN")
        assert deletes(emu) == []
        t_retired = time.time()
        await set_execution(pg_conn, name, active=False, execution_state="suspended")
        # No resync will come (1 h): only the notification can bring the key back.
        await eventually(
            lambda: len(deletes(emu, name)) >= 1,
            "the DELETE after the retirement",
            timeout_s=threshold_s + 8,
        )
        assert sample(parts, "retired_pod_gc_retirement_to_enqueue_seconds_count") >= 1
    sent = deletes(emu, name)
    assert len(sent) == 1 and sent[0].status == 200
    assert sent[0].time_s >= t_retired + threshold_s
    assert preconditions(sent[0]) == (pod["metadata"]["uid"], pod["metadata"]["resourceVersion"])


# ---------------------------------------------------------------- invariants 1 and 2: races


async def test_a_pod_recreated_under_the_same_name_before_the_delete_survives_its_own_threshold(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 1.5
    name = await seed_row(pg_conn, "i1", active=False, state="suspended")
    old = create_pod(emu, "i1", Shape.SUCCEEDED)
    swapped: list[tuple[float, dict[str, Any]]] = []

    def swap() -> None:
        t_swap = time.time()
        emu.delete_pod(NS, name)  # another client deletes it (terminal: gone at once)
        swapped.append((t_swap, create_pod(emu, "i1", Shape.SUCCEEDED)))

    # The swap happens when the fresh GET (the last read before the DELETE) reaches the
    # server: between the observation and the delete.
    emu.before_next(swap, method="GET", path_contains=pod_path(name))
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=threshold_s) as parts:
        await eventually(lambda: bool(swapped), "the fresh GET")
        t_swap, new = swapped[0]
        new_uid = new["metadata"]["uid"]
        assert new_uid != old["metadata"]["uid"]
        await eventually(
            lambda: any(preconditions(e)[0] == new_uid for e in deletes(emu, name)),
            "the new pod's DELETE after its own threshold",
        )
        changed = outcome(parts, "changed")
    sent = deletes(emu, name)
    # A DELETE carrying the old UID could only ever be refused (409/404): harmless.
    assert all(e.status != 200 for e in sent if preconditions(e)[0] != new_uid)
    new_deletes = [e for e in sent if preconditions(e)[0] == new_uid]
    assert_not_before(new_deletes, t_swap + threshold_s, "the recreated pod")
    assert [e.status for e in new_deletes] == [200]
    assert preconditions(new_deletes[0])[1] == new["metadata"]["resourceVersion"]
    assert changed >= 1, "the swap was never noticed as a change"


async def test_a_row_reactivated_before_the_delete_stops_it(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 1.0
    name = await seed_row(pg_conn, "r1", active=False, state="suspended")
    create_pod(emu, "r1", Shape.SUCCEEDED)
    # Re-activated when the fresh GET reaches the server: after the lookup, before the re-read.
    emu.before_next(
        partial(set_execution, pg_conn, name, active=True, execution_state="active"),
        method="GET",
        path_contains=pod_path(name),
    )
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=threshold_s) as parts:
        await eventually(lambda: outcome(parts, "changed") >= 1, "the re-verification")
        t_checked = time.time()
        await eventually(
            lambda: sample(parts, "retired_pod_gc_skips_total", reason="row_active") >= 1,
            "the reconcile of the re-activation",
        )
        await sleep_until_wall(t_checked + 2 * threshold_s + 0.5)
        assert len(parts.clocks) == 0
    assert deletes(emu) == []
    assert emu.get_pod(NS, name) is not None


async def test_a_flip_back_and_forth_within_one_window_restarts_the_clock_at_the_last_retirement(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 2.0
    name = await seed_row(pg_conn, "f1", active=True, state="active")
    create_pod(emu, "f1", Shape.SUCCEEDED)
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=threshold_s) as parts:
        await eventually(
            lambda: sample(parts, "retired_pod_gc_skips_total", reason="row_active") >= 1,
            "the first reconcile (row active)",
        )
        await eventually(lambda: parts.listener.connected, "the LISTEN")
        await set_execution(pg_conn, name, active=False, execution_state="suspended")
        await clock_started(parts)
        await anyio.sleep(0.9)
        # Re-activated and retired again in two transactions sent in one round trip: both
        # notifications arrive together, faster than any reconcile can run in between.
        t_last = time.time()
        await pg_conn.execute(
            f"""
            BEGIN;
            UPDATE sandbox_k8s_executions SET active = true, execution_state = 'active',
                   retired_at = NULL WHERE pod_name = '{name}';
            COMMIT;
            BEGIN;
            UPDATE sandbox_k8s_executions SET active = false, execution_state = 'suspended',
                   retired_at = now() WHERE pod_name = '{name}';
            COMMIT;
            """
        )
        await eventually(lambda: len(deletes(emu, name)) >= 1, "the DELETE")
    sent = deletes(emu, name)
    assert len(sent) == 1 and sent[0].status == 200
    assert_not_before(sent, t_last + threshold_s, "the flipped execution")


# ---------------------------------------------------------------- invariant 3: gaps


async def test_a_forced_410_relist_clears_clocks_and_delays_the_delete_a_full_threshold(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 2.0
    name = await seed_row(pg_conn, "w1", active=False, state="suspended")
    create_pod(emu, "w1", Shape.SUCCEEDED)
    t0 = time.time()
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=threshold_s) as parts:
        await clock_started(parts)
        await sleep_until_wall(t0 + 0.9)
        t_gap = time.time()
        emu.expire_next_watches(1)
        emu.drop_watches()
        await eventually(lambda: sample(parts, "retired_pod_gc_relists_total") >= 1, "relist")
        assert sample(parts, "retired_pod_gc_watch_restarts_total", reason="expired") >= 1
        await eventually(lambda: len(deletes(emu, name)) >= 1, "the DELETE after the relist")
    sent = deletes(emu, name)
    assert len(sent) == 1 and sent[0].status == 200
    assert_not_before(sent, t_gap + threshold_s, "after a cold cache")


async def test_a_listener_reconnect_clears_clocks_and_delays_the_delete_a_full_threshold(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 2.0
    name = await seed_row(pg_conn, "l1", active=False, state="suspended")
    create_pod(emu, "l1", Shape.SUCCEEDED)
    t0 = time.time()
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=threshold_s) as parts:
        await clock_started(parts)
        pid = await wait_listener(pg_conn)
        await sleep_until_wall(t0 + 0.9)
        t_gap = time.time()
        assert await pg_conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        await eventually(
            lambda: sample(parts, "retired_pod_gc_listener_reconnects_total") >= 1, "reconnect"
        )
        await eventually(lambda: len(deletes(emu, name)) >= 1, "the DELETE after the reconnect")
    sent = deletes(emu, name)
    assert len(sent) == 1 and sent[0].status == 200
    assert_not_before(sent, t_gap + threshold_s, "after a listener reconnect")


# ---------------------------------------------------------------- logs


async def test_a_store_log_line_inside_a_reconcile_carries_its_batch_id(
    emulator: RunningEmulator,
    pg_url: str,
    pg_conn: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real store logs a malformed row while the worker loop reconciles its key: that line,
    written by service.pg during the row lookup, carries the id of the batch the key came in
    (and, in a batch of one, the key's reconcile id), as the reconciler's own lines do."""
    emu = emulator.emulator
    caplog.set_level(logging.INFO, logger="service")
    caplog.set_level(logging.DEBUG, logger="service.engine.delete")  # the delete's own line
    await pg_conn.execute("ALTER TABLE sandbox_k8s_executions ALTER COLUMN active DROP NOT NULL")
    malformed = await seed_row(pg_conn, "l1", active=False, state="suspended")
    await pg_conn.execute(
        "UPDATE sandbox_k8s_executions SET active = NULL WHERE pod_name = $1", malformed
    )
    reaped = await seed_row(pg_conn, "l2", active=False, state="suspended")
    create_pod(emu, "l1", Shape.SUCCEEDED)
    create_pod(emu, "l2", Shape.SUCCEEDED)
    async with running_service(emulator, pg_url):
        await eventually(lambda: bool(deletes(emu, reaped)), "the DELETE of the well-formed pod")
    store_lines = [
        r
        for r in caplog.records
        if r.name == "service.pg.store" and "malformed execution row" in r.getMessage()
    ]
    assert store_lines, "the store logged no malformed row"
    assert all(getattr(r, "batch_id", None) for r in store_lines)
    [deleted] = [
        r
        for r in caplog.records
        if r.name == "service.engine.delete" and r.getMessage().startswith("deleted ")
    ]
    assert getattr(deleted, "reconcile_id", None)
    outside = [r for r in caplog.records if "starting in" in r.getMessage()]
    assert outside
    assert not any(hasattr(r, "reconcile_id") or hasattr(r, "batch_id") for r in outside)
    assert emu.get_pod(NS, malformed) is not None  # a malformed row never deletes
