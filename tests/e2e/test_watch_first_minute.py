"""A connection black-holed in the service's first minute, before the API server has sent its
watch a periodic bookmark (a kube-apiserver sends the first one 60 s into a watch): the pod
created then is deleted within ``THRESHOLD_SECONDS`` + 90 s (docs/architecture.md, "A silent
watch").

The real service, through the TCP proxy of ``tests/kubeproxy.py``, at the product's connectivity
defaults (``WATCH_SILENCE_SECONDS`` 75, ``WATCH_TIMEOUT_SECONDS`` 300, ``API_TIMEOUT_SECONDS`` 10,
leader election with its default Lease timings); only ``THRESHOLD_SECONDS`` is short (5). The
emulator sends bookmarks every 60 s, and ends every watch at its ``timeoutSeconds`` with a last
bookmark 2 s before, as a kube-apiserver does. As soon as the cache is synced, every open
connection is black-holed (no reset, no bytes; new connections work), and a pod is created whose
execution is already retired.

Judged from evidence, not from the seconds alone: the stream open at the black hole asked for a
``timeoutSeconds`` within the bound; it was given up for its silence (the restart counted
``silent``, its log line, no read timeout), not before that ``timeoutSeconds``; the watch that
replaced it resumed from the version last seen (no relist) and so brought the pod; the DELETE
came after it. Takes about 90 s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.faults import RequestRecord
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.pg.devdata import seed_execution, seed_sandbox
from service import config
from service.pg.migrate import migrate
from tests.kubeproxy import proxied

from .harness import LEASE_NAMESPACE, SANDBOX_NAMESPACE, ServiceLauncher, sample, wait_until

pytestmark = pytest.mark.anyio

SANDBOX = "firstmin0"
POD = pod_name(SANDBOX, 1)
THRESHOLD_S = 5.0
BOUND_S = THRESHOLD_S + 90.0
"""The promise: from the pod's creation to its DELETE."""
SILENCE_S = config.WATCH_SILENCE_SECONDS.default
DEFAULTS: dict[str, object] = {
    var.suffix: var.default
    for var in (
        config.API_TIMEOUT_SECONDS,
        config.WATCH_TIMEOUT_SECONDS,
        config.WATCH_SILENCE_SECONDS,
        config.LEASE_DURATION_SECONDS,
        config.RENEW_DEADLINE_SECONDS,
        config.RETRY_PERIOD_SECONDS,
    )
}
"""The settings the harness shortens for other tests, at the product's defaults here."""


@pytest.fixture
def emulator_options() -> dict[str, object]:
    return {"bookmark_interval_s": 60.0, "history_size": 10_000, "kubelet_finish_after_s": 0.5}


async def _seed(url: str) -> None:
    """The sandbox, and its execution already retired (suspended)."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrate(conn, channel="sandbox_execution_changed", with_schema=True)
        await seed_sandbox(conn, SANDBOX, namespace=SANDBOX_NAMESPACE)
        await seed_execution(
            conn, pod_name=POD, sandbox_id=SANDBOX, execution_state="suspended", active=False
        )
    finally:
        await conn.close()


def _pod_watches(requests: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in requests if r.path.endswith(f"/namespaces/{SANDBOX_NAMESPACE}/pods")]


@pytest.mark.slow
@pytest.mark.background
@pytest.mark.timeout(300)
async def test_a_watch_black_holed_before_its_first_bookmark_is_given_up_and_the_pod_deleted(
    emulator: RunningEmulator, pg_url: str, tmp_path: Path, record_property: Any
) -> None:
    emu = emulator.emulator
    emu.ensure_namespace(LEASE_NAMESPACE)
    await _seed(pg_url)
    async with proxied(emulator) as proxy:
        launcher = ServiceLauncher(tmp_path=tmp_path, emulator_url=proxy.url, database_url=pg_url)
        try:
            svc = launcher.start(
                "firstmin", ENABLED=True, DRY_RUN=False, THRESHOLD_SECONDS=THRESHOLD_S, **DEFAULTS
            )
            await svc.wait_for("/readyz", 200, timeout_s=60)
            holed = proxy.blackhole_existing()
            holed_at = time.time()
            assert holed >= 1 and proxy.black_holed == proxy.open

            # The premise: the black hole came within 10 s of the sync, before any periodic
            # bookmark (the one BOOKMARK read is the streaming list's initial-events-end).
            (sync,) = _pod_watches(emu.watch_requests())
            assert sync.query.get("sendInitialEvents") in ("true", "True")
            assert holed_at - sync.time_s <= 10.0
            metrics = await svc.metrics()
            assert sample(metrics, "retired_pod_gc_watch_events_total", type="BOOKMARK") == 1

            created = emu.create_pod(
                sandbox_pod(sandbox_id=SANDBOX, generation=1, shape=Shape.SUCCEEDED),
                namespace=SANDBOX_NAMESPACE,
            )
            created_at = time.time()

            def deletes() -> list[Any]:
                return [
                    d
                    for d in emu.audit_log(method="DELETE", path_contains=f"/pods/{POD}")
                    if d.status < 300
                ]

            await wait_until(
                lambda: bool(deletes()),
                timeout_s=BOUND_S - (time.time() - created_at),
                what=f"the DELETE of {POD} within THRESHOLD_SECONDS + 90 s of its creation",
            )
            (delete,) = deletes()
            assert delete.body["preconditions"]["uid"] == created["metadata"]["uid"]
            assert delete.time_s - created_at <= BOUND_S

            # The evidence. The stream black-holed asked the server to end it within the
            # bound, and was watched again from the version it had reached, no sooner than
            # the server would have ended it.
            timeout_s = int(sync.query["timeoutSeconds"])
            assert timeout_s <= SILENCE_S
            resumed = next(w for w in _pod_watches(emu.watch_requests()) if w.time_s > holed_at)
            assert "sendInitialEvents" not in resumed.query
            assert int(resumed.query["resourceVersion"]) < int(
                created["metadata"]["resourceVersion"]
            )
            assert resumed.time_s - sync.time_s >= timeout_s
            assert resumed.time_s < delete.time_s
            # Given up for its silence (not by the request's read timeout), the cache kept.
            metrics = await svc.metrics()
            restarts = "retired_pod_gc_watch_restarts_total"
            assert sample(metrics, restarts, reason="silent") == 1
            assert sample(metrics, restarts, reason="timeout") == 0
            assert sample(metrics, "retired_pod_gc_relists_total") == 0
            silent_lines = [
                line
                for line in svc.log_text().splitlines()
                if "no end of the stream and no line" in line and "taken for dead" in line
            ]
            assert len(silent_lines) == 1, svc.log_tail()
            record_property("sync_to_black_hole_s", round(holed_at - sync.time_s, 2))
            record_property("dead_watch_to_resume_s", round(resumed.time_s - sync.time_s, 2))
            record_property("created_to_delete_s", round(delete.time_s - created_at, 2))
            svc.assert_running()
        finally:
            launcher.close()
