"""trim_heap: freed C-heap memory goes back to the OS (glibc), and it is a no-op elsewhere."""

from __future__ import annotations

import gc
import platform
import weakref

from service.kit.memory import freeze_long_lived, trim_heap


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def test_trim_heap_returns_the_free_pages_below_the_top_of_the_heap() -> None:
    if platform.libc_ver()[0] != "glibc":
        # No malloc_trim in this C library: nothing is done, and it says so.
        assert trim_heap() is False
        return
    # 100 MB of 100 kB blocks (below glibc's mmap threshold, so from its heap), written so their
    # pages are resident, then one block above them that stays: free() alone cannot shrink the
    # heap from the top, so the freed 100 MB stays resident until trimmed.
    blocks = [b"\x01" * 100_000 for _ in range(1_000)]
    pin = b"\x02" * 100_000
    del blocks
    before = _rss_kib()
    assert trim_heap() is True
    after = _rss_kib()
    assert before - after > 50_000, (before, after)
    assert pin[0] == 2


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_long_lived_collects_garbage_first_then_freezes_what_is_alive() -> None:
    # A cycle nobody references: garbage that only the collector can free, and it must be freed,
    # not frozen forever.
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    kept = [[i] for i in range(1_000)]  # alive: 1,001 tracked lists
    before = gc.get_freeze_count()
    # (What it freezes stays frozen: the suite freezes its own objects at start anyway.)
    frozen = freeze_long_lived()
    assert gone() is None
    assert frozen == gc.get_freeze_count()
    assert frozen >= before + len(kept) + 1
