"""Randomized fault campaigns against the real service wiring, checked against ground truth.

One *seed* is one campaign: its own API server emulator (in process, over HTTP), its own
database on a shared throwaway PostgreSQL (reached through a :class:`PgProxy`), and its own
service instance built by ``service.app.service.build`` and run by ``run``, exactly as the CLI
does. A seed's schedule (what happens, to which pod, with which fault) is drawn from
``random.Random(seed)`` up front, so re-running a seed replays the same schedule; timing is real
(the service runs on the real clock), so a replay is faithful but not bit-exact.

Phases of a seed:

1. **chaos**: ``steps`` steps ~20-200 ms apart — pod creation, phase / IP / condition changes,
   blips (a change and its reversal in the same instant), recreation under the same name,
   deletion by others, row retirement (suspended, replaced, ...), re-activation, new generations,
   bursts of simultaneous retirements; faults: watch drop (abrupt or clean), forced 410,
   compaction, API 500/429, GET latency, ``pg_terminate_backend``, a PostgreSQL restart, a
   silently stalled listener connection; composite scenarios (recreate behind a stale cache;
   re-activate behind a stalled listener; re-activate behind the trigger's back); and, after
   half of the bursts, a change while workers wait for delete tokens that exactly one check of
   the service can see (:func:`while_waiting_for_tokens`). After every step the checker runs.
2. **quiet**: faults are lifted; every pod that is reapable then must be deleted (reported, in
   dry run) within ``threshold + recovery_bound + backlog / pace_rate``, counted from the end of
   the last fault (including another seed's restart of the shared server).

The checker (:class:`Checker`) holds every safety invariant of DESIGN.md against the emulator's
audit log and the driver's ground truth (:mod:`tests.chaos.model`); see docs/reliability.md for
the tolerances and why they are sound.

Run ``python -m tests.chaos.campaign --seeds 50`` (``make chaos SEEDS=50``) or ``--seed 1234``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import gc
import logging
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
from prometheus_client import CollectorRegistry

from devtools.emulator import Emulator, start_emulator
from devtools.emulator.core import AuditEntry
from devtools.emulator.faults import RequestRecord
from devtools.pg.throwaway import ThrowawayPostgres, create_database_async, with_database
from service.app.service import build, run
from service.config import load
from service.kit.ratelimit import capped_shape
from service.kube.api import new_api_client
from service.kube.informer import BACKOFF_MAX_S as INFORMER_BACKOFF_MAX_S
from service.metrics import Metrics
from service.pg.listener import BACKOFF_MAX_S as LISTENER_BACKOFF_MAX_S
from service.pg.migrate import DEFAULT_CHANNEL, migrate
from tests.chaos.model import (
    NAMESPACE,
    NON_REAPABLE_SHAPES,
    TERMINAL_REAPABLE,
    PodLife,
    PodShape,
    PodTruth,
    RowLife,
    RowTruth,
    continuously_reapable,
    pod_shape_reapable,
    pod_status,
    reactivate,
    reapable,
    retire,
)
from tests.chaos.pglog import RESOLUTION_S, SERVER_SETTINGS, StatementLog
from tests.chaos.pgproxy import PgProxy

logger = logging.getLogger(__name__)
PREFIX = "SPACE_RETIRED_EXECUTION_POD_GC_"
SELECTOR_LABEL = ("app.kubernetes.io/managed-by", "space-sandbox")
RECONCILER_LOGGER = "service.engine.reconciler"
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"


@dataclass(frozen=True, slots=True)
class CampaignConfig:
    threshold_s: float = 1.0
    deletes_per_minute: int = 60
    """Small on purpose: a burst of retirements exceeds the pacer's burst capacity (6)."""
    steps: int = 45
    sandboxes: int = 14
    start_tolerance_s: float = 0.05
    """Clock skew between the service's monotonic clock and the audit's wall clock, and the
    granularity of timer wake-ups: deletes may be judged this much early. (Load only ever makes
    the service later, never earlier.)"""
    pacing_slack_s: float = 1.0
    """Grant → DELETE arrival, for the pacer's envelope only: the token is taken as the DELETE is
    handed to the API client (engine/budget.py), so this is the request's transit through the
    shared loop. The grants themselves keep the envelope exactly (tests/unit/test_budget.py)."""
    recovery_bound_s: float = 8.0
    """After faults stop and the service's links are back (see :func:`links_back_at`): a key's
    requeue backoff (≤ 5 s · 1.1, service/app/service.py), a sync, and the first checks."""
    quiet_s: float = 1.5
    """Disabled mode: how long the quiet phase watches for (forbidden) actions."""


def seed_mode(seed: int) -> str:
    """``live`` mostly; every 8th seed dry run, every 8th (offset 4) disabled."""
    if seed % 8 == 0:
        return "dry_run"
    if seed % 8 == 4:
        return "disabled"
    return "live"


def reproduce_commands(seed: int) -> str:
    return (
        f"make chaos SEED={seed}   (or: CHAOS_SEED={seed} .venv/bin/pytest "
        f"tests/chaos/test_campaign.py -k campaign)"
    )


# ------------------------------------------------------------------ shared infrastructure


class SharedPostgres:
    """One throwaway server for a whole campaign, a migrated template, and a restart lock."""

    TEMPLATE = "chaos_template"

    def __init__(self) -> None:
        self.server = ThrowawayPostgres(settings={"max_connections": "500", **SERVER_SETTINGS})
        self.statements: StatementLog | None = None
        self._lock = anyio.Lock()
        self._counter = 0
        self.restarts = 0
        self.restarted_at = 0.0
        """Wall-clock time the last restart ended (``inf`` while one is under way)."""

    async def start(self) -> None:
        await anyio.to_thread.run_sync(self.server.start)
        assert self.server.root_dir is not None
        self.statements = StatementLog(self.server.root_dir / "server.log")
        await create_database_async(self.server.url, self.TEMPLATE)
        conn = await asyncpg.connect(with_database(self.server.url, self.TEMPLATE), timeout=10)
        try:
            await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
        finally:
            await conn.close()

    def stop(self) -> None:
        self.server.stop()

    async def new_database(self, seed: int) -> str:
        self._counter += 1
        name = f"chaos_{seed}_{self._counter}"
        async with self._lock:  # CREATE DATABASE ... TEMPLATE needs the template idle
            await create_database_async(self.server.url, name, template=self.TEMPLATE)
        return name

    async def restart(self) -> None:
        async with self._lock:
            self.restarted_at = math.inf
            try:
                await anyio.to_thread.run_sync(self.server.restart)
            finally:
                self.restarted_at = time.time()
            self.restarts += 1


