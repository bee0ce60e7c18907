"""B7: what the change-notify trigger costs the *writer* — the same statements with no trigger,
with trigger 0002 (one NOTIFY per row) and with trigger 0003 (statement level, batches).

All three trigger sets live on one table in one database; a variant is measured with only its
own triggers enabled (``ALTER TABLE ... ENABLE/DISABLE TRIGGER``), and the variants take turns,
round after round, so that a change of machine load hits each of them alike. One connection
LISTENs on the channel throughout (the notifications are really queued and delivered) and
counts what each statement sends.

Timed: the writer's whole transaction, ``BEGIN; <statement(s)>; COMMIT`` in one round trip
(NOTIFYs are queued at COMMIT, so it belongs to the cost). Beside the wall time, the CPU time of
the writer's server process for the same transaction (``/proc/<pid>/schedstat``, nanoseconds;
the server runs on this machine): the trigger runs in that process, and its CPU time is far
less disturbed by other load on the machine than the wall time. Between two timed runs the rows are
put back and the table vacuumed (untimed), so every variant meets the same table; each round
takes the variants in another order. Statements:

* ``one_row``: retire one row (``UPDATE ... WHERE pod_name = $1``), median of many;
* ``statement_10k``: retire every row in one ``UPDATE`` (10,000 by default);
* ``single_row_statements_10k``: the same rows retired by one ``UPDATE`` each, in one
  transaction.

Beside the three, two floors of 0003's UPDATE trigger (benchmark-only triggers, not shipped):
``capture`` is a statement-level UPDATE trigger with both transition tables whose function does
nothing (what PostgreSQL pays to keep the old and new rows for it), and ``compare`` runs 0003's
row selection and nothing else: old and new rows joined by ``id``, the rows whose ``active`` or
``execution_state`` changed, counted (no JSON, no NOTIFY). What 0003 costs above ``compare`` is
its payloads; ``compare`` itself is what any statement-level trigger that reports exactly the
changed rows must pay.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import asyncpg

from benchmarks.harness import load_average
from service.pg.migrate import DEFAULT_CHANNEL, migrate, read_sql

VARIANTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "0002": ("retired_pod_gc_execution_inserted_deleted", "retired_pod_gc_execution_updated"),
    "0003": (
        "retired_pod_gc_executions_inserted",
        "retired_pod_gc_executions_updated",
        "retired_pod_gc_executions_deleted",
    ),
    "capture": ("b7_floor_capture",),
    "compare": ("b7_floor_compare",),
}
_FLOORS = """
CREATE FUNCTION b7_floor_capture() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END $$;
CREATE TRIGGER b7_floor_capture AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION b7_floor_capture();
CREATE FUNCTION b7_floor_compare() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM count(coalesce(n.pod_name, o.pod_name))
    FROM old_rows AS o
    FULL JOIN new_rows AS n ON n.id = o.id
    WHERE o.id IS NULL OR n.id IS NULL
       OR o.active IS DISTINCT FROM n.active
       OR o.execution_state IS DISTINCT FROM n.execution_state;
    RETURN NULL;
