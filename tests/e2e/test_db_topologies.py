"""The database topologies of docs/operations.md, end to end: the real ``retired-pod-gc run``
process against the API emulator and real servers on loopback (devtools/pg/topology.py) —
Debian's PgBouncer with a stock config in session and transaction mode, a streaming hot standby
made by ``pg_basebackup -R``, a multi-host failover URL through SIGKILL of the primary and
promotion of the standby, and a rotated password in DATABASE_URL_FILE.

Each database is set up as an operator sets one up: the platform's tables (deploy/sql/0001),
deploy/db-role/role.sql as the admin, ``retired-pod-gc migrate`` with the admin URL, a password
for ``retired_pod_gc``; the service logs in as ``retired_pod_gc``.

RESYNC_PERIOD_SECONDS is an hour: once the service has seen a pod's row active, only a
notification (or the listener's reconnect) can bring the pod back to a reconcile, so a delete
of a pod retired while the service runs proves the notification path. The time from the
retirement's commit to the DELETE is recorded (``record_property``), never asserted: the
bound is a product figure (docs/operations.md), measured, not a test's wall-clock claim.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from devtools.pg.devdata import seed_execution, seed_sandbox, set_execution
from devtools.pg.throwaway import ThrowawayPostgres, run_async
from devtools.pg.topology import ThrowawayPgBouncer, ThrowawayStandby, kill, require_password

from .harness import (
    LEASE_NAMESPACE,
    REPO_ROOT,
    SANDBOX_NAMESPACE,
    ServiceLauncher,
    ServiceProcess,
    base_env,
    lease_holder,
    run_cli,
    sample,
    wait_until,
    write_kubeconfig,
)

pytestmark = pytest.mark.anyio
NS = SANDBOX_NAMESPACE
ROLE = "retired_pod_gc"
PASSWORD = "first-secret"
THRESHOLD_S = 2.0
WAIT_CAP_S = 30.0
"""Longest wait for something the product promises within seconds: a cap against a hung test,
not a bound under test."""
SETTINGS: dict[str, object] = {
    "ENABLED": True,
    "DRY_RUN": False,
    "THRESHOLD_SECONDS": THRESHOLD_S,
    "RESYNC_PERIOD_SECONDS": 3600,
    "LISTENER_HEARTBEAT_SECONDS": 1,
    "LISTENER_HEARTBEAT_TIMEOUT_SECONDS": 1,
    "DB_CONNECT_TIMEOUT_SECONDS": 2,
    "DEBUG_PENDING": True,
}
NOT_DELIVERED = "notifications are not delivered"
RECONNECTS = "retired_pod_gc_listener_reconnects_total"
TEMPLATE = "space_template"
LOST_STATEMENT = re.compile(r'prepared statement "[^"]*" (does not exist|already exists)')


# ------------------------------------------------------------------------------ the database


async def _execute(url: str, sql: str, *args: object) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()


def _as_operator(admin_url: str, kubeconfig: Path) -> None:
    """The platform's tables, the project's roles, the trigger by ``retired-pod-gc migrate``
    (admin URL), a password for the controller's login."""
    schema = (REPO_ROOT / "deploy" / "sql" / "0001_dev_schema.sql").read_text(encoding="utf-8")
    role = (REPO_ROOT / "deploy" / "db-role" / "role.sql").read_text(encoding="utf-8")
    run_async(lambda: _execute(admin_url, schema))
    run_async(lambda: _execute(admin_url, role))
    done = run_cli("migrate", env=base_env(kubeconfig=kubeconfig, database_url=admin_url))
    assert done.code == 0, done.stderr
    assert "applied: " in done.stdout, done.stdout
    run_async(lambda: _execute(admin_url, f"ALTER ROLE {ROLE} PASSWORD '{PASSWORD}'"))


def _role_url(admin_url: str, *, password: str = PASSWORD) -> str:
    """``admin_url`` (one host) as the controller's login."""
    return admin_url.replace("postgres@", f"{ROLE}:{password}@", 1)


def _multi_host_url(database: str, ports: tuple[int, int], attrs: str) -> str:
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"postgresql://{ROLE}:{PASSWORD}@{hosts}/{database}?target_session_attrs={attrs}"


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Commands that need no cluster (migrate) still read the usual environment.
    return write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig", "http://127.0.0.1:1")


@pytest.fixture(scope="module")
def server(kubeconfig: Path) -> Iterator[ThrowawayPostgres]:
    """One server for the module; a template database set up by the operator's steps."""
    with ThrowawayPostgres() as pg:
        _as_operator(pg.create_database(TEMPLATE), kubeconfig)
        yield pg
        # Its data is thrown away: no shutdown checkpoint of every clone (seconds when busy).
        kill(pg)


