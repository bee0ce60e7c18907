"""LeaderElector in-process against the emulator over HTTP: acquire, renew, a conflicting write
(409), lapsed renewals (injected 500s) and release on cancellation."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import pytest

from devtools.emulator import RunningEmulator
from devtools.emulator.statuses import LEASES
from service import config
from service.config import LeaderSettings
from service.kube.api import new_api_client
from service.kube.leaderelection import LeaderElector
from service.kube.transport import ApiTransport
from service.metrics import KubeMetrics
from tests.kubefixtures import ProxiedEmulator, eventually
from tests.pgfixtures import metric

pytestmark = pytest.mark.anyio

NS = "sandboxes"
LEASE = "gc-lease"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}"


def _settings(
    identity: str, *, lease_s: float = 3.0, renew_s: float = 1.0, retry_s: float = 0.05
) -> LeaderSettings:
    return LeaderSettings(
        enabled=True,
        lease_name=LEASE,
        lease_namespace=NS,
        lease_duration_s=lease_s,
        renew_deadline_s=renew_s,
        retry_period_s=retry_s,
        identity=identity,
    )


class Elector:
    """An elector plus what it reported through ``on_change``."""

    def __init__(self, api: ApiTransport, settings: LeaderSettings) -> None:
        self.changes: list[bool] = []
        self.metrics = KubeMetrics()
        self.elector = LeaderElector(
            api,
            settings=settings,
            namespace=NS,
            metrics=self.metrics,
            request_timeout_s=2.0,
        )
        self.elector.add_handler(self.changes.append)

    @property
    def gauge(self) -> float:
        return metric(self.metrics.registry, "retired_pod_gc_is_leader")


def _lease(running: RunningEmulator) -> dict[str, Any]:
    emu = running.emulator
    return emu.to_object(LEASES, emu.lookup(LEASES, NS, LEASE))


def _spec(running: RunningEmulator) -> dict[str, Any]:
    return dict(_lease(running)["spec"])


async def test_acquires_then_renews_and_releases_on_cancel(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    me = Elector(kube_api, _settings("me"))
    async with anyio.create_task_group() as tg:
        await tg.start(me.elector.run)
        await eventually(me.elector.is_leader, timeout_s=5)
        assert me.changes == [True]
        assert me.gauge == 1
        first = _spec(emulator)
        assert first["holderIdentity"] == "me"
        assert first["leaseDurationSeconds"] == 3
        assert first["acquireTime"]
        first_rv = _lease(emulator)["metadata"]["resourceVersion"]
        # Renewals: renewTime moves, acquireTime stays, resourceVersion moves on.
        await eventually(lambda: _spec(emulator)["renewTime"] != first["renewTime"], timeout_s=3)
        renewed = _spec(emulator)
        assert renewed["holderIdentity"] == "me"
        assert renewed["acquireTime"] == first["acquireTime"]
        assert int(_lease(emulator)["metadata"]["resourceVersion"]) > int(first_rv)
        assert me.elector.is_leader()
        tg.cancel_scope.cancel()
    # Cancelled: steps down first, then hands the lease back.
    assert me.changes == [True, False]
    assert me.gauge == 0
    assert not me.elector.is_leader()
    assert _spec(emulator)["holderIdentity"] == ""
    puts = emulator.emulator.audit_log(method="PUT", path_contains=LEASE_PATH)
    assert puts[-1].body["spec"]["holderIdentity"] == ""
    assert puts[-1].status == 200


async def test_standby_waits_for_a_held_lease_and_does_not_release_it(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    leader = Elector(kube_api, _settings("leader"))
    standby = Elector(kube_api, _settings("standby"))
    async with anyio.create_task_group() as outer:
        await outer.start(leader.elector.run)
        await eventually(leader.elector.is_leader, timeout_s=5)
        async with anyio.create_task_group() as tg:
            await tg.start(standby.elector.run)
            await anyio.sleep(0.5)  # ten retry periods
            assert not standby.elector.is_leader()
            assert standby.changes == []
            tg.cancel_scope.cancel()
        # The standby's cancellation does not touch a lease it never held.
        assert _spec(emulator)["holderIdentity"] == "leader"
        standby_puts = [
            e
            for e in emulator.emulator.audit_log(method="PUT", path_contains=LEASE_PATH)
            if e.body["spec"]["holderIdentity"] in ("standby", "")
        ]
        assert standby_puts == []
        outer.cancel_scope.cancel()


async def test_a_conflicting_write_is_a_409_that_costs_leadership_until_expiry(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    me = Elector(kube_api, _settings("me", lease_s=1.0, renew_s=0.6, retry_s=0.05))
    async with anyio.create_task_group() as tg:
        await tg.start(me.elector.run)
        await eventually(me.elector.is_leader, timeout_s=5)
        # While the next renewal is in flight somebody else takes the lease: the renewal
        # carries a stale resourceVersion.
        puts_before = len(emu.audit_log(method="PUT", path_contains=LEASE_PATH))
        taken: list[float] = []

        def take_over() -> None:
            other = _lease(emulator)
            other["spec"]["holderIdentity"] = "other"
            emu.replace(LEASES, NS, LEASE, other)
            taken.append(time.monotonic())

        emu.before_next(take_over, method="PUT", path_contains=LEASE_PATH)
        await eventually(lambda: bool(taken), timeout_s=3)
        taken_at = taken[0]
        await eventually(
            lambda: any(
                e.status == 409
                for e in emu.audit_log(method="PUT", path_contains=LEASE_PATH)[puts_before:]
            ),
            timeout_s=3,
        )
        # The 409 is handled (the loop goes on) and the next GET shows the new holder.
        await eventually(lambda: not me.elector.is_leader(), timeout_s=2)
        assert me.changes == [True, False]
        assert _spec(emulator)["holderIdentity"] == "other"
        # "other" never renews: after the lease duration, as seen by this replica, it is ours again.
        await eventually(me.elector.is_leader, timeout_s=4)
        assert time.monotonic() - taken_at >= 1.0
        assert _spec(emulator)["holderIdentity"] == "me"
        assert _spec(emulator)["leaseTransitions"] >= 1
        assert me.changes == [True, False, True]
        tg.cancel_scope.cancel()


async def test_lapsed_renewals_step_down_before_the_lease_expires(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    lease_s, renew_s = 3.0, 1.0
    me = Elector(kube_api, _settings("me", lease_s=lease_s, renew_s=renew_s, retry_s=0.1))
    async with anyio.create_task_group() as tg:
        await tg.start(me.elector.run)
        await eventually(me.elector.is_leader, timeout_s=5)
        emu.fail_next(10_000, code=500, path_contains=LEASE_PATH)
        failing_since = time.monotonic()
        await eventually(lambda: not me.elector.is_leader(), timeout_s=lease_s)
        stepped_down_s = time.monotonic() - failing_since
        # Before anybody else could take over: the lease, renewed last before failing_since,
        # expires lease_s after that renewal at the latest.
        assert stepped_down_s < lease_s
        await eventually(lambda: me.changes == [True, False], timeout_s=1)
        assert me.gauge == 0
        # The API recovers: the lease is still ours on the server, so it is renewed at once.
        emu.clear_faults()
        await eventually(me.elector.is_leader, timeout_s=2)
        assert me.changes == [True, False, True]
        tg.cancel_scope.cancel()
    assert _spec(emulator)["holderIdentity"] == ""


async def test_release_retries_when_its_view_of_the_lease_is_stale(
    emulator: RunningEmulator, kube_api: ApiTransport
) -> None:
    emu = emulator.emulator
    # A long retry period: the elector sleeps right after acquiring, so it does not see the
    # server-side change below before it is cancelled.
    me = Elector(kube_api, _settings("me", lease_s=6.0, renew_s=4.0, retry_s=2.0))
    async with anyio.create_task_group() as tg:
        await tg.start(me.elector.run)
        await eventually(me.elector.is_leader, timeout_s=5)
        # A renewal the server applied but whose answer never arrived: same holder, new version
        # (and a history of earlier transitions).
        stale = _lease(emulator)
        stale["spec"]["renewTime"] = "2030-01-01T00:00:00.000000Z"
        stale["spec"]["leaseTransitions"] = 5
        emu.replace(LEASES, NS, LEASE, stale)
        tg.cancel_scope.cancel()
    puts = emu.audit_log(method="PUT", path_contains=LEASE_PATH)
    assert [p.status for p in puts if p.body["spec"]["holderIdentity"] == ""] == [409, 200]
    assert _spec(emulator)["holderIdentity"] == ""
    # Releasing keeps the transition count (client-go does too).
    assert _spec(emulator)["leaseTransitions"] == 5


async def test_a_lease_it_cannot_read_is_an_unexpected_answer_not_a_crash(
    emulator: RunningEmulator, kube_api: ApiTransport, caplog: pytest.LogCaptureFixture
) -> None:
    # The server holds a Lease whose duration is not a number: the elector must neither crash
    # nor take the lease over; it keeps retrying, as for any unexpected answer.
    emulator.emulator.create(
        LEASES,
        NS,
        {
            "metadata": {"name": LEASE, "namespace": NS},
            "spec": {"holderIdentity": "other", "leaseDurationSeconds": "soon"},
        },
    )
    candidate = Elector(kube_api, _settings("candidate"))
    caplog.set_level(logging.DEBUG, logger="service.kube.leaderelection")
    async with anyio.create_task_group() as tg:
        await tg.start(candidate.elector.run)
        # Read, judged unreadable, and read again: the loop lived on (a debug line each time).
        await eventually(
            lambda: sum("malformed lease" in r.getMessage() for r in caplog.records) >= 3,
            timeout_s=5,
        )
        # One warning for the cause, not one a retry.
        warned = [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and "malformed lease" in r.getMessage()
        ]
        assert len(warned) == 1
        assert not candidate.elector.is_leader()
        assert candidate.changes == []
        tg.cancel_scope.cancel()
    assert _spec(emulator)["holderIdentity"] == "other"


@pytest.mark.timeout(90)
async def test_a_renewal_stuck_on_a_black_holed_connection_does_not_cost_leadership(
    proxied_emulator: ProxiedEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    # The defaults: a renewal every 2 s, leadership lost after 10 s without one, and an API
    # timeout of 10 s, which alone would let one stuck attempt use up the whole renew deadline.
    settings = LeaderSettings(
        enabled=True,
        lease_name=LEASE,
        lease_namespace=NS,
        lease_duration_s=config.LEASE_DURATION_SECONDS.default,
        renew_deadline_s=config.RENEW_DEADLINE_SECONDS.default,
        retry_period_s=config.RETRY_PERIOD_SECONDS.default,
        identity="me",
    )
    running = proxied_emulator.running
    api = await new_api_client(host=proxied_emulator.url)
    changes: list[bool] = []
    elector = LeaderElector(
        api,
        settings=settings,
        namespace=NS,
        metrics=KubeMetrics(),
        request_timeout_s=config.API_TIMEOUT_SECONDS.default,
    )
    elector.add_handler(changes.append)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(elector.run)
            await eventually(elector.is_leader, timeout_s=30)
            # Right after a renewal, the pooled keep-alive connection it used goes silent: the
            # next renewal is sent on it and never answered.
            renewed = _spec(running)["renewTime"]
            await eventually(lambda: _spec(running)["renewTime"] != renewed, timeout_s=30)
            assert proxied_emulator.proxy.blackhole_existing() >= 1
            renewed = _spec(running)["renewTime"]
            with caplog.at_level(logging.WARNING, logger="service.kube.leaderelection"):
                # The stuck attempt gives up in time for the next one, on a new connection,
                # to renew within the renew deadline.
                await eventually(lambda: _spec(running)["renewTime"] != renewed, timeout_s=60)
            assert [r.getMessage() for r in caplog.records if "lease" in r.getMessage()], (
                "no renewal was stuck on the black-holed connection"
            )
            assert changes == [True]
            assert elector.is_leader()
            tg.cancel_scope.cancel()
    finally:
        await api.close()
