"""Starts the simulator's long runs when the session's collection is complete
(``tests/sim/background.py``), and stops any still going when it ends."""

from __future__ import annotations

import pytest

from tests.sim.background import RUNS


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    names = {item.name for item in session.items}
    for name, run in RUNS.items():
        if name in names:
            run.start(nice=19)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for run in RUNS.values():
        run.stop()
