"""The deterministic simulation's command line (``python -m tests.sim``; ``make sim``).

    python -m tests.sim --seeds N [--start S] [--jobs J]   sweep N seeds
    python -m tests.sim --seed K [--steps i,j,...]          replay one, with its trace
    python -m tests.sim --removals [--seeds N] [--only ...] the mutation check on the simulator

A sweep prints each failure (the seed, the shortest failing schedule it could shrink to, the
violation and the trace around it) and a closing line ``N seeds, F failed, ..., S seeds/min``.
Exit status 1 when a seed failed (or, for ``--removals``, when a removal went unnoticed).
The process runs with ``PYTHONHASHSEED=0`` (it re-executes itself if needed) so that a seed's
trace hash is the same in every process.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, "-m", "tests.sim", *sys.argv[1:]])

from tests.sim.runner import main

if __name__ == "__main__":
    sys.exit(main())
