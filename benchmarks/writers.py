"""B13: what the change-notify trigger costs the platform's writers when many write at once:
``python -m benchmarks.writers`` (``make bench-writers``).

B7 times one writer; the platform's API store writes from many connections at once, and there
the cost that matters is not the trigger's CPU alone: a transaction that sent a NOTIFY takes a
database-wide lock at commit and holds it through its commit's WAL flush, so such transactions
commit one at a time. So: Debian's PostgreSQL 15 with its defaults (``fsync``,
``synchronous_commit`` and ``full_page_writes`` on, JIT on), ``pgbench`` (from the same package)
as the writers, one listener connected throughout (the notifications are really queued and
delivered), and the throughput of each trigger variant beside the others.

Mixes (pgbench scripts, prepared statements, one transaction each):

* ``common``: the platform's common writes: 80 % one-row state changes of active executions,
  20 % inserts of new active executions. None of them can start or stop a clock.
* ``retire``: every write retires or re-activates one execution (``active = NOT active``): each
  one must be sent. The NOTIFY ceiling; the ``floor-notify`` variant beside it (a statement
  trigger that sends one constant NOTIFY and reads nothing) is the least any notifying trigger
  costs. Beside ``common``, ``floor-row-when``: row-level triggers with the shipped WHENs whose
  function does nothing, the least a trigger that filters rows costs.

Variants: ``none`` (no trigger), ``shipped`` (``migrate``'s rendering of the trigger step),
each mix's floor (:data:`FLOORS`), and each ``--trigger FILE`` (another whole trigger file,
e.g. an earlier text of the step, applied as it is). Before each run every trigger of the table is
dropped, the variant installed, the rows the previous run inserted removed (with triggers off),
the table vacuumed and a checkpoint taken; variants take turns in each round, in alternating
order, and the medians of the rounds are reported with the ratio to ``none``. Results in
``benchmarks/results/<name>.json``; benchmarks/RESULTS.md, B13.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg

from benchmarks.harness import load_average, machine
from devtools.pg.throwaway import Flavor, ThrowawayPostgres, find_bin_dir
from service.pg.migrate import DEFAULT_CHANNEL, migrate, render_trigger_sql

EXECUTIONS = 10_000
"""Active executions the ``common`` mix changes (ids 1..N), and as many more that the
``retire`` mix flips (ids N+1..2N)."""

_SETTINGS = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
"""Debian's defaults, which the throwaway server turns off for the tests' speed."""

_SCRIPTS = {
    "common_update.sql": (
        f"\\set id random(1, {EXECUTIONS})\n"
        "UPDATE sandbox_k8s_executions SET execution_state = CASE WHEN execution_state ="
        " 'running' THEN 'starting' ELSE 'running' END WHERE id = :id;\n"
    ),
    "common_insert.sql": (
        f"\\set s random(1, {EXECUTIONS})\n"
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active) VALUES ('w' || :s, 2, 0,"
        " 'space-sbx-new-' || gen_random_uuid(), 'create', 'starting', true);\n"
    ),
    "retire.sql": (
        f"\\set id random({EXECUTIONS + 1}, {2 * EXECUTIONS})\n"
        "UPDATE sandbox_k8s_executions SET active = NOT active, execution_state = CASE WHEN"
        " active THEN 'suspended' ELSE 'running' END, retired_at = CASE WHEN active THEN now()"
        " END WHERE id = :id;\n"
    ),
}
MIXES = {
    "common": ["common_update.sql@8", "common_insert.sql@2"],
    "retire": ["retire.sql"],
}

FLOOR_NOTIFY = f"""
CREATE OR REPLACE FUNCTION b13_floor_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('{DEFAULT_CHANNEL}', 'x');
    RETURN NULL;
END
$fn$;
CREATE TRIGGER b13_floor_notify AFTER UPDATE ON sandbox_k8s_executions
    FOR EACH STATEMENT EXECUTE FUNCTION b13_floor_notify();
