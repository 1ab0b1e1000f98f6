"""Keep freed host memory inside the process (Linux, glibc), so CPU steps stop page-faulting.

glibc's malloc serves every block above its mmap threshold (32 MB at most) with a fresh
``mmap`` and gives it back to the kernel on ``free``. A CPU training step allocates and frees
tensors that big hundreds of times (one micro-batch's MLP activation: 32 x 256 tokens x 1024
floats = 33 MB), and each new one costs a page fault per 4 KB page plus the kernel zeroing it:
on the benchmark's shapes ~175,000 faults and about a second of an 11-second step. With mmap
off for malloc (``M_MMAP_MAX`` = 0) and heap trimming off (``M_TRIM_THRESHOLD``), freed blocks
stay in the process for the next allocation, which is what jemalloc or tcmalloc (PyTorch's CPU
tuning guide suggests preloading one) give, without a preloaded library. The cost: the process
keeps its peak memory until it exits instead of returning it.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to reuse freed memory instead of unmapping it; False where that is not possible
    (not Linux, or a C library without ``mallopt``, e.g. musl, whose stub refuses)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already uses
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
