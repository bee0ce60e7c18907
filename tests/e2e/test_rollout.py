"""The rollout an operator does, end to end: the real ``retired-pod-gc run`` process against the
API emulator and a real PostgreSQL, once per phase (disabled → dry run → live), on the demo's
population. Also: health endpoints, and a database that is down at start.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from typing import Any

import anyio
import pytest

from devtools.demo import POPULATION, UNRELATED
from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape

from .harness import (
    SANDBOX_NAMESPACE,
    ServiceLauncher,
    closed_port,
    lease_holder,
    outcomes,
    present,
    sample,
    seed_population,
    wait_until,
)

pytestmark = pytest.mark.anyio

THRESHOLD_S = 3.0
SHUTDOWN_TIMEOUT_S = 5.0
EXPECT_REAPED = {p.name for p in POPULATION if p.expect_deleted}
EXPECT_KEPT = {p.name for p in POPULATION if not p.expect_deleted} | {UNRELATED}
BOTH_SHAPES = {"replaced_never_started": 1, "terminal_retired": 1}


VERDICTS = {
    p.name: ("terminal_retired" if p.shape is Shape.SUCCEEDED else "replaced_never_started")
    for p in POPULATION
    if p.expect_deleted
}


def _events_by_uid(emu: Any, reason: str) -> dict[str, list[dict[str, Any]]]:
    """The Events of ``reason`` the API server received, by the UID they regard."""
    out: dict[str, list[dict[str, Any]]] = {}
    for event in emu.events.events(SANDBOX_NAMESPACE, f"reason={reason}"):
        out.setdefault(event["regarding"]["uid"], []).append(event)
    return out


def _assert_one_event_per_reaped_uid(
    emu: Any, reason: str, pods: dict[str, tuple[str, str]]
) -> None:
    by_uid = _events_by_uid(emu, reason)
    assert {uid: len(events) for uid, events in by_uid.items()} == {
        pods[name][0]: 1 for name in EXPECT_REAPED
    }
    for name in EXPECT_REAPED:
        uid, rv = pods[name]
        (event,) = by_uid[uid]
        assert event["regarding"]["name"] == name
        assert VERDICTS[name] in event["note"]
        assert f"uid={uid} resourceVersion={rv}" in event["note"]


def _deletes(emu: Any) -> list[Any]:
    return emu.audit_log(method="DELETE", path_contains=f"/namespaces/{SANDBOX_NAMESPACE}/pods/")


async def _stop(svc: Any, signum: signal.Signals = signal.SIGTERM) -> None:
    code, took_s = await svc.terminate(timeout_s=SHUTDOWN_TIMEOUT_S + 3, signum=signum)
    assert code == 0, (
        f"{svc.name}: exit {code} after {signum.name} ({took_s:.1f}s)\n{svc.log_tail()}"
    )
    assert took_s <= SHUTDOWN_TIMEOUT_S
    assert "Traceback" not in svc.log_text()
    assert f"received {signum.name}" in svc.log_text()


async def test_rollout_disabled_then_dry_run_then_live(
    emulator: RunningEmulator,
    launcher: ServiceLauncher,
    pg_url: str,
    record_property: Any,
) -> None:
    emu = emulator.emulator
    created = await seed_population(pg_url, emu)
    all_names = EXPECT_REAPED | EXPECT_KEPT
    assert present(emu) == all_names

    # (a) disabled: nothing deleted, nothing reported, health still served.
    svc = launcher.start("disabled", ENABLED=False, THRESHOLD_SECONDS=THRESHOLD_S)
    await svc.wait_for("/readyz", 200)
    assert (await svc.get("/healthz"))[0] == 200
    await anyio.sleep(max(0.0, THRESHOLD_S + 2 - (time.monotonic() - svc.started_at)))
    text = await svc.metrics()
    assert sample(text, "retired_pod_gc_enabled") == 0
    assert outcomes(text, mode="dry_run") == {}
    assert outcomes(text, mode="live") == {}
    assert present(emu) == all_names
    assert _deletes(emu) == []
    # Once synced, what is alive is kept out of the garbage collector's scans (kit memory).
    with anyio.fail_after(30):
        while "cached objects exempted from full garbage collections" not in svc.log_text():
            await anyio.sleep(0.05)
    await _stop(svc)
    assert emu.events.events() == []

    # (b) dry run: each retired shape reported exactly once, nothing deleted.
    svc = launcher.start("dry-run", ENABLED=True, DRY_RUN=True, THRESHOLD_SECONDS=THRESHOLD_S)
    await svc.wait_for("/readyz", 200)
    seen: dict[str, int] = {}

    async def would_reap_both() -> None:
        nonlocal seen
        while sum(seen.values()) < 2:
            seen = outcomes(await svc.metrics(), mode="dry_run")
            await anyio.sleep(0.1)

    with anyio.fail_after(THRESHOLD_S + 10):
        await would_reap_both()
    reported_at_s = time.monotonic() - svc.started_at
    assert reported_at_s >= THRESHOLD_S, "reported before the threshold"
    # Well past the threshold (and past several resyncs of the same keys): still once per UID.
    await anyio.sleep(THRESHOLD_S)
    text = await svc.metrics()
    assert outcomes(text, mode="dry_run") == BOTH_SHAPES
    assert outcomes(text, mode="live") == {}
    assert sample(text, "retired_pod_gc_dry_run") == 1
    assert present(emu) == all_names
    assert _deletes(emu) == []
    await _stop(svc)
    # One RetiredPodWouldDelete per reported UID (written by the time SIGTERM's flush ended).
    uids = {
        name: (pod["metadata"]["uid"], pod["metadata"]["resourceVersion"])
        for name, pod in created.items()
    }
    _assert_one_event_per_reaped_uid(emu, "RetiredPodWouldDelete", uids)
    assert _events_by_uid(emu, "RetiredPodDeleted") == {}
    # SIGTERM released the lease: the next phase need not wait for it to expire.
    assert lease_holder(emu) == ""

    # (c) live: exactly the two retired shapes are deleted, under preconditions.
    before = {
        name: (pod["metadata"]["uid"], pod["metadata"]["resourceVersion"])
        for name, pod in created.items()
    }
    for name in all_names:
        pod = emu.get_pod(SANDBOX_NAMESPACE, name)
        assert pod is not None
        assert (pod["metadata"]["uid"], pod["metadata"]["resourceVersion"]) == before[name]
    svc = launcher.start("live", ENABLED=True, DRY_RUN=False, THRESHOLD_SECONDS=THRESHOLD_S)
    started = svc.started_at
    await wait_until(
        lambda: not (EXPECT_REAPED & present(emu)),
        timeout_s=THRESHOLD_S + 8,
        what="both retired pods deleted",
    )
    reaped_after_s = time.monotonic() - started
    print(f"\nlive phase: both retired pods deleted {reaped_after_s:.2f}s after process start")
    record_property("live_reap_seconds", round(reaped_after_s, 3))
    assert THRESHOLD_S <= reaped_after_s <= THRESHOLD_S + 5
    # Graceful deletion of the node-bound Pending pod finishes (the emulator's kubelet).
    await wait_until(
        lambda: not any(emu.get_pod(SANDBOX_NAMESPACE, n) for n in EXPECT_REAPED),
        timeout_s=5,
        what="pods gone",
    )
    await anyio.sleep(1.0)
    text = await svc.metrics()
    assert outcomes(text, mode="live") == BOTH_SHAPES
    assert present(emu) == EXPECT_KEPT
    deletes = _deletes(emu)
    assert sorted(d.path.rsplit("/", 1)[-1] for d in deletes) == sorted(EXPECT_REAPED)
    for d in deletes:
        name = d.path.rsplit("/", 1)[-1]
        assert d.status == 200
        assert d.body["preconditions"] == {
            "uid": before[name][0],
            "resourceVersion": before[name][1],
        }
    await _stop(svc)
    # Each deleted pod has one RetiredPodDeleted regarding its UID, the verdict in its note.
    _assert_one_event_per_reaped_uid(emu, "RetiredPodDeleted", before)


async def test_health_and_readiness_with_the_database_down(
    emulator: RunningEmulator, launcher: ServiceLauncher
) -> None:
    down = f"postgresql://gc:secret@127.0.0.1:{closed_port()}/nowhere"
    svc = launcher.start(
        "db-down", database_url=down, ENABLED=True, DRY_RUN=False, DB_CONNECT_TIMEOUT_SECONDS=1
    )
    await svc.wait_for("/healthz", 200)
    # The pod cache syncs (the API server is fine) but the database never answers.
    await anyio.sleep(2.0)
    svc.assert_running()
    status, body = await svc.get("/readyz")
    assert status == 503
    # Each problem named with its cause: the pool's ping and the listener both refused.
    assert "database: Unavailable: ConnectionRefusedError" in body
    assert "notify listener: Unavailable: ConnectionRefusedError" in body
    assert "pod cache not synced" not in body
    assert (await svc.get("/healthz"))[0] == 200
    assert "secret" not in svc.log_text()
    # Ctrl-C in a terminal is the same graceful stop.
    await _stop(svc, signal.SIGINT)


async def test_a_crash_at_start_exits_1_with_one_critical_log_line(
    emulator: RunningEmulator, launcher: ServiceLauncher
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        svc = launcher.start("crash", METRICS_BIND_ADDRESS=f"127.0.0.1:{port}")
        code = await svc.wait_exit(15)
    assert code == 1, svc.log_tail()
    records = [json.loads(line) for line in svc.log_text().splitlines() if line.startswith("{")]
    assert len(records) == len(svc.log_text().splitlines()), "every stderr line is a JSON record"
    critical = [r for r in records if r["level"] == "critical"]
    assert len(critical) == 1
    assert "address already in use" in critical[0]["msg"]
