"""Development data: insert sandboxes and executions, and flip executions (demo, tests, benchmarks).

Production never runs these: the sandbox platform owns its rows. They exist so that every
harness seeds the same realistic data through one piece of code.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

NAMESPACE = "sandboxes"


async def seed_sandbox(
    conn: asyncpg.Connection,
    sandbox_id: str,
    *,
    namespace: str = NAMESPACE,
    managed_by: str = "kubernetes",
) -> None:
    await conn.execute(
        "INSERT INTO sandboxes (id, namespace, managed_by) VALUES ($1, $2, $3)",
        sandbox_id,
        namespace,
        managed_by,
    )


async def seed_execution(
    conn: asyncpg.Connection,
    *,
    pod_name: str,
    sandbox_id: str,
    generation: int = 1,
    activation_attempt: int = 0,
    pod_kind: str = "create",
    execution_state: str = "active",
    active: bool = True,
) -> None:
    await conn.execute(
        """
        INSERT INTO sandbox_k8s_executions
            (sandbox_id, generation, activation_attempt, pod_name, pod_kind,
             execution_state, active, retired_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, CASE WHEN $7 THEN NULL ELSE now() END)
        """,
        sandbox_id,
        generation,
        activation_attempt,
        pod_name,
        pod_kind,
        execution_state,
        active,
    )


async def seed_executions(
    conn: asyncpg.Connection,
    sandbox_ids: Sequence[str],
    *,
    namespace: str = NAMESPACE,
    execution_state: str = "suspended",
    active: bool = False,
) -> list[str]:
    """One managed sandbox and one generation-1 create row per id; returns the pod names."""
    await conn.executemany(
        "INSERT INTO sandboxes (id, namespace, managed_by) VALUES ($1, $2, 'kubernetes')",
        [(sid, namespace) for sid in sandbox_ids],
    )
    names = [f"space-sbx-{sid}-g1" for sid in sandbox_ids]
    await conn.executemany(
        """
        INSERT INTO sandbox_k8s_executions
            (sandbox_id, generation, activation_attempt, pod_name, pod_kind,
             execution_state, active)
        VALUES ($1, 1, 0, $2, 'create', $3, $4)
        """,
        [
            (sid, name, execution_state, active)
            for sid, name in zip(sandbox_ids, names, strict=True)
        ],
    )
    return names


async def set_execution(
    conn: asyncpg.Connection, pod_name: str, *, active: bool, execution_state: str
) -> None:
    """Retire or re-activate one execution (the trigger NOTIFYs on commit)."""
    await conn.execute(
        """
        UPDATE sandbox_k8s_executions
           SET active = $2, execution_state = $3,
               retired_at = CASE WHEN $2 THEN NULL ELSE now() END
         WHERE pod_name = $1
        """,
        pod_name,
        active,
        execution_state,
    )
