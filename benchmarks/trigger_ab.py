"""A/B of change-trigger versions by the writer's server CPU: ``python -m benchmarks.trigger_ab``.

B7 (``benchmarks/writer.py``) times the shipped triggers; this compares *versions* of the UPDATE
trigger side by side, to decide whether a change to the SQL is worth making. One throwaway
server, one database of B7's table (``--rows`` active rows), and beside no trigger, the shipped
0003 and B7's ``compare`` floor:

* each ``FILE`` ending in ``.full.sql``: a whole trigger file (another version of
  ``0003_notify_statement_trigger.sql``: 0003's first form, the ``rows`` payload, is ``git show
  156efb4:service/pg/sql/0003_notify_statement_trigger.sql``), its ``retired_pod_gc_`` names
  prefixed so that it lives beside the shipped one;
* each other ``FILE``: ``CREATE FUNCTION FNAME() RETURNS trigger ...`` (a floor or a variant of
  the UPDATE trigger alone); it gets a statement-level UPDATE trigger with both transition tables.

Each round enables one variant at a time (in turn, rotating), runs 50 one-row retirements, then
retires every row in one ``UPDATE`` and records the writer's server-process CPU for that
transaction (``/proc/<pid>/schedstat``); the rows are put back and the table vacuumed before each
timed run, as in B7. A connection LISTENs throughout and counts what each variant sends.

The trigger's general query is planned once per session, with the transition tables' row count
of its first run. B7 and this script run a statement of no row first (the one-row path), so the
general query is planned for the first 10,000-row statement; ``--prime "id <= 2"`` runs a
two-row statement first instead, so that it is planned for two rows (what a session whose first
statement touches a few rows gets).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path

import asyncpg

from benchmarks.writer import _REACTIVATE, _RETIRE, _backend_cpu_s, _prepare
from devtools.pg.throwaway import ThrowawayPostgres
from service.pg.migrate import DEFAULT_CHANNEL


async def _install(conn: asyncpg.Connection, path: Path) -> tuple[str, str]:
    """(variant name, its UPDATE trigger's name) of one file, installed."""
    name = path.name.removesuffix(".sql").replace("-", "_").replace(".", "_")
    sql = path.read_text()
    if path.name.endswith(".full.sql"):
        await conn.execute(sql.replace("retired_pod_gc_", f"ab_{name}_"))
        return name, f"ab_{name}_executions_updated"
    await conn.execute(sql.replace("FNAME", f"ab_{name}"))
    await conn.execute(
        f"CREATE TRIGGER ab_{name} AFTER UPDATE ON sandbox_k8s_executions"
        " REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows"
        f" FOR EACH STATEMENT EXECUTE FUNCTION ab_{name}()"
    )
    return name, f"ab_{name}"


async def run(url: str, files: list[Path], *, rounds: int, rows: int, prime: str) -> None:
    conn = await asyncpg.connect(url)
    listen = await asyncpg.connect(url)
    await _prepare(conn, rows)  # the schema, the shipped 0003 (and 0002, B7's floors)
    variants: dict[str, list[str]] = {
        "none": [],
        "0003": ["retired_pod_gc_executions_updated"],
        "compare": ["b7_floor_compare"],  # B7's floor: the rows 0003 reports, nothing sent
    }
    for path in files:
        name, trigger = await _install(conn, path)
        variants[name] = [trigger]
    sent = {"n": 0, "bytes": 0, "max": 0}

    def on(_c: object, _pid: int, _ch: str, payload: str) -> None:
        size = len(payload.encode())
        sent.update(n=sent["n"] + 1, bytes=sent["bytes"] + size, max=max(sent["max"], size))

    await listen.add_listener(DEFAULT_CHANNEL, on)
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    one: dict[str, list[float]] = {v: [] for v in variants}
    notified: dict[str, dict[str, int]] = {}
    order = list(variants)
    for r in range(rounds):
        for v in order[r % len(order) :] + order[: r % len(order)]:
            await conn.execute("ALTER TABLE sandbox_k8s_executions DISABLE TRIGGER USER")
            for trigger in variants[v]:
                await conn.execute(f"ALTER TABLE sandbox_k8s_executions ENABLE TRIGGER {trigger}")
            await conn.execute(f"{_RETIRE} WHERE false")
            if prime:
                await conn.execute(f"{_RETIRE} WHERE {prime}")
                await conn.execute(_REACTIVATE)
            used = _backend_cpu_s(pid)
            for i in range(1, 51):
                await conn.execute(f"BEGIN; {_RETIRE} WHERE pod_name = 'space-sbx-w{i}-g1'; COMMIT")
            one[v].append((_backend_cpu_s(pid) - used) / 50)
            await conn.execute(_REACTIVATE)
            await conn.execute("VACUUM sandbox_k8s_executions")
            await listen.fetchval("SELECT 1")
            sent.update(n=0, bytes=0, max=0)
            used = _backend_cpu_s(pid)
            await conn.execute(f"BEGIN; {_RETIRE} WHERE active; COMMIT")
            cpu[v].append(_backend_cpu_s(pid) - used)
            await listen.fetchval("SELECT 1")
            notified[v] = dict(sent)
            await conn.execute(_REACTIVATE)
            await conn.execute("VACUUM sandbox_k8s_executions")
    await listen.close()
    await conn.close()
    base, base_one = statistics.median(cpu["none"]), statistics.median(one["none"])
    print(f"{rows} rows, {rounds} rounds; load average at the end {os.getloadavg()}")
    for v in variants:
        m, q1 = statistics.median(cpu[v]), statistics.quantiles(cpu[v], n=4)[0]
        o = statistics.median(one[v])
        s = notified[v]
        print(
            f"{v:>16}: {rows} rows: median {m * 1000:6.1f} ms ({m / base:.2f}x), q1 "
            f"{q1 * 1000:6.1f}, min {min(cpu[v]) * 1000:6.1f}; one row {o * 1e6:4.0f} us "
            f"({o / base_one:.2f}x); {s['n']} NOTIFYs, {s['bytes']} bytes, largest {s['max']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trigger_ab", description=__doc__)
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--prime", default="", help="WHERE clause of a statement run first")
    args = p.parse_args()
    with ThrowawayPostgres() as pg:
        asyncio.run(run(pg.url, args.files, rounds=args.rounds, rows=args.rows, prime=args.prime))


if __name__ == "__main__":
    main()