END $$;
CREATE TRIGGER b7_floor_compare AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION b7_floor_compare();
"""
_RETIRE = (
    "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced', "
    "retired_at = now()"
)
_REACTIVATE = (
    "UPDATE sandbox_k8s_executions SET active = true, execution_state = 'active',"
    " retired_at = NULL WHERE NOT active"
)


async def _prepare(conn: asyncpg.Connection, rows: int) -> list[str]:
    await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)  # schema and 0003
    # 0002 beside it (its own function and trigger names; 0003's file would drop them).
    await conn.execute(read_sql("0002_notify_trigger"))
    await conn.execute(_FLOORS)
    await conn.execute(
        "INSERT INTO sandboxes SELECT 'w' || i, 'sandboxes', 'kubernetes'"
        " FROM generate_series(1, $1) i",
        rows,
    )
    await conn.execute(
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active)"
        " SELECT 'w' || i, 1, 0, 'space-sbx-w' || i || '-g1', 'create', 'active', true"
        " FROM generate_series(1, $1) i",
        rows,
    )
    await conn.execute("ANALYZE")
    return [f"space-sbx-w{i}-g1" for i in range(1, rows + 1)]


async def _use(conn: asyncpg.Connection, variant: str) -> None:
    await conn.execute("ALTER TABLE sandbox_k8s_executions DISABLE TRIGGER USER")
    for trigger in VARIANTS[variant]:
        await conn.execute(f"ALTER TABLE sandbox_k8s_executions ENABLE TRIGGER {trigger}")
    # The first statement after ALTER TABLE replans (relcache invalidation): not timed.
    await conn.execute(f"{_RETIRE} WHERE false")


class _Notifications:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.count = 0
        self.max_bytes = 0

    def on(self, _c: object, _pid: int, _channel: str, payload: str) -> None:
        self.count += 1
        self.max_bytes = max(self.max_bytes, len(payload.encode()))

    async def drain(self) -> None:
        """Every notification committed so far has arrived (the server sends what it queued
        for this connection before it answers a query on it)."""
        await self.conn.fetchval("SELECT 1")


def _backend_cpu_s(pid: int) -> float:
    """CPU seconds the server process ``pid`` has run (0.0 where /proc does not show it)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


async def _timed(conn: asyncpg.Connection, sql: str, pid: int) -> tuple[float, float]:
    """Wall seconds and the writer's server CPU seconds of ``BEGIN; sql; COMMIT``."""
    # Every timed run starts from the same table: the dead row versions of the runs before it
    # (each run and its undo rewrite every row) would otherwise slow the later variants down.
    await conn.execute("VACUUM sandbox_k8s_executions")
    cpu = _backend_cpu_s(pid)
    started = time.perf_counter()
    await conn.execute(f"BEGIN; {sql}; COMMIT")
    return time.perf_counter() - started, _backend_cpu_s(pid) - cpu


async def b7_writer(
    db_url: str, *, rows: int = 10_000, rounds: int = 5, one_row_runs: int = 400
) -> dict[str, Any]:
    """Each variant takes ``rounds`` turns; per turn ``one_row_runs`` one-row transactions
    (at most ``rows``), one ``rows``-row statement and one transaction of ``rows`` single-row
    statements."""
    one_row_runs = min(one_row_runs, rows)
    conn = await asyncpg.connect(db_url)
    listen = await asyncpg.connect(db_url)
    note = _Notifications(listen)
    try:
        names = await _prepare(conn, rows)
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        cpu: dict[str, dict[str, list[float]]] = {
            v: {"statement_10k": [], "single_row_statements_10k": []} for v in VARIANTS
        }
        await listen.add_listener(DEFAULT_CHANNEL, note.on)
        samples: dict[str, dict[str, list[float]]] = {
            v: {"one_row": [], "statement_10k": [], "single_row_statements_10k": []}
            for v in VARIANTS
        }
        notifies: dict[str, dict[str, int]] = {v: {} for v in VARIANTS}
        max_bytes: dict[str, int] = dict.fromkeys(VARIANTS, 0)
        singles = "; ".join(f"{_RETIRE} WHERE pod_name = '{n}'" for n in names)
        order = list(VARIANTS)
        for round_ in range(rounds):
            # Each round in another order, so that no variant always runs first or last.
            for variant in order[round_ % len(order) :] + order[: round_ % len(order)]:
                await _use(conn, variant)
                s, counts = samples[variant], notifies[variant]
                await note.drain()
                note.count = 0
                # A different row each time; all put back afterwards (no VACUUM in between: one
                # row's dead version hardly matters).
                for name in names[:one_row_runs]:
                    started = time.perf_counter()
                    await conn.execute(f"BEGIN; {_RETIRE} WHERE pod_name = '{name}'; COMMIT")
                    s["one_row"].append(time.perf_counter() - started)
                await note.drain()
                counts["one_row"] = note.count // one_row_runs
                await conn.execute(_REACTIVATE)
                await note.drain()
                note.count = 0
                wall, used = await _timed(conn, f"{_RETIRE} WHERE active", pid)
                s["statement_10k"].append(wall)
                cpu[variant]["statement_10k"].append(used)
                await note.drain()
                counts["statement_10k"] = note.count
                await conn.execute(_REACTIVATE)
                await note.drain()
                note.count = 0
                wall, used = await _timed(conn, singles, pid)
                s["single_row_statements_10k"].append(wall)
                cpu[variant]["single_row_statements_10k"].append(used)
                await note.drain()
                counts["single_row_statements_10k"] = note.count
                await conn.execute(_REACTIVATE)
                await note.drain()
                max_bytes[variant] = max(max_bytes[variant], note.max_bytes)
                note.max_bytes = 0
    finally:
        await listen.close()
        await conn.close()
    out: dict[str, Any] = {
        "rows": rows,
        "rounds": rounds,
        "one_row_runs": rounds * one_row_runs,
        "variants": {},
        "load_average": load_average(),
    }
    base = {k: statistics.median(v) for k, v in samples["none"].items()}
    base_cpu = {k: statistics.median(v) for k, v in cpu["none"].items()}
    for variant, per in samples.items():
        out["variants"][variant] = {
            kind: {
                "median_ms": statistics.median(values) * 1000,
                "min_ms": min(values) * 1000,
                "max_ms": max(values) * 1000,
                "ratio_to_none": statistics.median(values) / base[kind],
                "notifies": notifies[variant].get(kind, 0),
                "samples": len(values),
            }
            for kind, values in per.items()
        }
        for kind, values in cpu[variant].items():
            median = statistics.median(values)
            entry = out["variants"][variant][kind]
            entry["server_cpu_ms"] = median * 1000
            entry["server_cpu_ratio_to_none"] = (
                median / base_cpu[kind] if base_cpu[kind] > 0 else float("nan")
            )
            entry["paired_ratio_to_none"] = _paired(per[kind], samples["none"][kind])
            entry["paired_server_cpu_ratio_to_none"] = _paired(values, cpu["none"][kind])
        out["variants"][variant]["max_payload_bytes"] = max_bytes[variant]
    return out


