"""CPU matrix products through numpy's OpenBLAS, with the thread count chosen per product.

Why it exists: the CPU model's linears (`ops.TorchOps.linear`) and, without MKL's packing or
numba, the CPU decode step's products (`cpu_linear`'s "blas") multiply with numpy's OpenBLAS,
which streams decode-shaped products (a few rows, a weight far larger than the CPU caches)
faster than torch's own BLAS on the lab's CPUs. How many threads a product gets decides whether
that pays off:

  * a small product (a decode step's layer matrices) runs on one thread: waking a second thread
    costs more than it saves, and on a busy machine a descheduled helper thread stalls the call
    for a whole scheduler tick;
  * a large weight times a few rows (the output head in decode) is split into column blocks,
    one Python thread per core, each running single-threaded OpenBLAS (numpy releases the GIL),
    because OpenBLAS's own threads pack the whole weight for a few-row product first;
  * everything else (prefill's thousands of rows, on a CPU other than Intel's: there `ops` hands
    those to torch's MKL) gets all of OpenBLAS's threads.

The thread count is set through OpenBLAS's C API (ctypes), and only when it changes.
Shapes: a [M, K] @ b [K, N] -> [M, N], fp32 numpy arrays.
"""
from __future__ import annotations

import ctypes
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .cpu_info import usable_cores

# A product runs on one thread when its weight is at most this large AND it is at most this
# many FLOPs (about 0.3 ms on one core): below that a second thread's wake-up costs more.
SINGLE_THREAD_WEIGHT_BYTES = 4 << 20
SINGLE_THREAD_FLOPS = 1 << 24
# A product with at most SPLIT_MAX_ROWS rows and a larger weight is split into column blocks of
# BLOCK_COLUMNS (4 MiB of a 256-row fp32 weight: a block stays in L3 while it is multiplied).
SPLIT_MAX_ROWS = 16
BLOCK_COLUMNS = 4096
CORES = usable_cores()  # the cores this process may keep busy (a container's or a hub's limit), not all the OS lists
MAX_WORKERS = 8  # threads that share out one product; more only add hand-offs on small weights


def _find_openblas_threads():
    """(set_threads, max_threads) for numpy's bundled OpenBLAS through ctypes, or None when this
    numpy has none (then OpenBLAS keeps its own thread count; results are the same)."""
    here = os.path.dirname(np.__file__)
    for path in glob.glob(here + ".libs/*openblas*") + glob.glob(os.path.join(here, ".dylibs", "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    setter.argtypes = [ctypes.c_int]
                    return setter, int(getter())
    return None


class BlasThreads:
    """Sets numpy's OpenBLAS thread count per product, calling into OpenBLAS only on a change."""

    def __init__(self):
        self.found = None  # (setter, max threads), looked up on first use; False if none
        self.current = None

    def use(self, threads: int | None):
        """`threads` for the next products; None = all that OpenBLAS started with."""
        if self.found is None:
            self.found = _find_openblas_threads() or False
            self.current = self.found[1] if self.found else None
        if self.found:
            want = self.found[1] if threads is None else min(threads, self.found[1])
            if want != self.current:
                self.found[0](want)
                self.current = want


BLAS_THREADS = BlasThreads()
_POOL: ThreadPoolExecutor | None = None  # started on first use: most processes never split


def on_every_core(run, parts: int):
    """run(0) .. run(parts - 1) at once (the CPU decode step's numba kernels and MKL blocks too): part 0 in the calling thread (one wake-up fewer than
    waiting for a worker), the others on worker threads (numpy releases the GIL in BLAS and in
    ufuncs), each with single-threaded OpenBLAS; returns when all are done."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, min(CORES, MAX_WORKERS) - 1), thread_name_prefix="labkit-blas")
    BLAS_THREADS.use(1)
    others = [_POOL.submit(run, i) for i in range(1, parts)]
    run(0)
    for future in others:
        future.result()


def blas_matmul(a, b):
    """a [M, K] @ b [K, N] with numpy (OpenBLAS), fp32 arrays -> a new [M, N] array: one thread
    for a small product, column blocks on every core for a large weight times a few rows, all of
    OpenBLAS's threads otherwise (see the module docstring)."""
    small = b.nbytes <= SINGLE_THREAD_WEIGHT_BYTES and 2 * a.shape[0] * b.size <= SINGLE_THREAD_FLOPS
    if small or a.shape[0] > SPLIT_MAX_ROWS or CORES < 2:
        BLAS_THREADS.use(1 if small else None)
        return np.matmul(a, b)
    return _split_columns(a, b)


def _split_columns(a, b):
    """a @ b with b's column blocks shared out to one worker thread per core."""
    workers = min(CORES, MAX_WORKERS)
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    starts = range(0, b.shape[1], BLOCK_COLUMNS)

    def run(first):  # blocks first, first + workers, ...: neighbours interleave, loads even out
        for j in starts[first::workers]:
            np.matmul(a, b[:, j:j + BLOCK_COLUMNS], out=out[:, j:j + BLOCK_COLUMNS])
    on_every_core(run, workers)
    return out
