"""The shipped alerts and their inhibition, end to end: Debian's Prometheus scrapes the real service
with deploy/monitoring/prometheusrule.yaml, Debian's Alertmanager routes with
deploy/monitoring/alertmanager-inhibit.yaml, and a webhook receiver in this process records what
would page (``warning`` and ``critical``; ``make promtool alertmanager`` installs both servers).

The rules' timings are compressed by :data:`SCALE`, rewritten from the shipped file (``for``,
``keep_firing_for``, every range window); scrapes and evaluations every second. Four installations
run at once, told apart by the ``namespace`` target label as the ServiceMonitor gives it, so that
every documented mode is watched through one healthy phase:

- ``gc-a``: two replicas, leader election on, live, one sandbox namespace; the database reached
  through a TCP proxy, so that it can be taken away from ``gc-a`` alone;
- ``gc-c``: the same mode in another sandbox namespace; the API server reached through a TCP proxy;
- ``gc-b``: one replica, leader election off, dry run, two sandbox namespaces; never disturbed;
- ``gc-d``: one replica, leader election off, live, two sandbox namespaces; never disturbed.

Phases: healthy (no alert pending or firing but :data:`PENDING_BY_DESIGN`, 5 minutes scaled),
then at once a database outage of ``gc-a`` (10 minutes scaled) and an API server outage of
``gc-c`` (9 minutes scaled), each black-holed (no reset, no bytes) and then restored. A page is a
group (alert name and namespace, the route's ``group_by``) notified as firing: each outage must
page exactly once, with the alert that names its cause, and nothing of its installation may stay
firing 2 minutes (scaled) after its restore. ``gc-b`` and ``gc-d`` never have another alert,
pending included. A kubelet's
readiness probe is played every second (the database gauge is refreshed by it). The inhibition
itself, rule by rule, is tests/e2e/test_inhibition.py's.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import anyio
import asyncpg
import pytest
import yaml
from aiohttp import web

from devtools.emulator import RunningEmulator
from devtools.emulator.sandboxpods import Shape, pod_name, sandbox_pod
from devtools.pg.devdata import seed_execution, seed_sandbox
from tests.kubeproxy import KubeProxy, proxied

from .harness import LEASE_NAMESPACE, ServiceLauncher, ServiceProcess, free_port
from .monitoring import (
    ALERTMANAGER,
    MONITORING,
    PROMETHEUS,
    START_S,
    alertmanager,
    get_json,
    server,
    shipped_inhibit_rules,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(420)]

SCALE = 15
"""The rules' durations are divided by this: 5 minutes become 20 s, 2 minutes 8 s, the one minute
the causes keep firing 4 s. Not more: the service's own recovery (reconnecting, the next probe,
scrape and evaluation) takes about 1.6 s of real time after a restore, and it must stay well inside
:data:`RESOLVED_WITHIN_S` beside the scaled ``keep_firing_for``."""
HEALTHY_S = 300 / SCALE
DB_OUTAGE_S = 600 / SCALE
API_OUTAGE_S = 540 / SCALE
RESOLVED_WITHIN_S = 120 / SCALE
"""After a restore, every alert of the disturbed installation is resolved within this."""

PAGING = ("warning", "critical")
ANY_DURATION = re.compile(r"(\d+)([smhd])")
RANGE = re.compile(r"\[(\d+)([smhd])\]")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _scaled(amount: str, unit: str) -> str:
    seconds = int(amount) * UNIT_S[unit] / SCALE
    return f"{max(1, round(seconds))}s"


def scaled_rules() -> dict[str, Any]:
    """The shipped rule groups with every duration divided by :data:`SCALE`."""
    source = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text(encoding="utf-8"))
    groups: list[dict[str, Any]] = source["spec"]["groups"]
    for group in groups:
        for rule in group["rules"]:
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    match = ANY_DURATION.fullmatch(rule[key])
                    assert match is not None, rule[key]
                    rule[key] = _scaled(*match.groups())
            rule["expr"] = RANGE.sub(lambda m: f"[{_scaled(m.group(1), m.group(2))}]", rule["expr"])
    return {"groups": groups}


def test_the_rules_are_scaled_from_the_shipped_file() -> None:
    rules = {r["alert"]: r for g in scaled_rules()["groups"] for r in g["rules"]}
    assert rules["RetiredPodGcDatabaseDown"]["for"] == "20s"
    assert rules["RetiredPodGcDatabaseDown"]["keep_firing_for"] == "4s"
    assert "[40s]" in rules["RetiredPodGcReconcileErrors"]["expr"]
    assert not any(re.search(r"\[\d+[mhd]\]", r["expr"]) for r in rules.values())


# ----------------------------------------------------------------------------- the servers


@dataclass
class Webhook:
    """Alertmanager's receiver: every notification, as (seconds since start, payload)."""

    started: float = field(default_factory=time.monotonic)
    received: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append((time.monotonic() - self.started, await request.json()))
        return web.Response(text="ok")

    def pages(self, namespace: str | None = None) -> list[tuple[str, str]]:
        """(alert name, namespace) of each group notified as firing, in order, once each."""
        out: list[tuple[str, str]] = []
        for _, payload in self.received:
            if payload["status"] != "firing":
                continue
            group = (payload["groupLabels"]["alertname"], payload["groupLabels"]["namespace"])
            if group not in out and namespace in (None, group[1]):
                out.append(group)
        return out