class ReportCollector(logging.Handler):
    """Collects the reconciler's dry-run "would reap" records, by seed (from the pod name)."""

    _SEED = re.compile(r"space-sbx-s(\d+)n")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reports: dict[int, list[tuple[float, str, str]]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("dry run: would reap"):
            return
        key = str(getattr(record, "key", ""))
        match = self._SEED.search(key)
        if match is None:
            return
        uid = str(getattr(record, "uid", ""))
        self.reports.setdefault(int(match.group(1)), []).append((record.created, key, uid))


# ------------------------------------------------------------------ schedule


@dataclass(frozen=True, slots=True)
class Step:
    kind: str
    index: int
    shape: PodShape
    state: str
    amount: float
    flag: bool
    pause_s: float


_STEP_WEIGHTS: dict[str, int] = {
    "shape": 14,
    "shape_reapable": 10,
    "pod_blip": 6,
    "ip": 3,
    "condition": 3,
    "recreate": 4,
    "delete_other": 2,
    "create_missing": 5,
    "retire": 12,
    "reactivate": 5,
    "row_blip": 5,
    "new_generation": 3,
    "burst": 6,
    "watch_drop": 3,
    "watch_410": 2,
    "compact": 1,
    "api_error": 3,
    "latency": 2,
    "kill_db": 2,
    "pg_restart": 1,
    "stall_listener": 2,
    "stale_recreate": 3,
    "stall_reactivate": 3,
    "silent_reactivate": 2,
}
_RETIRE_STATES = ("suspended", "replaced", "replaced", "failed", "cancelled", "stopped", "paused")


def make_schedule(seed: int, cfg: CampaignConfig) -> list[Step]:
    rng = random.Random(seed)
    kinds = list(_STEP_WEIGHTS)
    weights = list(_STEP_WEIGHTS.values())
    steps = []
    for _ in range(cfg.steps):
        steps.append(
            Step(
                kind=rng.choices(kinds, weights)[0],
                index=rng.randrange(cfg.sandboxes),
                shape=rng.choice(list(PodShape)),
                state=rng.choice(_RETIRE_STATES),
                amount=rng.random(),
                flag=rng.random() < 0.5,
                pause_s=rng.uniform(0.02, 0.2),
            )
        )
    return steps


# ------------------------------------------------------------------ the driver (ground truth)


@dataclass
class Sandbox:
    sandbox_id: str
    generation: int
    kind: str
    managed: bool
    row_frozen: bool = False
    """Its row was changed behind the trigger's back: no later step touches the row again."""

    def name(self, generation: int | None = None) -> str:
        return f"space-sbx-{self.sandbox_id}-g{generation or self.generation}"


class World:
    """Performs every change and records it as ground truth (see :mod:`tests.chaos.model`)."""

    def __init__(
        self, *, seed: int, emu: Emulator, db_url: str, proxy: PgProxy, shared: SharedPostgres
    ) -> None:
        self.seed = seed
        self.emu = emu
        self.db_url = db_url
        self.proxy = proxy
        self.shared = shared
        self.db_name = db_url.rsplit("/", 1)[1]
        self.lives: dict[str, PodLife] = {}
        self.uid_of: dict[str, str] = {}
        self.rows: dict[str, RowLife] = {}
        self.sandboxes: list[Sandbox] = []
        self.stall_until = 0.0
        self.threshold_s = 1.0
        self.stats: Counter[str] = Counter()
        self._conn: asyncpg.Connection | None = None

    # -- database ------------------------------------------------------------------------

    async def _execute(self, sql: str, *args: Any, silent: bool = False) -> tuple[float, float]:
        """Run one statement in its own transaction, reconnecting through restarts; (lo, hi) of
        its commit. ``silent``: with ``session_replication_role = replica``, so no trigger fires
        (a writer that bypasses the notify trigger)."""
        lo = time.time()
        deadline = time.monotonic() + 20
        while True:
            try:
                if self._conn is None or self._conn.is_closed():
                    self._conn = await asyncpg.connect(self.db_url, timeout=5)
                if silent:
                    async with self._conn.transaction():
                        await self._conn.execute("SET LOCAL session_replication_role = replica")
                        await self._conn.execute(sql, *args, timeout=5)
                else:
                    await self._conn.execute(sql, *args, timeout=5)
                return lo, time.time()
            except (
                OSError,
                asyncpg.PostgresError,
                asyncpg.InterfaceError,
                asyncpg.InternalClientError,
                TimeoutError,
            ):
                if time.monotonic() > deadline:
                    raise
                if self._conn is not None:
                    self._conn.terminate()
                    self._conn = None
                await anyio.sleep(0.05)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    async def insert_row(self, name: str, row: RowTruth) -> None:
        lo, hi = await self._execute(
            """INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,
                   pod_name, pod_kind, execution_state, active)
               VALUES ($1, $2, 0, $3, $4, $5, $6)""",
            row.sandbox_id,
            row.generation,
            name,
            row.pod_kind,
            row.state,
            row.active,
        )
        self.rows.setdefault(name, RowLife(name)).record(lo, hi, row)

    async def update_rows(self, changes: dict[str, RowTruth], *, silent: bool = False) -> None:
        """One UPDATE for every row in ``changes`` (a burst commits them together)."""
        if not changes:
            return
        names = list(changes)
        lo, hi = await self._execute(
            """UPDATE sandbox_k8s_executions AS e SET active = c.active,
                      execution_state = c.state,
                      retired_at = CASE WHEN c.active THEN NULL ELSE now() END
               FROM unnest($1::text[], $2::bool[], $3::text[]) AS c(name, active, state)
               WHERE e.pod_name = c.name""",
            names,
            [changes[n].active for n in names],
            [changes[n].state for n in names],
            silent=silent,
        )
        for n in names:
            self.rows[n].record(lo, hi, changes[n])

    # -- pods ----------------------------------------------------------------------------

    def life(self, name: str) -> PodLife | None:
        """The current UID's life for ``name``, synced with the server (the service may have
        deleted it)."""
        uid = self.uid_of.get(name)
        life = self.lives.get(uid) if uid else None
        if life is None or life.ended_at is not None:
            return None
        obj = self.emu.get_pod(NAMESPACE, name)
        if obj is None or obj["metadata"]["uid"] != uid or obj["metadata"].get("deletionTimestamp"):
            life.end(time.time(), by_service=True)
            return None
        return life

    def create_pod(self, sb: Sandbox, generation: int, shape: PodShape, kind: str) -> None:
        name = sb.name(generation)
        labels = {
            SELECTOR_LABEL[0]: SELECTOR_LABEL[1],
            "space.sandbox-id": sb.sandbox_id,
            "space.generation": str(generation),
            "space.pod-kind": kind,
        }
        body = {
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "nodeName": "node-a",
                "containers": [{"name": "sandbox", "image": "registry.example/sandbox:1.0"}],
                "terminationGracePeriodSeconds": 30,
            },
            "status": pod_status(shape),
        }
        # A pod the service deleted may still be terminating under this name (graceful
        # deletion of a node-bound Pending pod): the kubelet finishes it before the name is
        # used again, as a new pod can only be created once the old object is gone.
        self.emu.finish_terminating(NAMESPACE, name)
        obj = self.emu.create_pod(body, namespace=NAMESPACE)
        t = time.time()
        uid = obj["metadata"]["uid"]
        life = PodLife(uid=uid, name=name)
        life.record(
            t, PodTruth(shape, sb.sandbox_id, generation, kind), obj["metadata"]["resourceVersion"]
        )
        self.lives[uid] = life
        self.uid_of[name] = uid

    def set_shape(self, life: PodLife, shape: PodShape) -> None:
        obj = self.emu.set_status(NAMESPACE, life.name, pod_status(shape))
        state = life.states[-1]
        new = PodTruth(shape, state.sandbox_id, state.generation, state.kind)
        life.record(time.time(), new, obj["metadata"]["resourceVersion"])

    def delete_pod(self, life: PodLife) -> None:
        self.emu.delete_pod(NAMESPACE, life.name, grace_period_s=0, uid=life.uid)
        life.end(time.time(), by_service=False)

    # -- setup ---------------------------------------------------------------------------

    async def populate(self, count: int, rng: random.Random) -> None:
        for i in range(count):
            managed = i != count - 1  # one sandbox is not Kubernetes-managed
            sb = Sandbox(f"s{self.seed}n{i}", 1, "restore" if i % 5 == 4 else "create", managed)
            self.sandboxes.append(sb)
            await self._execute(
                "INSERT INTO sandboxes (id, namespace, managed_by) VALUES ($1, $2, $3)",
                sb.sandbox_id,
                NAMESPACE,
                "kubernetes" if managed else "nomad",
            )
            row = RowTruth(sb.sandbox_id, 1, sb.kind, "active", True, managed)
            await self.insert_row(sb.name(), row)
            shape = rng.choice([PodShape.PENDING_STUCK, PodShape.RUNNING, PodShape.SUCCEEDED])
            self.create_pod(sb, 1, shape, sb.kind)