def _paired(values: Sequence[float], none: Sequence[float]) -> dict[str, float]:
    """The variant's time over no trigger's *in the same round* (the two a few seconds apart),
    round by round: median, lowest and highest of those ratios. A machine whose speed drifts
    from minute to minute moves both times of a round together, which the ratio of the two
    medians (``ratio_to_none``) does not cancel."""
    ratios = [v / n for v, n in zip(values, none, strict=True) if n > 0]
    if not ratios:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def summary_lines(b7: dict[str, Any]) -> Sequence[str]:
    """One progress line per variant."""
    lines = []
    for variant, per in b7["variants"].items():
        lines.append(
            f"B7 {variant:>7}: one row {per['one_row']['median_ms']:.3f} ms "
            f"({per['one_row']['ratio_to_none']:.2f}x); {b7['rows']} rows in one statement "
            f"{per['statement_10k']['median_ms']:.1f} ms "
            f"({per['statement_10k']['ratio_to_none']:.2f}x, "
            f"{per['statement_10k']['notifies']} NOTIFYs; server CPU "
            f"{per['statement_10k'].get('server_cpu_ms', float('nan')):.1f} ms, "
            f"{per['statement_10k'].get('server_cpu_ratio_to_none', float('nan')):.2f}x; "
            f"paired by round {_paired_text(per['statement_10k'])}); "
            f"{b7['rows']} one-row statements "
            f"{per['single_row_statements_10k']['median_ms']:.0f} ms "
            f"({per['single_row_statements_10k']['ratio_to_none']:.2f}x, "
            f"{per['single_row_statements_10k']['notifies']} NOTIFYs)"
        )
    return lines


def _paired_text(entry: dict[str, Any]) -> str:
    """An entry's ratios paired by round, as text."""
    paired, cpu = entry["paired_ratio_to_none"], entry["paired_server_cpu_ratio_to_none"]
    return (
        f"{paired['median']:.2f}x [{paired['min']:.2f}-{paired['max']:.2f}], "
        f"server CPU {cpu['median']:.2f}x [{cpu['min']:.2f}-{cpu['max']:.2f}]"
    )
