"""The simulator's long runs in ``make test``, started when the session begins and judged by
their tests.

The 20,000-seed slice and the removals' mutation check are CPU work in subprocesses that the
suite would otherwise wait for, idle, near its end. ``tests/sim/conftest.py`` starts the runs of
the collected tests as soon as collection is complete, at the lowest CPU priority (``nice``
19): they take the cycles the rest of the suite leaves idle (its integration tests mostly wait on
sockets and subprocesses) and never those it needs, so the rest runs as it would without them.
The test then waits for its run's end and judges its output exactly as a run started there
would be judged. A test run on its own (or deselected and then asked for) starts its run when it
is reached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SimRun:
    """``python -m tests.sim <args>`` in a subprocess, its output in temporary files (a pipe
    nobody reads while the suite runs would fill and stall it)."""

    args: tuple[str, ...]
    _proc: subprocess.Popen[bytes] | None = None
    _out: IO[bytes] | None = None
    _err: IO[bytes] | None = None

    def start(self, *, nice: int = 0) -> None:
        if self._proc is not None:
            return
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        # Outside the suite's coverage tracing, which would multiply its time.
        env.pop("COVERAGE_PROCESS_START", None)
        # Closed by result() or stop(): they outlive this call, as the run does.
        self._out = tempfile.TemporaryFile()  # noqa: SIM115
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            [
                *(("nice", "-n", str(nice)) if nice else ()),
                *(sys.executable, "-m", "tests.sim"),
                *self.args,
            ],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=self._err,
        )

    def result(self, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Its exit and output, once it has ended (started now if it was not); a run that has
        not ended within ``timeout_s`` is killed and raises ``subprocess.TimeoutExpired``."""
        self.start()
        assert self._proc is not None and self._out is not None and self._err is not None
        try:
            code = self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        outputs = []
        for f in (self._out, self._err):
            f.seek(0)
            outputs.append(f.read().decode(errors="replace"))
            f.close()
        return subprocess.CompletedProcess(self._proc.args, code, outputs[0], outputs[1])

    def stop(self) -> None:
        """Kill the run if it is still going (the session ends without its test)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for f in (self._out, self._err):
            if f is not None:
                f.close()


SLICE = 20_000
RUNS: dict[str, SimRun] = {
    "test_a_slice_of_seeds_passes": SimRun(("--seeds", str(SLICE), "--start", "1", "--jobs", "2")),
    # The removals' mutation check, bounded (see its test).
    "test_every_removed_check_is_caught_within_1000_seeds": SimRun(
        ("--removals", "--no-baseline", "--seeds", "1000")
    ),
}
"""The background runs, by the name of the test that judges each."""