# ------------------------------------------------------------------ the checker


class Checker:
    """Every safety invariant, checked incrementally after each step and at the end."""

    def __init__(
        self,
        *,
        world: World,
        cfg: CampaignConfig,
        mode: str,
        reports: list[tuple[float, str, str]],
    ) -> None:
        self.world = world
        self.cfg = cfg
        self.mode = mode
        self.reports = reports
        self.violations: list[str] = []
        self.delete_times: list[float] = []
        self.deleted_uids: set[str] = set()
        self.reported_uids: set[str] = set()
        self.race_windows: list[float] = []
        """Final re-read start (database) → action (API server arrival or report), seconds."""
        self._audit_seen = 0
        self._reports_seen = 0
        shape = capped_shape(cfg.deletes_per_minute)
        self.capacity, self.rate_per_s = shape if shape is not None else (1, 0.0)

    def _fail(self, where: str, message: str) -> None:
        self.violations.append(f"[{where}] {message}")

    def check(self, where: str) -> None:
        audit = self.world.emu.audit
        new: list[AuditEntry] = audit[self._audit_seen :]
        self._audit_seen = len(audit)
        for entry in new:
            if entry.method == "DELETE" and "/pods/" in entry.path:
                self._check_delete(where, entry)
        reports = self.reports[self._reports_seen :]
        self._reports_seen = len(self.reports)
        for created, key, uid in reports:
            self._check_report(where, created, key, uid)
        self._check_budget(where)

    def _window_ok(self, life: PodLife, t: float, *, deleted: bool) -> tuple[bool, str]:
        """Invariants 1 and 3 for an action on ``life`` at ``t`` (DELETE arrival or report).

        The final re-read's start comes from PostgreSQL's statement log: pod and row must have
        been reapable together at every instant from a threshold before ``t`` up to it. After
        it, a row change is the accepted race (the service bounds how long it lets that last,
        ``FINAL_CHECK_MAX_AGE_S``; the fake-clock tests hold it to that); the pod must stay
        reapable up to a DELETE — its resourceVersion precondition pins it to the fresh GET,
        made before the re-read. A report has no precondition: its pod is judged up to the last
        fresh GET (the emulator's record), and as that GET saw it up to the re-read.
        """
        statements = self.world.shared.statements
        assert statements is not None
        reread = statements.last_reread_before(self.world.db_name, life.name, t)
        if reread is None:
            return False, "no final re-read of its row before it (PostgreSQL statement log)"
        self.race_windows.append(t - reread)
        a = t - self.cfg.threshold_s + self.cfg.start_tolerance_s
        row = self.world.rows.get(life.name)
        seen = reread - RESOLUTION_S
        if not deleted:
            # No precondition pins a reported pod: it is judged as the fresh GET saw it, from
            # the last GET before the re-read (the emulator's record) on.
            # (The log's millisecond resolution: a GET up to 1 ms after may precede the bind.)
            got = self._last_get_before(life.name, reread + RESOLUTION_S)
            pod_at_get = life.at(got) if got is not None else None
            if got is None or pod_at_get is None:
                return False, "no fresh GET of a live pod before its final re-read"
            ok, why = continuously_reapable(life, row, a, got)
            if ok:
                frozen = PodLife(life.uid, life.name, [got], [pod_at_get], [life.rv_at(got) or ""])
                ok, why = continuously_reapable(frozen, row, got, seen)
            if not ok:
                return False, f"{why}; fresh GET at {got:.3f}, final re-read began at {reread:.3f}"
            return True, ""
        ok, why = continuously_reapable(life, row, a, seen)
        if not ok:
            return False, f"{why}; final re-read began at {reread:.3f}"
        for changed, state in zip(life.times, life.states, strict=True):
            if deleted and reread < changed <= t and not pod_shape_reapable(state):
                return False, f"pod {state} at {changed:.3f}, after the final re-read"
        return True, ""

    def _last_get_before(self, name: str, t: float) -> float | None:
        path = f"{PODS_PATH}/{name}"
        times = [
            r.time_s
            for r in self.world.emu.requests
            if r.method == "GET" and r.path == path and 0 < r.time_s < t
        ]
        return max(times, default=None)

    def _check_delete(self, where: str, entry: AuditEntry) -> None:
        name = entry.path.rsplit("/", 1)[1]
        t = entry.time_s
        self.delete_times.append(t)
        if self.mode != "live":
            self._fail(where, f"{self.mode}: a DELETE was sent for {name} (invariants 5/6)")
        body = entry.body if isinstance(entry.body, dict) else {}
        pre = body.get("preconditions") if isinstance(body.get("preconditions"), dict) else None
        uid = pre.get("uid") if pre else None
        rv = pre.get("resourceVersion") if pre else None
        if not uid or not rv:
            self._fail(where, f"DELETE {name} without uid+resourceVersion preconditions: {body}")
        if entry.status not in (200, 202):
            return  # refused (404/409/injected): nothing was deleted
        life = (
            self.world.lives.get(str(uid))
            if uid
            else self.world.lives.get(self.world.uid_of.get(name, ""))
        )
        if life is None or life.name != name:
            self._fail(where, f"DELETE {name} deleted a pod UID the driver never created ({uid})")
            return
        self.deleted_uids.add(life.uid)
        # The pod side at the DELETE itself: the resourceVersion precondition pins the state.
        i = max(0, bisect.bisect_right(life.times, t) - 1)
        if rv is not None and life.rvs[i] != rv:
            self._fail(
                where,
                f"DELETE {name}: precondition resourceVersion {rv} is not the pod's "
                f"({life.rvs[i]}) at the time (invariant 7)",
            )
        if not pod_shape_reapable(life.states[i]):
            self._fail(where, f"DELETE {name} uid {life.uid}: pod state {life.states[i]} (inv. 2)")
        ok, why = self._window_ok(life, t, deleted=True)
        if not ok:
            self._fail(
                where,
                f"DELETE {name} uid {life.uid} at {t:.3f}: not continuously reapable for the "
                f"threshold {self.cfg.threshold_s}s before it: {why} (invariants 1/3)",
            )
        life.end(t, by_service=True)

    def _check_report(self, where: str, created: float, key: str, uid: str) -> None:
        name = key.rsplit("/", 1)[1]
        if self.mode != "dry_run":
            self._fail(where, f"{self.mode}: a would-reap report for {key} (invariant 6)")
        if uid in self.reported_uids:
            self._fail(where, f"dry run reported uid {uid} ({key}) twice (invariant 5)")
        self.reported_uids.add(uid)
        life = self.world.lives.get(uid)
        if life is None or life.name != name:
            self._fail(where, f"report for {key} names an unknown uid {uid}")
            return
        ok, why = self._window_ok(life, created, deleted=False)
        if not ok:
            self._fail(where, f"dry-run report {key} uid {uid} at {created:.3f}: {why}")

    def _check_budget(self, where: str) -> None:
        times = sorted(self.delete_times)
        cap = self.cfg.deletes_per_minute
        lo = 0
        for hi, t in enumerate(times):
            while times[lo] <= t - 60.0:
                lo += 1
            if hi - lo + 1 > cap:
                self._fail(where, f"{hi - lo + 1} DELETEs within 60 s (cap {cap}, invariant 4)")
                self.delete_times.clear()  # report once
                return
        # The pacer's envelope (budget.py): at most C + r·t grants in any window of length t.
        slack = self.cfg.pacing_slack_s
        for i in range(len(times)):
            for j in range(i + self.capacity, len(times)):
                span = times[j] - times[i]
                if span > 60:
                    break
                allowed = self.capacity + self.rate_per_s * (span + slack)
                if j - i + 1 > allowed:
                    self._fail(
                        where,
                        f"{j - i + 1} DELETEs within {span:.2f}s exceed the budget's pace "
                        f"(burst {self.capacity} + {self.rate_per_s:.2f}/s, invariant 4)",
                    )
                    self.delete_times.clear()
                    return


