"""Shared test configuration: the asyncio backend for anyio tests, and a leaked-task check.

Area fixtures live in their own plugin modules (listed in ``pytest_plugins``) so that the
PostgreSQL and Kubernetes harnesses stay independent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

pytest_plugins: list[str] = ["tests.pgfixtures", "tests.kubefixtures"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every async (anyio) test also gets the leaked-task check; sync tests do not need it.
    for item in items:
        names = getattr(item, "fixturenames", None)
        if names is not None and "anyio_backend" in names and "no_leaked_tasks" not in names:
            names.append("no_leaked_tasks")


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail an async test that leaves tasks running on its event loop."""
    before = set(asyncio.all_tasks())
    yield
    await asyncio.sleep(0)
    leaked = [
        t
        for t in asyncio.all_tasks() - before
        if not t.done() and "_call_in_runner_task" not in repr(t.get_coro())
    ]
    if leaked:
        pytest.fail(f"test left {len(leaked)} task(s) running: {leaked[:3]}")
