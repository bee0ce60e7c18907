"""The operator-facing HTTP servers: ``/metrics``, ``/healthz``, ``/readyz`` on the pod's port and,
when ``DEBUG_PENDING`` is on, ``/debug/pending`` (``service/app/pending.py``) on a listener of its
own, ``DEBUG_BIND_ADDRESS``: loopback by default, so only ``kubectl port-forward`` reaches it
(docs/operations.md, "Who can reach what"). The metrics port answers 404 for every ``/debug/`` path.

``/healthz`` answers 200 while every registered loop has checked in recently (a wedged informer,
listener or worker makes the process restartable by the kubelet). ``/readyz`` answers 200 when
every dependency it asks is well (the pod cache synced, a recent database ping, the listener's
delivery proven, the Kubernetes API server answering and accepting the credentials), else 503,
its body naming each problem.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from service.app.pending import DEFAULT_LIMIT as PENDING_LIMIT
from service.app.pending import PATH as PENDING_PATH
from service.kit import clock
from service.pg.store import PgExecutionStore

logger = logging.getLogger(__name__)

PING_TTL_S = 2.0


class Heartbeats:
    """Loops call :meth:`beat`; a loop silent for longer than its allowance is stuck."""

    def __init__(self) -> None:
        self._allowances_s: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def register(self, name: str, allowance_s: float) -> None:
        self._allowances_s[name] = allowance_s
        self._last[name] = clock.now()

    def beat(self, name: str) -> None:
        self._last[name] = clock.now()

    def stuck(self) -> list[str]:
        now = clock.now()
        return sorted(
            name
            for name, allowance in self._allowances_s.items()
            if now - self._last.get(name, now) > allowance
        )


class HealthServer:
    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        heartbeats: Heartbeats,
        cache_synced: Callable[[], bool],
        database_problem: Callable[[], Awaitable[str | None]],
        listener_problem: Callable[[], str | None],
        api_problem: Callable[[], str | None] = lambda: None,
        host: str,
        port: int,
        pending: Callable[[int, str | None], dict[str, Any]] | None = None,
        debug_host: str = "127.0.0.1",
        debug_port: int = 0,
    ) -> None:
        self._registry = registry
        self._heartbeats = heartbeats
        self._cache_synced = cache_synced
        self._database_problem = database_problem
        self._listener_problem = listener_problem
        self._api_problem = api_problem
        self._host = host
        self._port = port
        self._pending = pending
        self._debug_host = debug_host
        self._debug_port = debug_port
        self.bound_port: int | None = None
        self.debug_bound_port: int | None = None
        """The debug listener's port once it serves (``None``: ``DEBUG_PENDING`` is off)."""

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        return app

    def _debug_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(PENDING_PATH, self._serve_pending)
        return app

    async def _serve_pending(self, request: web.Request) -> web.Response:
        """``?limit=N`` (the soonest due N, default ``DEFAULT_LIMIT``), ``?key=NS/POD``."""
        assert self._pending is not None
        raw = request.query.get("limit", str(PENDING_LIMIT))
        if not raw.isascii() or not raw.isdigit():
            return web.Response(status=400, text="limit: expected a non-negative integer\n")
        return web.json_response(self._pending(int(raw), request.query.get("key")))

    async def _serve_metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _: web.Request) -> web.Response:
        stuck = self._heartbeats.stuck()
        if stuck:
            return web.Response(status=503, text=f"stuck: {', '.join(stuck)}\n")
        return web.Response(text="ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        problems = [] if self._cache_synced() else ["pod cache not synced"]
        for what, problem in (
            ("database", await self._database_problem()),
            ("notify listener", self._listener_problem()),
            ("kubernetes api", self._api_problem()),
        ):
            if problem is not None:
                problems.append(f"{what}: {problem}")
        if problems:
            return web.Response(status=503, text="; ".join(problems) + "\n")
        return web.Response(text="ok\n")

    async def run(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``started`` with the metrics port once both listeners (the
        debug one only with ``DEBUG_PENDING``) accept connections."""
        runners: list[web.AppRunner] = []
        try:
            self.bound_port = await _serve(runners, self._app(), self._host, self._port)
            logger.info("serving /metrics /healthz /readyz on %s:%s", self._host, self.bound_port)
            if self._pending is not None:
                self.debug_bound_port = await _serve(
                    runners, self._debug_app(), self._debug_host, self._debug_port
                )
                logger.info(
                    "serving %s on %s:%s", PENDING_PATH, self._debug_host, self.debug_bound_port
                )
            task_status.started(self.bound_port)
            await anyio.sleep_forever()
        finally:
            with anyio.move_on_after(5, shield=True):
                for runner in reversed(runners):
                    await runner.cleanup()


async def _serve(runners: list[web.AppRunner], app: web.Application, host: str, port: int) -> int:
    """Start serving ``app`` on ``host:port`` (its runner appended to ``runners`` for the
    cleanup); the port bound (``port`` 0: the one the kernel picked)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    runners.append(runner)
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else port


def cached_ping(store: PgExecutionStore) -> Callable[[], Awaitable[str | None]]:
    """The database's part of ``/readyz``: why the last ping failed, ``None`` when it worked.
    Probes may come often, so the database is asked at most every ``PING_TTL_S``."""
    last_at = -PING_TTL_S * 2
    last_problem: str | None = "not checked yet"

    async def ping() -> str | None:
        nonlocal last_at, last_problem
        now = clock.now()
        if now - last_at >= PING_TTL_S:
            ok = await store.ping()
            last_problem = None if ok else store.problem or "unreachable"
            last_at = now
        return last_problem

    return ping