# ------------------------------------------------------------------ running one seed


@dataclass(frozen=True, slots=True)
class Recovery:
    """The quiet phase of one seed: when the service's links were back, and when its last due
    pod was acted on, in seconds after the faults stopped."""

    links_back_s: float
    done_s: float


@dataclass(slots=True)
class SeedResult:
    seed: int
    mode: str
    violations: list[str] = field(default_factory=list)
    deletes: int = 0
    reports: int = 0
    duration_s: float = 0.0
    stats: Counter[str] = field(default_factory=Counter)
    race_windows: list[float] = field(default_factory=list)
    recovery: Recovery | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = (
            f"seed {self.seed} [{self.mode}] {'ok' if self.ok else 'FAILED'}: "
            f"{self.deletes} deletes, {self.reports} reports, {self.duration_s:.1f}s"
        )
        if self.ok:
            return head
        lines = [head, *(f"  - {v}" for v in self.violations[:8])]
        lines.append(f"  reproduce: {reproduce_commands(self.seed)}")
        return "\n".join(lines)


def service_env(*, mode: str, db_url: str, cfg: CampaignConfig) -> dict[str, str]:
    env = {
        "ENABLED": "false" if mode == "disabled" else "true",
        "DRY_RUN": "true" if mode == "dry_run" else "false",
        "THRESHOLD_SECONDS": str(cfg.threshold_s),
        "DELETES_PER_MINUTE": str(cfg.deletes_per_minute),
        "RECONCILE_TIMEOUT_SECONDS": "5",
        "NAMESPACE": NAMESPACE,
        "WORKERS": "4",
        "RESYNC_PERIOD_SECONDS": "600",
        "SHUTDOWN_TIMEOUT_SECONDS": "2",
        "API_TIMEOUT_SECONDS": "2",
        "WATCH_TIMEOUT_SECONDS": "30",
        "DATABASE_URL": db_url,
        "DB_CONNECT_TIMEOUT_SECONDS": "2",
        "DB_STATEMENT_TIMEOUT_SECONDS": "2",
        # Ten times faster than production (10 s + 5 s), yet slow enough that a silent stall
        # leaves the final re-read as the only defence for a while.
        "LISTENER_HEARTBEAT_SECONDS": "1.0",
        "LISTENER_HEARTBEAT_TIMEOUT_SECONDS": "1.0",
        "METRICS_BIND_ADDRESS": "127.0.0.1:0",
        "LEADER_ELECTION": "false",
        "LOG_LEVEL": "info",
    }
    return {PREFIX + k: v for k, v in env.items()}