@asynccontextmanager
async def _webhook() -> AsyncIterator[tuple[Webhook, int]]:
    hook = Webhook()
    app = web.Application()
    app.router.add_post("/", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield hook, port
    finally:
        await runner.cleanup()


@dataclass(frozen=True)
class Target:
    service: ServiceProcess
    namespace: str


def _prometheus_config(targets: list[Target], alertmanager_port: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": ["rules.yaml"],
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]
        },
        "scrape_configs": [
            {
                "job_name": "retired-pod-gc",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{t.service.port}"],
                        # What the ServiceMonitor's target gives every series.
                        "labels": {
                            "namespace": t.namespace,
                            "pod": t.service.name,
                            "service": "retired-pod-gc",
                        },
                    }
                    for t in targets
                ],
            }
        ],
    }


def _alertmanager_config(webhook_port: int) -> dict[str, Any]:
    return {
        "route": {
            "receiver": "context",
            "group_by": ["alertname", "namespace"],
            # Alertmanager's defaults (30 s, 5 m, 4 h), scaled.
            "group_wait": f"{round(30 / SCALE)}s",
            "group_interval": f"{round(300 / SCALE)}s",
            "repeat_interval": f"{round(4 * 3600 / SCALE)}s",
            "routes": [
                {"matchers": [f'severity=~"{"|".join(PAGING)}"'], "receiver": "pager"},
            ],
        },
        "receivers": [
            {"name": "context"},
            {
                "name": "pager",
                "webhook_configs": [
                    {"url": f"http://127.0.0.1:{webhook_port}/", "send_resolved": False}
                ],
            },
        ],
        "inhibit_rules": shipped_inhibit_rules(),
    }


@asynccontextmanager
async def _monitoring(tmp_path: Path, targets: list[Target]) -> AsyncIterator[Monitoring]:
    async with _webhook() as (hook, hook_port):
        am_port, prom_port = free_port(), free_port()
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        (prom_dir / "rules.yaml").write_text(yaml.safe_dump(scaled_rules()))
        (prom_dir / "prometheus.yml").write_text(
            yaml.safe_dump(_prometheus_config(targets, am_port))
        )
        prometheus = [
            PROMETHEUS,
            f"--config.file={prom_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            # Firing alerts are sent again every second (else every minute), so that a resolved
            # one reaches Alertmanager at the scale of the rules.
            "--rules.alert.resend-delay=1s",
        ]
        config = _alertmanager_config(hook_port)
        with (
            alertmanager(tmp_path / "alertmanager", config, am_port) as am_url,
            server(prometheus, prom_dir / "prometheus.log", prom_port, "prometheus"),
        ):
            yield Monitoring(hook, f"http://127.0.0.1:{prom_port}", am_url)


