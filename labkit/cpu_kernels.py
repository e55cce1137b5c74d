"""The CPU decode step's kernels, compiled by numba, each with its numpy reference beside it (the
elementwise ones' references are the step's numpy forms in `cpu_decode`).

What you learn here (the CPU counterpart of kernels/, where the GPU's Triton kernels live):
  * a few-row product reads each weight row ONCE for all B rows: `few_rows_linear` walks the
    weight's output rows in groups of 4 and, for every 4 rows of x, keeps the 4 x 4 dot products
    in registers, so the weight streams from memory once per call whatever B is (a BLAS gemm packs
    the weight into its own tiles first, and for a few rows that copy costs more than the product);
    `tile_2x4_linear` is its form for AVX2's 16 vector registers, asking for the rows ahead as it
    goes, for the weight that streams from memory at every step;
  * on a CPU with AVX-512 (`cpu_linear`), `panel_linear` multiplies a weight repacked once
    into panels of 16 output columns (`pack_panels`), each [K, 16] contiguous, by register
    tiles of 4, 8 or 16 rows x 16 columns whose sums stay in vector registers for the whole K
    loop (no reduction across a vector's lanes), asking for the panels ahead as it goes, so a
    weight that streams from memory (the LM head) keeps streaming while the tile multiplies; it
    reads x transposed, so a tile's 16 values of x at each k lie side by side;
  * decode attention reads the cache AS STORED and widens each value in registers
    (`decode_attention`; for G = 2 as vector code written out in LLVM IR: 8 keys' dot products
    summed across their lanes together, and the values' running sums kept in registers): bf16
    is its 16 high bits of an fp32, fp8 e4m3 a shift of its exponent and mantissa (its value
    times 2^-8: the 2^8 joins fp8's per-layer scale), int8 a conversion times its token's scale,
    so the bytes a step reads are the bytes `roofline.kv_bytes_per_token` counts, not an fp32
    copy made first; on a CPU with AVX512-VNNI an int8 cache (dh = 64) is attended in integers
    instead (`_attend_pair_int8`: q and the softmax weights rounded to int16, the codes only
    sign-extended, two products summed per instruction), half the vector instructions a key;
  * the elementwise work between them (RMS norm, RoPE, SwiGLU, the new token's cache write) is a
    few vectors per row, where a numpy call's own cost (~1-3 us) outweighs its arithmetic: one
    fused call each (`rms_norm`, `rotate_in_place`, `swiglu`, `store_int8`, `store_rounded` for
    bf16/fp16/fp8 as torch's conversions round, `store_as_is`) instead of 4-8 numpy or torch calls.

Pseudocode of the attention, one (row b, kv head h) unit per task, G = H / Hkv queries per unit:
    n = lengths[b]                                   # keys this row sees, the new one included
    s[g, t] = (q[g] . widen(K[t])) * k_scale[t]      # t < n; q pre-scaled by 1/sqrt(dh)
    p[g, t] = exp(s[g, t] - max_t s[g]) * v_scale[t] # int8: per token; fp8: one per layer, below
    out[g]  = sum_t p[g, t] widen(V[t]) / sum_t exp(s[g, t] - max_t s[g])

Storage the kernels read (numpy has no bf16 or fp8, so those travel as their bits):
  fp32 -> float32; bf16 -> uint16 (its bits); fp16 -> int16 (its bits); fp8 e4m3 -> uint8 (its
  bits); int8 -> int8.

numba is pinned in requirements.txt but not a core dependency (a GPU image need not have it):
`AVAILABLE` says whether the kernels exist; without numba the CPU step keeps its numpy path.
Compiled code is cached beside this file (numba's `cache=True`), so a new process loads it. The
kernels run on the calling thread and release the GIL: callers split the work across cores with
`cpu_blas.on_every_core` (one pool for the whole step, the caller's thread working too).

Shapes: x [B, K]; w [N, K] (a linear's [out, in] weight, contiguous); q, out [B, Hkv, G, dh];
K, V [B, Hkv, S_max, dh]; int8 scales [B, Hkv, S_max]; lengths [B].
"""
from __future__ import annotations

import functools

import numpy as np

try:
    import numba
    from llvmlite import binding, ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic, overload
except ImportError:  # the core installs without numba (a GPU image): the CPU step keeps numpy's path
    numba = None

AVAILABLE = numba is not None
# How far ahead of the key it works on the attention asks the CPU for K (or V) rows, in bytes of
# cache (`keys_ahead`: 32 keys of fp32 at dh = 64, 128 of int8 or fp8). One core streaming an fp32
# cache alone read 10 GB/s without, 15 GB/s with 32 keys ahead. Counted in keys, a one-byte cache
# was asked for 4x closer, too close once the weights had pushed part of it out of the L3: lab-cpu's
# int8 attention at B = 16, S = 4,096 after a 60 MiB sweep 2.24 ms at 2 KiB ahead, 1.98 at 8 KiB
# (alone 1.77-1.80 either way); fp8 2.67 against 2.46 (2-core Xeon VM).
PREFETCH_BYTES_AHEAD = 8 << 10
# Bytes of weight rows ahead whose lines the streamed products ask for while they multiply this
# row: the hardware's prefetchers alone left the lab's 49,152 x 256 LM head streaming well under
# the DRAM's rate once compute came between the loads (see `streamed_row_dot_linear`).
PREFETCH_WEIGHT_BYTES_AHEAD = 32 << 10
# `panel_linear`: output columns per panel (one 512-bit vector of fp32), rows per register tile (16
# sums of 16 lanes fill half of AVX-512's 32 vector registers; 8, then 4, for the rows past the last
# 16: a batch of 4 as one 4-row tile, not padded to 8, took half the FMAs and no padded copy), and
# how many panels ahead a tile asks for, into the L2 (16 KiB each at K = 256: 64 KiB ahead).
# From 8 rows on, a tile spans two adjacent panels (PANEL_PAIR_ROWS rows of 8, then 4, x 32
# columns): each broadcast of x then feeds two FMAs, so a step of K loads 10 values for 16 FMAs
# where the 16-row tile of one panel loaded 17. One core, K = 256, 32 rows: 197-201 -> 217-226
# GFLOP/s (N = 49,152 and 2,048); lab-cpu's head at 32 rows on 2 cores 2.16-2.40 -> 1.91-1.98 ms, at
# 64 rows 4.75-5.12 -> 3.90-4.00 (2-core EPYC VM, Zen 5). Each output still sums its K products in
# the same order, so the results are the same bits. Below 8 rows the single panels stay: streaming
# two panels at once, the 49,152-column head at 4 rows took 1.39-1.42 ms on one core against 1.11-1.16.
PANEL_COLUMNS, PANEL_TILE_ROWS, PANEL_PREFETCH_AHEAD = 16, (16, 8, 4), 4
PANEL_PAIR_ROWS = (8, 4)
# `store_rounded`'s codes for the caches it writes, and where torch's fp32 -> e4m3 gives NaN (0x7F):
# |x| >= 480.0, these bits
ROUNDED_STORES = {"bf16": 1, "fp16": 2, "fp8": 3}
_FP8_NAN_FROM_BITS = np.uint32(1087 << 20)
# Head sizes whose G = 2 attention runs as vector code written out below (`_pair_scores_8`,
# `_pair_values_dh`: a row of K or V is one vector of dh values): lab-cpu's 64 and lab-tiny's 16 (the
# tests'); other sizes keep the scalar loops (each size more costs ~0.3 s of compiling per cache dtype).
VECTOR_HEAD_DIMS = (16, 64)
# An int8 cache at this head size (lab-cpu's) on a CPU with AVX512-VNNI is attended in integers
# (`_attend_pair_int8`): q and the softmax weights rounded to 16-bit integers (INT16_MAX at their
# largest), each int8 key or value only sign-extended, the products summed by vpdpwssd in int32
# over at most INT8_BLOCK_KEYS keys at a time (32,767 x 127 per product: 256 of them stay < 2^31).
# Tried and not kept: the K pass on AMX's tiles (q's int16 as a signed high and a shifted low
# byte, a column of ones, one tdpbssd per 16 keys: the same int32 sums as here). One core, 4,096
# keys: the K pass 8.3 -> 6.2 us of the unit's 17.5; in lab-cpu's step at B = 16, S = 4,096
# attention took 1.64-1.75 ms against 1.60-1.70 (3 alternating processes): there the cache's
# stream, not the arithmetic, sets its pace. Not worth its tile setup and Linux's permission
# request (2-core Xeon VM).
INT8_DOT_HEAD_DIM, INT16_MAX, INT8_BLOCK_KEYS = 64, 32767, 256