async def run_seed(
    seed: int,
    *,
    shared: SharedPostgres,
    collector: ReportCollector,
    cfg: CampaignConfig,
) -> SeedResult:

    mode = seed_mode(seed)
    result = SeedResult(seed, mode)
    started = time.monotonic()
    rng = random.Random(seed ^ 0x5EED)
    schedule = make_schedule(seed, cfg)
    db_name = await shared.new_database(seed)
    upstream_port = shared.server.port
    proxy = await PgProxy("127.0.0.1", upstream_port).start()
    service_db = f"postgresql://postgres@127.0.0.1:{proxy.port}/{db_name}"
    emu = Emulator(bookmark_interval_s=0.5, kubelet_finish_after_s=0.2)
    emu.ensure_namespace(NAMESPACE)
    running = await start_emulator(emulator=emu)
    world = World(
        seed=seed,
        emu=emu,
        db_url=with_database(shared.server.url, db_name),
        proxy=proxy,
        shared=shared,
    )
    world.threshold_s = cfg.threshold_s
    reports = collector.reports.setdefault(seed, [])
    checker = Checker(world=world, cfg=cfg, mode=mode, reports=reports)
    api = await new_api_client(host=running.url)
    try:
        await world.populate(cfg.sandboxes, rng)
        settings = load(service_env(mode=mode, db_url=service_db, cfg=cfg))
        parts = build(settings, api=api, metrics=Metrics(CollectorRegistry()))
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(run, parts, stop=stop))
            try:
                for n, step in enumerate(schedule):
                    await apply_step(world, step, rng, result.stats)
                    if world.stall_until and time.time() >= world.stall_until:
                        world.proxy.unstall()
                        world.stall_until = 0.0
                    checker.check(f"step {n} {step.kind}")
                    await anyio.sleep(step.pause_s)
                result.recovery = await quiet_phase(world, checker, cfg, mode)
            finally:
                stop.set()
    except Exception as exc:  # a crash of the service or the harness fails the seed
        logger.exception("seed %d crashed", seed)
        result.violations.append(f"crashed: {type(exc).__name__}: {exc}")
    finally:
        proxy.unstall()
        await api.close()
        await world.close()
        await proxy.aclose()
        await running.aclose()
    result.violations.extend(checker.violations)
    result.deletes = len(checker.deleted_uids)
    result.reports = len(checker.reported_uids)
    result.race_windows = checker.race_windows
    result.duration_s = time.monotonic() - started
    return result


async def quiet_phase(
    world: World, checker: Checker, cfg: CampaignConfig, mode: str
) -> Recovery | None:
    """Faults stop; every pod reapable now must be acted on within the stated bound."""
    world.emu.clear_faults()
    world.proxy.unstall()
    world.stall_until = 0.0
    t_quiet = time.time()
    due: dict[str, str] = {}
    for name, uid in world.uid_of.items():
        life = world.life(name)
        row = world.rows.get(name)
        if life is not None and row is not None and reapable(life.current, row.current):
            due[uid] = name
    if mode == "disabled":
        await anyio.sleep(cfg.threshold_s + cfg.quiet_s)
        checker.check("quiet")
        return None
    backlog_s = 0.0
    if mode == "live" and checker.rate_per_s > 0:
        backlog_s = max(0, len(due) - checker.capacity + 1) / checker.rate_per_s
    bound_s = cfg.threshold_s + cfg.recovery_bound_s + backlog_s
    # A watch still streaming now (answered with status 0 so far): the informer needs no retry.
    watching = any("watch" in r.query and r.time_s > 0 and r.status == 0 for r in pod_syncs(world))
    informer_back = t_quiet if watching else math.inf
    while True:
        checker.check("quiet")
        done = checker.deleted_uids if mode == "live" else checker.reported_uids
        missing = {uid: name for uid, name in due.items() if uid not in done}
        # Seeds share one PostgreSQL server: a restart by another seed is a fault too, and the
        # bound counts from the end of the last one.
        faults_stopped = max(t_quiet, world.shared.restarted_at)
        if informer_back == math.inf:  # its first request since the faults stopped
            informer_back = min(
                (r.time_s for r in pod_syncs(world) if r.time_s >= t_quiet), default=math.inf
            )
        back_at = links_back_at(world, faults_stopped, informer_back)
        deadline = min(back_at, faults_stopped + RECONNECT_CAP_S) + bound_s
        if not missing or time.time() > deadline:
            break
        await anyio.sleep(0.1)
    recovery = Recovery(links_back_s=back_at - faults_stopped, done_s=time.time() - faults_stopped)
    if missing:
        # Slow or stuck? Watch a while longer, for the report only.
        late: dict[str, float] = {}
        until = time.time() + LIVENESS_GRACE_S
        while len(late) < len(missing) and time.time() < until:
            checker.check("quiet")
            done = checker.deleted_uids if mode == "live" else checker.reported_uids
            for uid, name in missing.items():
                if uid in done and name not in late:
                    late[name] = time.time()
            await anyio.sleep(0.1)
        checker.violations.append(
            f"[liveness] {len(missing)} pod(s) reapable since the faults stopped were not "
            f"{'deleted' if mode == 'live' else 'reported'} within {bound_s:.1f}s of the "
            f"service's links being back (at {back_at - t_quiet:+.2f}s): "
            f"{sorted(missing.values())[:5]}\n"
            + liveness_evidence(world, sorted(missing.values())[:5], t_quiet, late)
        )
    return recovery


LIVENESS_GRACE_S = 30.0

RECONNECT_CAP_S = max(INFORMER_BACKOFF_MAX_S, LISTENER_BACKOFF_MAX_S) + 2.0
"""The service's links are back this long after the faults stopped at the latest: its backoff
caps, plus a connect attempt (DB_CONNECT_TIMEOUT_SECONDS, API_TIMEOUT_SECONDS)."""


def pod_syncs(world: World) -> list[RequestRecord]:
    """The list and watch requests on the pods, as the emulator received them."""
    return [r for r in world.emu.requests if r.method == "GET" and r.path == PODS_PATH]


