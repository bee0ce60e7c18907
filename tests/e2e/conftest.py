"""End-to-end fixtures: the emulator in this process (kubelet finishing graceful deletions), and a
:class:`ServiceLauncher` that kills every service process it started and prints their log tails
when the test failed."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from devtools.emulator import RunningEmulator

from .harness import LEASE_NAMESPACE, ServiceLauncher


@pytest.fixture
def emulator_options() -> dict[str, object]:
    # A real kubelet finishes a graceful deletion; 0.5 s keeps the scenarios short.
    return {"bookmark_interval_s": 0.5, "history_size": 10_000, "kubelet_finish_after_s": 0.5}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def launcher(
    request: pytest.FixtureRequest, tmp_path: Path, emulator: RunningEmulator, pg_url: str
) -> Iterator[ServiceLauncher]:
    emulator.emulator.ensure_namespace(LEASE_NAMESPACE)
    launcher = ServiceLauncher(tmp_path=tmp_path, emulator_url=emulator.url, database_url=pg_url)
    try:
        yield launcher
    finally:
        launcher.close()
        report = getattr(request.node, "report_call", None)
        if report is None or report.failed:
            print(launcher.failure_report())
