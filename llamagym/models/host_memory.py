"""Hand freed CPU memory back to the operating system after each update (glibc's `malloc_trim`).

PyTorch's CPU tensors come from the C library's malloc. glibc serves a request below its mmap threshold from a heap,
and raises that threshold (up to 32 MiB) whenever a larger block is freed, so after the first large tensor nearly
every activation of an update lands in a heap, whose freed space stays resident: a heap shrinks only from its top.
Measured in generate mode (guess-the-number; docs/learning-that-holds.md, tenth session), the process held 0.75-1.05
GiB of freed heap between updates from the first one on. `malloc_trim(0)` gives the freed pages of every heap back,
in about 15 ms. Trimming after every optimizer step instead of every update held the peak lower but made updates
20-50% slower, since each step faults the same pages in again. Elsewhere (macOS, Windows, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the C heap's freed pages to the operating system; True when there was a `malloc_trim` to call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