_databases = iter(range(1_000_000))


@pytest.fixture
def database(server: ThrowawayPostgres) -> str:
    """A fresh database of the module's server, cloned from the set-up template; its name."""
    name = f"space_{next(_databases)}"
    server.create_database(name, template=TEMPLATE)
    return name


@pytest.fixture(scope="module")
def session_bouncer(server: ThrowawayPostgres) -> Iterator[ThrowawayPgBouncer]:
    with ThrowawayPgBouncer(server, users={ROLE: PASSWORD}, pool_mode="session") as b:
        yield b


@pytest.fixture(scope="module")
def transaction_bouncer(server: ThrowawayPostgres) -> Iterator[ThrowawayPgBouncer]:
    with ThrowawayPgBouncer(server, users={ROLE: PASSWORD}, pool_mode="transaction") as b:
        yield b


@pytest.fixture(scope="module")
def standby(server: ThrowawayPostgres) -> Iterator[ThrowawayStandby]:
    """A hot standby of the module's server (never promoted)."""
    with ThrowawayStandby(server) as s:
        yield s


# ------------------------------------------------------------------------ pods, rows, service


@pytest.fixture
async def launcher(
    request: pytest.FixtureRequest, tmp_path: Path, emulator: RunningEmulator
) -> AsyncIterator[ServiceLauncher]:
    """Each service gets its database URL (or URL file) from the test."""
    emulator.emulator.ensure_namespace(LEASE_NAMESPACE)
    launcher = ServiceLauncher(tmp_path=tmp_path, emulator_url=emulator.url, database_url="")
    try:
        yield launcher
    finally:
        launcher.close()
        report = getattr(request.node, "report_call", None)
        if report is None or report.failed:
            print(launcher.failure_report())


async def _seed(admin_url: str, emulator: RunningEmulator, sandbox_id: str, *, active: bool) -> str:
    """A managed sandbox, its generation-1 row (active or retired as ``suspended``) and its
    Succeeded pod (the terminal_retired shape once the row is retired); returns the pod name."""
    pod = sandbox_pod(sandbox_id=sandbox_id, generation=1, shape=Shape.SUCCEEDED, namespace=NS)
    name = str(pod["metadata"]["name"])
    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        await seed_sandbox(conn, sandbox_id, namespace=NS)
        await seed_execution(
            conn,
            pod_name=name,
            sandbox_id=sandbox_id,
            execution_state="active" if active else "suspended",
            active=active,
        )
    finally:
        await conn.close()
    emulator.emulator.create_pod(pod)
    return name


async def _retire(admin_url: str, name: str) -> float:
    """Retire ``name``'s row (committed when this returns); the commit's wall time."""
    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        await set_execution(conn, name, active=False, execution_state="suspended")
        return time.time()
    finally:
        await conn.close()


def _deletes(emulator: RunningEmulator, name: str | None = None) -> list[float]:
    """Wall times of the DELETEs of ``name`` (of any sandbox pod without it) the API accepted."""
    path = f"/namespaces/{NS}/pods/" + (name or "")
    return [
        e.time_s
        for e in emulator.emulator.audit_log(method="DELETE", path_contains=path)
        if e.status == 200
    ]


async def _started(svc: ServiceProcess, emulator: RunningEmulator, *, seen_active: int) -> None:
    """Ready, the lease held, ``seen_active`` pods skipped as row_active, the work queue empty:
    from here on one of those pods comes back to a reconcile only through a notification, a
    reconnect of the listener or a new term as leader."""
    await svc.wait_for("/readyz", 200, timeout_s=WAIT_CAP_S)
    await wait_until(
        lambda: lease_holder(emulator.emulator) == svc.name, timeout_s=WAIT_CAP_S, what="lease"
    )
    with anyio.fail_after(WAIT_CAP_S):
        while True:
            text = await svc.metrics()
            if (
                _metric(text, "retired_pod_gc_skips_total", reason="row_active") >= seen_active
                and _metric(text, "retired_pod_gc_is_leader") == 1
                and _metric(text, "retired_pod_gc_queue_depth") == 0
                and _metric(text, "retired_pod_gc_queue_delayed") == 0
            ):
                return
            await anyio.sleep(0.1)


