"""An int8 cache attended in integers, on a CPU with AVX512-VNNI at lab-cpu's head size (64).

What you learn here: q and the softmax weights are rounded to int16 (2^-16 of their largest,
against the cache's own 2^-8), each int8 key or value is only sign-extended, and vpdpwssd sums two
products per instruction in int32: half the vector instructions a key of the float path, whose
outputs it stays within ~2e-4 of (tested). Elsewhere an int8 cache is widened to fp32 like the
others (`attended_in_integers` says False, and nothing here is compiled).

Shapes: q, out [2, dh]; k, v [S_max, dh] int8 codes, rows contiguous; k_scale, v_scale [S_max].
"""
from __future__ import annotations

import numpy as np

from ._jit import AVAILABLE, host_features, keep_builds_current

# An int8 cache at this head size (lab-cpu's) on a CPU with AVX512-VNNI is attended in integers
# (`attend_pair_int8`): q and the softmax weights rounded to 16-bit integers (INT16_MAX at their
# largest), each int8 key or value only sign-extended, the products summed by vpdpwssd in int32
# over at most INT8_BLOCK_KEYS keys at a time (32,767 x 127 per product: 256 of them stay < 2^31).
# Tried and not kept: the K pass on AMX's tiles (q's int16 as a signed high and a shifted low
# byte, a column of ones, one tdpbssd per 16 keys: the same int32 sums as here). One core, 4,096
# keys: the K pass 8.3 -> 6.2 us of the unit's 17.5; in lab-cpu's step at B = 16, S = 4,096
# attention took 1.64-1.75 ms against 1.60-1.70 (3 alternating processes): there the cache's
# stream, not the arithmetic, sets its pace. Not worth its tile setup and Linux's permission
# request (2-core Xeon VM).
INT8_DOT_HEAD_DIM, INT16_MAX, INT8_BLOCK_KEYS = 64, 32767, 256


def int8_in_integers() -> bool:
    """Whether this CPU has AVX512-VNNI (and AVX512-BW), the instructions `attend_pair_int8` is
    written with; elsewhere an int8 cache is widened to fp32 like the others."""
    return {"+avx512vnni", "+avx512bw"} <= host_features()


