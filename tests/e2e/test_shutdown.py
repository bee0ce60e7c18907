"""Graceful shutdown of the real process: SIGTERM while DELETEs are in flight drains them (within
SHUTDOWN_TIMEOUT_SECONDS), exits 0 and releases the lease; work slower than the timeout is
abandoned, and the process still exits 0 promptly and releases the lease."""

from __future__ import annotations

import time
from typing import Any

import pytest

from devtools.emulator import RunningEmulator

from .harness import SANDBOX_NAMESPACE, ServiceLauncher, lease_holder, seed_population, wait_until

pytestmark = pytest.mark.anyio

THRESHOLD_S = 2.0


def _delete_requests(emu: Any) -> int:
    return sum(
        1
        for r in list(emu.requests)
        if r.method == "DELETE" and f"/namespaces/{SANDBOX_NAMESPACE}/pods/" in r.path
    )


async def test_sigterm_drains_in_flight_deletes_and_releases_the_lease(
    emulator: RunningEmulator, launcher: ServiceLauncher, pg_url: str
) -> None:
    emu = emulator.emulator
    await seed_population(pg_url, emu)
    delay_s = 1.5
    emu.add_latency(delay_s, method="DELETE")
    svc = launcher.start(
        "drain",
        ENABLED=True,
        DRY_RUN=False,
        THRESHOLD_SECONDS=THRESHOLD_S,
        SHUTDOWN_TIMEOUT_SECONDS=5,
    )
    await wait_until(lambda: _delete_requests(emu) >= 1, timeout_s=THRESHOLD_S + 8, what="a DELETE")
    assert lease_holder(emu) == "drain"
    code, took_s = await svc.terminate(timeout_s=10)
    print(f"\nSIGTERM with a DELETE in flight: exited after {took_s:.2f}s")
    assert code == 0, svc.log_tail()
    # It waited for the in-flight DELETE (about delay_s), and no longer than the timeout.
    assert delay_s - 0.5 <= took_s <= 5 + 2, took_s
    in_flight = _delete_requests(emu)
    answered = emu.audit_log(method="DELETE")
    assert len(answered) == in_flight
    assert [a.status for a in answered] == [200] * in_flight
    assert lease_holder(emu) == ""
    log = svc.log_text()
    assert "did not finish within the shutdown timeout" not in log
    assert "Traceback" not in log


async def test_sigterm_with_work_slower_than_the_timeout_still_exits_0_promptly(
    emulator: RunningEmulator, launcher: ServiceLauncher, pg_url: str
) -> None:
    emu = emulator.emulator
    await seed_population(pg_url, emu)
    emu.add_latency(30.0, method="DELETE")
    svc = launcher.start(
        "stuck",
        ENABLED=True,
        DRY_RUN=False,
        THRESHOLD_SECONDS=THRESHOLD_S,
        SHUTDOWN_TIMEOUT_SECONDS=1,
    )
    await wait_until(lambda: _delete_requests(emu) >= 1, timeout_s=THRESHOLD_S + 8, what="a DELETE")
    started = time.monotonic()
    code, took_s = await svc.terminate(timeout_s=10)
    assert code == 0, svc.log_tail()
    assert took_s <= 1 + 3, took_s
    assert time.monotonic() - started < 5
    assert lease_holder(emu) == ""
    assert "did not finish within the shutdown timeout" in svc.log_text()
    emu.clear_faults()
