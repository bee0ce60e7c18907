"""B7's trigger share: what the change-notify trigger adds to the writer's statement, measured
inside that statement, on the wheel's PostgreSQL and on Debian's PostgreSQL 15 with its defaults.

``EXPLAIN (ANALYZE, FORMAT JSON)`` of a retirement ``UPDATE`` runs it and reports the statement's
execution time and, apart, each trigger's time (``Triggers``: name, time, calls); an AFTER
trigger's calls (the shipped trigger's, one a row its WHEN lets through) run before the statement
ends, so their time is part of the execution time. What the ratio leaves out is the WHEN's
evaluation and the transition tables' capture, counted as the statement's own (B13i counts
them). Per statement, the ratio ``total / (total - trigger)`` is what the statement costs with the
trigger over what it costs without it, both from the one execution: the machine's load, which
moves from one run to the next, moves both alike.

The table is not the project's dev schema but :data:`FOREIGN_SCHEMA`, one the project did not
write (another column order, an identity key, extra columns, a partial index on ``active``, a
cascading foreign key; no trigger of the owner's, whose time would count as the statement's).
The trigger is installed by ``migrate`` (no ``--with-schema``). Statements:

* ``statement``: every row retired by one ``UPDATE`` (``rows``, 10,000 by default); the rows are
  put back and the table vacuumed (untimed) after each;
* ``one_row``: one row retired by one ``UPDATE``, a different row each time.

Each statement kind runs beside a ``sandboxes`` table of each size of ``sandboxes`` (``rows`` by
default, one sandbox an execution, and 200,000: sandboxes accumulate, executions do not; the
extra sandboxes have no execution), each size in a database of its own, analyzed once seeded.

Each server runs the shipped trigger (``0003``) and beside it each file of ``others``: another text
of the trigger file, named by its file name, its ``retired_pod_gc_`` names prefixed ``b7_<name>_``;
one at a time (only that variant's UPDATE trigger enabled), in turn. One untimed round first: a
session's first statement that runs the trigger's general query plans it. A connection LISTENs
throughout. The server is the throwaway's (``devtools/pg/throwaway.py``): speed settings such as
``fsync = off``, nothing about the planner or JIT.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg

from benchmarks.harness import load_average
from devtools.pg.devdata import FOREIGN_SCHEMA
from devtools.pg.throwaway import Flavor, ThrowawayPostgres
from service.pg.migrate import DEFAULT_CHANNEL, migrate

SERVERS = {"wheel": Flavor.WHEEL, "debian15": Flavor.DEBIAN}
_SEED = """
INSERT INTO sandboxes (managed_by, namespace, id, owner)
    SELECT 'kubernetes', 'sandboxes', 'w' || i, 'team-' || (i % 50)
    FROM generate_series(1, {sandboxes}) i;
INSERT INTO sandbox_k8s_executions
    (pod_name, sandbox_id, execution_state, generation, pod_kind, notes)
    SELECT 'space-sbx-w' || i || '-g1', 'w' || i, 'active', 1, 'create', '{{"by": "bench"}}'
    FROM generate_series(1, {rows}) i;
ANALYZE;
"""
_RETIRE = (
    "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced',"
    " retired_at = now()"
)
_REACTIVATE = (
    "UPDATE sandbox_k8s_executions SET active = true, execution_state = 'active',"
    " retired_at = NULL WHERE NOT active"
)
SHIPPED = "0003"
LARGE_SANDBOXES = 200_000


def _variant(path: Path) -> str:
    """The variant name of a trigger file: its name, an SQL identifier's characters only."""
    return re.sub(r"[^a-z0-9_]", "_", path.name.removesuffix(".sql").lower())


async def _explained(conn: asyncpg.Connection, sql: str, trigger: str) -> tuple[float, float]:
    """(execution ms, ``trigger``'s ms) of one run of ``sql``: the time of all of its calls (a
    row-level trigger's, one a row its WHEN let through; a statement-level one's, one)."""
    (out,) = json.loads(await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}"))
    fired = [t for t in out.get("Triggers", []) if t["Trigger Name"] == trigger]
    if len(fired) != 1 or fired[0]["Calls"] < 1:
        raise RuntimeError(f"{trigger} did not fire: {out.get('Triggers')}")
    return float(out["Execution Time"]), float(fired[0]["Time"])