if AVAILABLE:
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic, overload

    from ._jit import (bits_as_float32, float32_bits, loop_back, loop_open, prefetch_flags, prefetch_ir, row_bytes,
                       shuffle, splat)
    from .attention_blocks import (FAST, keys_ahead, pair_numerators, prefetch_row, rows_ahead, store_scores_8,
                                   sum_lanes_of_8)

    _INT8_IN_INTEGERS = int8_in_integers()  # read as `attended_in_integers` is typed: without VNNI its code is never compiled

    # ---- an int8 cache in integers (AVX512-VNNI, dh = 64). vpdpwssd multiplies 32 pairs of int16
    # and adds each pair's two products into one of 16 int32 lanes. The K pass: a key's 64 codes
    # sign-extended to int16 against q's 64 int16, two instructions a query, then 8 keys' 16 lanes
    # summed across as the float pass does (`sum_lanes_of_8`). The V pass takes keys two at a
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
        raw = builder.load(builder.bitcast(row_bytes(builder, array, row), ir.VectorType(i8, 64).as_pointer()), align=1)
        wide = builder.sext(raw, ir.VectorType(i16, 64))
        return [shuffle(builder, wide, wide, list(range(32 * h, 32 * h + 32))) for h in (0, 1)]

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
                queries.append([shuffle(builder, whole, whole, list(range(32 * h, 32 * h + 32))) for h in (0, 1)])
            sums = ([], [])
            for j in range(8):
                halves = _int16_halves(builder, k, builder.add(t, i64(j)))
                for query, partial in zip(queries, sums):
                    first = builder.call(dp, [ir.Constant(v16i32, None), query[0], halves[0]])
                    partial.append(builder.call(dp, [first, query[1], halves[1]]))
            per_key = builder.load(builder.bitcast(builder.gep(scales.data, [t]), eight.as_pointer()), align=4)
            for q, (partial, factor, out) in enumerate(zip(sums, factors, (s0, s1))):
                scores = builder.fmul(builder.sitofp(sum_lanes_of_8(builder, partial, builder.add), eight),
                                      builder.fmul(per_key, splat(builder, factor, 8), flags=FAST), flags=FAST)
                store_scores_8(builder, scores, out, t, tops, q)
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
            _, i16, i32, i64 = _VNNI_INT
            v16i32, v32i16, v16f32 = ir.VectorType(i32, 16), ir.VectorType(i16, 32), ir.VectorType(ir.FloatType(), 16)
            dp = _dpwssd(builder)
            prefetch = prefetch_ir(builder)

            def clamp(row):
                return builder.select(builder.icmp_signed("<", row, last), row, last)
            entry, loop, done, t, sums = loop_open(builder, first, stop, "pairs",  # per query, 4 x 16 dimensions
                                                    [ir.Constant(v16i32, None)] * 8)
            ahead = builder.add(t, i64(rows_ahead(INT8_DOT_HEAD_DIM)))
            for row in (clamp(ahead), clamp(builder.add(ahead, i64(1)))):  # one 64-byte line a row
                builder.call(prefetch, [row_bytes(builder, v, row), *prefetch_flags(3)])
            rows = (_int16_halves(builder, v, t), _int16_halves(builder, v, clamp(builder.add(t, i64(1)))))
            mixed = []
            for h in (0, 1):  # within each 128-bit lane: dims 0-3 of both rows, then dims 4-7
                for high in (0, 4):
                    mask = [8 * lane + high + j + other for lane in range(4) for j in range(4) for other in (0, 32)]
                    mixed.append(shuffle(builder, rows[0][h], rows[1][h], mask))
            new = []
            for q, p in enumerate((p0, p1)):
                pair = builder.load(builder.bitcast(builder.gep(p.data, [t]), i32.as_pointer()), align=2)
                weights = builder.bitcast(splat(builder, pair, 16), v32i16)
                for c in range(4):
                    new.append(builder.call(dp, [sums[4 * q + c], mixed[c], weights]))
            loop_back(builder, t, stop, sums, new, loop, done, step=2)
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

    def attended_in_integers(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        """Attend as `attend_pair_int8` and say True where it applies: an int8 cache (per-token
        scales) at dh = 64 on a CPU with AVX512-VNNI; elsewhere False, and nothing of it compiled."""

    @overload(attended_in_integers)
    def _attended_in_integers_for(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        if not (_INT8_IN_INTEGERS and isinstance(k, types.Array) and k.dtype == types.int8
                and isinstance(k_scale, types.Array) and k_scale.ndim == 1):
            return lambda q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out: False

        def attend(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
            if q.shape[1] != INT8_DOT_HEAD_DIM or k.shape[1] != INT8_DOT_HEAD_DIM:
                return False
            attend_pair_int8(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out)
            return True
        return attend

    @numba.njit(fastmath=True, cache=True)
    def attend_pair_int8(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
        """`attention._attend_pair` over an int8 cache at dh = 64, in integers (the module
        docstring): the same softmax, with q and the weights p_t v_scale[t] rounded to int16, each
        at its own scale. That rounding is 2^-16 of their largest, against the cache's own 2^-8:
        outputs stay within ~2e-4 of their largest of the float path's (tested), and the keys and
        values are only sign-extended. lab-cpu, 4,096 keys, one core: 19.5 us against 27.3 us the unit."""
        dh = INT8_DOT_HEAD_DIM
        q16 = np.empty((2, dh), np.int16)
        sq0, sq1 = _as_int16(q[0], q16[0]) * k_scale_all, _as_int16(q[1], q16[1]) * k_scale_all
        s0, s1 = np.empty(n, np.float32), np.empty(n, np.float32)
        tops = np.full(16, -np.inf, np.float32)
        t, distance = 0, keys_ahead(k)
        while t + 8 <= n:
            for ahead in range(8):
                prefetch_row(k, min(t + ahead + distance, n - 1))
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
        total0, total1 = pair_numerators(s0, s1, n, np.float32(1), top0, top1)
        big0 = big1 = np.uint32(0)
        for t in range(n):  # V's scales folded into the weights; their largest compared as bits (they are >= 0,
            w0, w1 = s0[t] * v_scale[t], s1[t] * v_scale[t]  # so the bits order as the values: a loop
            s0[t], s1[t] = w0, w1                              # LLVM vectorises, where max() on floats was not)
            b0, b1 = float32_bits(w0), float32_bits(w1)
            big0 = b0 if b0 > big0 else big0
            big1 = b1 if b1 > big1 else big1
        sp0, sp1 = _int16_step(bits_as_float32(big0)), _int16_step(bits_as_float32(big1))
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

    keep_builds_current(globals())