def links_back_at(world: World, faults_stopped: float, informer_back: float) -> float:
    """When the service's links were back after the faults stopped (``inf`` until then), from
    the proxy's and the emulator's side, not from the service's word: the later of its last
    listener connect since the faults stopped and ``informer_back`` (when its informer was
    listing or watching again). Both wait out a backoff that grew with the faults (an outage's
    length, how many requests failed in a row): a loaded machine lengthens a database restart,
    so a fixed bound from the end of the faults would judge the product's backoff, not its
    liveness. The backoffs have their caps (RECONNECT_CAP_S), so this bound cannot grow
    without limit."""
    connects = [t for t in world.proxy.listener_connected_at if t >= faults_stopped]
    return max(faults_stopped, informer_back, *connects)


def liveness_evidence(
    world: World, names: list[str], t_quiet: float, late: dict[str, float]
) -> str:
    """What the service did around the quiet phase, from the emulator's and the proxy's side
    (times in seconds from the start of the quiet phase; status 0: still streaming)."""

    def at(t: float) -> str:
        return f"{t - t_quiet:+.2f}"

    since = t_quiet - 15.0
    syncs = [
        f"{at(r.time_s)} {'watch' if 'watch' in r.query else 'list'} {r.status}"
        for r in pod_syncs(world)
        if r.time_s >= since
    ]
    lines = [
        f"    restart ended {at(world.shared.restarted_at)}"
        if world.shared.restarted_at
        else "    no restart",
        "    listener connects: "
        + ", ".join(at(t) for t in world.proxy.listener_connected_at if t >= since),
        "    pods list/watch: " + ", ".join(syncs),
    ]
    for name in names:
        path = f"{PODS_PATH}/{name}"
        seen = [
            f"{at(r.time_s)} {r.method} {r.status}"
            for r in world.emu.requests
            if r.path == path and r.time_s >= since
        ]
        after = (
            f"acted on at {at(late[name])}"
            if name in late
            else f"not acted on by {at(t_quiet + LIVENESS_GRACE_S)}"
        )
        lines.append(f"    {name}: {after}; " + ", ".join(seen))
    return "\n".join(lines)


# ------------------------------------------------------------------ steps


_TARGETED = frozenset(
    {"pod_blip", "row_blip", "stale_recreate", "stall_reactivate", "silent_reactivate"}
)
_ROW_STEPS = frozenset(
    {"retire", "reactivate", "row_blip", "new_generation", "stall_reactivate", "silent_reactivate"}
)


def oldest_reapable(world: World, amount: float) -> int | None:
    """Index of one of the three sandboxes reapable (ground truth) for the longest time: the
    ones whose clocks run, or that wait for a delete token — where a lost event matters."""
    candidates: list[tuple[float, int]] = []
    for i, sb in enumerate(world.sandboxes):
        name = sb.name()
        life = world.life(name)
        row = world.rows.get(name)
        if life is None or row is None or not reapable(life.current, row.current):
            continue
        candidates.append((max(life.times[-1], row.his[-1]), i))
    if not candidates:
        return None
    candidates.sort()
    return candidates[int(amount * min(3, len(candidates)))][1]


async def until_paced(world: World, since: float) -> None:
    """Wait until the budget's burst is spent: a DELETE after ``since`` has been seen, and then
    none for 0.15 s (the pacer's next token is up to 1/r ≈ 1.1 s away; workers wait for it).
    Gives up 3 s after ``since``."""
    deadline = since + 3.0
    last = 0.0
    while (now := time.time()) < deadline:
        deletes = [
            e.time_s
            for e in world.emu.audit
            if e.method == "DELETE" and e.time_s >= since and e.status in (200, 202)
        ]
        last = max(deletes, default=0.0)
        if last and now - last >= 0.15:
            return
        await anyio.sleep(0.02)


BLIP_GAP_S = 0.02
"""Between the two statements of a row blip. Each commit is only known to lie in the
[sent, answered] interval of its statement, and inside it the checker accepts either state: back
to back, the two intervals touch and the middle state could have lived for no instant at all.
With a gap it provably lived (at least this long), so a DELETE that ignored it is a violation."""

TOKEN_WAIT_VARIANTS = ("silent", "stalled", "lagged", "pending_blip", "retired_blip", "recreated")


async def while_waiting_for_tokens(
    world: World, names: list[str], variant: str, fraction: float
) -> None:
    """After a burst, while workers wait for delete tokens holding candidates they verified,
    change every pod or row left behind the service's back. Each variant leaves exactly one
    check of the service able to see the change:

    * ``silent``: re-activate the rows behind the trigger's back (no notification at all): the
      final re-read classification after the token wait;
    * ``stalled``: re-activate and re-retire the rows behind a stalled listener (the final
      re-read shows them retired again): the notification sync, which must refuse;
    * ``lagged``: take the informer's watch down and keep it down while each pod blips through
      a non-reapable state (the fresh GET shows the final state under the same UID): the
      resourceVersion, ahead of the cache;
    * ``pending_blip``: each Succeeded/Failed create pod blips through Pending with no IP and the
      condition False, delivered at once (a pod-only check passes it; with a `suspended` row it
      is no reap): event-time clearing on any pod change;
    * ``retired_blip`` (the burst retired Pending never-started pods as `replaced`): each row
      moves to `suspended` and back, still retired throughout: event-time clearing on every
      notification;
    * ``recreated``: behind a watch kept down, each pod is deleted and created again under the
      same name in the same reapable shape (a new UID, never observed): the UID comparison.

    ``fraction`` in [0, 1) spreads the moment of the change over the first 0.3 s of the wait."""
    # The clocks the burst started expire a threshold from now: DELETEs before that are of pods
    # whose clocks ran already, and say nothing about where the pacer stands.
    await until_paced(world, time.time() + world.threshold_s - 0.1)
    # Workers now wait for the next paced token (up to 1/r ≈ 1.1 s away).
    await anyio.sleep(0.3 * fraction)
    left = [name for name in names if world.life(name) is not None]
    lives = [life for life in map(world.life, left) if life is not None]
    if variant in ("lagged", "recreated"):
        world.emu.fail_next(3, code=500, method="GET", query={"watch": "true"})
        world.emu.drop_watches(abrupt=True)
    if variant == "recreated":
        for life in lives:
            state = life.states[-1]
            world.delete_pod(life)
            sb = next(sb for sb in world.sandboxes if sb.name() == life.name)
            world.create_pod(sb, state.generation, state.shape, state.kind)
    elif variant == "lagged":
        for life in lives:
            current = life.states[-1].shape
            world.set_shape(life, NON_REAPABLE_SHAPES[len(life.name) % len(NON_REAPABLE_SHAPES)])
            world.set_shape(life, current)
    elif variant == "pending_blip":
        for life in lives:
            state = life.states[-1]
            if state.shape in TERMINAL_REAPABLE and state.kind == "create":
                world.set_shape(life, PodShape.PENDING_STUCK)
                world.set_shape(life, state.shape)
    else:
        if variant == "stalled":
            world.proxy.stall()
        retired: dict[str, RowTruth] = {}
        for name in left:
            row = world.rows[name].current
            assert row is not None
            retired[name] = row
        middle = {
            name: retire(row, "suspended") if variant == "retired_blip" else reactivate(row)
            for name, row in retired.items()
        }
        await world.update_rows(middle, silent=variant == "silent")
        if variant != "silent":
            await anyio.sleep(BLIP_GAP_S)
            await world.update_rows(retired)
        else:
            for sb in world.sandboxes:
                sb.row_frozen = sb.row_frozen or sb.name() in retired
    # Nothing else happens meanwhile: this scenario is about the final checks alone.
    await anyio.sleep(2.5)
    world.proxy.unstall()
    world.stall_until = 0.0


