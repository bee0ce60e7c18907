"""The cancel-create write: the one UPDATE this project ever issues.

Retires an execution fenced on its generation and activation attempt, so a cancel that races a
newer activation of the same sandbox can never retire the newer one. A failure of the database
raises its kit error (``service/pg/errors.py``): ``Unavailable`` or ``DatabaseError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.pg.errors import database_errors

_RETIRE = """
UPDATE sandbox_k8s_executions AS e
   SET active = false, execution_state = 'cancelled', retired_at = now()
  FROM sandboxes AS s
 WHERE s.id = e.sandbox_id
   AND s.namespace = ANY($1::text[])
   AND s.managed_by = 'kubernetes'
   AND e.sandbox_id = $2
   AND e.generation = $3
   AND e.activation_attempt = $4
   AND e.active
RETURNING e.pod_name
"""

_CURRENT = """
SELECT e.pod_name, s.namespace, e.active, e.execution_state, e.activation_attempt
  FROM sandbox_k8s_executions AS e
  JOIN sandboxes AS s ON s.id = e.sandbox_id
 WHERE s.namespace = ANY($1::text[])
   AND s.managed_by = 'kubernetes'
   AND e.sandbox_id = $2
   AND e.generation = $3
"""


@dataclass(frozen=True, slots=True)
class CancelRow:
    """The execution of (sandbox, generation) after the fenced retire."""

    retired_now: bool
    """True when this call's UPDATE matched (it retired the execution)."""
    pod_name: str | None
    namespace: str | None
    """The namespace of the execution's sandbox (where its pod is)."""
    active: bool | None
    state: str | None
    activation_attempt: int | None


async def retire_for_cancel(
    conn: Any,
    *,
    namespaces: Sequence[str],
    sandbox_id: str,
    generation: int,
    activation_attempt: int,
    timeout_s: float,
) -> CancelRow:
    """Run the fenced UPDATE, then read back the execution of that generation; only sandboxes of
    ``namespaces`` (the configured sandbox namespaces) are in scope."""
    with database_errors():
        async with conn.transaction():
            updated = await conn.fetch(
                _RETIRE,
                list(namespaces),
                sandbox_id,
                generation,
                activation_attempt,
                timeout=timeout_s,
            )
            row = await conn.fetchrow(
                _CURRENT, list(namespaces), sandbox_id, generation, timeout=timeout_s
            )
    found = dict(row) if row is not None else {}
    return CancelRow(
        retired_now=bool(updated),
        pod_name=found.get("pod_name"),
        namespace=found.get("namespace"),
        active=found.get("active"),
        state=found.get("execution_state"),
        activation_attempt=found.get("activation_attempt"),
    )
