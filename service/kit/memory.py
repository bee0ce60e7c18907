"""Memory kept in check: freed heap given back to the OS, long-lived objects out of the GC's scans.

A sync of the pod cache allocates and frees far more than it keeps, and glibc keeps what is freed
below the top of its heap mapped, so the RSS would stay near the sync's peak: :func:`trim_heap`
(``malloc_trim(0)``; nothing where the C library is not glibc) is called once when a sync
completes, never per event. :func:`freeze_long_lived` is called once, when the pod cache has
first synced: what is alive then lives as long as the process, and every full collection of the
cyclic garbage collector would walk it again (a pause that grows with the cache).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

__all__ = ["freeze_long_lived", "trim_heap"]


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, the C library among them
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS; ``True`` if any were (never without glibc)."""
    return _TRIM is not None and _TRIM(0) == 1


def freeze_long_lived() -> int:
    """Collect the garbage, then move every object still alive into the collector's permanent
    generation (``gc.freeze``); returns how many it holds. A frozen object that later becomes
    part of an unreachable cycle is never freed: the price, bounded by what was alive once."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