"""

FLOOR_ROW_WHEN = """
CREATE OR REPLACE FUNCTION b13_floor_row_when() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RETURN NULL;
END
$fn$;
CREATE TRIGGER b13_floor_row_when_inserted AFTER INSERT ON sandbox_k8s_executions
    FOR EACH ROW WHEN (NEW.active IS NOT TRUE) EXECUTE FUNCTION b13_floor_row_when();
CREATE TRIGGER b13_floor_row_when_updated AFTER UPDATE ON sandbox_k8s_executions
    FOR EACH ROW WHEN (OLD.active IS NOT TRUE OR NEW.active IS NOT TRUE)
    EXECUTE FUNCTION b13_floor_row_when();
"""
FLOORS = {"common": ("floor-row-when", FLOOR_ROW_WHEN), "retire": ("floor-notify", FLOOR_NOTIFY)}
"""Each mix's floor: for ``common``, row-level triggers with the shipped trigger's WHENs and no
transition tables, whose function does nothing (the least a trigger that lets only inactive rows
through costs a write it lets through none of); for ``retire``, one constant NOTIFY a statement."""

_DROP_TRIGGERS = """
DO $$
DECLARE t record;
BEGIN
    FOR t IN SELECT tgname FROM pg_trigger
             WHERE tgrelid = 'sandbox_k8s_executions'::regclass AND NOT tgisinternal LOOP
        EXECUTE format('DROP TRIGGER %I ON sandbox_k8s_executions', t.tgname);
    END LOOP;
END $$;
"""


async def _prepare(conn: asyncpg.Connection) -> None:
    await migrate(conn, channel=DEFAULT_CHANNEL, with_schema=True)
    await conn.execute(_DROP_TRIGGERS)
    await conn.execute(
        "INSERT INTO sandboxes SELECT 'w' || i, 'sandboxes', 'kubernetes'"
        " FROM generate_series(1, $1) i",
        EXECUTIONS,
    )
    await conn.execute(
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active)"
        " SELECT 'w' || (1 + (i - 1) % $1), 1, 0, 'space-sbx-w' || i || '-g1', 'create',"
        " 'running', true FROM generate_series(1, 2 * $1) i",
        EXECUTIONS,
    )


async def _install(conn: asyncpg.Connection, sql: str) -> None:
    """Only ``sql``'s triggers on the table, the rows as seeded, the table vacuumed."""
    await conn.execute(_DROP_TRIGGERS)
    if sql:
        await conn.execute(sql)
    await conn.execute(
        "SET session_replication_role = replica;"
        f" DELETE FROM sandbox_k8s_executions WHERE id > {2 * EXECUTIONS};"
        " RESET session_replication_role"
    )
    await conn.execute("VACUUM ANALYZE sandbox_k8s_executions")
    await conn.execute("CHECKPOINT")


