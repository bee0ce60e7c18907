"""A seed's world: every change to its pods or rows, made and recorded as ground truth.

Every change the driver makes to a seed's pods (on its API server emulator) or execution rows
(in its database) goes through :class:`World`, which records it in the timelines of
:mod:`tests.chaos.model` as it makes it: a pod state at the exact ``time.time()`` of the emulator
call, a row change as the ``[sent, answered]`` interval of its statement. The checker judges the
service against these timelines. :func:`pod_status` is how a :class:`tests.chaos.model.PodShape`
is written to the emulator.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg

from devtools.emulator import Emulator
from tests.chaos.model import NAMESPACE, PodLife, PodShape, PodTruth, RowLife, RowTruth
from tests.chaos.pgproxy import PgProxy
from tests.chaos.pgserver import SharedPostgres

SELECTOR_LABEL = ("app.kubernetes.io/managed-by", "space-sandbox")


def _cond(kind: str, status: str) -> dict[str, str]:
    return {"type": kind, "status": status, "lastTransitionTime": "2026-01-01T00:00:00Z"}


def pod_status(shape: PodShape) -> dict[str, Any]:
    """The ``.status`` a kubelet would write for ``shape``."""
    waiting = {"waiting": {"reason": "ContainerCreating"}}
    running = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    terminated = {"terminated": {"exitCode": 0, "reason": "Completed"}}

    def containers(state: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": "sandbox", "state": state, "ready": False, "restartCount": 0}]

    base_conditions = [_cond("PodScheduled", "True")]
    match shape:
        case PodShape.PENDING_STUCK:
            return {
                "phase": "Pending",
                "conditions": [_cond("PodReadyToStartContainers", "False"), *base_conditions],
                "containerStatuses": containers(waiting),
            }
        case PodShape.PENDING_WITH_IP:
            return {
                "phase": "Pending",
                "podIP": "10.0.0.7",
                "conditions": [_cond("PodReadyToStartContainers", "False"), *base_conditions],
                "containerStatuses": containers(waiting),
            }
        case PodShape.PENDING_NO_CONDITION:
            return {
                "phase": "Pending",
                "conditions": base_conditions,
                "containerStatuses": containers(waiting),
            }
        case PodShape.PENDING_READY:
            return {
                "phase": "Pending",
                "conditions": [_cond("PodReadyToStartContainers", "True"), *base_conditions],
                "containerStatuses": containers(waiting),
            }
        case PodShape.RUNNING:
            return {
                "phase": "Running",
                "podIP": "10.0.0.7",
                "conditions": [_cond("PodReadyToStartContainers", "True"), *base_conditions],
                "containerStatuses": containers(running),
            }
        case PodShape.SUCCEEDED | PodShape.FAILED:
            return {
                "phase": "Succeeded" if shape is PodShape.SUCCEEDED else "Failed",
                "conditions": [_cond("PodReadyToStartContainers", "False"), *base_conditions],
                "containerStatuses": containers(terminated),
            }
        case PodShape.SUCCEEDED_NO_STATUSES:
            return {"phase": "Succeeded", "conditions": base_conditions}
        case PodShape.FAILED_CONTAINER_RUNNING:
            return {
                "phase": "Failed",
                "conditions": base_conditions,
                "containerStatuses": containers(running),
            }
        case PodShape.UNKNOWN_PHASE:
            return {"phase": "Unknown", "conditions": base_conditions}
    raise AssertionError(shape)


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

    # -- faults --------------------------------------------------------------------------

    def end_stall(self) -> None:
        """Let the listener's connection flow again (and forget when a stall was due to end)."""
        self.proxy.unstall()
        self.stall_until = 0.0

    def lift_faults(self) -> None:
        """Clear the emulator's injected faults and end any listener stall."""
        self.emu.clear_faults()
        self.end_stall()

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