@dataclass
class Monitoring:
    hook: Webhook
    prometheus_url: str
    alertmanager_url: str

    async def prometheus_alerts(self) -> list[dict[str, Any]]:
        """Every alert Prometheus holds (pending or firing)."""
        body = await get_json(self.prometheus_url + "/api/v1/alerts")
        alerts: list[dict[str, Any]] = body["data"]["alerts"]
        return alerts

    async def alertmanager_alerts(self) -> list[dict[str, Any]]:
        """Alertmanager's active alerts (muted ones included)."""
        alerts: list[dict[str, Any]] = await get_json(self.alertmanager_url + "/api/v2/alerts")
        return alerts

    async def targets_up(self, count: int) -> bool:
        """Both servers ready and every target scraped."""
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for url in (self.prometheus_url, self.alertmanager_url):
                async with http.get(url + "/-/ready") as response:
                    if response.status != 200:
                        return False
        body = await get_json(self.prometheus_url + "/api/v1/targets")
        up = [t for t in body["data"]["activeTargets"] if t["health"] == "up"]
        return len(up) == count


def _shown(alerts: list[dict[str, Any]]) -> list[str]:
    return sorted(
        f"{a['labels']['alertname']}{{namespace={a['labels'].get('namespace')}, "
        f"pod={a['labels'].get('pod')}}} {a.get('state') or a.get('status', {}).get('state')}"
        for a in alerts
    )


# ---------------------------------------------------------------------------- the services