async def _reaped_by_notification(
    svc: ServiceProcess,
    emulator: RunningEmulator,
    admin_url: str,
    name: str,
    record_property: Any,
) -> None:
    """Retire ``name`` after :func:`_started`: its pod is deleted once, by the notification (the
    listener did not reconnect, the lease was held throughout, and a retirement notification
    was enqueued)."""
    before = await svc.metrics()
    committed_at = await _retire(admin_url, name)
    await wait_until(
        lambda: bool(_deletes(emulator, name)), timeout_s=WAIT_CAP_S, what=f"{name} deleted"
    )
    [deleted_at] = _deletes(emulator, name)
    after = await svc.metrics()
    for unchanged in (RECONNECTS, "retired_pod_gc_is_leader"):
        assert _metric(after, unchanged) == _metric(before, unchanged), unchanged
    enqueued = "retired_pod_gc_retirement_to_enqueue_seconds_count"
    assert _metric(after, enqueued) > _metric(before, enqueued)
    record_property("commit_to_delete_s", round(deleted_at - committed_at, 3))
    print(f"{svc.name}: {name} deleted {deleted_at - committed_at:.2f}s after the commit")


async def _pending_keys(svc: ServiceProcess) -> set[str]:
    status, body = await svc.get("/debug/pending", debug=True)
    assert status == 200, body
    return {str(p["key"]) for p in json.loads(body)["pods"]}


def _log_lines(svc: ServiceProcess, needle: str) -> list[str]:
    return [line for line in svc.log_text().splitlines() if needle in line]


