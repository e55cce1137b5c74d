"""Few-row products: x [B, K] @ w [N, K].T for a decode step's B rows (1 to a few dozen), every
weight row read ONCE for all B rows.

What you learn here: a BLAS gemm packs the weight into its own tiles first, and for a few rows that
copy costs more than the product. `few_rows_linear` walks the weight's output rows in groups of 4
and, for every 4 rows of x, keeps the 4 x 4 dot products in registers, so the weight streams from
memory once per call whatever B is; `linear_columns` picks the loop that suits B; `tile_2x4_linear`
is the form for AVX2's 16 vector registers, asking for the rows ahead as it goes, for the weight
that streams from memory at every step (the LM head). The kernels run on the calling thread and
release the GIL; `linear_on_cores` shares one product out on numba's pool.

Shapes: x [B, K]; w [N, K] (a linear's [out, in] weight, contiguous); out [B, N].
"""
from __future__ import annotations

import numpy as np

from ._jit import AVAILABLE, keep_builds_current

# Bytes of weight rows ahead whose lines the streamed products ask for while they multiply this
# row: the hardware's prefetchers alone left the lab's 49,152 x 256 LM head streaming well under
# the DRAM's rate once compute came between the loads (`tile_2x4_linear`).
PREFETCH_WEIGHT_BYTES_AHEAD = 32 << 10


def few_rows_linear_reference(x, w):
    """x [B, K] @ w [N, K].T -> [B, N] fp32, the product `few_rows_linear` computes."""
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