async def _seed(url: str, emulator: RunningEmulator) -> None:
    """In each sandbox namespace a Succeeded pod whose execution is retired (reaped in live mode,
    reported in dry run) and one whose execution is active."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        for namespace in SANDBOX_NAMESPACES:
            emulator.emulator.ensure_namespace(namespace)
            for index, active in enumerate((False, True)):
                sandbox_id = f"{namespace.replace('-', '')}{index}"
                await seed_sandbox(conn, sandbox_id, namespace=namespace)
                await seed_execution(
                    conn,
                    pod_name=pod_name(sandbox_id, 1),
                    sandbox_id=sandbox_id,
                    active=active,
                    execution_state="active" if active else "suspended",
                )
                emulator.emulator.create_pod(
                    sandbox_pod(
                        sandbox_id=sandbox_id,
                        generation=1,
                        shape=Shape.SUCCEEDED,
                        namespace=namespace,
                    ),
                    namespace=namespace,
                )
    finally:
        await conn.close()


def _via(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


async def _kubelet(services: list[ServiceProcess]) -> None:
    """Readiness probes every second, as a kubelet sends them."""
    while True:
        for svc in services:
            await svc.get("/readyz", timeout_s=1.0)
        await anyio.sleep(1.0)


@asynccontextmanager
async def _pg_proxy(url: str) -> AsyncIterator[KubeProxy]:
    """A TCP proxy in front of PostgreSQL (the generic one the API server's tests use)."""
    parts = urlsplit(url)
    proxy = await KubeProxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
    try:
        yield proxy
    finally:
        await proxy.aclose()


# ------------------------------------------------------------------------------- the test


async def _watch(
    mon: Monitoring, until: Callable[[], bool], *, quiet: set[str | None], seen: list[str]
) -> None:
    """Poll Prometheus every second until ``until()``; fail on any alert (pending included, but
    for :data:`PENDING_BY_DESIGN`) of a namespace in ``quiet``; every alert seen is added to
    ``seen``."""
    while not until():
        alerts = await mon.prometheus_alerts()
        seen.extend(s for s in _shown(alerts) if s not in seen)
        loud = [
            a
            for a in alerts
            if a["labels"].get("namespace") in quiet
            and not (a["state"] == "pending" and _labelled(a) in PENDING_BY_DESIGN)
        ]
        assert not loud, f"alerts on an undisturbed installation: {_shown(loud)}"
        await anyio.sleep(1.0)


PENDING_BY_DESIGN = {("gc-b", "RetiredPodGcDryRunWouldReapGrowing")}
"""(namespace, alert) pending on a healthy system: a dry run that reports would-be reaps makes the
rollout's signal pending (info, firing only after a day of reports, never in this test), as soon
as Prometheus has seen its counter before a report."""


def _labelled(alert: dict[str, Any]) -> tuple[str, str]:
    return alert["labels"].get("namespace", ""), alert["labels"]["alertname"]


def _after(seconds: float) -> Callable[[], bool]:
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() >= deadline


async def _resolved(mon: Monitoring, namespace: str, within_s: float) -> float:
    """Seconds until neither Prometheus nor Alertmanager has a firing alert of ``namespace``."""
    started = time.monotonic()
    while True:
        firing = [
            a
            for a in await mon.prometheus_alerts()
            if a["labels"].get("namespace") == namespace and a["state"] == "firing"
        ]
        active = [
            a for a in await mon.alertmanager_alerts() if a["labels"].get("namespace") == namespace
        ]
        took = time.monotonic() - started
        if not firing and not active:
            return took
        assert took < within_s, (
            f"{namespace}: still firing {took:.1f}s after the restore: "
            f"{_shown(firing)} / {_shown(active)}"
        )
        await anyio.sleep(0.5)


@dataclass(frozen=True)
class Outage:
    """One cause taken away from one installation: the page it must give, once."""

    namespace: str
    proxy: KubeProxy
    seconds: float
    page: str
    heal: bool
    """A database partition heals (its connections pass bytes again); the API server's stay dead."""

    async def run(self, mon: Monitoring, resolved_s: dict[str, float]) -> None:
        self.proxy.blackhole_all()
        await anyio.sleep(self.seconds)
        self.proxy.restore(heal=self.heal)
        resolved_s[self.namespace] = await _resolved(mon, self.namespace, RESOLVED_WITHIN_S)


SANDBOX_NAMESPACES = (
    "sandboxes",
    "sandboxes-b",
    "sandboxes-c",
    "sandboxes-d",
    "sandboxes-e",
    "sandboxes-f",
)
DISTURBED = {
    # Shorter timeouts, so that an outage is seen within a second or two.
    "API_TIMEOUT_SECONDS": 1,
    "WATCH_SILENCE_SECONDS": 2,
    "DB_CONNECT_TIMEOUT_SECONDS": 1,
    "DB_STATEMENT_TIMEOUT_SECONDS": 1,
    "LISTENER_HEARTBEAT_TIMEOUT_SECONDS": 1,
}


@pytest.mark.background
async def test_each_outage_pages_once_with_its_cause_and_a_healthy_system_never(
    emulator: RunningEmulator, pg_url: str, tmp_path: Path, record_property: Any
) -> None:
    for binary in (PROMETHEUS, ALERTMANAGER):
        assert Path(binary).exists(), f"{binary} is missing: make promtool alertmanager"
    started = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - started, 1)

    emulator.emulator.ensure_namespace(LEASE_NAMESPACE)
    await _seed(pg_url, emulator)
    phase("seeded")
    seen: list[str] = []
    launchers: list[ServiceLauncher] = []

    def launcher(name: str, api_url: str) -> ServiceLauncher:
        # A directory each: a launcher writes its kubeconfig there.
        (tmp_path / name).mkdir()
        launchers.append(
            ServiceLauncher(tmp_path=tmp_path / name, emulator_url=api_url, database_url=pg_url)
        )
        return launchers[-1]

    live: dict[str, object] = {"ENABLED": True, "DRY_RUN": False, "THRESHOLD_SECONDS": 2}
    async with proxied(emulator) as api_proxy, _pg_proxy(pg_url) as db_proxy:
        try:
            gc_a, gc_c = launcher("gc-a", emulator.url), launcher("gc-c", api_proxy.url)
            gc_b, gc_d = launcher("gc-b", emulator.url), launcher("gc-d", emulator.url)
            installations: dict[str, list[ServiceProcess]] = {
                "gc-a": [
                    gc_a.start(
                        name,
                        database_url=_via(pg_url, db_proxy.port),
                        LEASE_NAME="gc-a",
                        **live,
                        **DISTURBED,
                    )
                    for name in ("gc-a-0", "gc-a-1")
                ],
                "gc-c": [
                    gc_c.start(
                        name, LEASE_NAME="gc-c", NAMESPACE="sandboxes-d", **live, **DISTURBED
                    )
                    for name in ("gc-c-0", "gc-c-1")
                ],
                "gc-b": [
                    gc_b.start(
                        "gc-b-0",
                        ENABLED=True,
                        DRY_RUN=True,
                        THRESHOLD_SECONDS=2,
                        LEADER_ELECTION=False,
                        NAMESPACE="",
                        NAMESPACES="sandboxes-b,sandboxes-c",
                    )
                ],
                "gc-d": [
                    gc_d.start(
                        "gc-d-0",
                        LEADER_ELECTION=False,
                        NAMESPACE="",
                        NAMESPACES="sandboxes-e,sandboxes-f",
                        **live,
                    )
                ],
            }
            services = [svc for replicas in installations.values() for svc in replicas]
            phase("launched")
            targets = [
                Target(svc, ns) for ns, replicas in installations.items() for svc in replicas
            ]
            undisturbed: set[str | None] = {"gc-b", "gc-d"}
            outages = [
                Outage("gc-a", db_proxy, DB_OUTAGE_S, "RetiredPodGcDatabaseDown", heal=True),
                Outage("gc-c", api_proxy, API_OUTAGE_S, "RetiredPodGcApiUnreachable", heal=False),
            ]
            async with _monitoring(tmp_path, targets) as mon, anyio.create_task_group() as tg:
                for svc in services:
                    await svc.wait_for("/readyz", 200, timeout_s=START_S)
                phase("ready")
                tg.start_soon(_kubelet, services)
                deadline = time.monotonic() + START_S
                while not await mon.targets_up(len(targets)):
                    assert time.monotonic() < deadline, "Prometheus never scraped every target"
                    await anyio.sleep(0.2)
                phase("scraped")

                # Healthy, in every mode at once: nothing pending, nothing firing, no page (from
                # the first evaluation after every target was scraped: RetiredPodGcAbsent is
                # pending before it).
                await anyio.sleep(2.0)
                await _watch(mon, _after(HEALTHY_S), quiet={*installations, None}, seen=seen)
                assert mon.hook.received == []
                phase("healthy")

                # Both outages at once, each of its own installation (the inhibition and the
                # pages are per namespace); the undisturbed ones stay quiet throughout.
                resolved_s: dict[str, float] = {}
                async with anyio.create_task_group() as both:
                    for outage in outages:
                        both.start_soon(outage.run, mon, resolved_s)
                    await _watch(
                        mon, lambda: len(resolved_s) == len(outages), quiet=undisturbed, seen=seen
                    )
                phase("outages_resolved")
                record_property("resolved_s", resolved_s)
                pages = [(o.page, o.namespace) for o in outages]
                assert sorted(mon.hook.pages()) == sorted(pages), seen
                # Nothing paged late, after its cause was back.
                await _watch(mon, _after(RESOLVED_WITHIN_S / 2), quiet=undisturbed, seen=seen)
                assert sorted(mon.hook.pages()) == sorted(pages), seen
                phase("late")
                record_property("alerts_seen", seen)
                record_property("notifications", len(mon.hook.received))
                tg.cancel_scope.cancel()
            for svc in services:
                svc.assert_running()
        finally:
            record_property("phases_s", phases)
            for each in launchers:
                each.close()
                print(each.failure_report())
            print("phases (s since the test began):", phases)
            print("alerts seen:", *seen, sep="\n  ")
