"""Keep the memory a CPU prefill frees, so its next tensors do not fault their pages in again.

Why it exists: a prefill makes and drops tensors of megabytes in every layer (at P = 4,096 on
lab-cpu: the fused q/k/v output 8 MiB, gate and up 24 MiB, each attention block's scores and
weights 4 MiB). glibc's malloc serves blocks past its mmap threshold with fresh mappings and
hands the top of its heap back to the OS once more than its trim threshold is free; either way
the next tensor of that size starts on pages the kernel must fault in and zero, one 4 KiB page at
a time. Its own dynamic threshold follows the sizes freed, but not far enough: measured on a
2-core AMD EPYC VM (Zen 5), lab-cpu prefills took 25,000-40,000 minor page faults each at
P = 4,096 and 3,000-9,000 at P = 1,024 (how far the threshold moves depends on the order of the
allocations: on one CI machine, ~200 a prefill at P = 1,024). With blocks up to 32 MiB from the
heap and up to 1 GiB of freed heap kept, they take ~0-2,500 and ~0-400, and the prefill's time,
fastest of three in each of five alternating processes, goes from 255.6-313.5 ms (median 270.1)
to 239.8-260.1 (247.7) at P = 4,096, and from 42.6-55.8 (49.6) to 40.4-46.2 (40.8) at P = 1,024.

The cost: the process keeps up to `KEEP_FREED_BYTES` of freed memory for its own reuse instead of
returning it, until `hand_back` (`sweeps.rest`, once the process has measured nothing for a
while). Only glibc has `mallopt`; elsewhere (macOS, Windows, musl) nothing changes and
`keep_freed_memory` says why.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools

# glibc's malloc.h: the parameters' numbers for mallopt().
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# glibc's malloc.c: DEFAULT_MMAP_MAX (how many blocks may be mapped at once), and the trim and mmap
# thresholds a process starts with.
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD_BYTES = DEFAULT_MMAP_THRESHOLD_BYTES = 128 * 1024
# The largest mmap threshold glibc accepts on a 64-bit machine (half its 64 MiB heap size).
HEAP_BLOCK_LIMIT_BYTES = 32 * 2**20
KEEP_FREED_BYTES = 2**30


def glibc():
    """(libc, its version) where this process's C library is glibc, `mallopt` typed; else (None,
    the library found, or that none was)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        return libc, libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError, TypeError):
        return None, name or "no C library found"


@functools.cache
def keep_freed_memory() -> str:
    """Have glibc's malloc serve blocks up to HEAP_BLOCK_LIMIT_BYTES from its heap and keep up to
    KEEP_FREED_BYTES of freed heap (once a process; the process's whole malloc, torch's
    tensors included). Returns what was done, or why nothing was."""
    libc, version = glibc()
    if libc is None:
        return f"left as it is: no glibc malloc to tune here ({version})"
    if not (libc.mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)):
        return f"left as it is: glibc {version} refused the thresholds"
    return (f"glibc {version}: blocks up to {HEAP_BLOCK_LIMIT_BYTES // 2**20} MiB from the heap, "
            f"up to {KEEP_FREED_BYTES // 2**30} GiB of freed memory kept")


@contextlib.contextmanager
def reused_memory():
    """While it runs, glibc's malloc serves every block from its heap, whatever its size, and keeps
    what is freed; after, it maps big blocks again, goes back to the trim threshold the process
    had (`keep_freed_memory`'s, or glibc's own) and hands the freed heap back (`malloc_trim`).
    Elsewhere than glibc it changes nothing.

    Why: blocks past 32 MiB are always mapped afresh, whatever `keep_freed_memory` says, so every
    call that makes one faults in and zeroes its pages, one 4 KiB page at a time. Plain attention's
    P x P fp32 matrices are such blocks. Measured on the 2-core EPYC VM (Zen 5; torch 2.13, fastest of 7,
    P = 4,096, 2 heads on 1 kv head, head dim 64: 134 MB a matrix): Q K^T 50 ms into a new tensor, 24 ms
    into an existing one; the whole plain call 148 ms, 62 ms inside this. A GPU's caching allocator
    reuses such blocks without asking; timed inside this, plain attention on a CPU pays for its
    traffic and arithmetic, as the roofline counts, and not for the OS's page faults."""
    libc, _ = glibc()
    if libc is None:
        yield
        return
    kept = keep_freed_memory.cache_info().currsize and keep_freed_memory().startswith("glibc")
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    libc.mallopt(M_MMAP_MAX, 0)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES if kept else DEFAULT_TRIM_THRESHOLD_BYTES)
        libc.malloc_trim(0)


def hand_back() -> bool:
    """Return the heap this process has freed to the OS (`malloc_trim`), whatever the kept amount
    (`keep_freed_memory`); True where that was done (glibc), False elsewhere."""
    libc, _ = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
