"""The decode attention's building blocks: a stored cache value widened to fp32 in registers, the
G = 2 K and V passes as vector code, and the softmax numerators of two queries.

What you learn here: the attention reads the cache AS STORED and widens each value where it is
used, so the bytes a step reads are the bytes `roofline.kv_bytes_per_token` counts, not an fp32
copy made first. bf16 is its 16 high bits of an fp32; fp8 e4m3 a shift of its exponent and
mantissa (its value times 2^-8: the 2^8 joins fp8's per-layer scale); int8 a conversion times its
token's scale. For G = 2 (the lab's CPU models) the passes are written out in LLVM IR: 8 keys' dot
products summed across their lanes together, and the values' running sums kept in registers.

Storage (numpy has no bf16 or fp8, so those travel as their bits): fp32 -> float32; bf16 ->
uint16 (its bits); fp16 -> int16 (its bits); fp8 e4m3 -> uint8 (its bits); int8 -> int8.
Shapes: q, o [dh]; a cache block k, v [S_max, dh] as stored, rows contiguous.
"""
from __future__ import annotations

import numpy as np

from ._jit import AVAILABLE, keep_builds_current

# How far ahead of the key it works on the attention asks the CPU for K (or V) rows, in bytes of
# cache (`keys_ahead`: 32 keys of fp32 at dh = 64, 128 of int8 or fp8). One core streaming an fp32
# cache alone read 10 GB/s without, 15 GB/s with 32 keys ahead. Counted in keys, a one-byte cache
# was asked for 4x closer, too close once the weights had pushed part of it out of the L3: lab-cpu's
# int8 attention at B = 16, S = 4,096 after a 60 MiB sweep 2.24 ms at 2 KiB ahead, 1.98 at 8 KiB
# (alone 1.77-1.80 either way); fp8 2.67 against 2.46 (2-core Xeon VM).
PREFETCH_BYTES_AHEAD = 8 << 10
# Head sizes whose G = 2 attention runs as vector code written out below (`pair_scores_8_for`,
# `pair_values_for`: a row of K or V is one vector of dh values): lab-cpu's 64 and lab-tiny's 16 (the
# tests'); other sizes keep the scalar loops (each size more costs ~0.3 s of compiling per cache dtype).
VECTOR_HEAD_DIMS = (16, 64)


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

