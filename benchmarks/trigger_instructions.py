"""B13i: the instructions a writer's backend executes with each change-trigger variant, counted
by callgrind: ``python -m benchmarks.trigger_instructions`` (``make bench-trigger-instructions``).

B13 (``benchmarks/writers.py``) measures throughput under concurrent writers, where the machine's
other load moves every figure. This counts instead: a single-user PostgreSQL 15 backend (Debian's
``postgres --single``, no server, no client, no network) runs the same statements under
``valgrind --tool=callgrind``, and the count of instructions it executed is the same from one run
to the next whatever else the machine does. It counts the backend's own work (the trigger's
function, its queries, the parsing of a WHEN, the NOTIFY queue), not the kernel's, nor the lock
waits of concurrent commits (that is B13's).

For each variant: a fresh copy of one seeded data directory (the dev schema, 10,000 sandboxes
and active executions), the variant installed (``none``: no trigger; ``shipped``: ``migrate``'s
rendering of the trigger step; each ``NAME=FILE``: another file applied as it is), then one
session per workload on a copy of that directory, each after the same warm-up of 100 common
writes; a workload's count is the session's count less the warm-up session's:

* ``common``: 1,000 of the platform's common writes, one transaction each (4 one-row state
  changes of an active execution to 1 insert of an active execution): per transaction;
* ``retire``: 1,000 one-row transactions each retiring or re-activating an execution: per
  transaction;
* ``mass``: one UPDATE retiring all 10,000 executions.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import load_average, machine
from devtools.pg.throwaway import Flavor, find_bin_dir
from service.pg.migrate import DEFAULT_CHANNEL, read_sql, render_trigger_sql

EXECUTIONS = 10_000
WARM_UP = 100
MEASURED = 1_000
_USER = "postgres"
"""The server runs as this user (``postgres`` refuses root): Debian's package creates it."""


def _run(cmd: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", _USER, "--", *cmd], input=stdin, capture_output=True, text=True
    )


def _single(bin_dir: Path, data: Path, sql: str, *, join_lines: bool) -> None:
    """Run ``sql`` in a single-user backend; ``join_lines``: statements end at ``;`` and a blank
    line (``-j``), else at each newline."""
    flags = ["-j"] if join_lines else []
    done = _run([str(bin_dir / "postgres"), "--single", *flags, "-D", str(data), _USER], sql)
    if done.returncode != 0 or "ERROR" in done.stderr:
        raise RuntimeError(f"single-user backend failed:\n{done.stderr[-3000:]}")


def _counted(bin_dir: Path, data: Path, lines: list[str], out: Path) -> int:
    """Instructions of a single-user backend running ``lines`` (one statement each)."""
    cmd = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        str(bin_dir / "postgres"),
        "--single",
        "-D",
        str(data),
        _USER,
    ]
    done = _run(cmd, "\n".join(lines) + "\n")
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None or "ERROR" in done.stderr:
        raise RuntimeError(f"callgrind run failed:\n{done.stderr[-3000:]}")
    return int(found.group(1))


def _workloads() -> dict[str, list[str]]:
    rng = random.Random(13)
    update = (
        "UPDATE sandbox_k8s_executions SET execution_state = CASE WHEN execution_state ="
        " 'running' THEN 'starting' ELSE 'running' END WHERE id = {};"
    )
    insert = (
        "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
        " pod_name, pod_kind, execution_state, active) VALUES ('w{}', 2, 0,"
        " 'space-sbx-new-{}', 'create', 'starting', true);"
    )
    common = [
        insert.format(rng.randint(1, EXECUTIONS), i)
        if i % 5 == 0
        else update.format(rng.randint(1, EXECUTIONS))
        for i in range(WARM_UP + MEASURED)
    ]
    retire = [
        "UPDATE sandbox_k8s_executions SET active = NOT active, execution_state = CASE WHEN"
        " active THEN 'suspended' ELSE 'running' END, retired_at = CASE WHEN active THEN now()"
        f" END WHERE id = {rng.randint(1, EXECUTIONS)};"
        for _ in range(MEASURED)
    ]
    mass = [
        "UPDATE sandbox_k8s_executions SET active = false, execution_state = 'replaced',"
        " retired_at = now();"
    ]
    warm = common[:WARM_UP]
    return {
        "warm_up": warm,
        "common": warm + common[WARM_UP:],
        "retire": warm + retire,
        "mass": warm + mass,
    }


def count(variants: dict[str, str]) -> dict[str, dict[str, float]]:
    bin_dir = find_bin_dir(Flavor.DEBIAN)
    workloads = _workloads()
    root = Path(tempfile.mkdtemp(prefix="retired-pod-gc-b13i-"))
    try:
        shutil.chown(root, _USER)
        template = root / "template"
        initdb = [str(bin_dir / "initdb"), "-D", str(template), "-U", _USER, "-A", "trust"]
        done = _run([*initdb, "-E", "UTF8", "--locale=C", "--no-sync"], "")
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        seed = read_sql("0001_dev_schema") + (
            f"\nINSERT INTO sandboxes SELECT 'w' || i, 'sandboxes', 'kubernetes'"
            f" FROM generate_series(1, {EXECUTIONS}) i;\n"
            "INSERT INTO sandbox_k8s_executions (sandbox_id, generation, activation_attempt,"
            " pod_name, pod_kind, execution_state, active) SELECT 'w' || i, 1, 0,"
            " 'space-sbx-w' || i || '-g1', 'create', 'running', true"
            f" FROM generate_series(1, {EXECUTIONS}) i;\n"
        )
        _single(bin_dir, template, seed + "\n\n", join_lines=True)
        results: dict[str, dict[str, float]] = {}
        for name, sql in variants.items():
            data = root / name
            _run(["cp", "-a", str(template), str(data)], "")
            if sql:
                _single(bin_dir, data, sql + "\n\n", join_lines=True)
            counts = {}
            for w, lines in workloads.items():
                # Each session on a copy of the variant's data: every one starts from the same
                # rows (a session's writes are committed).
                session = root / f"{name}.{w}"
                _run(["cp", "-a", str(data), str(session)], "")
                counts[w] = _counted(bin_dir, session, lines, root / f"{name}.{w}.out")
            base = counts["warm_up"]
            results[name] = {
                "common_per_tx": (counts["common"] - base) / MEASURED,
                "retire_per_tx": (counts["retire"] - base) / MEASURED,
                "mass": float(counts["mass"] - base),
            }
            print(name, json.dumps(results[name]), flush=True)
        return results
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def table(results: dict[str, dict[str, float]]) -> str:
    base = results["none"]
    lines = [
        "| variant | common write, instructions | retire one, instructions |"
        " 10,000-row retirement, instructions |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        cells = [
            f"{r[k]:,.0f} ({r[k] / base[k]:.3f}x)"
            for k in ("common_per_tx", "retire_per_tx", "mass")
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", metavar="NAME=FILE", help="more variants")
    p.add_argument("--name", default="trigger-instructions")
    args = p.parse_args(argv)
    variants = {"none": "", "shipped": render_trigger_sql(DEFAULT_CHANNEL)}
    for spec in args.variants:
        name, _, path = spec.partition("=")
        variants[name] = Path(path).read_text()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = load_average()
    results = count(variants)
    out: dict[str, Any] = {
        "machine": machine(),
        "started": started,
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "config": {"repeats": 1},
        "command": "python -m benchmarks.trigger_instructions "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "B13i": {"server": "Debian PostgreSQL 15 (postgres --single)", "results": results},
    }
    path = Path(__file__).parent / "results" / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(table(results))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
