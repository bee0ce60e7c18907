"""Unit tests run on virtual time (``tests/virtualtime.py``): the product's one clock is the
event loop's, and here that loop's time moves only when every task waits. A module that talks
to a real server overrides ``anyio_backend`` with ``"asyncio"`` (real time)."""

from __future__ import annotations

import pytest

from tests.virtualtime import VIRTUAL_TIME


@pytest.fixture
def anyio_backend() -> object:
    return VIRTUAL_TIME
