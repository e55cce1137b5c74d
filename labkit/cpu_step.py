"""The CPU decode step as ONE numba call: every layer's products, attention and elementwise work,
and the LM head, with no Python between them.

Why it exists: `cpu_decode.CpuDecode.step` issues ~40 calls a step from Python. Each is cheap on
its own (a numba dispatch is ~1-2 us), but a decode step streams its weights and its cache through
every level of the CPU's caches, so the Python, numpy and numba code that runs between two kernels
finds its own instructions and data evicted and pays a memory access for most of them. Measured on
the 2-core Xeon VM (lab-cpu, S = 1,024, the median of 40 steps, each kernel bracketed): at B = 16,
0.77 of a 6.06 ms step ran outside the kernels, at B = 1 0.32 of 1.86 ms; one tiny torch operation
took ~90 us right after the LM head against ~4 us on its own. Here the same kernels
(`cpu_kernels`) run back to back inside one compiled function, so that time is gone.

It applies where every product is the panel product (`cpu_linear.Panels`, a CPU with AVX-512 or
AVX2, up to `cpu_linear.FEW_ROWS` or `ONEDNN_FEW_ROWS` rows), attention is numba's, every row has the same length
(static batching, the sweeps) and the cache stores fp32, bf16, fp16, fp8 or int8 — `CpuDecode`
checks, and keeps its call-by-call step everywhere else, and while the breakdown's clock is hooked
in (a single call has no parts to bracket).

The cache writes are the call-by-call step's kernels (tested bit for bit): fp32 as is
(`cpu_kernels.store_as_is`), int8 by `cpu_kernels.store_int8`, and bf16, fp16 and fp8 by
`cpu_kernels.store_rounded`, which rounds as torch's conversions do.

Shapes: tokens [B]; activations [Bp, d], Bp = B rounded up to a multiple of 4 (the panel product's
smallest tile) with zero rows past B, which every operation keeps at zero; caches [L, B, Hkv, T, dh]
as stored (`cpu_decode.AS_STORED`); logits [Bp, 16 P] (the caller takes [:B, :V]).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import cpu_kernels

AVAILABLE = cpu_kernels.AVAILABLE
# how `decode_step` writes each cache: as is, by `cpu_kernels.store_rounded` (its codes), or quantised
STORES = {"fp32": 0, **cpu_kernels.ROUNDED_STORES, "int8": 4}

if AVAILABLE:
    import numba

    from .cpu_kernels._installed_builds import seed_from_install
    seed_from_install([Path(__file__).parent])  # this folder's builds, before the kernels below are defined
    from .cpu_kernels import (decode_attention, decode_attention_on_cores, panel_linear_on_cores, rms_norm,
                              rotate_in_place, store_as_is, store_int8, store_rounded, swiglu)

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def _product(x, panels, parts):
        """x [Bp, K] @ the panels [P, K, 16] -> a new [Bp, 16 P], on `parts` of numba's threads."""
        out = np.empty((x.shape[0], panels.shape[0] * 16), np.float32)
        panel_linear_on_cores(x, panels, out, parts)
        return out

    # No fastmath here: numba compiles a function first called from a fastmath one with fastmath too,
    # and keeps that compilation for every later caller, so `store_int8`'s division and rounding
    # (whose reference rounds twice) would move by one bit depending on what ran first (it did).
    # The kernels called below are fastmath themselves and stay so (numba adds the flag, never drops it).
    @numba.njit(nogil=True, cache=True)
    def decode_step(tokens, position, max_length, cos, sin, K_all, V_all, k_scales, v_scales, k_all, v_all, store,
                    panels, embed, attn_norms, mlp_norms, final_norm, eps, heads, scale, parts, attention_parts,
                    padded_rows):
        """One decode step of a Llama (`model.Llama.decode_layers`' arithmetic) -> logits [Bp, 16 P].

        Per step: tokens [B] int64; position (where the new K/V go); max_length (keys every row
        attends to, the new one included); cos, sin [1, 1, dh] (`CpuDecode._rope_rows`). Per cache:
        K_all, V_all [L, B, Hkv, T, dh] as stored; k_scales, v_scales: int8's [L, B, Hkv, T] (else
        [1, 1, 1, 1], unread); k_all, v_all [L]: fp8's per-layer scales (else ones); store:
        `STORES`' code. Per model: panels, the 17 products' (per layer wqkv, wo, w_gate_up, w_down,
        then the head); embed [V, d]; attn_norms, mlp_norms: per layer [d]; final_norm [d]; eps;
        heads = (H, Hkv); scale = 1/sqrt(dh); parts, attention_parts: threads for the products and
        for attention (1: this thread); padded_rows = Bp."""
        B, (H, Hkv) = tokens.shape[0], heads
        d, dh = embed.shape[1], cos.shape[2]
        G = H // Hkv
        per_token = store == 4
        lengths = np.full(B, max_length, np.int32)
        x = np.zeros((padded_rows, d), np.float32)
        for b in range(B):
            x[b] = embed[tokens[b]]
        for i in range(len(attn_norms)):
            qkv = _product(rms_norm(x, attn_norms[i], eps), panels[4 * i], parts).reshape((padded_rows, -1, dh))
            rotate_in_place(qkv[:B, :H + Hkv], cos, sin)  # RoPE on q and k at once
            k, v = qkv[:B, H:H + Hkv], qkv[:B, H + Hkv:H + 2 * Hkv]  # [B, Hkv, dh] each
            if store == 0:
                store_as_is(k, K_all[i], position)
                store_as_is(v, V_all[i], position)
            elif store == 4:
                store_int8(k, K_all[i], k_scales[i], position)
                store_int8(v, V_all[i], v_scales[i], position)
            else:  # fp8's inverse scales as the reference's scale.reciprocal(): one IEEE division
                store_rounded(k, K_all[i], position, store, np.float32(1) / k_all[i])
                store_rounded(v, V_all[i], position, store, np.float32(1) / v_all[i])
            q = np.empty((B, Hkv, G, dh), np.float32)  # pre-scaled, the G queries of a kv head together
            for b in range(B):
                for h in range(H):
                    for j in range(dh):
                        q[b, h // G, h % G, j] = qkv[b, h, j] * scale
            o = np.empty_like(q)
            layer = i if per_token else 0
            if attention_parts == 1:
                decode_attention(q, K_all[i], V_all[i], per_token, k_scales[layer], v_scales[layer], k_all[i],
                                 v_all[i], lengths, o, 0, B * Hkv)
            else:
                decode_attention_on_cores(q, K_all[i], V_all[i], per_token, k_scales[layer], v_scales[layer],
                                          k_all[i], v_all[i], lengths, o, attention_parts)
            attended = np.zeros((padded_rows, H * dh), np.float32)
            attended[:B] = o.reshape((B, H * dh))
            x += _product(attended, panels[4 * i + 1], parts)
            gated = swiglu(_product(rms_norm(x, mlp_norms[i], eps), panels[4 * i + 2], parts))
            x += _product(gated, panels[4 * i + 3], parts)
        return _product(rms_norm(x, final_norm, eps), panels[4 * len(attn_norms)], parts)


_POOL_STARTED_IN = [None]  # the process (pid) in which `run_step` has started numba's pool


def run_step(*args):
    """`decode_step(*args)`, numba's thread pool started first: `decode_step` is not a parallel
    function itself (the products and attention it calls are), and a process that loads it from
    numba's cache before any parallel function has run would call into a pool that does not exist
    (a segmentation fault, numba 0.68). `numba.get_num_threads` starts the pool if it is not; asked
    once per process (a forked child asks again), not every step: after a step it took ~9 us."""
    if _POOL_STARTED_IN[0] != os.getpid():
        numba.get_num_threads()
        _POOL_STARTED_IN[0] = os.getpid()
    return decode_step(*args)


if AVAILABLE:  # a cached build of `decode_step` holds the kernels compiled in: dropped when they change
    cpu_kernels.keep_builds_current(globals())
