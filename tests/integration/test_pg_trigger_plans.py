"""The change-notify trigger's queries as the server plans and runs them: no JIT compilation, and
no read of `sandboxes`.

On the session's server and on Debian's PostgreSQL 15 with its default settings (``planner_url``),
where JIT is on and the trigger's general query is estimated far above ``jit_above_cost``
(service/pg/sql/0003_notify_statement_trigger.sql says why the trigger turns JIT off for it and
why its payload names no namespace). The plans are the
ones the server ran: ``auto_explain`` reports every statement, the trigger's nested ones included;
a plan compiled with JIT carries a ``JIT`` section.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import asyncpg
import pytest

from tests.pgfixtures import NAMESPACE, PgServer

pytestmark = pytest.mark.anyio

ROWS = 2000
_SEED = f"""
INSERT INTO sandboxes (id, namespace, managed_by)
    SELECT 'p' || n, '{NAMESPACE}', 'kubernetes' FROM generate_series(1, {ROWS}) AS n;
INSERT INTO sandbox_k8s_executions
    (sandbox_id, generation, activation_attempt, pod_name, pod_kind, execution_state, active)
    SELECT 'p' || n, 1, 0, 'space-sbx-p' || n || '-g1', 'create', 'suspended', false
    FROM generate_series(1, {ROWS}) AS n;
ANALYZE;
"""
# One statement of many rows per trigger event: each runs the event's general query. The rows are
# inactive, so that every statement has changes to send (the trigger's gates let no statement
# that writes only active rows reach its queries).
STATEMENTS = {
    "update": "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced'",
    "insert": (
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active)"
        " SELECT sandbox_id, 2, 0, replace(pod_name, '-g1', '-g2'), 'create', 'activating', false"
        " FROM sandbox_k8s_executions"
    ),
    "delete": "DELETE FROM sandbox_k8s_executions",
}


async def _plans_of(
    conn: asyncpg.Connection, statement: str, *, analyze: bool = False
) -> list[dict[str, Any]]:
    """Every plan the server ran for ``statement``, nested statements included (auto_explain,
    sent to this session as notices); with ``analyze``, each node with the times it ran."""
    notices: list[str] = []

    def on_notice(_conn: object, message: asyncpg.PostgresLogMessage) -> None:
        notices.append(str(getattr(message, "message", "")))

    await conn.execute(
        "LOAD 'auto_explain';"
        " SET auto_explain.log_min_duration = 0;"
        " SET auto_explain.log_nested_statements = on;"
        " SET auto_explain.log_format = json;"
        " SET auto_explain.log_level = notice;"
        f" SET auto_explain.log_analyze = {'on' if analyze else 'off'};"
        " SET auto_explain.log_timing = off"
    )
    conn.add_log_listener(on_notice)
    try:
        await conn.execute(statement)
        # The notices' callbacks are scheduled on the loop as they arrive: one more round trip
        # and a turn of the loop, and every one of them has run.
        await conn.execute("SET auto_explain.log_min_duration = -1")
        await anyio.sleep(0)
    finally:
        conn.remove_log_listener(on_notice)
    marker = "plan:\n"
    return [json.loads(n.split(marker, 1)[1]) for n in notices if marker in n]


@pytest.mark.parametrize("event", list(STATEMENTS))
async def test_the_trigger_runs_no_query_with_jit(planner_url: str, event: str) -> None:
    conn = await asyncpg.connect(planner_url, timeout=10)
    try:
        await conn.execute(_SEED)
        plans = await _plans_of(conn, STATEMENTS[event])
        texts = [p["Query Text"] for p in plans]
        # The statement itself and the trigger's general query (the one that groups the rows)
        # were both reported: the check below has something to look at.
        assert any(t == STATEMENTS[event] for t in texts), texts
        assert any("generate_series(1, cardinality(g.names)" in t for t in texts), texts
        jitted = [p["Query Text"][:120] for p in plans if "JIT" in p]
        assert jitted == []
    finally:
        await conn.close(timeout=5)


async def test_the_debian_server_compiles_with_jit_by_default(pg_debian_server: PgServer) -> None:
    # What the test above runs against: Debian's PostgreSQL 15, JIT available and on, so a plan
    # above jit_above_cost is compiled and reported with its JIT section.
    conn = await asyncpg.connect(pg_debian_server.admin_url, timeout=10)
    try:
        assert (await conn.fetchval("SHOW server_version")).startswith("15.")
        assert await conn.fetchval("SELECT pg_jit_available()") is True
        assert await conn.fetchval("SHOW jit") == "on"
        await conn.execute("SET jit_above_cost = 0")
        (plan,) = json.loads(
            await conn.fetchval(
                "EXPLAIN (ANALYZE, FORMAT JSON) SELECT sum(n) FROM generate_series(1, 1000) AS n"
            )
        )
        assert plan["JIT"]["Functions"] > 0
    finally:
        await conn.close(timeout=5)


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """``node`` and every node under it, InitPlans and subplans included."""
    return [node, *(n for child in node.get("Plans", []) for n in _nodes(child))]


@pytest.mark.parametrize("event", list(STATEMENTS))
async def test_the_trigger_never_reads_sandboxes(planner_url: str, event: str) -> None:
    # The payload names pods, not namespaces: no query of the trigger reads `sandboxes`, which
    # grows with every sandbox ever made (the SQL file's "Why no namespace"). A statement of
    # many rows (the general query) and one of one row (the short path), each event.
    conn = await asyncpg.connect(planner_url, timeout=10)
    try:
        await conn.execute(_SEED)
        one_row = {
            "update": STATEMENTS["update"] + " WHERE pod_name = 'space-sbx-p1-g1'",
            "insert": (
                "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
                " pod_name, pod_kind, execution_state, active)"
                " VALUES ('p1', 3, 0, 'space-sbx-p1-g3', 'create', 'activating', false)"
            ),
            "delete": STATEMENTS["delete"] + " WHERE pod_name = 'space-sbx-p2-g1'",
        }[event]
        trigger_plans = []
        # (The general INSERT copies every row: it goes first, the one-row INSERT adds another.)
        order = (one_row, STATEMENTS[event]) if event != "insert" else (STATEMENTS[event], one_row)
        for statement in order:
            plans = await _plans_of(conn, statement, analyze=True)
            # The trigger's queries read its transition tables (the foreign key's checks of an
            # INSERT read `sandboxes` too, and are not the trigger's).
            trigger_plans += [p for p in plans if "_rows" in p["Query Text"]]
        # The trigger ran (its short path's query and its general query were reported) ...
        texts = [p["Query Text"] for p in trigger_plans]
        assert any("pg_notify" in t and "generate_series" not in t for t in texts), texts
        assert any("generate_series(1, cardinality(g.names)" in t for t in texts), texts
        # ... and no node of any of its queries names `sandboxes`.
        assert [
            p["Query Text"]
            for p in trigger_plans
            for n in _nodes(p["Plan"])
            if n.get("Relation Name") == "sandboxes"
        ] == []
    finally:
        await conn.close(timeout=5)