async def _never_ready(svc: ServiceProcess, *, seconds: float, reason: str) -> None:
    """/readyz answers 503 naming ``reason`` on every poll for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        svc.assert_running()
        status, body = await svc.get("/readyz")
        assert status == 503 and reason in body, (status, body)
        await anyio.sleep(0.1)


async def _wait_unready(svc: ServiceProcess, reason: str) -> None:
    with anyio.fail_after(WAIT_CAP_S):
        while True:
            svc.assert_running()
            status, body = await svc.get("/readyz")
            assert status != 200, f"{svc.name} ready: {body}"
            if status == 503 and reason in body:
                return
            await anyio.sleep(0.1)


def _metric(text: str, name: str, **labels: str) -> float:
    return sample(text, name, **labels)


# ------------------------------------------------------------------------------- PgBouncer


async def test_pgbouncer_session_mode_reaps_by_notification(
    emulator: RunningEmulator,
    launcher: ServiceLauncher,
    server: ThrowawayPostgres,
    database: str,
    session_bouncer: ThrowawayPgBouncer,
    record_property: Any,
) -> None:
    admin = server.database_url(database)
    name = await _seed(admin, emulator, "pgb-session", active=True)
    svc = launcher.start("gc", database_url=session_bouncer.url(ROLE, database), **SETTINGS)
    await _started(svc, emulator, seen_active=1)
    await _reaped_by_notification(svc, emulator, admin, name, record_property)
    text = await svc.metrics()
    assert _metric(text, "retired_pod_gc_listener_delivery_ok") == 1
    assert _metric(text, "retired_pod_gc_listener_connected") == 1
    assert "Traceback" not in svc.log_text()


async def test_pgbouncer_transaction_mode_with_a_direct_listener_reaps_by_notification(
    emulator: RunningEmulator,
    launcher: ServiceLauncher,
    server: ThrowawayPostgres,
    database: str,
    transaction_bouncer: ThrowawayPgBouncer,
    record_property: Any,
) -> None:
    admin = server.database_url(database)
    name = await _seed(admin, emulator, "pgb-transaction", active=True)
    svc = launcher.start(
        "gc",
        database_url=transaction_bouncer.url(ROLE, database),
        LISTENER_DATABASE_URL=_role_url(admin),
        DB_TRANSACTION_POOLER=True,
        **SETTINGS,
    )
    await _started(svc, emulator, seen_active=1)
    await _reaped_by_notification(svc, emulator, admin, name, record_property)
    text = await svc.metrics()
    assert _metric(text, "retired_pod_gc_listener_delivery_ok") == 1
    assert _metric(text, "retired_pod_gc_listener_connected") == 1
    # A prepared statement lost (or left behind) between transactions would show here.
    assert not LOST_STATEMENT.search(svc.log_text())
    assert "Traceback" not in svc.log_text()


async def test_pgbouncer_transaction_mode_listener_is_unready_and_deletes_nothing(
    emulator: RunningEmulator,
    launcher: ServiceLauncher,
    server: ThrowawayPostgres,
    database: str,
    transaction_bouncer: ThrowawayPgBouncer,
) -> None:
    admin = server.database_url(database)
    # Retired before the start: a service that trusted its listener would reap it one
    # threshold after its first pass.
    retired = await _seed(admin, emulator, "pgb-tx-retired", active=False)
    later = await _seed(admin, emulator, "pgb-tx-later", active=True)
    svc = launcher.start(
        "gc",
        database_url=transaction_bouncer.url(ROLE, database),
        DB_TRANSACTION_POOLER=True,
        **SETTINGS,
    )
    await _wait_unready(svc, NOT_DELIVERED)
    await _retire(admin, later)
    # Never ready, several heartbeats and thresholds long.
    await _never_ready(svc, seconds=THRESHOLD_S + 2, reason=NOT_DELIVERED)
    assert _deletes(emulator) == [], "deleted although delivery is not proven"
    assert {retired, later} <= {p["metadata"]["name"] for p in emulator.emulator.pods(NS)}
    text = await svc.metrics()
    assert _metric(text, "retired_pod_gc_listener_delivery_ok") == 0
    assert _metric(text, "retired_pod_gc_listener_connected") == 0
    assert _metric(text, "retired_pod_gc_listener_delivery_failures_total") >= 1
    # One warning, naming the likely causes and the fix; not one per probe or per reconcile.
    lines = [json.loads(line) for line in _log_lines(svc, NOT_DELIVERED)]
    assert len(lines) == 1, [(r["logger"], r["msg"][:100]) for r in lines]
    [record] = lines
    assert record["level"] == "warning", record
    for word in ("pooler", "proxy", "LISTENER_DATABASE_URL"):
        assert word in record["msg"], (word, record)


# --------------------------------------------------------------------------------- standby


async def test_url_at_a_hot_standby_is_unready_in_recovery_and_deletes_nothing(
    emulator: RunningEmulator,
    launcher: ServiceLauncher,
    server: ThrowawayPostgres,
    database: str,
    standby: ThrowawayStandby,
) -> None:
    admin = server.database_url(database)
    # Readable on the standby, retired: a service that read from it would reap the pod.
    retired = await _seed(admin, emulator, "standby-retired", active=False)
    standby.wait_replayed(server)
    svc = launcher.start("gc", database_url=_role_url(standby.database_url(database)), **SETTINGS)
    await _wait_unready(svc, "in recovery")
    await _never_ready(svc, seconds=THRESHOLD_S + 2, reason="in recovery")
    assert _deletes(emulator) == []
    assert retired in {p["metadata"]["name"] for p in emulator.emulator.pods(NS)}
    assert _log_lines(svc, "in recovery"), svc.log_tail()
    assert _log_lines(svc, "hot standby"), svc.log_tail()


async def test_every_one_shot_command_at_a_hot_standby_is_one_line_saying_so_and_acts_on_nothing(
    emulator: RunningEmulator,
    server: ThrowawayPostgres,
    database: str,
    standby: ThrowawayStandby,
    tmp_path: Path,
) -> None:
    admin = server.database_url(database)
    retired = await _seed(admin, emulator, "standby-cli", active=False)
    standby.wait_replayed(server)
    env = base_env(
        kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", emulator.url),
        database_url=_role_url(standby.database_url(database)),
        DB_CONNECT_TIMEOUT_SECONDS=5,
    )
    commands = {
        "migrate": ("migrate",),
        "scan": ("scan", "--timeout", "5"),
        "explain": ("explain", f"{NS}/{retired}"),
        "cancel-create": ("cancel-create", "standby-cli", "1", "0"),
    }
    for command, args in commands.items():
        result = await anyio.to_thread.run_sync(lambda args=args: run_cli(*args, env=env))
        lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("{")]
        assert result.code == 1, (command, result)
        assert "Traceback" not in result.stderr, (command, result.stderr)
        assert len(lines) == 1, (command, result.stderr)
        assert "hot standby" in lines[0], (command, lines[0])
    assert _deletes(emulator) == []
    assert retired in {p["metadata"]["name"] for p in emulator.emulator.pods(NS)}


@pytest.mark.parametrize("attrs", ["read-write", "primary"])
async def test_multi_host_url_survives_failover(
    emulator: RunningEmulator,
    launcher: ServiceLauncher,
    kubeconfig: Path,
    attrs: str,
    record_property: Any,
) -> None:
    """The retirement of ``lost`` is committed on the primary (the service sees it and its
    clock starts) but never reaches the standby; the primary is killed before the clock is due
    and the standby promoted. ``lost``'s row is active on the new primary: never deleted. A pod
    retired on the new primary is."""
    with ThrowawayPostgres() as primary:
        admin = primary.create_database("space")
        _as_operator(admin, kubeconfig)
        lost = await _seed(admin, emulator, "failover-lost", active=True)
        later = await _seed(admin, emulator, "failover-later", active=True)
        with ThrowawayStandby(primary) as standby:
            standby.wait_replayed(primary)
            url = _multi_host_url("space", (primary.port, standby.port), attrs)
            svc = launcher.start("gc", database_url=url, **SETTINGS)
            await _started(svc, emulator, seen_active=2)

            standby.detach()
            await _retire(admin, lost)
            with anyio.fail_after(WAIT_CAP_S):
                while f"{NS}/{lost}" not in await _pending_keys(svc):
                    await anyio.sleep(0.02)
            reconnects = _metric(await svc.metrics(), RECONNECTS)
            kill(primary)
            assert _deletes(emulator) == [], "deleted before the failover: no test"
            standby.promote()
            promoted_at = time.time()

            # Back on the new primary (the one server left) and ready.
            with anyio.fail_after(WAIT_CAP_S):
                while True:
                    text = await svc.metrics()
                    if (
                        _metric(text, RECONNECTS) > reconnects
                        and _metric(text, "retired_pod_gc_listener_connected") == 1
                    ):
                        break
                    await anyio.sleep(0.1)
            await svc.wait_for("/readyz", 200, timeout_s=WAIT_CAP_S)
            new_admin = standby.database_url("space")
            await _reaped_by_notification(svc, emulator, new_admin, later, record_property)
            promotion_to_delete_s = _deletes(emulator, later)[0] - promoted_at
            record_property("promotion_to_delete_s", round(promotion_to_delete_s, 3))
            print(f"{attrs}: {later} deleted {promotion_to_delete_s:.2f}s after the promotion")
            # The clock of the lost retirement ends on the new primary's active row.
            with anyio.fail_after(WAIT_CAP_S):
                while f"{NS}/{lost}" in await _pending_keys(svc):
                    await anyio.sleep(0.1)
            assert _deletes(emulator, lost) == []
            assert lost in {p["metadata"]["name"] for p in emulator.emulator.pods(NS)}
            svc.assert_running()
            assert "Traceback" not in svc.log_text()


# -------------------------------------------------------------------------------- rotation


def _write_secret(path: Path, url: str) -> None:
    """As the kubelet updates a mounted Secret: a new file swapped in whole."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(url + "\n", encoding="utf-8")
    os.replace(fresh, path)