if AVAILABLE:
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic, overload

    from ._jit import (bits_as_float32, exp_nonpositive, half_bits_as_float32, load_row, loop_back, loop_open, prefetch,
                       prefetch_flags, prefetch_ir, row_bytes, shuffle, splat)

    def rows_ahead(row_bytes):
        """Rows of `row_bytes` each in PREFETCH_BYTES_AHEAD (at least 1): how far ahead the attention
        asks for K or V rows (`keys_ahead` in numba code, the LLVM IR passes at codegen)."""
        return max(1, PREFETCH_BYTES_AHEAD // row_bytes)

    @numba.njit(inline="always")
    def keys_ahead(array):
        """`rows_ahead` for a [rows, dh] cache block."""
        return max(1, PREFETCH_BYTES_AHEAD // (array.shape[1] * array.itemsize))

    @numba.njit(inline="always")
    def prefetch_row(array, row):
        """Prefetch row `row` of a [rows, dh] cache block: its first 4 cache lines (a whole row
        up to 256 bytes: dh = 64 in fp32; longer rows' tails are left to the hardware)."""
        step = max(1, 64 // array.itemsize)  # values per 64-byte line
        lines = (array.shape[1] + step - 1) // step
        prefetch(array, row, 0)
        if lines > 1:
            prefetch(array, row, step)
        if lines > 2:
            prefetch(array, row, 2 * step)
        if lines > 3:
            prefetch(array, row, 3 * step)

    def widen(code):
        """One stored cache value -> fp32 (see the module docstring), in units of `widen_unit`
        (fp8: 2^8; the others: their value); typed per storage."""

    @overload(widen)
    def _widen(code):
        if code == types.float32:
            return lambda code: code
        if code == types.uint16:  # bf16: the high half of an fp32
            return lambda code: bits_as_float32(np.uint32(code) << np.uint32(16))
        if code == types.int16:  # fp16: its bits, converted by the CPU
            return lambda code: half_bits_as_float32(code)
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
                return half_bits_as_float32(shifted & np.int16(-0x4080))
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

    # ---- G = 2 attention as vector code (LLVM IR; numba gives no vector types). A row of K or V is
    # loaded as one <dh x stored> vector and widened as `widen` does, lane by lane (`widen_vector`).
    # K pass: for 8 keys, q0 * k and q1 * k are folded to 16 lanes each, and the 8 keys' 16-lane sums
    # are added across their lanes together by 4 rounds of shuffles (`sum_lanes_of_8`): about 3
    # instructions a key where one key's own reduction took 8. V pass: o0, o1 stay in registers over
    # every key, one FMA each per key, the row PREFETCH_BYTES_AHEAD ahead asked for.
    STORED_IR = {types.float32: ("fp32", ir.FloatType()), types.uint16: ("bf16", ir.IntType(16)),
                  types.int16: ("fp16", ir.IntType(16)), types.uint8: ("fp8", ir.IntType(8)),
                  types.int8: ("int8", ir.IntType(8))}
    FAST = ("fast",)
    ROW_BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}

    def widen_vector(builder, raw, kind, n):
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



    def bf16_halves(builder, array, row, dh):
        """Row `row` of a bf16 [rows, dh] array (as uint16 bits, rows contiguous) widened as two
        <dh / 2 x float>: (values 0, 2, 4, ..., values 1, 3, 5, ...). Each 32-bit word holds two
        values, the even one in its low half (little-endian), so one shift and one mask widen 32
        values where zero-extending and shifting took two of each; `split_even_odd` lays a
        query (or sums) out the same way. Bit for bit `widen`."""
        i32, f32, n = ir.IntType(32), ir.FloatType(), dh // 2
        words = builder.load(builder.bitcast(row_bytes(builder, array, row), ir.VectorType(i32, n).as_pointer()), align=1)
        even = builder.shl(words, ir.Constant(ir.VectorType(i32, n), [16] * n))
        odd = builder.and_(words, ir.Constant(ir.VectorType(i32, n), [-0x10000] * n))
        return tuple(builder.bitcast(w, ir.VectorType(f32, n)) for w in (even, odd))

    def in_halves(kind, dh):
        """Whether the K and V passes widen this cache as `bf16_halves` does: bf16, with halves
        of 16 lanes or more (`fold_to_16`'s smallest)."""
        return kind == "bf16" and dh >= 32

    def split_even_odd(builder, v, dh):
        """<dh x float> -> (its even lanes, its odd lanes), two <dh / 2 x float>."""
        return (shuffle(builder, v, v, list(range(0, dh, 2))), shuffle(builder, v, v, list(range(1, dh, 2))))

    def join_even_odd(builder, even, odd, dh):
        """`split_even_odd` undone: lane 2 i from even[i], lane 2 i + 1 from odd[i]."""
        return shuffle(builder, even, odd, [i // 2 + (dh // 2 if i % 2 else 0) for i in range(dh)])


    def fold_to_16(builder, v, dh):
        """<dh x float> -> <16 x float>: its dh / 16 runs of 16 lanes added."""
        runs = [shuffle(builder, v, v, list(range(c, c + 16))) for c in range(0, dh, 16)]
        while len(runs) > 1:
            runs = [builder.fadd(runs[i], runs[i + 1], flags=FAST) for i in range(0, len(runs), 2)]
        return runs[0]

    def sum_lanes_of_8(builder, vectors, add=None):
        """8 vectors <16 x float> -> one <8 x float> whose lane j is the sum of vectors[j]'s lanes
        (`add`: how two vectors add, fast fadd by default; the int8 pass's int32 give builder.add).
        Each round pairs the vectors up and keeps, of each key's `width` partial sums, the first
        half plus the second: 16 partials a key in 8 vectors, then 8 in 4, 4 in 2, 2 in 1."""
        add = add or (lambda a, b: builder.fadd(a, b, flags=FAST))
        width = 16
        while len(vectors) > 1:
            groups = 16 // width
            low = [g * width + e for g in range(groups) for e in range(width // 2)]
            high = [i + width // 2 for i in low]
            vectors = [add(shuffle(builder, a, b, low + [16 + i for i in low]),
                           shuffle(builder, a, b, high + [16 + i for i in high]))
                       for a, b in zip(vectors[0::2], vectors[1::2])]
            width //= 2
        last = vectors[0]  # 8 keys x 2 partials
        return add(shuffle(builder, last, last, list(range(0, 16, 2))), shuffle(builder, last, last, list(range(1, 16, 2))))

    def store_scores_8(builder, scores, out, t, tops, q):
        """A K-pass block's end: scores <8 x float> into out[t : t + 8], and query q's 8 running
        maxima (tops[8 q : 8 q + 8]) raised to them."""
        eight = ir.VectorType(ir.FloatType(), 8)
        builder.store(scores, builder.bitcast(builder.gep(out.data, [t]), eight.as_pointer()), align=4)
        top = builder.bitcast(builder.gep(tops.data, [ir.IntType(64)(8 * q)]), eight.as_pointer())
        old = builder.load(top, align=4)
        builder.store(builder.select(builder.fcmp_ordered(">", scores, old), scores, old), top, align=4)

    def pair_scores_8_for(dh, scaled):
        """The K pass's block for head size dh: s0[t : t + 8], s1[t : t + 8] = q0 . widen(k[t + j]),
        q1 . widen(k[t + j]) for j < 8, times k_scale[t + j] where `scaled` (int8's per-token
        scales; else k_scale is not read), and tops [16] (q0's 8 running maxima, then q1's) raised
        to them; q0, q1, s0, s1, tops contiguous fp32, k [S_max, dh] as stored with contiguous rows
        (the cache's are). The scaling and the maxima as vectors here: a scalar loop after each block
        took a fifth of the K pass (bf16 at 4,096 keys, one core: 15.0 us, the blocks alone 12.1)."""
        def typer(typingctx, q0, q1, k, t, k_scale, s0, s1, tops):
            if not (isinstance(k, types.Array) and k.dtype in STORED_IR and k.ndim == 2):
                return None
            if scaled and not (isinstance(k_scale, types.Array) and k_scale.ndim == 1):
                return None
            kind, element = STORED_IR[k.dtype]

            def codegen(context, builder, signature, args):
                q0, q1, k, _, scales, s0, s1, tops = (
                    context.make_array(ty)(context, builder, a) if isinstance(ty, types.Array) else None
                    for ty, a in zip(signature.args, args))
                t = context.cast(builder, args[3], signature.args[3], types.intp)
                f32, i64 = ir.FloatType(), ir.IntType(64)
                eight = ir.VectorType(f32, 8)
                queries = [builder.load(builder.bitcast(q.data, ir.VectorType(f32, dh).as_pointer()), align=4)
                           for q in (q0, q1)]
                halves = in_halves(kind, dh)
                if halves:
                    queries = [split_even_odd(builder, query, dh) for query in queries]
                sums = ([], [])
                for j in range(8):
                    row = builder.add(t, i64(j))
                    if halves:
                        even, odd = bf16_halves(builder, k, row, dh)
                        for (q_even, q_odd), partial in zip(queries, sums):
                            both = builder.fadd(builder.fmul(q_even, even, flags=FAST),
                                                builder.fmul(q_odd, odd, flags=FAST), flags=FAST)
                            partial.append(fold_to_16(builder, both, dh // 2))
                        continue
                    key = widen_vector(builder, load_row(builder, k, row, dh, element), kind, dh)
                    for query, partial in zip(queries, sums):
                        partial.append(fold_to_16(builder, builder.fmul(query, key, flags=FAST), dh))
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
                    scores = sum_lanes_of_8(builder, partial)
                    if factor is not None:
                        scores = builder.fmul(scores, factor, flags=FAST)
                    store_scores_8(builder, scores, out, t, tops, q)
                return context.get_dummy_value()
            return types.none(q0, q1, k, t, k_scale, s0, s1, tops), codegen
        return intrinsic(typer)

    def pair_values_for(dh):
        """The V pass for head size dh: o0 += sum_t p0[t] widen(v[t]), o1 likewise, t in first ..
        stop - 1; v [S_max, dh] as stored with contiguous rows; p0, p1, o0, o1 contiguous fp32 (o0, o1 [dh]
        in registers throughout)."""
        def typer(typingctx, v, first, stop, p0, p1, o0, o1):
            if not (isinstance(v, types.Array) and v.dtype in STORED_IR and v.ndim == 2):
                return None
            kind, element = STORED_IR[v.dtype]

            def codegen(context, builder, signature, args):
                v, _, _, p0, p1, o0, o1 = (context.make_array(ty)(context, builder, a) if isinstance(ty, types.Array)
                                           else None for ty, a in zip(signature.args, args))
                first, stop = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2))
                i64, f32 = ir.IntType(64), ir.FloatType()
                vector = ir.VectorType(f32, dh)
                starts = [builder.load(builder.bitcast(o.data, vector.as_pointer()), align=4) for o in (o0, o1)]
                halves = in_halves(kind, dh)  # the sums as even and odd lanes
                if halves:
                    starts = [half for start in starts for half in split_even_odd(builder, start, dh)]
                lanes = dh // 2 if halves else dh
                prefetch = prefetch_ir(builder)
                sum_type = ir.VectorType(f32, lanes)
                fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    sum_type, [sum_type, sum_type, sum_type]), f"llvm.fmuladd.v{lanes}f32")
                last = builder.sub(stop, i64(1))
                entry, loop, done, t, sums = loop_open(builder, first, stop, "values", starts)
                ahead = builder.add(t, i64(rows_ahead(dh * ROW_BYTES_PER_VALUE[kind])))
                ahead = builder.select(builder.icmp_signed("<", ahead, last), ahead, last)
                row = row_bytes(builder, v, ahead)
                for line in range(0, dh * ROW_BYTES_PER_VALUE[kind], 64):  # every line of the row ahead
                    builder.call(prefetch, [builder.gep(row, [i64(line)]), *prefetch_flags(3)])
                values = (bf16_halves(builder, v, t, dh) if halves
                          else [widen_vector(builder, load_row(builder, v, t, dh, element), kind, dh)])
                new = []
                for q, p in enumerate((p0, p1)):
                    weight = splat(builder, builder.load(builder.gep(p.data, [t])), lanes)
                    for h, value in enumerate(values):
                        new.append(builder.call(fma, [weight, value, sums[q * len(values) + h]]))
                loop_back(builder, t, stop, sums, new, loop, done)
                finals = []
                for start, value in zip(starts, new):  # every phi first: LLVM wants them at the block's top
                    final = builder.phi(sum_type)
                    final.add_incoming(start, entry)
                    final.add_incoming(value, loop)
                    finals.append(final)
                if halves:
                    finals = [join_even_odd(builder, finals[i], finals[i + 1], dh) for i in (0, 2)]
                for final, o in zip(finals, (o0, o1)):
                    builder.store(final, builder.bitcast(o.data, vector.as_pointer()), align=4)
                return context.get_dummy_value()
            return types.none(v, first, stop, p0, p1, o0, o1), codegen
        return intrinsic(typer)

    (pair_scores_8_16, pair_scores_8_64), (scaled_scores_8_16, scaled_scores_8_64) = (
        [pair_scores_8_for(dh, scaled) for dh in VECTOR_HEAD_DIMS] for scaled in (False, True))
    pair_values_16, pair_values_64 = (pair_values_for(dh) for dh in VECTOR_HEAD_DIMS)

    @numba.njit(fastmath=True, cache=True)
    def pair_numerators(s0, s1, n, scale, top0, top1):
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

    keep_builds_current(globals())
