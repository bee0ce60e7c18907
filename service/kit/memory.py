"""Memory kept in check: freed heap memory given back to the operating system after a sync or
a large batch of work (glibc ``malloc_trim``), and long-lived objects kept out of the garbage
collector's full scans.

A sync of the pod cache allocates and frees far more than it keeps: list bodies or streamed
lines, decode temporaries, the sync's bookkeeping. CPython takes every block over 512 bytes (dict
and set tables, lists, buffers) from the C allocator, and glibc keeps what is freed below the top
of its heap mapped, so the process's RSS stays near the sync's peak.
:func:`trim_heap` asks glibc to return every free page (``malloc_trim(0)``: unmapped with
``madvise``, nothing live is touched). It is called once when a sync completes, never per
event. Where the C library is not glibc (musl, macOS) there is no such call and it does nothing.

:func:`freeze_long_lived` is called once, when the pod cache has first synced: what is alive then
(modules, functions, the clients, the cache's tables) lives as long as the process, yet every
full collection of the cyclic garbage collector would walk it again: a pause of the event loop
that grows with the cache.
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
    """Return the C heap's free pages to the OS; ``True`` if any were (``False`` where the C
    library has no ``malloc_trim``)."""
    return _TRIM is not None and _TRIM(0) == 1


def freeze_long_lived() -> int:
    """Collect the garbage there is, then move every object still alive into the collector's
    permanent generation (``gc.freeze``), which no collection scans again; returns how many
    objects it holds.

    Objects created afterwards are collected as before. One frozen object that later becomes
    part of an unreachable cycle is never freed: the price, bounded by what was alive at the call,
    which is why it is called once, after the startup's work and the first sync."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
