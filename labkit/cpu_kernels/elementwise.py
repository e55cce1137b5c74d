"""The step's elementwise work between its products, fused: RMS norm, RoPE and SwiGLU, one call
each where numpy made 4-8 (each ~1-3 us at decode's few rows, more than their arithmetic). The
numpy forms in `cpu_decode` (`rms_norm`, `CpuDecode._rotate`, `_swiglu`) are the references and
the path without numba.

Shapes: x [B, d]; q and k [B, heads, dh]; gate_up [B, 2 n].
"""
from __future__ import annotations

import numpy as np

from ._jit import AVAILABLE, keep_builds_current


if AVAILABLE:
    import numba

    from ._jit import exp_nonpositive

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

    keep_builds_current(globals())