def _summary(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    ratios = [total / (total - trigger) for total, trigger in pairs]
    return {
        "statements": len(pairs),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "total_ms_median": statistics.median(t for t, _ in pairs),
        "trigger_ms_median": statistics.median(g for _, g in pairs),
    }


async def _one_server(
    url: str,
    *,
    rows: int,
    sandboxes: int,
    rounds: int,
    one_row_runs: int,
    others: dict[str, str],
) -> dict[str, Any]:
    conn = await asyncpg.connect(url)
    listen = await asyncpg.connect(url)
    try:
        await listen.add_listener(DEFAULT_CHANNEL, lambda *_: None)
        await conn.execute(FOREIGN_SCHEMA)
        await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False)
        triggers = {SHIPPED: "retired_pod_gc_executions_updated"}
        for name, sql in others.items():
            await conn.execute(sql.replace("retired_pod_gc_", f"b7_{name}_"))
            triggers[name] = f"b7_{name}_executions_updated"
        variants = list(triggers)
        await conn.execute(_SEED.format(rows=rows, sandboxes=max(rows, sandboxes)))
        server = {
            "version": await conn.fetchval("SHOW server_version"),
            "jit": await conn.fetchval("SHOW jit"),
            "jit_available": await conn.fetchval("SELECT pg_jit_available()"),
        }
        statement: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        one_row: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for round_ in range(rounds + 1):  # round 0 untimed: the trigger's queries get planned
            for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
                trigger = triggers[variant]
                await conn.execute("ALTER TABLE sandbox_k8s_executions DISABLE TRIGGER USER")
                await conn.execute(f"ALTER TABLE sandbox_k8s_executions ENABLE TRIGGER {trigger}")
                await conn.execute(f"{_RETIRE} WHERE false")  # replans after ALTER TABLE
                for i in range(1, one_row_runs + 1):
                    pair = await _explained(
                        conn, f"{_RETIRE} WHERE pod_name = 'space-sbx-w{i}-g1'", trigger
                    )
                    if round_:
                        one_row[variant].append(pair)
                await conn.execute(_REACTIVATE)
                await conn.execute("VACUUM sandbox_k8s_executions")
                pair = await _explained(conn, f"{_RETIRE} WHERE active", trigger)
                if round_:
                    statement[variant].append(pair)
                await conn.execute(_REACTIVATE)
                await conn.execute("VACUUM sandbox_k8s_executions")
    finally:
        await listen.close()
        await conn.close()
    return {
        "server": server,
        "variants": {
            v: {"statement": _summary(statement[v]), "one_row": _summary(one_row[v])}
            for v in variants
        },
    }


async def b7_share(
    *,
    rows: int = 10_000,
    sandboxes: Sequence[int] = (),
    rounds: int = 21,
    one_row_runs: int = 20,
    others: Sequence[Path] = (),
) -> dict[str, Any]:
    """Each server of :data:`SERVERS` in turn, and on it each size of ``sandboxes`` (default
    ``rows`` and 200,000): ``rounds`` statements of ``rows`` rows and ``rounds * one_row_runs``
    one-row statements per variant."""
    sizes = list(sandboxes) or [rows, LARGE_SANDBOXES]
    other_sql = {_variant(p): p.read_text() for p in others}
    out: dict[str, Any] = {
        "rows": rows,
        "rounds": rounds,
        "sandboxes": sizes,
        "others": {_variant(p): str(p) for p in others},
        "servers": {},
    }
    for name, flavor in SERVERS.items():
        with ThrowawayPostgres(flavor=flavor) as pg:
            cases = {}
            for size in sizes:
                cases[str(size)] = await _one_server(
                    pg.create_database(f"bench_b7_share_{size}"),
                    rows=rows,
                    sandboxes=size,
                    rounds=rounds,
                    one_row_runs=one_row_runs,
                    others=other_sql,
                )
            first = cases[str(sizes[0])]
            out["servers"][name] = {
                "server": first["server"],
                "cases": {size: {"variants": c["variants"]} for size, c in cases.items()},
            }
    out["load_average"] = load_average()
    return out


def cases_of(share: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """A server's result by size of `sandboxes` (a run from before the sizes: its one size,
    ``rows``)."""
    return result.get("cases") or {str(share["rows"]): {"variants": result["variants"]}}


def summary_lines(share: dict[str, Any]) -> Sequence[str]:
    """One progress line per server and variant."""
    lines = []
    for server, result in share["servers"].items():
        for size, case in cases_of(share, result).items():
            for variant, per in case["variants"].items():
                s, o = per["statement"], per["one_row"]
                lines.append(
                    f"B7 share {server} ({result['server']['version']}, jit "
                    f"{result['server']['jit']}) {int(size):,} sandboxes {variant}: "
                    f"{share['rows']} rows {s['ratio_median']:.3f}x "
                    f"[{s['ratio_min']:.3f}-{s['ratio_max']:.3f}] (trigger "
                    f"{s['trigger_ms_median']:.1f} of {s['total_ms_median']:.1f} ms, "
                    f"{s['statements']} statements); one row {o['ratio_median']:.3f}x "
                    f"[{o['ratio_min']:.3f}-{o['ratio_max']:.3f}]"
                )
    return lines
