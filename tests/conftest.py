"""Shared test configuration: the asyncio backend for anyio tests, and an event-loop guard.

Area fixtures live in their own plugin modules (listed in ``pytest_plugins``) so that the
PostgreSQL and Kubernetes harnesses stay independent.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.background import BackgroundRun, take_out

pytest_plugins: list[str] = ["tests.pgfixtures", "tests.kubefixtures", "tests.kubectl"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


_BACKGROUND: list[BackgroundRun] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    # The background tests' runs start now, beside the rest (tests/background.py): those whose
    # stand-in is still selected (-k or -m may have deselected it since).
    selected = {item.nodeid for item in session.items}
    _BACKGROUND[:] = [run for run in _BACKGROUND if run.stand_in_nodeid in selected]
    for run in _BACKGROUND:
        run.start()
    # What exists once every test module is imported (the modules, the test functions, the
    # strategies) lives for the whole session: take it out of the collector's sight, so that the
    # full collection the event-loop guard runs after every async test walks only what the tests
    # made since (about 10 ms instead of about 90 ms each, over hundreds of tests). Objects made
    # later are collected as before: every task or future a test leaves behind is among them.
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for run in _BACKGROUND:
        run.stop()


def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    _BACKGROUND[:] = take_out(session, items)
    # Every async (anyio) test also gets the event-loop guard; sync tests do not need it.
    for item in items:
        names = getattr(item, "fixturenames", None)
        if names is not None and "anyio_backend" in names and "event_loop_guard" not in names:
            names.append("event_loop_guard")


def _describe(context: dict[str, Any]) -> str:
    exc = context.get("exception")
    where = context.get("future") or context.get("task") or context.get("handle") or ""
    what = f"{type(exc).__name__}: {exc}" if exc is not None else ""
    return " | ".join(str(x) for x in (context.get("message"), what, where) if x)


@pytest.fixture
async def event_loop_guard() -> AsyncIterator[None]:
    """Fail an async test that leaves tasks running on its event loop, or during which the
    loop's exception handler was called: an exception raised in a callback, or a task or
    future whose exception nobody retrieved (found by a garbage collection at the end)."""
    loop = asyncio.get_running_loop()
    calls: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()

    def record(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        calls.append(context)
        loop.default_exception_handler(context)

    loop.set_exception_handler(record)
    before = set(asyncio.all_tasks())
    try:
        yield
        await asyncio.sleep(0)
        leaked = [
            t
            for t in asyncio.all_tasks() - before
            if not t.done() and "_call_in_runner_task" not in repr(t.get_coro())
        ]
        if leaked:
            pytest.fail(f"test left {len(leaked)} task(s) running: {leaked[:3]}")
        gc.collect()  # an unretrieved exception is reported when its task or future is freed
        await asyncio.sleep(0)
        if calls:
            pytest.fail(
                f"the event loop's exception handler was called {len(calls)} time(s): "
                + "; ".join(_describe(c) for c in calls[:3])
            )
    finally:
        loop.set_exception_handler(previous)