def _pgbench(
    pgbench: Path, *, port: int, scripts: Path, mix: str, writers: int, seconds: int
) -> dict[str, float]:
    files = [arg for script in MIXES[mix] for arg in ("-f", str(scripts / script))]
    cmd = [
        str(pgbench),
        "-n",
        "-M",
        "prepared",
        "-c",
        str(writers),
        "-j",
        str(min(writers, 2)),
        "-T",
        str(seconds),
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-U",
        "postgres",
        "b13",
        *files,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
    latency = re.search(r"latency average = ([\d.]+) ms", out)
    if tps is None or latency is None:
        raise RuntimeError(f"pgbench printed no tps or latency:\n{out}")
    return {"tps": float(tps.group(1)), "latency_ms": float(latency.group(1))}


async def b13(
    *,
    writers: Sequence[int],
    rounds: int,
    seconds: int,
    mixes: Sequence[str],
    extra: dict[str, str],
) -> dict[str, Any]:
    pgbench = find_bin_dir(Flavor.DEBIAN) / "pgbench"
    server = ThrowawayPostgres(flavor=Flavor.DEBIAN, settings=_SETTINGS).start()
    started = time.time()
    load_start = load_average()
    try:
        url = server.create_database("b13")
        conn = await asyncpg.connect(url)
        listener = await asyncpg.connect(url)
        sent = [0]
        await listener.add_listener(DEFAULT_CHANNEL, lambda *_: sent.__setitem__(0, sent[0] + 1))
        await _prepare(conn)
        variants = {"none": "", "shipped": render_trigger_sql(DEFAULT_CHANNEL), **extra}
        runs: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory() as tmp:
            scripts = Path(tmp)
            for name, text in _SCRIPTS.items():
                (scripts / name).write_text(text)
            for r in range(rounds):
                for mix in mixes:
                    floor, floor_sql = FLOORS[mix]
                    names = [*variants, floor]
                    for w in writers:
                        for variant in names if r % 2 == 0 else names[::-1]:
                            sql = floor_sql if variant == floor else variants[variant]
                            await _install(conn, sql)
                            await listener.fetchval("SELECT 1")
                            before = sent[0]
                            result = _pgbench(
                                pgbench,
                                port=server.port,
                                scripts=scripts,
                                mix=mix,
                                writers=w,
                                seconds=seconds,
                            )
                            await listener.fetchval("SELECT 1")  # every notification is here
                            run = {
                                "round": r,
                                "mix": mix,
                                "writers": w,
                                "variant": variant,
                                **result,
                                "notifications": sent[0] - before,
                            }
                            runs.append(run)
                            print(json.dumps(run), flush=True)
        await conn.close()
        await listener.close()
        version = await _server_version(url)
    finally:
        server.stop()
    return {
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "config": {"repeats": rounds, "seconds": seconds},
        "B13": {"server": version, "runs": runs, "summary": summarize(runs)},
    }


async def _server_version(url: str) -> str:
    conn = await asyncpg.connect(url)
    try:
        return str(await conn.fetchval("SELECT version()"))
    finally:
        await conn.close()


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median tps and latency of each (mix, writers, variant), and its tps ratio to ``none``'s
    median (how many times slower the writers are)."""
    keys = sorted({(r["mix"], r["writers"], r["variant"]) for r in runs}, key=str)
    med = {
        k: {
            field: statistics.median(
                r[field] for r in runs if (r["mix"], r["writers"], r["variant"]) == k
            )
            for field in ("tps", "latency_ms", "notifications")
        }
        for k in keys
    }
    out = []
    for mix, w, variant in keys:
        m = med[(mix, w, variant)]
        base = med.get((mix, w, "none"))
        out.append(
            {
                "mix": mix,
                "writers": w,
                "variant": variant,
                **m,
                "slower": base["tps"] / m["tps"] if base else None,
            }
        )
    return out


def table(summary: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| mix | writers | variant | tps (median) | latency ms | NOTIFYs a run | slower |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['mix']} | {s['writers']} | `{s['variant']}` | {s['tps']:,.0f} |"
            f" {s['latency_ms']:.2f} | {s['notifications']:,.0f} | **{s['slower']:.2f}x** |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", default="1,8,32", help="pgbench clients, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=int, default=10, help="length of one pgbench run")
    p.add_argument("--mixes", default="common,retire")
    p.add_argument(
        "--trigger",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="another variant: a whole trigger file applied as it is",
    )
    p.add_argument("--name", default="writers", help="benchmarks/results/<name>.json")
    args = p.parse_args(argv)
    command = "python -m benchmarks.writers " + " ".join(argv if argv is not None else sys.argv[1:])
    extra = {}
    for spec in args.trigger:
        name, _, path = spec.partition("=")
        extra[name] = Path(path).read_text()
    result = asyncio.run(
        b13(
            writers=[int(w) for w in args.writers.split(",")],
            rounds=args.rounds,
            seconds=args.seconds,
            mixes=args.mixes.split(","),
            extra=extra,
        )
    )
    result["command"] = command
    out = Path(__file__).parent / "results" / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["B13"]["summary"]))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
