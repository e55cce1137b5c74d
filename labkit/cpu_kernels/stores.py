"""The new token's cache write, in one call each where numpy or torch made ~8: an fp32 cache as is
(`store_as_is`), int8 quantised per row (`store_int8`), bf16, fp16 and fp8 rounded as torch's
conversions round (`store_rounded`). Each is tested bit for bit against its reference in
`cpu_decode` (`quantize_int8`, `store_converted`), so none is compiled with fastmath.

Shapes: x [B, Hkv, dh] fp32; a cache [B, Hkv, T, dh] as stored; int8's scales [B, Hkv, T].
"""
from __future__ import annotations

import numpy as np

from ._jit import AVAILABLE, keep_builds_current

# `store_rounded`'s codes for the caches it writes, and where torch's fp32 -> e4m3 gives NaN (0x7F):
# |x| >= 480.0, these bits
ROUNDED_STORES = {"bf16": 1, "fp16": 2, "fp8": 3}
_FP8_NAN_FROM_BITS = np.uint32(1087 << 20)


if AVAILABLE:
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    from ._jit import bits_as_float32, float32_bits

    @numba.njit(nogil=True, cache=True)  # no fastmath: x * inv + 0.5 rounds twice, as the reference
    def store_int8(x, codes, scales, position):
        """x [B, Hkv, dh] fp32 quantised into codes[:, :, position] (codes [B, Hkv, T, dh] int8) and
        scales[:, :, position] (scales [B, Hkv, T] fp32), one scale per row: `cpu_decode.quantize_int8`
        (the kernels' reference in numpy) bit for bit, in one call where numpy made ~8 (~30 us a
        call at B = 16). A row holding a NaN gets a NaN scale and zero codes, as the reference: numba's
        max() leaves NaNs out, and such a row was stored with a finite scale, an overflow upstream
        hidden in the cache instead of read back as NaN. (Its NaN tests need this compiled without
        fastmath, which would drop them: so is every caller of it.)"""
        B, Hkv, dh = x.shape
        for b in range(B):
            for h in range(Hkv):
                absmax = np.float32(0)
                for j in range(dh):
                    magnitude = abs(x[b, h, j])
                    if magnitude != magnitude:
                        absmax = magnitude
                        break
                    absmax = max(absmax, magnitude)
                inv = np.float32(127) / absmax if absmax > 0 else np.float32(0)  # 0 for a NaN row too
                for j in range(dh):
                    code = np.floor(x[b, h, j] * inv + np.float32(0.5))
                    code = min(max(code, np.float32(-127)), np.float32(127)) if code == code else np.float32(0)
                    codes[b, h, position, j] = np.int8(code)
                scales[b, h, position] = absmax / np.float32(127)

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
        bits = float32_bits(value)
        return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @numba.njit(cache=True)  # no fastmath: the subnormals' add must round as torch's does
    def fp8_bits(value):
        """An fp32 rounded to float8_e4m3fn as torch's conversion rounds it (c10's
        fp8e4m3fn_from_fp32_value: to nearest, ties to even; |x| >= 480 to NaN, 0x7F), as a uint8.
        Subnormals (below 2^-6): one fp32 addition of 2^14 (`denorm`), whose ulp is e4m3's subnormal
        step 2^-9, rounds the value to a multiple of it; the sum's low bits are the code."""
        bits = float32_bits(value)
        sign = bits & np.uint32(0x80000000)
        bits ^= sign
        if bits >= _FP8_NAN_FROM_BITS:
            code = np.uint32(0x7F)
        elif bits < np.uint32(121 << 23):  # below 2^-6: e4m3's subnormals, rounded by a float add
            denorm = np.uint32(141 << 23)
            code = (float32_bits(bits_as_float32(bits) + bits_as_float32(denorm)) - denorm) & np.uint32(0xFF)
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

    keep_builds_current(globals())