async def apply_step(world: World, step: Step, rng: random.Random, stats: Counter[str]) -> None:
    index = step.index
    if step.kind in _TARGETED:
        target = oldest_reapable(world, step.amount)
        index = index if target is None else target
    sb = world.sandboxes[index]
    name = sb.name()
    life = world.life(name)
    row_life = world.rows.get(name)
    row = row_life.current if row_life else None
    emu = world.emu
    kind = step.kind
    applied = True
    if sb.row_frozen and kind in _ROW_STEPS:
        kind = "skip"
    match kind:
        case "skip":
            applied = False
            kind = step.kind
        case "shape" | "shape_reapable" | "ip" | "condition":
            if life is None:
                applied = False
            else:
                if kind == "shape":
                    shape = step.shape
                elif kind == "shape_reapable":
                    shape = [PodShape.SUCCEEDED, PodShape.FAILED, PodShape.PENDING_STUCK][
                        int(step.amount * 3)
                    ]
                elif kind == "ip":
                    shape = PodShape.PENDING_WITH_IP
                else:
                    current = life.states[-1].shape
                    shape = (
                        PodShape.PENDING_READY
                        if current is PodShape.PENDING_STUCK
                        else PodShape.PENDING_STUCK
                    )
                world.set_shape(life, shape)
        case "pod_blip":
            if life is None:
                applied = False
            else:
                current = life.states[-1].shape
                if step.flag and current in TERMINAL_REAPABLE and life.states[-1].kind == "create":
                    # Through Pending with no IP and the condition False: a pod-only check
                    # passes it, but it is reapable only with a row retired as `replaced`.
                    between = PodShape.PENDING_STUCK
                else:
                    between = NON_REAPABLE_SHAPES[int(step.amount * len(NON_REAPABLE_SHAPES))]
                world.set_shape(life, between)
                world.set_shape(life, current)
        case "recreate" | "stale_recreate":
            if kind == "stale_recreate":
                # The informer loses its stream and its next GETs fail, so the cache keeps
                # the old UID for a while; meanwhile the name gets a new pod.
                emu.drop_watches(abrupt=True)
                emu.fail_next(3, code=500, method="GET", path_contains="/namespaces/sandboxes/pods")
            if life is not None:
                world.delete_pod(life)
            pod_kind = (
                sb.kind if step.amount < 0.85 else ("restore" if sb.kind == "create" else "create")
            )
            shape = step.shape if not step.flag else PodShape.SUCCEEDED
            world.create_pod(sb, sb.generation, shape, pod_kind)
        case "delete_other":
            if life is None:
                applied = False
            else:
                world.delete_pod(life)
        case "create_missing":
            if life is not None:
                applied = False
            else:
                world.create_pod(sb, sb.generation, step.shape, sb.kind)
        case "retire":
            if row is None:
                applied = False
            else:
                await world.update_rows({name: retire(row, step.state)})
        case "reactivate":
            if row is None or row.active:
                applied = False
            else:
                await world.update_rows({name: reactivate(row)})
        case "row_blip":
            if row is None or row.active:
                applied = False
            else:
                # Re-activated and back; or, when the row says `replaced`, through another
                # retired state (`suspended`): still retired, yet a Pending never-started pod
                # is reapable only with `replaced`.
                middle = (
                    retire(row, "suspended")
                    if step.flag and row.state == "replaced"
                    else reactivate(row)
                )
                await world.update_rows({name: middle})
                await anyio.sleep(BLIP_GAP_S)
                await world.update_rows({name: row})
        case "new_generation":
            if row is not None and row.active:
                await world.update_rows({name: retire(row, "replaced")})
            sb.generation += 1
            new_row = RowTruth(sb.sandbox_id, sb.generation, sb.kind, "active", True, sb.managed)
            await world.insert_row(sb.name(), new_row)
            world.create_pod(sb, sb.generation, PodShape.PENDING_STUCK, sb.kind)
        case "burst":
            # Half of the bursts are followed by a change while workers wait for tokens.
            variant = None
            if step.flag:
                variant = TOKEN_WAIT_VARIANTS[int(step.amount * len(TOKEN_WAIT_VARIANTS))]
                # This is about the wait for delete tokens alone: lift earlier faults (a
                # stalled listener or failing GETs would stop the deletes for other reasons).
                emu.clear_faults()
                world.proxy.unstall()
                world.stall_until = 0.0
            changes: dict[str, RowTruth] = {}
            for other in world.sandboxes:
                other_name = other.name()
                other_life = world.life(other_name)
                other_row = world.rows[other_name].current
                if other_life is None or other_row is None or other.row_frozen:
                    continue
                pod_now = other_life.states[-1]
                if variant == "retired_blip" and pod_now.kind == "create":
                    # Pending never-started pods, retired as `replaced`.
                    if pod_now.shape is not PodShape.PENDING_STUCK:
                        world.set_shape(other_life, PodShape.PENDING_STUCK)
                    changes[other_name] = retire(other_row, "replaced")
                    continue
                if pod_now.shape not in TERMINAL_REAPABLE:
                    world.set_shape(other_life, PodShape.SUCCEEDED)
                changes[other_name] = retire(other_row, "suspended")
            await world.update_rows(changes)
            if variant is not None:
                fraction = (step.amount * len(TOKEN_WAIT_VARIANTS)) % 1
                await while_waiting_for_tokens(world, list(changes), variant, fraction)
        case "watch_drop":
            emu.drop_watches(abrupt=step.flag)
        case "watch_410":
            emu.expire_next_watches(1)
            emu.drop_watches(abrupt=False)
        case "compact":
            emu.compact()
            emu.drop_watches(abrupt=step.flag)
        case "api_error":
            code = 429 if step.flag else 500
            method = ["GET", "DELETE", None][int(step.amount * 3)]
            emu.fail_next(
                1 + int(step.amount * 2),
                code=code,
                method=method,
                path_contains="/pods",
                retry_after_s=1 if code == 429 else None,
            )
        case "latency":
            emu.add_latency(
                0.05 + 0.35 * step.amount,
                method="GET",
                path_contains="/pods",
                count=1 + int(step.amount * 4),
            )
        case "kill_db":
            app = ["retired-pod-gc-listener", "retired-pod-gc", ""][int(step.amount * 3)]
            await world._execute(
                """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                   WHERE datname = $1 AND pid <> pg_backend_pid()
                     AND ($2 = '' OR application_name = $2)""",
                world.db_name,
                app,
            )
        case "pg_restart":
            await world.shared.restart()
        case "stall_listener":
            world.proxy.stall()
            world.stall_until = time.time() + 0.3 + 0.9 * step.amount
        case "stall_reactivate":
            # A re-activation (and maybe a re-retirement) the stalled listener never delivers.
            if row is None or row.active:
                applied = False
            else:
                world.proxy.stall()
                world.stall_until = time.time() + 0.6 + 0.8 * step.amount
                await world.update_rows({name: reactivate(row)})
                if step.flag:
                    await anyio.sleep(0.1 + 0.3 * step.amount)
                    await world.update_rows({name: row})
        case "silent_reactivate":
            # A writer that bypasses the trigger re-activates the row: no notification ever
            # comes, so only the final re-read can see it (and the row stays active for good).
            if row is None or row.active:
                applied = False
            else:
                await world.update_rows({name: reactivate(row)}, silent=True)
                sb.row_frozen = True
        case _:
            raise AssertionError(kind)
    stats[kind if applied else f"{kind} (n/a)"] += 1


