"""The change-notify trigger's CPU share of a 10,000-row retirement, from ``perf`` samples of the
writer's backend (benchmarks/NOTES.md, "Trigger CPU profiles").

``python -m benchmarks.trigger_cpu [--seconds S] [--sandboxes N] [--floors] [FILE ...]``

Debian's PostgreSQL 15 only: its binary keeps frame pointers and symbols, so each sample's call
stack says whether the trigger was running. Each text (the shipped 0003, each FILE: another text
of the trigger file, the floors with ``--floors``) gets a throwaway server of its own, B7's
schema and rows (benchmarks/share.py) and ``sandboxes`` sandboxes, then the retirement over and
over for ``seconds`` under ``perf record``, the rows put back between runs by a statement that
fires no trigger (``session_replication_role = replica``, inside a ``DO`` block, whose samples
are told apart by ``plpgsql_inline_handler``) and the table vacuumed. Prints, per text, the
samples a statement under the retirement's executor and under ``plpgsql_exec_trigger``, and the
CPU ratio: the first over the first less the second.

The floors are benchmark-only UPDATE trigger functions that stop early: both transition tables
read; their rows matched by ``id`` (hash join); and the changes grouped (``array_agg``). The
planner settings are the shipped text's (JIT, merge joins and sorts off).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

from benchmarks.share import _REACTIVATE, _RETIRE, _SEED, FOREIGN_SCHEMA
from devtools.pg.throwaway import Flavor, ThrowawayPostgres
from service.pg.migrate import DEFAULT_CHANNEL, migrate

_CHANGED = """
    SELECT CASE WHEN o.id IS NULL THEN 'insert' WHEN n.id IS NULL THEN 'delete'
                ELSE 'update' END AS op,
           CASE WHEN n.id IS NULL THEN o.sandbox_id ELSE n.sandbox_id END AS sandbox_id,
           CASE WHEN n.id IS NULL THEN o.pod_name ELSE n.pod_name END AS pod_name,
           CASE WHEN n.id IS NULL THEN o.active ELSE n.active END AS active,
           CASE WHEN n.id IS NULL THEN o.execution_state ELSE n.execution_state END AS state
    FROM old_rows AS o FULL JOIN new_rows AS n ON n.id = o.id
    WHERE o.id IS NULL OR n.id IS NULL OR o.active IS DISTINCT FROM n.active
       OR o.execution_state IS DISTINCT FROM n.execution_state
    OFFSET 0
"""
FLOORS = {
    "floor-read": "SELECT (SELECT count(*) FROM old_rows) + (SELECT count(*) FROM new_rows)",
    "floor-matched": f"SELECT count(*) FROM ({_CHANGED}) AS u",
    "floor-grouped": "SELECT sum(cardinality(g.names)) FROM ("
    " SELECT array_agg(u.pod_name) AS names"
    f" FROM ({_CHANGED}) AS u GROUP BY u.op, u.active, u.state) AS g",
}
_FLOOR_FUNCTION = """
CREATE OR REPLACE FUNCTION b7_cpu_floor() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    n bigint;
BEGIN
    PERFORM set_config('jit', 'off', true), set_config('enable_mergejoin', 'off', true),
            set_config('enable_sort', 'off', true);
    {query} INTO n;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER b7_cpu_floor AFTER UPDATE ON sandbox_k8s_executions
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION b7_cpu_floor();
"""
_ROWS = 10_000


async def _profile(url: str, text: str, *, sandboxes: int, seconds: float, out: Path) -> int:
    """Install ``text`` as the only UPDATE trigger, then retire the rows for ``seconds`` under
    ``perf record``; the number of retirements."""
    conn = await asyncpg.connect(url)
    listen = await asyncpg.connect(url)
    try:
        await listen.add_listener(DEFAULT_CHANNEL, lambda *_: None)
        await conn.execute(FOREIGN_SCHEMA)
        await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=False)
        await conn.execute(_SEED.format(rows=_ROWS, sandboxes=max(_ROWS, sandboxes)))
        if text:
            await conn.execute(text)
        await conn.execute("ALTER TABLE sandbox_k8s_executions DISABLE TRIGGER USER")
        trigger = "b7_cpu_floor" if "b7_cpu_floor" in text else "retired_pod_gc_executions_updated"
        await conn.execute(f"ALTER TABLE sandbox_k8s_executions ENABLE TRIGGER {trigger}")
        put_back = f"DO $$BEGIN SET LOCAL session_replication_role = replica; {_REACTIVATE}; END$$"
        await conn.execute(f"{_RETIRE} WHERE active")
        await conn.execute(put_back)
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        perf = subprocess.Popen(
            ["perf", "record", "-F", "2000", "-g", "-p", str(pid), "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await asyncio.sleep(0.5)
        runs = 0
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            await conn.execute(f"{_RETIRE} WHERE active")
            await conn.execute(put_back)
            await conn.execute("VACUUM sandbox_k8s_executions")
            runs += 1
        perf.send_signal(2)
        perf.wait()
        return runs
    finally:
        await listen.close()
        await conn.close()


def _samples(data: Path) -> tuple[int, int]:
    """(samples under the retirement's executor, those also under the trigger)."""
    stacks = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "ip,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n\n")
    statement = trigger = 0
    for stack in stacks:
        if "plpgsql_inline_handler" in stack:
            continue
        if "standard_ExecutorRun" in stack or "standard_ExecutorFinish" in stack:
            statement += 1
            trigger += "plpgsql_exec_trigger" in stack
    return statement, trigger


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trigger_cpu", description=__doc__)
    p.add_argument("files", nargs="*", type=Path, help="other texts of the trigger file")
    p.add_argument("--seconds", type=float, default=15.0, help="profiled time a text")
    p.add_argument("--sandboxes", type=int, default=_ROWS, help="rows of sandboxes")
    p.add_argument("--floors", action="store_true", help="also the floors")
    args = p.parse_args()
    if shutil.which("perf") is None:
        sys.exit("benchmarks.trigger_cpu: needs perf (Debian: apt-get install linux-perf)")
    texts = {"0003": ""} | {f.name: f.read_text() for f in args.files}
    if args.floors:
        texts |= {n: _FLOOR_FUNCTION.format(query=q) for n, q in FLOORS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in texts.items():
            data = Path(tmp) / "perf.data"
            with ThrowawayPostgres(flavor=Flavor.DEBIAN) as pg:
                runs = asyncio.run(
                    _profile(
                        pg.create_database("bench_trigger_cpu"),
                        text,
                        sandboxes=args.sandboxes,
                        seconds=args.seconds,
                        out=data,
                    )
                )
            statement, trigger = _samples(data)
            print(
                f"{name}: {args.sandboxes:,} sandboxes, {runs} statements, samples a statement"
                f" {statement / runs:.1f}, trigger {trigger / runs:.1f}, CPU ratio"
                f" {statement / (statement - trigger):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
