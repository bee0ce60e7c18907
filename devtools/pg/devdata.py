"""Development data: insert sandboxes and executions, and flip executions (demo, tests, benchmarks).

Production never runs these: the sandbox platform owns its rows. They exist so that every
harness seeds the same realistic data through one piece of code.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

NAMESPACE = "sandboxes"

# A production-like schema the project did not write: another column order, an identity key,
# jsonb and timestamp columns, a partial index on `active`, a cascading foreign key (B7, and the
# migrate tests, which add a trigger of the owner's to it).
FOREIGN_SCHEMA = """
CREATE TABLE sandboxes (
    created_at  timestamptz NOT NULL DEFAULT now(),
    managed_by  text NOT NULL,
    namespace   text NOT NULL,
    id          text PRIMARY KEY,
    owner       text
);
CREATE TABLE sandbox_k8s_executions (
    pod_name            text NOT NULL UNIQUE,
    active              boolean NOT NULL DEFAULT true,
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    notes               jsonb,
    sandbox_id          text NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    execution_state     text NOT NULL CHECK (execution_state <> ''),
    generation          integer NOT NULL,
    activation_attempt  integer NOT NULL DEFAULT 0,
    pod_kind            text NOT NULL,
    retired_at          timestamptz,
    updated_at          timestamptz
);
CREATE INDEX executions_active_idx ON sandbox_k8s_executions (active) WHERE active;
"""


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
