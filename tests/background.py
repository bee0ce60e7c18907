"""Real-time scenarios run beside the suite: a test marked ``background`` is run by a pytest of
its own, started as soon as the session's collection is complete, and judged at the session's
end by a stand-in item that waits for that run and fails with its output unless it passed.

Such a scenario spends a minute or more waiting for a bound of the product to pass (a watch's
silence bound, an alert's `for:`) while its CPU stays mostly idle; run in line, the suite would
wait with it. The run is the test exactly as written (its fixtures, its assertions, its own
timeout) in a child process, which ``CHILD_ENV`` tells not to do this again; it shares the
machine with the rest of the suite, so it is judged on a busy machine, as every test must pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD_ENV = "RETIRED_POD_GC_BACKGROUND_CHILD"
WAIT_S = 600.0
"""How long the stand-in waits for the run past the point it is reached (the run's own test has
its own timeout, well below)."""


class BackgroundRun:
    """``python -m pytest <nodeid>`` in a child process, its output in a temporary file."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.stand_in_nodeid = ""
        """The node id of the item that judges this run (set when it is made)."""
        self._out: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, CHILD_ENV: "1"}
        env.pop("COVERAGE_PROCESS_START", None)
        # Closed in result() or stop(): it outlives this call, as the run does.
        self._out = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", self.nodeid],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def result(self) -> tuple[int, str]:
        assert self._proc is not None and self._out is not None
        try:
            code = self._proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self._out.seek(0)
        output = self._out.read().decode(errors="replace")
        self._out.close()
        return code, output

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._out is not None:
            self._out.close()


class BackgroundItem(pytest.Item):
    """Stands for one background test: passes when its run passed."""

    def __init__(self, *, run: BackgroundRun, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.run = run
        self.add_marker(pytest.mark.timeout(WAIT_S + 60))

    def runtest(self) -> None:
        code, output = self.run.result()
        if code != 0:
            raise AssertionError(f"{self.run.nodeid} failed in its own run:\n{output[-6000:]}")

    def repr_failure(
        self, excinfo: pytest.ExceptionInfo[BaseException], style: object = None
    ) -> str:
        return str(excinfo.value)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"{self.run.nodeid} (run beside the suite)"


def take_out(session: pytest.Session, items: list[pytest.Item]) -> list[BackgroundRun]:
    """Replace each ``background`` test of ``items`` by a stand-in at the end; return the runs
    to start (none in a child, nor when only collecting)."""
    if os.environ.get(CHILD_ENV) or session.config.option.collectonly:
        return []
    runs = []
    kept = []
    for item in items:
        if item.get_closest_marker("background") is None:
            kept.append(item)
            continue
        run = BackgroundRun(item.nodeid)
        runs.append(run)
        stand_in = BackgroundItem.from_parent(item.parent, name=f"{item.name}[background]", run=run)
        run.stand_in_nodeid = stand_in.nodeid
        kept.append(stand_in)
    items[:] = [i for i in kept if not isinstance(i, BackgroundItem)] + [
        i for i in kept if isinstance(i, BackgroundItem)
    ]
    return runs
