"""The service under faults, with the real adapters: the delete budget (invariant 4), benign
404/409 answers, API errors with backoff, and a database that goes down (invariant 3).

Same harness as ``test_engine_safety`` (the whole service in-process, real time, the emulator
over HTTP, a real PostgreSQL); see that module's docstring for how "never" and "eventually" are
judged.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape, pod_status
from devtools.pg.throwaway import ThrowawayPostgres
from service.kit.ratelimit import capped_shape
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from tests.integration.test_engine_safety import (
    EVENTUALLY_S,
    NS,
    TERMINAL,
    assert_not_before,
    clock_started,
    create_pod,
    deletes,
    eventually,
    outcome,
    pod_path,
    preconditions,
    requests_for,
    running_service,
    sample,
    seed_row,
)
from tests.kubefixtures import SANDBOX_NAMESPACE

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- invariant 4


async def test_rate_limit_caps_deletes_per_rolling_minute(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    cap = 6
    count = 15
    for i in range(count):
        await seed_row(pg_conn, f"b{i:02d}", active=False, state="suspended")
        create_pod(emu, f"b{i:02d}", Shape.SUCCEEDED)
    shape = capped_shape(cap)
    assert shape is not None
    burst, rate_per_s = shape
    # A real minute cannot be waited for. Instead: every candidate is due at once, and the
    # deletes are watched for a fixed 13 s after the first one. A budget that admits more
    # than the cap as a burst (or none at all) exceeds 6 within that span already; the
    # design's pacer (burst N//10, then (N - burst)/60 per second) sends 1 + 1 here.
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=1, DELETES_PER_MINUTE=cap):
        await eventually(lambda: len(deletes(emu)) >= 1, "the first DELETE")
        first = deletes(emu)[0].time_s
        await anyio.sleep(max(0.0, first + 13.0 - time.time()))
        # The pacer's second token comes 12 s after the first; allow for a slow machine.
        await eventually(lambda: len(deletes(emu)) >= 2, "the paced second DELETE")
        observed_until = time.time()
    sent = sorted(e.time_s for e in deletes(emu))
    assert all(e.status == 200 for e in deletes(emu))
    for i, start in enumerate(sent):
        in_window = sum(1 for t in sent[i:] if t - start < 60.0)
        assert in_window <= cap, f"{in_window} DELETEs within 60 s from {start - first:.2f}s"
    # No faster than the pacer allows either (one spare for timing at the edges); progress
    # (the backlog keeps flowing) was awaited above.
    assert len(sent) <= burst + (observed_until - first) * rate_per_s + 1


# ---------------------------------------------------------------- benign 404 / 409


async def test_delete_answered_404_or_409_is_benign_and_a_conflict_is_decided_again(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    gone = await seed_row(pg_conn, "c1", active=False, state="suspended")
    moved = await seed_row(pg_conn, "c2", active=False, state="suspended")
    later = await seed_row(pg_conn, "c3", active=True, state="active")
    create_pod(emu, "c1", Shape.SUCCEEDED)
    moved_pod = create_pod(emu, "c2", Shape.SUCCEEDED)
    create_pod(emu, "c3", Shape.SUCCEEDED)
    # Another client acts while each pod's first DELETE is in flight: it arrives at the server,
    # the other client's change lands, then the DELETE is handled.
    status = {**pod_status(Shape.SUCCEEDED), "message": "status rewritten by the kubelet"}
    rewritten: list[dict[str, Any]] = []
    # Someone else deleted it: our DELETE finds nothing (404).
    emu.before_next(
        partial(emu.delete_pod, NS, gone), method="DELETE", path_contains=pod_path(gone)
    )
    # A status write bumps its resourceVersion: our precondition no longer holds (409).
    emu.before_next(
        lambda: rewritten.append(emu.set_status(NS, moved, status)),
        method="DELETE",
        path_contains=pod_path(moved),
    )
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=1) as parts:
        await eventually(lambda: len(deletes(emu, moved)) >= 2, "the DELETE after the conflict")
        new_rv = rewritten[0]["metadata"]["resourceVersion"]
        assert new_rv != moved_pod["metadata"]["resourceVersion"]
        await eventually(lambda: outcome(parts, "gone") >= 1, "the gone outcome")
        # Still working after both: a later retirement is acted upon.
        await eventually(lambda: parts.listener.connected, "the LISTEN")
        t_retired = time.time()
        await pg_conn.execute(
            "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'stopped',"
            " retired_at = now() WHERE pod_name = $1",
            later,
        )
        await eventually(lambda: len(deletes(emu, later)) >= 1, "the later DELETE")
        # The server has answered it; the service counts the outcome when its client has read
        # the answer (later, on a loaded machine).
        await eventually(lambda: outcome(parts, TERMINAL) >= 2, "the later DELETE's outcome")
        assert outcome(parts, "conflict") == 1
        assert outcome(parts, TERMINAL) == 2
        assert (
            sample(
                parts,
                "retired_pod_gc_deletes_total",
                sandbox_namespace=SANDBOX_NAMESPACE,
                result="gone",
            )
            == 1
        )
        assert (
            sample(
                parts,
                "retired_pod_gc_deletes_total",
                sandbox_namespace=SANDBOX_NAMESPACE,
                result="conflict",
            )
            == 1
        )
        assert (
            sample(
                parts,
                "retired_pod_gc_deletes_total",
                sandbox_namespace=SANDBOX_NAMESPACE,
                result="deleted",
            )
            == 2
        )
    assert [e.status for e in deletes(emu, gone)] == [404]
    first, second = deletes(emu, moved)
    assert (first.status, second.status) == (409, 200)
    uid = moved_pod["metadata"]["uid"]
    assert preconditions(first) == (uid, moved_pod["metadata"]["resourceVersion"])
    assert preconditions(second) == (uid, new_rv)
    assert [e.status for e in deletes(emu, later)] == [200]
    assert_not_before(deletes(emu, later), t_retired + 1, "the later retirement")


# ---------------------------------------------------------------- API errors


async def test_api_errors_back_off_and_end_in_exactly_one_delete(
    emulator: RunningEmulator, pg_url: str, pg_conn: asyncpg.Connection
) -> None:
    emu = emulator.emulator
    threshold_s = 1.0
    name = await seed_row(pg_conn, "e1", active=False, state="suspended")
    pod = create_pod(emu, "e1", Shape.SUCCEEDED)
    emu.fail_next(2, code=500, method="GET", path_contains=pod_path(name))
    emu.fail_next(1, code=429, method="GET", path_contains=pod_path(name), retry_after_s=1)
    emu.fail_next(1, code=500, method="DELETE", path_contains=pod_path(name))
    emu.fail_next(2, code=429, method="DELETE", path_contains=pod_path(name), retry_after_s=1)
    t0 = time.time()
    async with running_service(emulator, pg_url, THRESHOLD_SECONDS=threshold_s) as parts:
        await eventually(
            lambda: any(e.status == 200 for e in deletes(emu, name)), "the successful DELETE"
        )
        await eventually(lambda: outcome(parts, TERMINAL) >= 1, "the DELETE's outcome")
        await anyio.sleep(1.0)  # room for a second DELETE, which must not come
        assert outcome(parts, TERMINAL) == 1
        # The GETs' and DELETE's 500s are errors; the GET's 429 is sent again by the API client
        # after its Retry-After, the DELETE's 429s (never sent again by the client) are
        # throttled: requeued after the Retry-After, not errors.
        assert outcome(parts, "error") == 3
        assert outcome(parts, "throttled") == 2
    sent = deletes(emu, name)
    assert [e.status for e in sent] == [500, 429, 429, 200]
    gets = [r for r in emu.requests if r.method == "GET" and r.path.endswith(pod_path(name))]
    assert [r.status for r in gets[:4]] == [500, 500, 429, 200]
    assert gets[3].time_s - gets[2].time_s >= 0.95  # the client waited for the Retry-After
    # After each 429 the next DELETE waits for the server's Retry-After (1 s), not the backoff.
    for answered_429, following in itertools.pairwise(sent[1:4]):
        assert following.time_s - answered_429.time_s >= 0.95, (answered_429, following)
    assert requests_for(emu, "GET", name) >= 3 + 3  # 3 failed GETs, then one per DELETE try
    assert_not_before(sent, t0 + threshold_s, "under API errors")
    assert all(
        preconditions(e) == (pod["metadata"]["uid"], pod["metadata"]["resourceVersion"])
        for e in sent
    )


# ---------------------------------------------------------------- the database goes down


def _stop_server(pg: ThrowawayPostgres) -> None:
    """Fast-shutdown the server but keep its data directory and port (``stop()`` removes
    both); ``start()`` then brings the same server back."""
    pid = pg.pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + 20
    while pg.running:
        if time.monotonic() > deadline:
            raise TimeoutError("postgres did not stop")
        time.sleep(0.01)


async def test_database_down_clears_clocks_and_delays_the_delete_a_full_threshold(
    emulator: RunningEmulator,
) -> None:
    emu = emulator.emulator
    threshold_s = 2.0
    # Its own server: stopping the session's would disturb every other test.
    pg = await anyio.to_thread.run_sync(ThrowawayPostgres().start)
    try:
        await migrate(pg.url, channel=DEFAULT_CHANNEL, with_schema=True)
        conn = await asyncpg.connect(pg.url, timeout=10)
        try:
            name = await seed_row(conn, "p1", active=False, state="suspended")
        finally:
            await conn.close()
        create_pod(emu, "p1", Shape.SUCCEEDED)
        t0 = time.time()
        async with running_service(
            emulator,
            pg.url,
            THRESHOLD_SECONDS=threshold_s,
            DB_CONNECT_TIMEOUT_SECONDS=0.5,
            DB_STATEMENT_TIMEOUT_SECONDS=1,
        ) as parts:
            await clock_started(parts)
            await eventually(lambda: parts.listener.connected, "the LISTEN")
            await anyio.sleep(max(0.0, t0 + 0.5 - time.time()))
            await anyio.to_thread.run_sync(_stop_server, pg)
            # Down for longer than the threshold: the clock that was running expires now.
            await eventually(
                lambda: outcome(parts, "lookup_failed") >= 1,
                "a failed lookup",
                timeout_s=threshold_s + 5,
            )
            await anyio.sleep(max(0.0, t0 + threshold_s + 1.0 - time.time()))
            assert deletes(emu) == [], "a DELETE was sent while the database was down"
            assert len(parts.clocks) == 0
            t_up = time.time()
            await anyio.to_thread.run_sync(pg.start)
            await eventually(
                lambda: len(deletes(emu, name)) >= 1,
                "the DELETE after the database came back",
                timeout_s=EVENTUALLY_S + threshold_s,
            )
        sent = deletes(emu, name)
        assert len(sent) == 1 and sent[0].status == 200
        assert_not_before(sent, t_up + threshold_s, "after the database came back")
    finally:
        await anyio.to_thread.run_sync(pg.stop)
