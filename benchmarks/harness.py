"""The benchmark harness: the emulator as a subprocess, a throwaway PostgreSQL, the population,
settings, the in-process service, and the small measuring helpers every scenario shares.

The emulator always runs in its own process so that the CPU and memory measured on the service
side are the service's own (the emulator encodes and fans out every object).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import aiohttp
import anyio
import asyncpg

from devtools.emulator.sandboxpods import Shape, sandbox_pod
from service import config
from service.app import service
from service.domain import Verdict
from service.kube.api import new_api_client
from service.metrics import Metrics
from service.pg.migrate import DEFAULT_CHANNEL, migrate

NAMESPACE = "sandboxes"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- measuring


def rss_kib(pid: int | None = None) -> int:
    """Resident set size in KiB (VmRSS of /proc/<pid>/status)."""
    path = f"/proc/{pid or 'self'}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_s() -> float:
    """CPU seconds (user + system) of this process so far, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary_ms(latencies_s: Sequence[float]) -> dict[str, float]:
    return {
        "count": len(latencies_s),
        "p50_ms": pct(latencies_s, 50) * 1000,
        "p99_ms": pct(latencies_s, 99) * 1000,
        "max_ms": (max(latencies_s) * 1000) if latencies_s else float("nan"),
    }


def machine() -> dict[str, Any]:
    """The machine and the versions of the libraries that matter, for a results file."""
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for dist in (
        "msgspec",
        "kubernetes_asyncio",
        "asyncpg",
        "aiohttp",
        "anyio",
        "aiolimiter",
        "prometheus-client",
    ):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "?"
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# --------------------------------------------------------------------------- emulator


