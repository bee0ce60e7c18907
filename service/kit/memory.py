"""Giving freed heap memory back to the operating system after a burst (glibc ``malloc_trim``).

A sync of the pod cache allocates and frees far more than it keeps: list bodies or streamed
lines, decode temporaries, the sync's bookkeeping. CPython takes every block over 512 bytes (dict
and set tables, lists, buffers) from the C allocator, and glibc keeps what is freed below the top
of its heap mapped, so the process's RSS stays near the sync's peak.
:func:`trim_heap` asks glibc to return every free page (``malloc_trim(0)``: unmapped with
``madvise``, nothing live is touched). It is called once when a sync completes, never per
event. Where the C library is not glibc (musl, macOS) there is no such call and it does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["trim_heap"]


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
