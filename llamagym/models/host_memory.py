"""Keep a CPU process's memory in bounds: hand freed memory back to the operating system (glibc's `malloc_trim`)
after each update, and within one whenever the freed memory it holds grows past a bound; cap oneDNN's cache.

PyTorch's CPU tensors come from the C library's malloc. glibc serves a request below its mmap threshold from a heap,
and raises that threshold (up to 32 MiB) whenever a larger block is freed, so after the first large tensor nearly
every activation of an update lands in a heap, whose freed space stays resident: a heap shrinks only from its top.
Measured in generate mode (guess-the-number; docs/learning-that-holds.md, tenth session), the process held 0.75-1.05
GiB of freed heap between updates from the first one on. `malloc_trim(0)` gives the freed pages of every heap back,
in about 15 ms. Trimming after every optimizer step instead of every update held the peak lower but made updates
20-50% slower, since each step faults the same pages in again; within an update of many steps the freed heap still
grew by 0.2-0.5 GiB (tic-tac-toe's 36 steps, twenty-third session), so `FreedMemoryBound` trims there only when the
resident memory has grown a bound past one step's working set. Elsewhere (macOS, Windows, musl) both do nothing.

Live memory grew too: bf16 matrix products on a CPU run as oneDNN primitives, one set per shape, kept in a cache of
up to 1024. Generate mode meets new lengths in every batch, so that cache only filled: over guess-the-number's first
seven updates the resident memory after an update rose from 1.15 to 1.60 GiB with it, from 1.10 to 1.33 GiB with it
capped at 128, at the same 22.5 s an update (docs/learning-that-holds.md, thirty-seventh session). On a Xeon with AMX
(family 6 model 167) a cache of 128 still let tic-tac-toe's generate-mode run peak at 3.08 GiB in 20 minutes; at 16 it
peaked at 2.14 GiB, its updates 0.91x as long on the same batches (sixty-second session). `bound_onednn_cache` caps it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# Within an update: trim once the resident memory is this far above the mark (see `FreedMemoryBound`). Each trim
# costs the next step faulting its working set in again: at 128 MiB guess-the-number's generate-mode updates trimmed
# 4-8 times and took 1.27x as long; at 256 MiB 0-3 times, and tic-tac-toe's took 1.05x, within single updates'
# spread (twenty-third session).
DEFAULT_SLACK_MIB = 256

# oneDNN's primitive cache capacity (its own default is 1024), unless the user sets one (see `bound_onednn_cache`).
# At 8 every primitive was made again and an update took 1.6x as long (twenty-third session, Xeon model 207); at 128
# generate mode's updates took as long as at 1024, scoring mode's 1.04x over a 3-minute probe (thirty-seventh, Zen 4).
# At 16 against 128 on the same batches (sixty-second session, Xeon model 167): generate mode's updates 0.91x as long
# and its peak 2.14 GiB instead of 3.08; scoring mode's 1.06x as long, its peak 1.61 GiB instead of 1.90.
ONEDNN_CACHE_CAPACITY = 16
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


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


def bound_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> bool:
    """Cap oneDNN's primitive cache at `capacity` primitives, unless the environment already sets a capacity (the
    user's choice wins); True when this call set it. oneDNN reads the setting when the process makes its first
    primitive, so this must run before the first bf16 matrix product on the CPU (a policy calls it as it is built).
    """
    if any(name in os.environ for name in ONEDNN_CACHE_VARIABLES):
        return False
    os.environ[ONEDNN_CACHE_VARIABLES[0]] = str(capacity)
    return True


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux's /proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class FreedMemoryBound:
    """Keeps the freed memory a process holds between trims to about `slack_mib` past one step's working set.

    `check()` (cheap: one read of /proc) is called where a step's tensors have just been freed. The first check after
    a trim marks the resident memory: what is live plus the pages the step just used, which the next step reuses.
    A later check that finds the resident memory more than `slack_mib` above that mark trims and starts again, so
    live memory that grows (a cache filling) only moves the mark up. Marking right after the trim instead would
    count the working set the next step faults in again as growth, and trim after every step. `release()` trims
    now. A no-op where there is no `malloc_trim` or no /proc.
    """

    def __init__(self, slack_mib: float = DEFAULT_SLACK_MIB):
        if not slack_mib > 0:
            raise ValueError(f"`slack_mib` should be > 0. Received {slack_mib}.")
        self.slack = int(slack_mib * 2**20)
        self.mark: int | None = None  # resident bytes at the first check since the last trim
        self.trims = 0  # trims `check` made (reported by the trainer per update)

    def check(self) -> bool:
        """Trim if the resident memory grew more than the slack since the mark; True when it trimmed."""
        now = resident_bytes()
        if now is None:
            return False
        if self.mark is None:
            self.mark = now
            return False
        if now - self.mark <= self.slack or not self.release():
            return False
        self.trims += 1
        return True

    def release(self) -> bool:
        """Trim now; the next `check` marks again. True when there was a `malloc_trim` to call."""
        self.mark = None
        return release_freed_memory()