class EmulatorProcess:
    """``python -m devtools.emulator`` in a subprocess, with its admin API."""

    def __init__(
        self,
        *,
        bookmark_interval_s: float = 60.0,
        kubelet_finish_after_s: float | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``extra_args``: more of ``python -m devtools.emulator``'s options (``--apf-seats 1``,
        ``--token-file PATH``...)."""
        self._extra_args = list(extra_args)
        self._bookmark_interval_s = bookmark_interval_s
        self._kubelet_finish_after_s = kubelet_finish_after_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> EmulatorProcess:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "devtools.emulator",
                "--port",
                "0",
                "--namespace",
                NAMESPACE,
                "--history-size",
                "200000",
                "--bookmark-interval-s",
                str(self._bookmark_interval_s),
                *(
                    ["--kubelet-finish-after-s", str(self._kubelet_finish_after_s)]
                    if self._kubelet_finish_after_s is not None
                    else []
                ),
                *self._extra_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = await anyio.to_thread.run_sync(self.proc.stdout.readline)
        text = line.decode().strip()
        if "listening on" not in text:
            raise RuntimeError(f"emulator did not start: {text!r}")
        self.url = text.rsplit(" ", 1)[-1]
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        return self

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        assert self._session is not None
        async with self._session.request(
            method, f"{self.url}/_emulator/{path}", json=body
        ) as response:
            response.raise_for_status()
            return await response.json()

    async def bulk(
        self,
        *,
        count: int,
        start: int,
        template: dict[str, Any] | None = None,
        name_prefix: str = "space-sbx-",
        generation: int = 1,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "namespace": NAMESPACE,
            "count": count,
            "start": start,
            "name_prefix": name_prefix,
            "generation": generation,
        }
        if template is not None:
            body["template"] = template
        result: dict[str, Any] = await self._call("POST", "pods/bulk", body)
        return result

    async def state(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "state")
        return result

    async def deletes(self) -> list[dict[str, Any]]:
        """Audit entries of pod DELETEs (``path``, ``status``, ``time_s`` wall clock)."""
        result: list[dict[str, Any]] = await self._call("GET", "audit?method=DELETE&path=/pods/")
        return result

    async def clear_audit(self) -> None:
        await self._call("DELETE", "audit")

    async def fail_next(
        self, *, code: int, method: str, query: dict[str, str], count: int = 1
    ) -> None:
        await self._call(
            "POST", "faults", {"count": count, "code": code, "method": method, "query": query}
        )

    async def clear_faults(self) -> None:
        await self._call("DELETE", "faults")

    async def drop_watches(self, *, abrupt: bool = True) -> None:
        await self._call("POST", "watches/drop", {"abrupt": abrupt})

    def _pod_url(self, name: str) -> str:
        return f"{self.url}/api/v1/namespaces/{NAMESPACE}/pods/{name}"

    async def get_pod(self, name: str) -> dict[str, Any] | None:
        """The pod as the API serves it (``None``: 404)."""
        assert self._session is not None
        async with self._session.get(self._pod_url(name)) as response:
            if response.status == 404:
                return None
            response.raise_for_status()
            pod: dict[str, Any] = await response.json()
            return pod

    async def replace_status(self, pod: dict[str, Any], status: dict[str, Any]) -> bool:
        """PUT ``.../status`` of ``pod`` (as read) with ``status``, as a kubelet's write would;
        False when the pod changed or went away meanwhile (409, 404)."""
        assert self._session is not None
        meta = pod["metadata"]
        body = {
            "metadata": {"name": meta["name"], "resourceVersion": meta["resourceVersion"]},
            "status": status,
        }
        async with self._session.put(self._pod_url(meta["name"]) + "/status", json=body) as r:
            if r.status in (404, 409):
                return False
            r.raise_for_status()
            return True

    def rss_kib(self) -> int:
        return rss_kib(self.proc.pid) if self.proc is not None else 0


def template(shape: Shape) -> dict[str, Any]:
    """A bulk-create template of ``shape`` (bulk_create sets name and the sandbox labels)."""
    pod = sandbox_pod(sandbox_id="x", generation=1, shape=shape, namespace=NAMESPACE)
    del pod["metadata"]["name"]
    return pod


def pod_name(index: int) -> str:
    return f"space-sbx-{index:012x}-g1"


@dataclass(frozen=True, slots=True)
class Population:
    """Pods ``0..n-1``: a quarter Running, half Succeeded, a quarter Pending-stuck (create).

    Every pod has an *active* execution row, so nothing is reapable until a benchmark
    retires rows. Succeeded and Pending-stuck pods become reapable when their row is retired
    as ``replaced`` (``terminal_retired`` and ``replaced_never_started``).
    """

    n: int

    @property
    def running(self) -> range:
        return range(0, self.n // 4)

    @property
    def succeeded(self) -> range:
        return range(self.n // 4, 3 * self.n // 4)

    @property
    def pending(self) -> range:
        return range(3 * self.n // 4, self.n)

    @property
    def reapable_shaped(self) -> list[int]:
        return [*self.succeeded, *self.pending]


async def create_pods(emulator: EmulatorProcess, population: Population) -> float:
    """Bulk-create the population in the emulator; returns seconds taken."""
    started = time.perf_counter()
    chunk = 20_000
    for rng, shape in (
        (population.running, Shape.RUNNING),
        (population.succeeded, Shape.SUCCEEDED),
        (population.pending, Shape.PENDING_STUCK),
    ):
        tpl = template(shape)
        for lo in range(rng.start, rng.stop, chunk):
            await emulator.bulk(count=min(chunk, rng.stop - lo), start=lo, template=tpl)
    return time.perf_counter() - started


async def seed_rows(db_url: str, population: Population) -> float:
    """Schema, trigger and one active row per pod (COPY: fast at 100k)."""
    started = time.perf_counter()
    conn = await asyncpg.connect(db_url)
    try:
        await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
        await insert_rows(conn, [f"{i:012x}" for i in range(population.n)])
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return time.perf_counter() - started


async def insert_rows(
    conn: asyncpg.Connection,
    ids: Sequence[str],
    *,
    state: str = "active",
    active: bool = True,
) -> None:
    """A sandbox and its execution row (generation 1, pod ``space-sbx-<id>-g1``) for each of
    ``ids``, in ``state`` (COPY: fast at 100k)."""
    await conn.copy_records_to_table(
        "sandboxes",
        records=[(sid, NAMESPACE, "kubernetes") for sid in ids],
        columns=["id", "namespace", "managed_by"],
    )
    await conn.copy_records_to_table(
        "sandbox_k8s_executions",
        records=[(sid, 1, 0, f"space-sbx-{sid}-g1", "create", state, active) for sid in ids],
        columns=[
            "sandbox_id",
            "generation",
            "activation_attempt",
            "pod_name",
            "pod_kind",
            "execution_state",
            "active",
        ],
    )


async def retire(conn: asyncpg.Connection, names: Sequence[str]) -> tuple[float, float]:
    """Retire ``names`` as ``replaced`` in one transaction; (wall time before COMMIT, after)."""
    async with conn.transaction() as _:
        await conn.execute(
            """UPDATE sandbox_k8s_executions
                  SET active = false, execution_state = 'replaced', retired_at = now()
                WHERE pod_name = ANY($1::text[])""",
            list(names),
        )
        before = time.time()
    return before, time.time()


async def reactivate(conn: asyncpg.Connection, names: Sequence[str]) -> None:
    await conn.execute(
        """UPDATE sandbox_k8s_executions
              SET active = true, execution_state = 'active', retired_at = NULL
            WHERE pod_name = ANY($1::text[])""",
        list(names),
    )


# --------------------------------------------------------------------------- service


def settings(db_url: str, **overrides: str) -> config.Settings:
    p = config.PREFIX
    env = {
        p + "ENABLED": "true",
        p + "DRY_RUN": "true",
        p + "THRESHOLD_SECONDS": "3600",
        p + "DATABASE_URL": db_url,
        p + "NAMESPACE": NAMESPACE,
        p + "METRICS_BIND_ADDRESS": "127.0.0.1:0",
        # One replica; the lease adds the same 30 requests/min to either design.
        p + "LEADER_ELECTION": "false",
        p + "DELETES_PER_MINUTE": "6000",
        p + "LOG_LEVEL": "warning",
    }
    # ``BENCH_SERVICE_<VAR>`` in the runner's environment overrides a service variable.
    env.update({p + k[14:]: v for k, v in os.environ.items() if k.startswith("BENCH_SERVICE_")})
    env.update({p + k: v for k, v in overrides.items()})
    return config.load(env)


def counter_total(metrics: Metrics, name: str) -> float:
    total = 0.0
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


@contextlib.asynccontextmanager
async def running_service(
    emulator_url: str,
    cfg: config.Settings,
    *,
    instrument: Callable[[service.Parts], None] | None = None,
    wait_idle: bool = True,
) -> AsyncIterator[service.Parts]:
    """The real wiring (build + run) in this process; yields once synced (and the initial
    catch-up reconciles are done, when ``wait_idle``)."""
    metrics = Metrics()
    api = await new_api_client(host=emulator_url, metrics=metrics.kube)
    try:
        parts = service.build(cfg, api=api, metrics=metrics)
        if instrument is not None:
            instrument(parts)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(service.run, parts, stop=stop))
            await parts.informer.wait_synced()
            if wait_idle:
                await wait_queue_idle(parts)
            try:
                yield parts
            finally:
                stop.set()
    finally:
        await api.close()


async def wait_queue_idle(parts: service.Parts, *, timeout_s: float = 600.0) -> float:
    """Wait until no key is ready or in flight (delayed keys may remain); returns seconds."""
    started = time.perf_counter()
    with anyio.fail_after(timeout_s):
        while len(parts.queue) or parts.queue.processing:
            await anyio.sleep(0.01)
    return time.perf_counter() - started


REAPABLE = frozenset(Verdict)