def pack_panels(w):
    """w [N, K] (a linear's [out, in] weight, any strides) -> panels [ceil(N / 16), K, 16] fp32,
    C-contiguous: panel p holds output columns 16 p .. 16 p + 15, row k their weights for input k
    (columns past N are zeros). The layout `panel_linear` streams: each panel one contiguous run."""
    N, K = w.shape
    padded = np.zeros((-(-N // PANEL_COLUMNS) * PANEL_COLUMNS, K), np.float32)
    padded[:N] = w
    return np.ascontiguousarray(padded.reshape(-1, PANEL_COLUMNS, K).transpose(0, 2, 1))


@functools.lru_cache(maxsize=1)
def panels_in_registers() -> bool:
    """Whether this CPU has AVX-512 (32 vector registers of 16 fp32), the registers `panel_linear`'s
    16 x 16 tile is written for: elsewhere its sums spill to memory (AVX2 has 16 registers of 8),
    so the panel product is chosen only here (`cpu_linear`); it is right everywhere (tested)."""
    if not AVAILABLE:
        return False
    return "+avx512f" in binding.get_host_cpu_features().flatten().split(",")


@functools.lru_cache(maxsize=1)
def int8_in_integers() -> bool:
    """Whether this CPU has AVX512-VNNI (and AVX512-BW), the instructions `_attend_pair_int8` is
    written with; elsewhere an int8 cache is widened to fp32 like the others."""
    if not AVAILABLE:
        return False
    features = binding.get_host_cpu_features().flatten().split(",")
    return "+avx512vnni" in features and "+avx512bw" in features


# ------------------------------------------------------------------ references (numpy)
def few_rows_linear_reference(x, w):
    """x [B, K] @ w [N, K].T -> [B, N] fp32, the product `few_rows_linear` computes."""
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


def widen_reference(stored):
    """A cache block as stored (float32, uint16 bf16 bits, int16 fp16 bits, uint8 fp8 bits, int8
    codes) -> fp32,
    by torch's own casts (an independent check of the kernels' bit tricks)."""
    import torch  # only the reference needs torch's bf16/fp8 casts; the kernels never do
    t = torch.from_numpy(np.ascontiguousarray(stored))
    if stored.dtype == np.uint16:
        t = t.view(torch.bfloat16)
    elif stored.dtype == np.int16:
        t = t.view(torch.float16)
    elif stored.dtype == np.uint8:
        t = t.view(torch.float8_e4m3fn)
    return t.float().numpy()


def decode_attention_reference(q, k, v, k_scale, v_scale, lengths):
    """The attention of the module docstring in float64 numpy: q [B, Hkv, G, dh] (pre-scaled),
    k, v as stored [B, Hkv, S_max, dh], k_scale/v_scale per token [B, Hkv, S_max] or a number,
    lengths [B] -> [B, Hkv, G, dh] fp32."""
    K, V = widen_reference(k).astype(np.float64), widen_reference(v).astype(np.float64)
    out = np.zeros(q.shape, np.float64)
    for b, n in enumerate(lengths):
        ks = k_scale[b, :, None, :n] if np.ndim(k_scale) else k_scale  # [Hkv, 1, n] or a number
        vs = v_scale[b, :, :n, None] if np.ndim(v_scale) else v_scale  # [Hkv, n, 1] or a number
        s = q[b].astype(np.float64) @ K[b, :, :n].transpose(0, 2, 1) * ks  # [Hkv, G, n]
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = p @ (V[b, :, :n] * vs) / p.sum(-1, keepdims=True)
    return out.astype(np.float32)


# ------------------------------------------------------------------ kernels (numba)
if AVAILABLE:
    _INT8_IN_INTEGERS = int8_in_integers()  # read as `_attended_in_integers` is typed: without VNNI its code is never compiled

    @intrinsic
    def _bits_as_float32(typingctx, bits):
        """The fp32 whose bits are the low 32 bits of the integer `bits` (a register
        reinterpretation; numba widens integer arithmetic to 64 bits, so the high half is dropped)."""
        if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
            return None

        def codegen(context, builder, signature, args):
            low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
            return builder.bitcast(low, ir.FloatType())
        return types.float32(bits), codegen

    @intrinsic
    def _half_bits_as_float32(typingctx, bits):
        """The fp32 value of the fp16 whose bits are the low 16 bits of the integer `bits`."""
        if not isinstance(bits, types.Integer) or bits.bitwidth < 16:
            return None

        def codegen(context, builder, signature, args):
            low = args[0] if bits.bitwidth == 16 else builder.trunc(args[0], ir.IntType(16))
            return builder.fpext(builder.bitcast(low, ir.HalfType()), ir.FloatType())
        return types.float32(bits), codegen

    @intrinsic
    def _prefetch(typingctx, array, row, col):
        """Ask the CPU to bring the cache line of array[row, col] (a 2-D array) in; no effect on
        results (LLVM's prefetch: a read, kept in every cache level)."""
        if not isinstance(array, types.Array) or array.ndim != 2:
            return None

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            data = context.make_array(array_type)(context, builder, args[0])
            index = [context.cast(builder, value, ty, types.intp) for value, ty in zip(args[1:], signature.args[1:])]
            pointer = cgutils.get_item_pointer(context, builder, array_type, data, index, wraparound=False)
            byte = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch.p0")
            builder.call(prefetch, [builder.bitcast(pointer, byte), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return types.none(array, row, col), codegen

    @numba.njit(inline="always")
    def _prefetch_weight_rows(w, row, rows, stop):
        """Prefetch every line of weight rows `row` .. `row + rows - 1` of w [N, K] that lie
        below `stop` (the caller's share of the rows: none is fetched for another thread)."""
        step = 64 // w.itemsize
        for r in range(row, min(row + rows, stop)):
            for col in range(0, w.shape[1], step):
                _prefetch(w, r, col)

    def _rows_ahead(row_bytes):
        """Rows of `row_bytes` each in PREFETCH_BYTES_AHEAD (at least 1): how far ahead the attention
        asks for K or V rows (`keys_ahead` in numba code, the LLVM IR passes at codegen)."""
        return max(1, PREFETCH_BYTES_AHEAD // row_bytes)

    @numba.njit(inline="always")
    def keys_ahead(array):
        """`_rows_ahead` for a [rows, dh] cache block."""
        return max(1, PREFETCH_BYTES_AHEAD // (array.shape[1] * array.itemsize))

    @numba.njit(inline="always")
    def _prefetch_row(array, row):
        """Prefetch row `row` of a [rows, dh] cache block: its first 4 cache lines (a whole row
        up to 256 bytes: dh = 64 in fp32; longer rows' tails are left to the hardware)."""
        step = max(1, 64 // array.itemsize)  # values per 64-byte line
        lines = (array.shape[1] + step - 1) // step
        _prefetch(array, row, 0)
        if lines > 1:
            _prefetch(array, row, step)
        if lines > 2:
            _prefetch(array, row, 2 * step)
        if lines > 3:
            _prefetch(array, row, 3 * step)

    def widen(code):
        """One stored cache value -> fp32 (see the module docstring), in units of `widen_unit`
        (fp8: 2^8; the others: their value); typed per storage."""

    @overload(widen)
    def _widen(code):
        if code == types.float32:
            return lambda code: code
        if code == types.uint16:  # bf16: the high half of an fp32
            return lambda code: _bits_as_float32(np.uint32(code) << np.uint32(16))
        if code == types.int16:  # fp16: its bits, converted by the CPU
            return lambda code: _half_bits_as_float32(code)
        if code == types.int8:
            return lambda code: np.float32(code)
        if code == types.uint8:  # fp8 e4m3 (sign 1, exponent 4 with bias 7, mantissa 3)
            def fp8(code):
                # Its 7 exponent-and-mantissa bits shifted left by 7 are the fp16 of the same value
                # times 2^-8 (bias 15 vs 7; e4m3's subnormals land on fp16's), exact for every finite
                # code; the CPU converts fp16 to fp32 in one instruction. Sign-extended to 16 bits
                # first, the shift also puts the sign in fp16's bit 15, and one mask (0xBF80) clears
                # its copy in bit 14: 3 integer instructions a vector where and-shift-or took 5.
                # The 2^8 is left to the caller (`widen_unit`): one multiply a call, not one a value.
                shifted = np.int16(np.int16(np.int8(code)) << np.int16(7))
                return _half_bits_as_float32(shifted & np.int16(-0x4080))
            return fp8
        return None

    def widen_unit(array):
        """What `widen`'s values of this storage count in: fp8's are its values times 2^-8, so
        2^8 (exact: a power of two); 1 for the others. The attention folds it into fp8's
        per-layer scales (saves a multiply per value: fp8's attention ~10 % faster, Zen 3)."""

    @overload(widen_unit)
    def _widen_unit(array):
        unit = np.float32(256.0) if array.dtype == types.uint8 else np.float32(1.0)
        return lambda array: unit

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
                a0 = a1 = a2 = a3 = np.float32(0)
                for k in range(K):
                    xv = x[b, k]
                    a0 += xv * w[j, k]; a1 += xv * w[j + 1, k]  # noqa: E702
                    a2 += xv * w[j + 2, k]; a3 += xv * w[j + 3, k]  # noqa: E702
                out[b, j], out[b, j + 1], out[b, j + 2], out[b, j + 3] = a0, a1, a2, a3
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
                a0 = a1 = a2 = a3 = np.float32(0)
                for k in range(K):
                    xv = x[b, k]
                    a0 += xv * w[j, k]; a1 += xv * w[j + 1, k]  # noqa: E702
                    a2 += xv * w[j + 2, k]; a3 += xv * w[j + 3, k]  # noqa: E702
                out[b, j], out[b, j + 1], out[b, j + 2], out[b, j + 3] = a0, a1, a2, a3
            j += 4
        row_dot_linear(x, w, out, j, stop)  # the last, partial group

    # ---- the panel product: x [B, K] (B a multiple of 4) @ panels [P, K, 16] -> out [B, 16 P]. Every
    # step of K is one vector load of the panel's row k, then per row of the tile a broadcast of xt[k, b]
    # and one FMA into that row's 16 sums, which live in registers from k = 0 to K - 1 (an LLVM loop
    # written out below: numba gives no vector types). One line of the panel PANEL_PREFETCH_AHEAD ahead
    # is asked for per step of K, so the weight streams in while the tile multiplies.
    def _splat(builder, value, lanes):
        """The scalar `value` (a float, an i32, ...) in every lane of a <lanes x its type> vector."""
        vector = ir.VectorType(value.type, lanes)
        first = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.IntType(32)(0))
        return builder.shuffle_vector(first, ir.Constant(vector, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))

    def _loop_open(builder, first, stop, name, starts):
        """Open a one-block loop over counter = first, .. < stop (none if first >= stop), carrying
        sums that start as `starts` (vectors): (entry, loop, done, counter, the sums' phis), the
        builder inside the loop; `_loop_back` closes it."""
        entry = builder.block
        loop, done = builder.append_basic_block(name), builder.append_basic_block(f"{name}_done")
        builder.cbranch(builder.icmp_signed("<", first, stop), loop, done)
        builder.position_at_end(loop)
        counter = builder.phi(ir.IntType(64))
        counter.add_incoming(first, entry)
        phis = []
        for start in starts:
            phi = builder.phi(start.type)
            phi.add_incoming(start, entry)
            phis.append(phi)
        return entry, loop, done, counter, phis

    def _loop_back(builder, counter, bound, phis, values, loop, done, step=1):
        """Close a one-block loop: counter + step and `values` flow back into `counter` and `phis`;
        on to `done` once counter + step reaches `bound`."""
        following = builder.add(counter, ir.IntType(64)(step))
        counter.add_incoming(following, loop)
        for phi, value in zip(phis, values):
            phi.add_incoming(value, loop)
        builder.cbranch(builder.icmp_signed("<", following, bound), loop, done)
        builder.position_at_end(done)

    def _panel_tile_codegen(rows, width):
        def codegen(context, builder, signature, args):
            xt_type, _, panels_type, _, _, out_type = signature.args
            xt, panels, out = (context.make_array(t)(context, builder, a)
                               for t, a in ((xt_type, args[0]), (panels_type, args[2]), (out_type, args[5])))
            i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
            vector = ir.VectorType(f32, PANEL_COLUMNS)
            first_row, panel, last = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 3, 4))
            K, rows_in_x = cgutils.unpack_tuple(builder, xt.shape, 2)
            _, N = cgutils.unpack_tuple(builder, out.shape, 2)
            panel_values = builder.mul(K, i64(PANEL_COLUMNS))
            x_rows = builder.gep(xt.data, [first_row])  # xt[0, first_row]
            weights, fetched = [], []  # per panel of the tile: panels[panel + c, 0, 0], and the one asked for ahead
            for c in range(width):
                weights.append(builder.gep(panels.data, [builder.mul(builder.add(panel, i64(c)), panel_values)]))
                ahead = builder.add(panel, i64(PANEL_PREFETCH_AHEAD + c))
                ahead = builder.select(builder.icmp_signed("<", ahead, last), ahead, last)  # never past `last`
                fetched.append(builder.gep(panels.data, [builder.mul(ahead, panel_values)]))
            byte = ir.IntType(8).as_pointer()
            prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch.p0")
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                vector, [vector, vector, vector]), f"llvm.fmuladd.v{PANEL_COLUMNS}f32")
            entry = builder.block
            loop, done = builder.append_basic_block("panel_k"), builder.append_basic_block("panel_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(i64(0), entry)
            sums = []  # [rows * width]: row r's sums for panel c at r * width + c
            for _ in range(rows * width):  # the tile's sums: zeros on entry, the last step's on every other
                phi = builder.phi(vector)
                phi.add_incoming(ir.Constant(vector, None), entry)
                sums.append(phi)
            offset = builder.mul(k, i64(PANEL_COLUMNS))
            w = [builder.load(builder.bitcast(builder.gep(start, [offset]), vector.as_pointer()), align=4)
                 for start in weights]
            # locality 2: into the L2 and L3, not the L1 (the LM head at 16 rows from DRAM, fastest of 12
            # alternating: 2.52 ms against 2.73 into the L1; from the L3 the same)
            for start in fetched:
                builder.call(prefetch, [builder.bitcast(builder.gep(start, [offset]), byte), i32(0), i32(2), i32(1)])
            new = []
            x_step = builder.gep(x_rows, [builder.mul(k, rows_in_x)])  # xt[k, first_row]: the tile's x, adjacent
            for r in range(rows):
                value = _splat(builder, builder.load(builder.gep(x_step, [i64(r)])), PANEL_COLUMNS)
                new.extend(builder.call(fma, [value, w[c], sums[r * width + c]]) for c in range(width))
            _loop_back(builder, k, K, sums, new, loop, done)
            for r in range(rows):
                row = builder.add(first_row, i64(r))
                for c in range(width):
                    column = builder.mul(builder.add(panel, i64(c)), i64(PANEL_COLUMNS))
                    target = builder.gep(out.data, [builder.add(builder.mul(row, N), column)])
                    builder.store(new[r * width + c], builder.bitcast(target, vector.as_pointer()), align=4)
            return context.get_dummy_value()
        return codegen

    def _panel_tile_for(rows, width=1):
        """The tile of `rows` rows and `width` adjacent panels: out[first_row : first_row + rows,
        16 panel : 16 (panel + width)] = those rows of x @ the panels; xt [K, B] (x transposed),
        panels [P, K, 16], out [B, 16 P], fp32 C-contiguous."""
        def typer(typingctx, xt, first_row, panels, panel, last, out):
            if not all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" and a.ndim == n
                       for a, n in ((xt, 2), (panels, 3), (out, 2))):
                return None
            return types.none(xt, first_row, panels, panel, last, out), _panel_tile_codegen(rows, width)
        return intrinsic(typer)

    _panel_tile_16, _panel_tile_8, _panel_tile_4 = (_panel_tile_for(rows) for rows in PANEL_TILE_ROWS)
    _pair_tile_8, _pair_tile_4 = (_panel_tile_for(rows, 2) for rows in PANEL_PAIR_ROWS)

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def _panel_linear_t(xt, panels, out, first, stop):
        """`panel_linear` for x given transposed, xt [K, B] C-contiguous."""
        B = xt.shape[1]
        panel = first
        while B >= PANEL_PAIR_ROWS[0] and panel + 2 <= stop:  # two panels a tile
            row = 0
            while row + 8 <= B:
                _pair_tile_8(xt, row, panels, panel, stop - 1, out)
                row += 8
            if row < B:
                _pair_tile_4(xt, row, panels, panel, stop - 1, out)
            panel += 2
        for panel in range(panel, stop):  # one panel a tile: below 8 rows, and an odd last panel
            row = 0
            while row + 16 <= B:
                _panel_tile_16(xt, row, panels, panel, stop - 1, out)
                row += 16
            if row + 8 <= B:
                _panel_tile_8(xt, row, panels, panel, stop - 1, out)
                row += 8
            if row < B:
                _panel_tile_4(xt, row, panels, panel, stop - 1, out)

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def panel_linear(x, panels, out, first, stop):
        """out[:, 16 first : 16 stop] of x [B, K] @ panels [P, K, 16] (`pack_panels`), B a multiple of
        4 (callers pad x with zero rows), out [B, 16 P]: panels `first` .. `stop` - 1. From 8 rows
        on, two panels at a time, met by tiles of 8 rows and one of 4 as the rest needs (`PANEL_PAIR_ROWS`);
        below 8 rows, and for an odd last panel, one panel at a time, met by tiles of 16 rows, then
        one of 8 and one of 4. The panels (16 KiB each at K = 256) stay in L1 between the tiles.
        x, panels, out fp32 and C-contiguous.

        The tile reads x transposed (a copy, [K, B]): its rows' x[b, k] are then adjacent, each
        broadcast a fixed offset from one pointer that moves once per k. Read in place, each row's
        address took a scalar add per FMA on the ports the FMAs use. One core, 16 or 32 rows, N = 2,048
        to 49,152 at K = 256: 158-177 GFLOP/s read in place, 175-190 transposed (the FMA peak ~218);
        lab-cpu's head at 32 rows on 2 cores 2.46 -> 2.14 ms (2-core Xeon VM)."""
        _panel_linear_t(np.ascontiguousarray(x.T), panels, out, first, stop)

    @numba.njit(nogil=True, fastmath=True, parallel=True, cache=True)
    def panel_linear_on_cores(x, panels, out, parts):
        """`panel_linear` over all P panels in `parts` near-equal shares, one per numba thread (x
        transposed once, for all of them).

        What sharing costs: the copy is written by this thread, and both threads then read it
        from each other's caches. lab-cpu's o projection (N = 256) at 16 rows: each thread's half
        took 9.1 us with a copy made just before, 5.8 with one made long before (and 5.7 on one
        thread alone). A copy per thread, made inside the parallel region, was no faster in a
        chain of 16 products (-0.6 to +0.9 us a product up to 16 rows, slower at 32): the
        activations cross between the cores either way (2-core Xeon VM)."""
        P = panels.shape[0]
        xt = np.ascontiguousarray(x.T)
        for p in numba.prange(parts):  # shares of whole pairs of panels; the last takes an odd one
            first = (P * p // parts) // 2 * 2
            stop = P if p == parts - 1 else (P * (p + 1) // parts) // 2 * 2
            _panel_linear_t(xt, panels, out, first, stop)

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

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def decode_attention(q, k, v, per_token, k_scale, v_scale, k_scale_all, v_scale_all, lengths, out,
                         first, stop):
        """out [B, Hkv, G, dh] = the attention of the module docstring over a cache as stored, for
        the (row, kv head) units `first` .. `stop` - 1 of the B * Hkv (callers share them out to
        threads: the GIL is released, `cpu_decode`).

        per_token: int8's per-token scales k_scale, v_scale [B, Hkv, S_max] apply (else they are
        not read: pass any [1, 1, 1] float32 array); k_scale_all, v_scale_all: fp8's per-layer
        scale (1.0 for the others)."""
        Hkv = q.shape[1]
        k_scale_all, v_scale_all = k_scale_all * widen_unit(k), v_scale_all * widen_unit(v)
        for unit in range(first, stop):
            b, h = unit // Hkv, unit % Hkv
            ks = k_scale[b, h] if per_token else k_scale[0, 0]
            vs = v_scale[b, h] if per_token else v_scale[0, 0]
            if q.shape[2] == 2:  # the lab's CPU models: 2 queries per kv head
                _attend_pair(q[b, h], k[b, h], v[b, h], per_token, ks, vs, k_scale_all, v_scale_all,
                             lengths[b], out[b, h])
            else:
                _attend_one(q[b, h], k[b, h], v[b, h], per_token, ks, vs, k_scale_all, v_scale_all,
                            lengths[b], out[b, h])

    @numba.njit(nogil=True, fastmath=True, parallel=True, cache=True)
    def decode_attention_on_cores(q, k, v, per_token, k_scale, v_scale, k_scale_all, v_scale_all, lengths,
                                  out, parts):
        """`decode_attention` over all B * Hkv units in `parts` near-equal shares, one per numba
        thread (see `linear_on_cores` for why numba's pool)."""
        units = q.shape[0] * q.shape[1]
        for p in numba.prange(parts):
            decode_attention(q, k, v, per_token, k_scale, v_scale, k_scale_all, v_scale_all, lengths, out,
                             units * p // parts, units * (p + 1) // parts)

    # ---- G = 2 attention as vector code (LLVM IR; numba gives no vector types). A row of K or V is
    # loaded as one <dh x stored> vector and widened as `widen` does, lane by lane (`_widen_vector`).
    # K pass: for 8 keys, q0 * k and q1 * k are folded to 16 lanes each, and the 8 keys' 16-lane sums
    # are added across their lanes together by 4 rounds of shuffles (`_sum_lanes_of_8`): about 3
    # instructions a key where one key's own reduction took 8. V pass: o0, o1 stay in registers over
    # every key, one FMA each per key, the row PREFETCH_BYTES_AHEAD ahead asked for.
    _STORED_IR = {types.float32: ("fp32", ir.FloatType()), types.uint16: ("bf16", ir.IntType(16)),
                  types.int16: ("fp16", ir.IntType(16)), types.uint8: ("fp8", ir.IntType(8)),
                  types.int8: ("int8", ir.IntType(8))}
    _FAST = ("fast",)
    _ROW_BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}

    def _widen_vector(builder, raw, kind, n):
        """<n x stored> -> <n x float>, bit for bit `widen` (fp8 in units of 2^-8, see `widen`)."""
        i16, i32, f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
        if kind == "fp32":
            return raw
        if kind == "bf16":  # the high half of an fp32
            wide = builder.shl(builder.zext(raw, ir.VectorType(i32, n)), ir.Constant(ir.VectorType(i32, n), [16] * n))
            return builder.bitcast(wide, ir.VectorType(f32, n))
        if kind == "fp16":
            return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), n)), ir.VectorType(f32, n))
        if kind == "int8":
            return builder.sitofp(raw, ir.VectorType(f32, n))
        wide = builder.shl(builder.sext(raw, ir.VectorType(i16, n)), ir.Constant(ir.VectorType(i16, n), [7] * n))
        wide = builder.and_(wide, ir.Constant(ir.VectorType(i16, n), [-0x4080] * n))  # fp8: as `widen`
        return builder.fpext(builder.bitcast(wide, ir.VectorType(ir.HalfType(), n)), ir.VectorType(f32, n))

    def _shuffle(builder, a, b, lanes):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes))

    def _bf16_halves(builder, array, row, dh):
        """Row `row` of a bf16 [rows, dh] array (as uint16 bits, rows contiguous) widened as two
        <dh / 2 x float>: (values 0, 2, 4, ..., values 1, 3, 5, ...). Each 32-bit word holds two
        values, the even one in its low half (little-endian), so one shift and one mask widen 32
        values where zero-extending and shifting took two of each; `_split_even_odd` lays a
        query (or sums) out the same way. Bit for bit `widen`."""
        i32, f32, n = ir.IntType(32), ir.FloatType(), dh // 2
        words = builder.load(builder.bitcast(_row_bytes(builder, array, row), ir.VectorType(i32, n).as_pointer()), align=1)
        even = builder.shl(words, ir.Constant(ir.VectorType(i32, n), [16] * n))
        odd = builder.and_(words, ir.Constant(ir.VectorType(i32, n), [-0x10000] * n))
        return tuple(builder.bitcast(w, ir.VectorType(f32, n)) for w in (even, odd))

    def _in_halves(kind, dh):
        """Whether the K and V passes widen this cache as `_bf16_halves` does: bf16, with halves
        of 16 lanes or more (`_fold_to_16`'s smallest)."""
        return kind == "bf16" and dh >= 32

    def _split_even_odd(builder, v, dh):
        """<dh x float> -> (its even lanes, its odd lanes), two <dh / 2 x float>."""
        return (_shuffle(builder, v, v, list(range(0, dh, 2))), _shuffle(builder, v, v, list(range(1, dh, 2))))

    def _join_even_odd(builder, even, odd, dh):
        """`_split_even_odd` undone: lane 2 i from even[i], lane 2 i + 1 from odd[i]."""
        return _shuffle(builder, even, odd, [i // 2 + (dh // 2 if i % 2 else 0) for i in range(dh)])

    def _row_bytes(builder, array, row):
        """An i8* to row `row` of a [rows, dh] array whose rows are contiguous (any row stride)."""
        stride = cgutils.unpack_tuple(builder, array.strides, 2)[0]
        return builder.gep(builder.bitcast(array.data, ir.IntType(8).as_pointer()), [builder.mul(row, stride)])

    def _load_row(builder, array, row, dh, element):
        """Row `row` of a [rows, dh] array (its rows contiguous) as one <dh x element> vector."""
        pointer = _row_bytes(builder, array, row)
        return builder.load(builder.bitcast(pointer, ir.VectorType(element, dh).as_pointer()), align=1)

    def _fold_to_16(builder, v, dh):
        """<dh x float> -> <16 x float>: its dh / 16 runs of 16 lanes added."""
        runs = [_shuffle(builder, v, v, list(range(c, c + 16))) for c in range(0, dh, 16)]
        while len(runs) > 1:
            runs = [builder.fadd(runs[i], runs[i + 1], flags=_FAST) for i in range(0, len(runs), 2)]
        return runs[0]

    def _sum_lanes_of_8(builder, vectors, add=None):
        """8 vectors <16 x float> -> one <8 x float> whose lane j is the sum of vectors[j]'s lanes
        (`add`: how two vectors add, fast fadd by default; the int8 pass's int32 give builder.add).
        Each round pairs the vectors up and keeps, of each key's `width` partial sums, the first
        half plus the second: 16 partials a key in 8 vectors, then 8 in 4, 4 in 2, 2 in 1."""
        add = add or (lambda a, b: builder.fadd(a, b, flags=_FAST))
        width = 16
        while len(vectors) > 1:
            groups = 16 // width
            low = [g * width + e for g in range(groups) for e in range(width // 2)]
            high = [i + width // 2 for i in low]
            vectors = [add(_shuffle(builder, a, b, low + [16 + i for i in low]),
                           _shuffle(builder, a, b, high + [16 + i for i in high]))
                       for a, b in zip(vectors[0::2], vectors[1::2])]
            width //= 2
        last = vectors[0]  # 8 keys x 2 partials
        return add(_shuffle(builder, last, last, list(range(0, 16, 2))), _shuffle(builder, last, last, list(range(1, 16, 2))))

    def _store_scores_8(builder, scores, out, t, tops, q):
        """A K-pass block's end: scores <8 x float> into out[t : t + 8], and query q's 8 running
        maxima (tops[8 q : 8 q + 8]) raised to them."""
        eight = ir.VectorType(ir.FloatType(), 8)
        builder.store(scores, builder.bitcast(builder.gep(out.data, [t]), eight.as_pointer()), align=4)
        top = builder.bitcast(builder.gep(tops.data, [ir.IntType(64)(8 * q)]), eight.as_pointer())
        old = builder.load(top, align=4)
        builder.store(builder.select(builder.fcmp_ordered(">", scores, old), scores, old), top, align=4)

    def _pair_scores_8_for(dh, scaled):
        """The K pass's block for head size dh: s0[t : t + 8], s1[t : t + 8] = q0 . widen(k[t + j]),
        q1 . widen(k[t + j]) for j < 8, times k_scale[t + j] where `scaled` (int8's per-token
        scales; else k_scale is not read), and tops [16] (q0's 8 running maxima, then q1's) raised
        to them; q0, q1, s0, s1, tops contiguous fp32, k [S_max, dh] as stored with contiguous rows
        (the cache's are). The scaling and the maxima as vectors here: a scalar loop after each block
        took a fifth of the K pass (bf16 at 4,096 keys, one core: 15.0 us, the blocks alone 12.1)."""
        def typer(typingctx, q0, q1, k, t, k_scale, s0, s1, tops):
            if not (isinstance(k, types.Array) and k.dtype in _STORED_IR and k.ndim == 2):
                return None
            if scaled and not (isinstance(k_scale, types.Array) and k_scale.ndim == 1):
                return None
            kind, element = _STORED_IR[k.dtype]

            def codegen(context, builder, signature, args):
                q0, q1, k, _, scales, s0, s1, tops = (
                    context.make_array(ty)(context, builder, a) if isinstance(ty, types.Array) else None
                    for ty, a in zip(signature.args, args))
                t = context.cast(builder, args[3], signature.args[3], types.intp)
                f32, i64 = ir.FloatType(), ir.IntType(64)
                eight = ir.VectorType(f32, 8)
                queries = [builder.load(builder.bitcast(q.data, ir.VectorType(f32, dh).as_pointer()), align=4)
                           for q in (q0, q1)]
                halves = _in_halves(kind, dh)
                if halves:
                    queries = [_split_even_odd(builder, query, dh) for query in queries]
                sums = ([], [])
                for j in range(8):
                    row = builder.add(t, i64(j))
                    if halves:
                        even, odd = _bf16_halves(builder, k, row, dh)
                        for (q_even, q_odd), partial in zip(queries, sums):
                            both = builder.fadd(builder.fmul(q_even, even, flags=_FAST),
                                                builder.fmul(q_odd, odd, flags=_FAST), flags=_FAST)
                            partial.append(_fold_to_16(builder, both, dh // 2))
                        continue
                    key = _widen_vector(builder, _load_row(builder, k, row, dh, element), kind, dh)
                    for query, partial in zip(queries, sums):
                        partial.append(_fold_to_16(builder, builder.fmul(query, key, flags=_FAST), dh))
                factor = None
                if scaled:  # k_scale[t : t + 8], one vector load where its values are adjacent
                    scale_type = signature.args[4]
                    if scale_type.layout == "C":
                        factor = builder.load(builder.bitcast(builder.gep(scales.data, [t]), eight.as_pointer()), align=4)
                    else:
                        factor = ir.Constant(eight, ir.Undefined)
                        for j in range(8):
                            pointer = cgutils.get_item_pointer(context, builder, scale_type, scales,
                                                               [builder.add(t, i64(j))], wraparound=False)
                            factor = builder.insert_element(factor, builder.load(pointer), ir.IntType(32)(j))
                for q, (partial, out) in enumerate(zip(sums, (s0, s1))):
                    scores = _sum_lanes_of_8(builder, partial)
                    if factor is not None:
                        scores = builder.fmul(scores, factor, flags=_FAST)
                    _store_scores_8(builder, scores, out, t, tops, q)
                return context.get_dummy_value()
            return types.none(q0, q1, k, t, k_scale, s0, s1, tops), codegen
        return intrinsic(typer)

    def _pair_values_for(dh):
        """The V pass for head size dh: o0 += sum_t p0[t] widen(v[t]), o1 likewise, t in first ..
        stop - 1; v [S_max, dh] as stored with contiguous rows; p0, p1, o0, o1 contiguous fp32 (o0, o1 [dh]
        in registers throughout)."""
        def typer(typingctx, v, first, stop, p0, p1, o0, o1):
            if not (isinstance(v, types.Array) and v.dtype in _STORED_IR and v.ndim == 2):
                return None
            kind, element = _STORED_IR[v.dtype]

            def codegen(context, builder, signature, args):
                v, _, _, p0, p1, o0, o1 = (context.make_array(ty)(context, builder, a) if isinstance(ty, types.Array)
                                           else None for ty, a in zip(signature.args, args))
                first, stop = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2))
                i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
                vector = ir.VectorType(f32, dh)
                starts = [builder.load(builder.bitcast(o.data, vector.as_pointer()), align=4) for o in (o0, o1)]
                halves = _in_halves(kind, dh)  # the sums as even and odd lanes
                if halves:
                    starts = [half for start in starts for half in _split_even_odd(builder, start, dh)]
                lanes = dh // 2 if halves else dh
                byte = i8.as_pointer()
                prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch.p0")
                sum_type = ir.VectorType(f32, lanes)
                fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    sum_type, [sum_type, sum_type, sum_type]), f"llvm.fmuladd.v{lanes}f32")
                last = builder.sub(stop, i64(1))
                entry, loop, done, t, sums = _loop_open(builder, first, stop, "values", starts)
                ahead = builder.add(t, i64(_rows_ahead(dh * _ROW_BYTES_PER_VALUE[kind])))
                ahead = builder.select(builder.icmp_signed("<", ahead, last), ahead, last)
                row = _row_bytes(builder, v, ahead)
                for line in range(0, dh * _ROW_BYTES_PER_VALUE[kind], 64):  # every line of the row ahead
                    builder.call(prefetch, [builder.gep(row, [i64(line)]), i32(0), i32(3), i32(1)])
                values = (_bf16_halves(builder, v, t, dh) if halves
                          else [_widen_vector(builder, _load_row(builder, v, t, dh, element), kind, dh)])
                new = []
                for q, p in enumerate((p0, p1)):
                    weight = _splat(builder, builder.load(builder.gep(p.data, [t])), lanes)
                    for h, value in enumerate(values):
                        new.append(builder.call(fma, [weight, value, sums[q * len(values) + h]]))
                _loop_back(builder, t, stop, sums, new, loop, done)
                finals = []
                for start, value in zip(starts, new):  # every phi first: LLVM wants them at the block's top
                    final = builder.phi(sum_type)
                    final.add_incoming(start, entry)
                    final.add_incoming(value, loop)
                    finals.append(final)
                if halves:
                    finals = [_join_even_odd(builder, finals[i], finals[i + 1], dh) for i in (0, 2)]
                for final, o in zip(finals, (o0, o1)):
                    builder.store(final, builder.bitcast(o.data, vector.as_pointer()), align=4)
                return context.get_dummy_value()
            return types.none(v, first, stop, p0, p1, o0, o1), codegen
        return intrinsic(typer)

    (_pair_scores_8_16, _pair_scores_8_64), (_scaled_scores_8_16, _scaled_scores_8_64) = (
        [_pair_scores_8_for(dh, scaled) for dh in VECTOR_HEAD_DIMS] for scaled in (False, True))
    _pair_values_16, _pair_values_64 = (_pair_values_for(dh) for dh in VECTOR_HEAD_DIMS)

    # ---- an int8 cache in integers (AVX512-VNNI, dh = 64). vpdpwssd multiplies 32 pairs of int16
    # and adds each pair's two products into one of 16 int32 lanes. The K pass: a key's 64 codes
    # sign-extended to int16 against q's 64 int16, two instructions a query, then 8 keys' 16 lanes
    # summed across as the float pass does (`_isum_lanes_of_8`). The V pass takes keys two at a
    # time: their rows interleaved, so each int32 lane holds one dimension of both, against the
    # pair of their weights broadcast; the interleave is a per-128-bit-lane unpack (one cheap
    # shuffle), which leaves the dimensions in INT8_VALUE_ORDER until the end.
    _VNNI_INT = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64))
    INT8_VALUE_ORDER = np.array([32 * h + 8 * lane + 4 * high + j for h in (0, 1) for high in (0, 1)
                                 for lane in range(4) for j in range(4)], np.int64)

    def _dpwssd(builder):
        """vpdpwssd (512-bit) as its saturating form, vpdpwssds: (int32 x 16 sums, int16 x 32,
        int16 x 32) -> int32 x 16. The same sums here: a block's never come near 2^31 (see
        INT8_BLOCK_KEYS). Why the saturating one: LLVM (llvmlite 0.45) split every vpdpwssd into
        vpmaddwd and vpaddd, two instructions where one does; vpdpwssds it keeps. lab-cpu's int8
        unit at 4,096 keys, one core: 19.6 -> 17.5 us (2-core Xeon VM)."""
        _, i16, i32, _ = _VNNI_INT
        v16i32, v32i16 = ir.VectorType(i32, 16), ir.VectorType(i16, 32)
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i32, [v16i32, v32i16, v32i16]),
                                              "llvm.x86.avx512.vpdpwssds.512")

    def _int16_halves(builder, array, row):
        """Row `row` of an int8 [rows, 64] array, sign-extended, as two <32 x i16> (dims 0-31, 32-63)."""
        i8, i16, _, _ = _VNNI_INT
        raw = builder.load(builder.bitcast(_row_bytes(builder, array, row), ir.VectorType(i8, 64).as_pointer()), align=1)
        wide = builder.sext(raw, ir.VectorType(i16, 64))
        return [_shuffle(builder, wide, wide, list(range(32 * h, 32 * h + 32))) for h in (0, 1)]

    @intrinsic
    def _int8_scores_8(typingctx, q0, q1, k, t, k_scale, sq0, sq1, s0, s1, tops):
        """s0[t + j] = (q0 . k[t + j]) k_scale[t + j] sq0 for j < 8, q0 int16 [64] (q / sq0), k int8
        [S_max, 64] with contiguous rows, k_scale [S_max] contiguous; s1 likewise; tops [16] (q0's 8
        running maxima, then q1's) raised to them."""
        if not (isinstance(k, types.Array) and k.dtype == types.int8 and k.ndim == 2
                and isinstance(k_scale, types.Array) and k_scale.layout == "C"):
            return None

        def codegen(context, builder, signature, args):
            arrays = [context.make_array(ty)(context, builder, a) if isinstance(ty, types.Array) else None
                      for ty, a in zip(signature.args, args)]
            q0, q1, k, _, scales, _, _, s0, s1, tops = arrays
            t = context.cast(builder, args[3], signature.args[3], types.intp)
            factors = [context.cast(builder, args[i], signature.args[i], types.float32) for i in (5, 6)]
            _, i16, i32, i64 = _VNNI_INT
            v16i32, eight = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 8)
            dp = _dpwssd(builder)
            queries = []
            for q in (q0, q1):
                whole = builder.load(builder.bitcast(q.data, ir.VectorType(i16, 64).as_pointer()), align=2)
                queries.append([_shuffle(builder, whole, whole, list(range(32 * h, 32 * h + 32))) for h in (0, 1)])
            sums = ([], [])
            for j in range(8):
                halves = _int16_halves(builder, k, builder.add(t, i64(j)))
                for query, partial in zip(queries, sums):
                    first = builder.call(dp, [ir.Constant(v16i32, None), query[0], halves[0]])
                    partial.append(builder.call(dp, [first, query[1], halves[1]]))
            per_key = builder.load(builder.bitcast(builder.gep(scales.data, [t]), eight.as_pointer()), align=4)
            for q, (partial, factor, out) in enumerate(zip(sums, factors, (s0, s1))):
                scores = builder.fmul(builder.sitofp(_sum_lanes_of_8(builder, partial, builder.add), eight),
                                      builder.fmul(per_key, _splat(builder, factor, 8), flags=_FAST), flags=_FAST)
                _store_scores_8(builder, scores, out, t, tops, q)
            return context.get_dummy_value()
        return types.none(q0, q1, k, t, k_scale, sq0, sq1, s0, s1, tops), codegen

    @intrinsic
    def _int8_values(typingctx, v, first, stop, last, p0, p1, o0, o1):
        """o0[i] += sum of p0[t] v[t, d] + p0[t + 1] v[t + 1, d] over pairs t = first, first + 2, ..
        < stop, d = INT8_VALUE_ORDER[i], in int32, then added to o0 (fp32 [64]); row t + 1 past
        `last` reads row `last` (its weight is 0: p0, p1 int16, zero past the last key, even
        length); v int8 [S_max, 64] with contiguous rows."""
        if not (isinstance(v, types.Array) and v.dtype == types.int8 and v.ndim == 2):
            return None

        def codegen(context, builder, signature, args):
            arrays = [context.make_array(ty)(context, builder, a) if isinstance(ty, types.Array) else None
                      for ty, a in zip(signature.args, args)]
            v, _, _, _, p0, p1, o0, o1 = arrays
            first, stop, last = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2, 3))
            i8, i16, i32, i64 = _VNNI_INT
            v16i32, v32i16, v16f32 = ir.VectorType(i32, 16), ir.VectorType(i16, 32), ir.VectorType(ir.FloatType(), 16)
            dp = _dpwssd(builder)
            prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")

            def clamp(row):
                return builder.select(builder.icmp_signed("<", row, last), row, last)
            entry, loop, done, t, sums = _loop_open(builder, first, stop, "pairs",  # per query, 4 x 16 dimensions
                                                    [ir.Constant(v16i32, None)] * 8)
            ahead = builder.add(t, i64(_rows_ahead(INT8_DOT_HEAD_DIM)))
            for row in (clamp(ahead), clamp(builder.add(ahead, i64(1)))):  # one 64-byte line a row
                builder.call(prefetch, [_row_bytes(builder, v, row), i32(0), i32(3), i32(1)])
            rows = (_int16_halves(builder, v, t), _int16_halves(builder, v, clamp(builder.add(t, i64(1)))))
            mixed = []
            for h in (0, 1):  # within each 128-bit lane: dims 0-3 of both rows, then dims 4-7
                for high in (0, 4):
                    mask = [8 * lane + high + j + other for lane in range(4) for j in range(4) for other in (0, 32)]
                    mixed.append(_shuffle(builder, rows[0][h], rows[1][h], mask))
            new = []
            for q, p in enumerate((p0, p1)):
                pair = builder.load(builder.bitcast(builder.gep(p.data, [t]), i32.as_pointer()), align=2)
                weights = builder.bitcast(_splat(builder, pair, 16), v32i16)
                for c in range(4):
                    new.append(builder.call(dp, [sums[4 * q + c], mixed[c], weights]))
            _loop_back(builder, t, stop, sums, new, loop, done, step=2)
            finals = []
            for value in new:  # every phi first: LLVM wants them at the block's top
                final = builder.phi(v16i32)
                final.add_incoming(ir.Constant(v16i32, None), entry)
                final.add_incoming(value, loop)
                finals.append(final)
            for q, o in enumerate((o0, o1)):
                for c in range(4):
                    target = builder.bitcast(builder.gep(o.data, [i64(16 * c)]), v16f32.as_pointer())
                    total = builder.fadd(builder.load(target, align=4), builder.sitofp(finals[4 * q + c], v16f32))
                    builder.store(total, target, align=4)
            return context.get_dummy_value()
        return types.none(v, first, stop, last, p0, p1, o0, o1), codegen

    @numba.njit(inline="always")
    def _int16_step(largest):
        """The scale at which `largest` (>= 0) is INT16_MAX; 1 where it is 0 (all zeros: any will do)."""
        return largest / np.float32(INT16_MAX) if largest > 0 else np.float32(1)

    @numba.njit(inline="always")
    def _as_int16(x, out):
        """out = round(x / scale) as int16 for x [64], scale = max |x| / INT16_MAX (1 if x is all 0);
        returns scale."""
        top = np.float32(0)
        for i in range(x.shape[0]):
            top = max(top, abs(x[i]))
        scale = _int16_step(top)
        inverse = np.float32(1) / scale
        for i in range(x.shape[0]):
            out[i] = np.int16(np.floor(x[i] * inverse + np.float32(0.5)))
        return scale

    def _attended_in_integers(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        """Attend as `_attend_pair_int8` and say True where it applies: an int8 cache (per-token
        scales) at dh = 64 on a CPU with AVX512-VNNI; elsewhere False, and nothing of it compiled."""

    @overload(_attended_in_integers)
    def _attended_in_integers_for(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        if not (_INT8_IN_INTEGERS and isinstance(k, types.Array) and k.dtype == types.int8
                and isinstance(k_scale, types.Array) and k_scale.ndim == 1):
            return lambda q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out: False

        def attend(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
            if q.shape[1] != INT8_DOT_HEAD_DIM or k.shape[1] != INT8_DOT_HEAD_DIM:
                return False
            _attend_pair_int8(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out)
            return True
        return attend

    @numba.njit(fastmath=True, cache=True)
    def _attend_pair_int8(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        """`_attend_pair` over an int8 cache at dh = 64, in integers (see above): the same softmax,
        with q and the weights p_t v_scale[t] rounded to int16, each at its own scale. That
        rounding is 2^-16 of their largest, against the cache's own 2^-8: outputs stay within
        ~2e-4 of their largest of the float path's (tested), and the keys and values are only
        sign-extended. lab-cpu, 4,096 keys, one core: 19.5 us against 27.3 us the unit."""
        dh = INT8_DOT_HEAD_DIM
        q16 = np.empty((2, dh), np.int16)
        sq0, sq1 = _as_int16(q[0], q16[0]) * k_scale_all, _as_int16(q[1], q16[1]) * k_scale_all
        s0, s1 = np.empty(n, np.float32), np.empty(n, np.float32)
        tops = np.full(16, -np.inf, np.float32)
        t, distance = 0, keys_ahead(k)
        while t + 8 <= n:
            for ahead in range(8):
                _prefetch_row(k, min(t + ahead + distance, n - 1))
            _int8_scores_8(q16[0], q16[1], k, t, k_scale, sq0, sq1, s0, s1, tops)
            t += 8
        top0 = top1 = np.float32(-np.inf)
        for j in range(8):
            top0, top1 = max(top0, tops[j]), max(top1, tops[8 + j])
        while t < n:  # the last keys, one at a time
            a0 = a1 = 0
            for d in range(dh):
                code = np.int32(k[t, d])
                a0 += np.int32(q16[0, d]) * code
                a1 += np.int32(q16[1, d]) * code
            s0[t], s1[t] = np.float32(a0) * (k_scale[t] * sq0), np.float32(a1) * (k_scale[t] * sq1)
            top0, top1 = max(top0, s0[t]), max(top1, s1[t])
            t += 1
        total0, total1 = _pair_numerators(s0, s1, n, np.float32(1), top0, top1)
        big0 = big1 = np.uint32(0)
        for t in range(n):  # V's scales folded into the weights; their largest compared as bits (they are >= 0,
            w0, w1 = s0[t] * v_scale[t], s1[t] * v_scale[t]  # so the bits order as the values: a loop
            s0[t], s1[t] = w0, w1                              # LLVM vectorises, where max() on floats was not)
            b0, b1 = _float32_bits(w0), _float32_bits(w1)
            big0 = b0 if b0 > big0 else big0
            big1 = b1 if b1 > big1 else big1
        sp0, sp1 = _int16_step(_bits_as_float32(big0)), _int16_step(_bits_as_float32(big1))
        even = n + (n & 1)
        p0, p1 = np.zeros(even, np.int16), np.zeros(even, np.int16)
        i0, i1 = np.float32(1) / sp0, np.float32(1) / sp1
        for t in range(n):  # >= 0: truncating x + 0.5 rounds to nearest
            p0[t] = np.int16(np.int32(s0[t] * i0 + np.float32(0.5)))
        for t in range(n):
            p1[t] = np.int16(np.int32(s1[t] * i1 + np.float32(0.5)))
        o = np.zeros((2, dh), np.float32)
        for start in range(0, even, INT8_BLOCK_KEYS):
            _int8_values(v, start, min(start + INT8_BLOCK_KEYS, even), n - 1, p0, p1, o[0], o[1])
        f0, f1 = sp0 * v_scale_all / total0, sp1 * v_scale_all / total1
        for i in range(dh):
            d = INT8_VALUE_ORDER[i]
            out[0, d], out[1, d] = o[0, i] * f0, o[1, i] * f1

    @numba.njit(inline="always")
    def _pair_scores_8(q0, q1, k, t, per_token, k_scale, s0, s1, tops):
        """The K pass's vector block for this head size (one of `VECTOR_HEAD_DIMS`), scaled where
        `per_token`."""
        if per_token:
            if k.shape[1] == 64:
                _scaled_scores_8_64(q0, q1, k, t, k_scale, s0, s1, tops)
            else:
                _scaled_scores_8_16(q0, q1, k, t, k_scale, s0, s1, tops)
        elif k.shape[1] == 64:
            _pair_scores_8_64(q0, q1, k, t, k_scale, s0, s1, tops)
        else:
            _pair_scores_8_16(q0, q1, k, t, k_scale, s0, s1, tops)

    @numba.njit(inline="always")
    def _pair_values_dh(v, first, stop, p0, p1, o0, o1):
        """The V pass as vector code for this head size (one of `VECTOR_HEAD_DIMS`)."""
        if v.shape[1] == 64:
            _pair_values_64(v, first, stop, p0, p1, o0, o1)
        else:
            _pair_values_16(v, first, stop, p0, p1, o0, o1)

    @numba.njit(fastmath=True, cache=True)
    def _pair_scores(q0, q1, k, n, per_token, k_scale, s0, s1):
        """s0[t], s1[t] = (q0 . widen(k[t])) k_scale[t], (q1 . widen(k[t])) k_scale[t] for t < n
        (int8's per-token scale where `per_token`, else none); q [dh], k [S_max, dh] as stored.
        Returns (max s0, max s1), kept as it goes, so the softmax needs no pass of its own for it.
        Four keys per iteration: eight independent sums keep the vector units busy while each
        one's reduction across its lanes finishes (int8: 194 against 162 keys/us per core)."""
        dh, distance = q0.shape[0], keys_ahead(k)
        top0 = top1 = np.float32(-np.inf)
        t = 0
        if dh in VECTOR_HEAD_DIMS and k.shape[1] == dh and n >= 8:  # 8 keys at a time as vector code, then the tail
            tops = np.full(16, -np.inf, np.float32)  # each block's 8 lanes of running maxima, q0's then q1's
            while t + 8 <= n:
                for ahead in range(8):
                    _prefetch_row(k, min(t + ahead + distance, n - 1))
                _pair_scores_8(q0, q1, k, t, per_token, k_scale, s0, s1, tops)
                t += 8
            for j in range(8):
                top0, top1 = max(top0, tops[j]), max(top1, tops[8 + j])
        while t + 4 <= n:
            for ahead in range(4):
                _prefetch_row(k, min(t + ahead + distance, n - 1))
            k0, k1, k2, k3 = k[t], k[t + 1], k[t + 2], k[t + 3]
            a0 = a1 = b0 = b1 = c0 = c1 = e0 = e1 = np.float32(0)
            for d in range(dh):
                x0, x1 = q0[d], q1[d]
                r = widen(k0[d])
                a0 += x0 * r
                a1 += x1 * r
                r = widen(k1[d])
                b0 += x0 * r
                b1 += x1 * r
                r = widen(k2[d])
                c0 += x0 * r
                c1 += x1 * r
                r = widen(k3[d])
                e0 += x0 * r
                e1 += x1 * r
            if per_token:
                sa, sb, sc, se = k_scale[t], k_scale[t + 1], k_scale[t + 2], k_scale[t + 3]
                a0, a1, b0, b1 = a0 * sa, a1 * sa, b0 * sb, b1 * sb
                c0, c1, e0, e1 = c0 * sc, c1 * sc, e0 * se, e1 * se
            s0[t], s1[t], s0[t + 1], s1[t + 1] = a0, a1, b0, b1
            s0[t + 2], s1[t + 2], s0[t + 3], s1[t + 3] = c0, c1, e0, e1
            top0 = max(top0, max(max(a0, b0), max(c0, e0)))
            top1 = max(top1, max(max(a1, b1), max(c1, e1)))
            t += 4
        while t < n:  # the last keys, one at a time
            key = k[t]
            a0 = a1 = np.float32(0)
            for d in range(dh):
                r = widen(key[d])
                a0 += q0[d] * r
                a1 += q1[d] * r
            if per_token:
                a0, a1 = a0 * k_scale[t], a1 * k_scale[t]
            s0[t], s1[t] = a0, a1
            top0, top1 = max(top0, a0), max(top1, a1)
            t += 1
        return top0, top1

    @numba.njit(fastmath=True, cache=True)
    def _pair_numerators(s0, s1, n, scale, top0, top1):
        """s0[:n], s1[:n] <- exp(scale s - scale top) in place, both queries in one vectorised loop
        (scale >= 0: the cache's scales are, so scale top is the max); returns their sums."""
        m0, m1 = top0 * scale, top1 * scale
        total0 = total1 = np.float32(0)
        for t in range(n):
            e0, e1 = exp_nonpositive(s0[t] * scale - m0), exp_nonpositive(s1[t] * scale - m1)
            s0[t], s1[t] = e0, e1
            total0 += e0
            total1 += e1
        return total0, total1

    @numba.njit(fastmath=True, cache=True)
    def _pair_values(v, n, p0, p1, o0, o1):
        """o0 += sum_t p0[t] widen(v[t]), o1 likewise, for t < n; v [S_max, dh] as stored, o [dh].
        Four values per iteration: the running sums o0, o1 live in memory, and updating them once
        per four values instead of every value shortens that chain (int8: 287 against 109 keys/us
        per core)."""
        dh = v.shape[1]
        if dh in VECTOR_HEAD_DIMS and o0.shape[0] == dh:
            _pair_values_dh(v, 0, n, p0, p1, o0, o1)
            return
        t, distance = 0, keys_ahead(v)
        while t + 4 <= n:
            for ahead in range(4):
                _prefetch_row(v, min(t + ahead + distance, n - 1))
            v0, v1, v2, v3 = v[t], v[t + 1], v[t + 2], v[t + 3]
            a0, a1, a2, a3 = p0[t], p0[t + 1], p0[t + 2], p0[t + 3]
            b0, b1, b2, b3 = p1[t], p1[t + 1], p1[t + 2], p1[t + 3]
            for d in range(dh):
                w0, w1, w2, w3 = widen(v0[d]), widen(v1[d]), widen(v2[d]), widen(v3[d])
                o0[d] += (a0 * w0 + a1 * w1) + (a2 * w2 + a3 * w3)
                o1[d] += (b0 * w0 + b1 * w1) + (b2 * w2 + b3 * w3)
            t += 4
        while t < n:  # the last values, one at a time
            value = v[t]
            a0, b0 = p0[t], p1[t]
            for d in range(dh):
                r = widen(value[d])
                o0[d] += a0 * r
                o1[d] += b0 * r
            t += 1

    @numba.njit(fastmath=True, cache=True)
    def _attend_pair(q, k, v, per_token, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        """`_attend_one` for G = 2, the two queries in one loop: each widened key or value feeds
        both from a register (about 1.4x the keys per second of the general loop)."""
        dh = q.shape[1]
        if _attended_in_integers(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
            return
        s0, s1 = np.empty(n, np.float32), np.empty(n, np.float32)
        top0, top1 = _pair_scores(q[0], q[1], k, n, per_token, k_scale, s0, s1)  # int8: each key's scale in
        total0, total1 = _pair_numerators(s0, s1, n, k_scale_all, top0, top1)
        if per_token:  # int8's V scales folded into the numerators: sum_t p_t (v_t s_t) = sum_t (p_t s_t) v_t
            for t in range(n):
                s0[t] *= v_scale[t]
                s1[t] *= v_scale[t]
        o0, o1 = np.zeros(dh, np.float32), np.zeros(dh, np.float32)
        _pair_values(v, n, s0, s1, o0, o1)
        f0, f1 = v_scale_all / total0, v_scale_all / total1
        for d in range(dh):
            out[0, d], out[1, d] = o0[d] * f0, o1[d] * f1

    @numba.njit(fastmath=True, cache=True)
    def _attend_one(q, k, v, per_token, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        """One (row, kv head): q, out [G, dh]; k, v [S_max, dh] as stored; int8's scales [S_max].
        Each key and value is widened once into `row` (dh fp32, in L1) and used by all G
        queries; K and V are read once each."""
        G, dh = q.shape
        distance = keys_ahead(k)
        s = np.empty((G, n), np.float32)
        row = np.empty(dh, np.float32)
        for t in range(n):  # scores: one pass over K
            _prefetch_row(k, min(t + distance, n - 1))
            key = k[t]
            for d in range(dh):
                row[d] = widen(key[d])
            scale = k_scale[t] * k_scale_all if per_token else k_scale_all
            for g in range(G):
                acc = np.float32(0)
                for d in range(dh):
                    acc += q[g, d] * row[d]
                s[g, t] = acc * scale
        denominators = np.empty(G, np.float32)
        for g in range(G):  # softmax numerators in place; int8's V scales folded into them
            top = s[g, 0]
            for t in range(1, n):
                top = max(top, s[g, t])
            total = np.float32(0)
            for t in range(n):
                p = exp_nonpositive(s[g, t] - top)
                total += p
                s[g, t] = p
            denominators[g] = total
            if per_token:
                for t in range(n):
                    s[g, t] *= v_scale[t]
        acc_out = np.zeros((G, dh), np.float32)
        for t in range(n):  # p @ V: one pass over V
            _prefetch_row(v, min(t + distance, n - 1))
            value = v[t]
            for d in range(dh):
                row[d] = widen(value[d])
            for g in range(G):
                p = s[g, t]
                for d in range(dh):
                    acc_out[g, d] += p * row[d]
        for g in range(G):
            factor = v_scale_all / denominators[g]
            for d in range(dh):
                out[g, d] = acc_out[g, d] * factor

    # ---- the step's elementwise work, fused: one call where numpy made 4-8 (each ~1-3 us at decode's
    # few rows); the numpy forms in `cpu_decode` (`rms_norm`, `CpuDecode._rotate`, `_swiglu`) are the
    # references and the path without numba.
    @numba.njit(nogil=True, cache=True)  # no fastmath: x * inv + 0.5 rounds twice, as the reference
    def store_int8(x, codes, scales, position):
        """x [B, Hkv, dh] fp32 quantised into codes[:, :, position] (codes [B, Hkv, T, dh] int8) and
        scales[:, :, position] (scales [B, Hkv, T] fp32), one scale per row: `cpu_decode.quantize_int8`
        (the kernels' reference in numpy) bit for bit, in one call where numpy made ~8 (~30 us a
        call at B = 16)."""
        B, Hkv, dh = x.shape
        for b in range(B):
            for h in range(Hkv):
                absmax = np.float32(0)
                for j in range(dh):
                    absmax = max(absmax, abs(x[b, h, j]))
                inv = np.float32(127) / absmax if absmax > 0 else np.float32(0)
                for j in range(dh):
                    code = np.floor(x[b, h, j] * inv + np.float32(0.5))
                    codes[b, h, position, j] = np.int8(min(max(code, np.float32(-127)), np.float32(127)))
                scales[b, h, position] = absmax / np.float32(127)

    @intrinsic
    def _float32_bits(typingctx, value):
        """The bits of an fp32 as a uint32."""
        if value != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(value), codegen

    @intrinsic
    def _half_bits(typingctx, value):
        """An fp32 rounded to fp16 (IEEE: to nearest, ties to even, as torch's `.half()`), as its
        16 bits in an int16 (the cache's numpy view of fp16)."""
        if value != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.int16(value), codegen

    @numba.njit(cache=True)
    def bf16_bits(value):
        """An fp32 rounded to bf16 as torch rounds it (to nearest, ties to even; NaN to 0x7FC0),
        as its 16 bits in a uint16 (the cache's numpy view of bf16)."""
        if value != value:
            return np.uint16(0x7FC0)
        bits = _float32_bits(value)
        return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @numba.njit(cache=True)  # no fastmath: the subnormals' add must round as torch's does
    def fp8_bits(value):
        """An fp32 rounded to float8_e4m3fn as torch's conversion rounds it (c10's
        fp8e4m3fn_from_fp32_value: to nearest, ties to even; |x| >= 480 to NaN, 0x7F), as a uint8.
        Subnormals (below 2^-6): one fp32 addition of 2^14 (`denorm`), whose ulp is e4m3's subnormal
        step 2^-9, rounds the value to a multiple of it; the sum's low bits are the code."""
        bits = _float32_bits(value)
        sign = bits & np.uint32(0x80000000)
        bits ^= sign
        if bits >= _FP8_NAN_FROM_BITS:
            code = np.uint32(0x7F)
        elif bits < np.uint32(121 << 23):  # below 2^-6: e4m3's subnormals, rounded by a float add
            denorm = np.uint32(141 << 23)
            code = (_float32_bits(_bits_as_float32(bits) + _bits_as_float32(denorm)) - denorm) & np.uint32(0xFF)
        else:  # rebias the exponent (127 -> 7) and round the mantissa's 23 bits to 3
            odd = (bits >> np.uint32(20)) & np.uint32(1)
            code = ((bits - np.uint32(120 << 23) + np.uint32(0x7FFFF) + odd) >> np.uint32(20)) & np.uint32(0xFF)
        return np.uint8(code | (sign >> np.uint32(24)))

    @numba.njit(nogil=True, cache=True)  # no fastmath: x * inverse, then the clamp, rounded as the reference's numpy
    def store_rounded(x, target, position, kind, inverse):
        """x [B, Hkv, dh] fp32 into target[:, :, position] ([B, Hkv, T, dh] as stored): bf16 (kind
        1) or fp16 (2) rounded, fp8 (3) scaled by `inverse` (the layer's scale.reciprocal()) and
        clamped to +-448 first (`ROUNDED_STORES`): `cpu_decode.store_converted` (one torch copy, the
        reference and the path without numba) bit for bit."""
        B, Hkv, dh = x.shape
        for b in range(B):
            for h in range(Hkv):
                for j in range(dh):
                    value = x[b, h, j]
                    if kind == 1:
                        target[b, h, position, j] = bf16_bits(value)
                    elif kind == 2:
                        target[b, h, position, j] = _half_bits(value)
                    else:
                        value = min(max(value * inverse, np.float32(-448)), np.float32(448))
                        target[b, h, position, j] = fp8_bits(value)

    @numba.njit(nogil=True, cache=True)
    def store_as_is(x, target, position):
        """x [B, Hkv, dh] fp32 into target[:, :, position] of an fp32 cache [B, Hkv, T, dh]."""
        B, Hkv, dh = x.shape
        for b in range(B):
            for h in range(Hkv):
                for j in range(dh):
                    target[b, h, position, j] = x[b, h, j]

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def rms_norm(x, weight, eps):
        """x [B, d] / rms over d * weight [d] -> a new [B, d] fp32 array."""
        B, d = x.shape
        out = np.empty_like(x)
        for b in range(B):
            acc = np.float32(0)
            for j in range(d):
                acc += x[b, j] * x[b, j]
            inv = np.float32(1) / np.sqrt(acc * np.float32(1.0 / d) + eps)
            for j in range(d):
                out[b, j] = x[b, j] * inv * weight[j]
        return out

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def rotate_in_place(x, cos, sin):
        """RoPE on x [B, heads, dh] in place, as `cpu_decode.CpuDecode._rotate`: x * cos
        + swap(x) * sin, cos, sin [B or 1, 1, dh] laid out as (cos, cos) and (-sin, +sin)."""
        B, heads, dh = x.shape
        half = dh // 2
        for b in range(B):
            c, s = cos[min(b, cos.shape[0] - 1), 0], sin[min(b, sin.shape[0] - 1), 0]
            for h in range(heads):
                row = x[b, h]
                for j in range(half):
                    lo, hi = row[j], row[j + half]
                    row[j] = lo * c[j] + hi * s[j]
                    row[j + half] = hi * c[j + half] + lo * s[j + half]

    # error_model="numpy": a float division by zero gives inf rather than raising, so the division
    # carries no zero test and LLVM vectorises its loop (1 + e >= 1 here, never zero). With Python's
    # error model the loop stayed scalar: [16, 1,536] took 12.6 us, now 5.4 (2-core Xeon VM).
    @numba.njit(nogil=True, fastmath=True, cache=True, error_model="numpy")
    def swiglu(gate_up):
        """gate_up [B, 2 n] (gate, then up) -> silu(gate) * up, a new [B, n] fp32 array; the
        sigmoid from exp of -|g| (never overflows), vectorised by `exp_nonpositive`."""
        B, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = np.empty((B, n), np.float32)
        e = np.empty(n, np.float32)  # one row's exps first, in a loop of their own: with the branch
        for b in range(B):           # beside it LLVM left the exp scalar (3x slower at [16, 1536])
            for j in range(n):
                e[j] = exp_nonpositive(-abs(gate_up[b, j]))
            for j in range(n):
                g = gate_up[b, j]
                out[b, j] = g * ((np.float32(1) if g >= 0 else e[j]) / (np.float32(1) + e[j])) * gate_up[b, n + j]
        return out

    @numba.njit(fastmath=True, cache=True)
    def exp_nonpositive(x):
        """exp(x) for x <= 0 in fp32, written out so that LLVM vectorises it (numba calls libm's
        scalar exp otherwise): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to
        r^7 (error < 2e-7 relative), times 2^n built in the exponent bits; below -87 it is 0."""
        x = max(x, np.float32(-87.0))
        n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
        r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln2 in two parts
        p = np.float32(1.0 / 5040)
        p = p * r + np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        return p * _bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))