if AVAILABLE:
    import numba

    from ._jit import prefetch

    @numba.njit(inline="always")
    def _prefetch_weight_rows(w, row, rows, stop):
        """Prefetch every line of weight rows `row` .. `row + rows - 1` of w [N, K] that lie
        below `stop` (the caller's share of the rows: none is fetched for another thread)."""
        step = 64 // w.itemsize
        for r in range(row, min(row + rows, stop)):
            for col in range(0, w.shape[1], step):
                prefetch(w, r, col)

    @numba.njit(inline="always")
    def _row_by_four(x, w, out, b, j):
        """out[b, j : j + 4] = x[b] . w[j .. j + 3]: one row of x against a group's 4 weight rows."""
        a0 = a1 = a2 = a3 = np.float32(0)
        for k in range(x.shape[1]):
            xv = x[b, k]
            a0 += xv * w[j, k]; a1 += xv * w[j + 1, k]  # noqa: E702
            a2 += xv * w[j + 2, k]; a3 += xv * w[j + 3, k]  # noqa: E702
        out[b, j], out[b, j + 1], out[b, j + 2], out[b, j + 3] = a0, a1, a2, a3

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def few_rows_linear(x, w, out, first, stop):
        """out[:, 4 first : 4 stop] of x [B, K] @ w [N, K].T, every weight row read once for all
        B rows; groups `first` .. `stop` - 1 of 4 output columns (callers share the groups of
        one product out to threads: the GIL is released, `cpu_linear`).

        A group is 4 weight rows (4 KiB at K = 256, in L1 while every 4 rows of x pass over
        them) and 16 accumulators per 4 x 4 tile; LLVM vectorises the k loop (fastmath lets it
        reorder the sums)."""
        B, K = x.shape
        N = w.shape[0]
        for group in range(first, stop):
            j = group * 4
            if j + 4 > N:  # the last, partial group: its rows one at a time
                row_dot_linear(x, w, out, j, N)
                continue
            b = 0
            while b + 4 <= B:
                a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
                a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0)
                for k in range(K):
                    w0, w1, w2, w3 = w[j, k], w[j + 1, k], w[j + 2, k], w[j + 3, k]
                    x0, x1, x2, x3 = x[b, k], x[b + 1, k], x[b + 2, k], x[b + 3, k]
                    a00 += x0 * w0; a01 += x0 * w1; a02 += x0 * w2; a03 += x0 * w3  # noqa: E702
                    a10 += x1 * w0; a11 += x1 * w1; a12 += x1 * w2; a13 += x1 * w3  # noqa: E702
                    a20 += x2 * w0; a21 += x2 * w1; a22 += x2 * w2; a23 += x2 * w3  # noqa: E702
                    a30 += x3 * w0; a31 += x3 * w1; a32 += x3 * w2; a33 += x3 * w3  # noqa: E702
                out[b, j], out[b, j + 1], out[b, j + 2], out[b, j + 3] = a00, a01, a02, a03
                out[b + 1, j], out[b + 1, j + 1], out[b + 1, j + 2], out[b + 1, j + 3] = a10, a11, a12, a13
                out[b + 2, j], out[b + 2, j + 1], out[b + 2, j + 2], out[b + 2, j + 3] = a20, a21, a22, a23
                out[b + 3, j], out[b + 3, j + 1], out[b + 3, j + 2], out[b + 3, j + 3] = a30, a31, a32, a33
                b += 4
            while b < B:  # the last rows, one at a time against the same 4 weight rows
                _row_by_four(x, w, out, b, j)
                b += 1

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def row_dot_linear(x, w, out, first, stop):
        """out[:, first:stop] of x [B, K] @ w [N, K].T, one weight row at a time: its B dot
        products while the row (1 KiB at K = 256) is in L1, each vectorised along K. For B < 4:
        with one x row the 4 x 4 tile has nothing to share, and this plain loop streamed the lab's
        LM head twice as fast (B = 1, 2-core EPYC: 1.35 ms against 3.34 ms on one core)."""
        B, K = x.shape
        for j in range(first, stop):
            for b in range(B):
                acc = np.float32(0)
                for k in range(K):
                    acc += x[b, k] * w[j, k]
                out[b, j] = acc

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def row_pair_linear(x, w, out, first, stop):
        """`row_dot_linear` two weight rows at a time: each x value loaded once feeds both (for
        4 <= B < 12, where it beat both the plain loop and the 4 x 4 tile on the lab's LM head)."""
        B, K = x.shape
        j = first
        while j + 2 <= stop:
            for b in range(B):
                a0 = np.float32(0)
                a1 = np.float32(0)
                for k in range(K):
                    xv = x[b, k]
                    a0 += xv * w[j, k]
                    a1 += xv * w[j + 1, k]
                out[b, j], out[b, j + 1] = a0, a1
            j += 2
        row_dot_linear(x, w, out, j, stop)

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def linear_columns(x, w, out, first, stop):
        """out[:, first:stop] of x [B, K] @ w [N, K].T by the loop that suits B (`first` a
        multiple of 4): the plain loop below 4 rows, pairs of weight rows below 12, the 4 x 4
        register tile from 12 up (where its reuse of each loaded value pays for its
        reductions: 91 GFLOP/s at B = 16 against 58-70 for the others)."""
        B = x.shape[0]
        if B < 4:
            row_dot_linear(x, w, out, first, stop)
        elif B < 12:
            row_pair_linear(x, w, out, first, stop)
        else:
            few_rows_linear(x, w, out, first // 4, (stop + 3) // 4)

    # ---- the streamed product: a weight far larger than any core's caches, read from memory once per
    # step (the LM head), for 4-11 rows. It asks for the rows PREFETCH_WEIGHT_BYTES_AHEAD ahead, and
    # runs on the caller's threads (`cpu_linear` shares it out with `cpu_blas.on_every_core`), never
    # inside a prange: the same kernel in a parallel function loaded from numba's cache ran 1.5-2.5x
    # slower than freshly compiled (numba 0.68, Zen 3), where called serially it runs at the same speed.
    @numba.njit(nogil=True, fastmath=True, cache=True)
    def tile_2x4_linear(x, w, out, first, stop):
        """out[:, first:stop] of x [B, K] @ w [N, K].T in 2 x 4 tiles, weight rows prefetched:
        2 rows of x against 4 weight rows, 8 accumulators and 6 loaded values per step of K,
        which fit AVX2's 16 vector registers (the 4 x 4 tile's 24 do not). The 4 weight rows
        (4 KiB at K = 256) stay in L1 while every pair of x rows passes over them. Weights in L2,
        one core of a Zen 3: 82 GFLOP/s at B = 4-16, against 46-62 for the plain loop and the
        loop over pairs of weight rows."""
        B, K = x.shape
        ahead = max(4, PREFETCH_WEIGHT_BYTES_AHEAD // (K * w.itemsize))  # rows
        j = first
        while j + 4 <= stop:
            _prefetch_weight_rows(w, j + ahead, 4, stop)
            b = 0
            while b + 2 <= B:
                a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
                for k in range(K):
                    w0, w1, w2, w3 = w[j, k], w[j + 1, k], w[j + 2, k], w[j + 3, k]
                    x0, x1 = x[b, k], x[b + 1, k]
                    a00 += x0 * w0; a01 += x0 * w1; a02 += x0 * w2; a03 += x0 * w3  # noqa: E702
                    a10 += x1 * w0; a11 += x1 * w1; a12 += x1 * w2; a13 += x1 * w3  # noqa: E702
                out[b, j], out[b, j + 1], out[b, j + 2], out[b, j + 3] = a00, a01, a02, a03
                out[b + 1, j], out[b + 1, j + 1], out[b + 1, j + 2], out[b + 1, j + 3] = a10, a11, a12, a13
                b += 2
            if b < B:  # an odd last row against the same 4 weight rows
                _row_by_four(x, w, out, b, j)
            j += 4
        row_dot_linear(x, w, out, j, stop)  # the last, partial group


    @numba.njit(nogil=True, fastmath=True, parallel=True, cache=True)
    def linear_on_cores(x, w, out, parts):
        """`linear_columns` over the N output columns in `parts` slices (multiples of 4), one per
        numba thread. numba's pool hands work over in ~10 us (its OpenMP threads wait spinning),
        where a Python thread pool took 50-65 us: enough to share a decode step's layer products."""
        N = w.shape[0]
        for p in numba.prange(parts):
            first = (N * p // parts) // 4 * 4
            stop = N if p == parts - 1 else (N * (p + 1) // parts) // 4 * 4
            linear_columns(x, w, out, first, stop)

    keep_builds_current(globals())
