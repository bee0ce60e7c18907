"""Run a command several times while an unrelated process keeps one CPU core busy.

``make test-under-load RUNS=10`` (the whole ``make test``) or ``make test-under-load RUNS=30
LOAD_CMD='.venv/bin/pytest tests/chaos/test_campaign.py -q'``. The busy process is a plain spin
loop in its own process group; it is killed when the runs end, fail, time out or are interrupted.
Each run is bounded (``--timeout``). Prints one line per run and a closing count; exits non-zero
when any run failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

SPIN = "while True: pass"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--busy", type=int, default=1, help="busy cores (spin processes)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True)
        for _ in range(args.busy)
    ]
    failed = 0
    started = time.monotonic()
    try:
        for n in range(1, args.runs + 1):
            t0 = time.monotonic()
            try:
                rc = subprocess.run(command, timeout=args.timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = -1
            failed += rc != 0
            print(
                f"under load: run {n}/{args.runs} exit {rc} in {time.monotonic() - t0:.0f}s",
                flush=True,
            )
    finally:
        for p in spinners:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    print(
        f"under load ({args.busy} busy core(s)): {args.runs - failed} passed, {failed} failed "
        f"in {time.monotonic() - started:.0f}s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