# ------------------------------------------------------------------ campaigns


async def run_campaign(
    seeds: Sequence[int],
    *,
    cfg: CampaignConfig | None = None,
    concurrency: int = 24,
    shared: SharedPostgres | None = None,
) -> list[SeedResult]:
    """Run ``seeds``, at most ``concurrency`` at a time; returns one result per seed."""
    cfg = cfg or CampaignConfig()
    own = shared is None
    shared = shared or SharedPostgres()
    if own:
        await shared.start()
    collector = ReportCollector()
    reconciler_logger = logging.getLogger(RECONCILER_LOGGER)
    old_level = reconciler_logger.level
    reconciler_logger.setLevel(logging.INFO)
    reconciler_logger.addHandler(collector)
    results: dict[int, SeedResult] = {}
    limiter = anyio.Semaphore(concurrency)

    async def one(seed: int) -> None:
        async with limiter:
            results[seed] = await run_seed(seed, shared=shared, collector=collector, cfg=cfg)

    try:
        async with anyio.create_task_group() as tg:
            for seed in seeds:
                tg.start_soon(one, seed)
    finally:
        reconciler_logger.removeHandler(collector)
        reconciler_logger.setLevel(old_level)
        if own:
            await anyio.to_thread.run_sync(shared.stop)
    return [results[s] for s in seeds]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds (from --start)")
    parser.add_argument("--start", type=int, default=1, help="first seed")
    parser.add_argument("--seed", type=int, action="append", help="run just this seed")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--steps", type=int, default=CampaignConfig().steps)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.WARNING)
    seeds = args.seed or list(range(args.start, args.start + args.seeds))
    cfg = CampaignConfig(steps=args.steps)
    started = time.monotonic()
    results, escaped = anyio.run(
        functools.partial(guarded_campaign, seeds, cfg=cfg, concurrency=args.concurrency)
    )
    failed = [r for r in results if not r.ok]
    for r in results:
        print(r.summary())
    for context in escaped:
        print(f"event loop exception handler called: {context}")
    windows = sorted(w for r in results for w in r.race_windows)
    if windows:
        print(
            f"final re-read -> action: p50 {windows[len(windows) // 2] * 1000:.1f} ms, "
            f"p99 {windows[int(len(windows) * 0.99)] * 1000:.1f} ms, "
            f"max {windows[-1] * 1000:.1f} ms over {len(windows)} actions"
        )
    recoveries = [r.recovery for r in results if r.recovery is not None]
    if recoveries:
        back = sorted(rc.links_back_s for rc in recoveries if rc.links_back_s < math.inf)
        early = len(recoveries) - len(back)
        back = back or [0.0]
        done = sorted(rc.done_s for rc in recoveries)
        print(
            f"after the faults stopped: links back p50 {back[len(back) // 2]:.2f} s, "
            f"max {back[-1]:.2f} s ({early} seeds done before theirs were); "
            f"last due pod acted on p50 {done[len(done) // 2]:.2f} s, "
            f"p99 {done[int(len(done) * 0.99)]:.2f} s, max {done[-1]:.2f} s"
        )
    total = Counter[str]()
    for r in results:
        total.update(r.stats)
    print(f"steps: {dict(sorted(total.items()))}")
    print(
        f"{len(results)} seeds, {len(failed)} failed, "
        f"{sum(r.deletes for r in results)} deletes, {sum(r.reports for r in results)} reports, "
        f"{time.monotonic() - started:.1f}s"
    )
    if failed:
        print("failing seeds: " + " ".join(str(r.seed) for r in failed))
    return 1 if failed or escaped else 0


async def guarded_campaign(
    seeds: Sequence[int], *, cfg: CampaignConfig, concurrency: int
) -> tuple[list[SeedResult], list[str]]:
    """:func:`run_campaign`, and every call of the event loop's exception handler meanwhile (an
    exception raised in a callback, or a task's or future's that nobody retrieved)."""
    loop = asyncio.get_running_loop()
    escaped: list[str] = []

    def record(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        escaped.append(f"{context.get('message')}: {type(exc).__name__}: {exc}")
        loop.default_exception_handler(context)

    loop.set_exception_handler(record)
    results = await run_campaign(seeds, cfg=cfg, concurrency=concurrency)
    gc.collect()
    await asyncio.sleep(0)
    return results, escaped


if __name__ == "__main__":
    sys.exit(main())