async def test_rotated_password_takes_effect_at_the_next_reconnect_without_a_restart(
    emulator: RunningEmulator,
    launcher: ServiceLauncher,
    server: ThrowawayPostgres,
    database: str,
    tmp_path: Path,
    record_property: Any,
) -> None:
    admin = server.database_url(database)
    require_password(server, user=ROLE, database=database)
    name = await _seed(admin, emulator, "rotation", active=True)
    secret = tmp_path / "database-url"
    _write_secret(secret, _role_url(admin))
    svc = launcher.start("gc", database_url="", DATABASE_URL_FILE=secret, **SETTINGS)
    await _started(svc, emulator, seen_active=1)
    pid = svc.proc.pid

    # The password changes before the Secret does: every reconnect fails meanwhile.
    await _execute(admin, f"ALTER ROLE {ROLE} PASSWORD 'second-secret'")
    await _execute(
        admin,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE usename = $1 AND datname = $2",
        ROLE,
        database,
    )
    await svc.wait_for("/readyz", 503, timeout_s=WAIT_CAP_S)

    async def failures() -> float:
        return _metric(await svc.metrics(), "retired_pod_gc_database_login_failures_total")

    with anyio.fail_after(WAIT_CAP_S):
        while await failures() < 4:
            await anyio.sleep(0.1)
    # Logged once per change of cause by each component that meets it (the listener, and the
    # store and the kept sweep when they query), not once per retry.
    refused = _log_lines(svc, "password authentication failed")
    per_logger = Counter(json.loads(line)["logger"] for line in refused)
    assert per_logger["service.pg.listener"] == 1, svc.log_tail()
    assert set(per_logger.values()) == {1}, per_logger
    assert (await svc.get("/readyz"))[0] == 503

    _write_secret(secret, _role_url(admin, password="second-secret"))
    await svc.wait_for("/readyz", 200, timeout_s=WAIT_CAP_S)
    await _reaped_by_notification(svc, emulator, admin, name, record_property)
    assert svc.proc.pid == pid and svc.proc.poll() is None, "restarted"
    assert "Traceback" not in svc.log_text()
