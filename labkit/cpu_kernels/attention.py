"""Decode attention over a cache read as stored, one (row, kv head) unit at a time, with its
float64 numpy reference.

Pseudocode, one (row b, kv head h) unit per task, G = H / Hkv queries per unit:
    n = lengths[b]                                   # keys this row sees, the new one included
    s[g, t] = (q[g] . widen(K[t])) * k_scale[t]      # t < n; q pre-scaled by 1/sqrt(dh)
    p[g, t] = exp(s[g, t] - max_t s[g]) * v_scale[t] # int8: per token; fp8: one per layer, below
    out[g]  = sum_t p[g, t] widen(V[t]) / sum_t exp(s[g, t] - max_t s[g])

What you learn here: each key and value is widened once (`attention_blocks.widen`) and feeds all G
queries from a register, K and V are each read once, and the rows PREFETCH_BYTES_AHEAD ahead are
asked for as it goes. For G = 2 the passes run as the vector blocks of `attention_blocks`, and an
int8 cache on AVX512-VNNI in integers (`attention_int8`).

Shapes: q, out [B, Hkv, G, dh]; K, V [B, Hkv, S_max, dh] as stored; int8 scales [B, Hkv, S_max];
lengths [B].
"""
from __future__ import annotations

import numpy as np

from ._jit import AVAILABLE, keep_builds_current
from .attention_blocks import widen_reference


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


if AVAILABLE:
    import numba

    from ._jit import exp_nonpositive
    from .attention_blocks import (VECTOR_HEAD_DIMS, keys_ahead, pair_numerators, pair_scores_8_16, pair_scores_8_64,
                                   pair_values_16, pair_values_64, prefetch_row, scaled_scores_8_16, scaled_scores_8_64,
                                   widen, widen_unit)
    from .attention_int8 import attended_in_integers

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

    @numba.njit(inline="always")
    def _pair_scores_8(q0, q1, k, t, per_token, k_scale, s0, s1, tops):
        """The K pass's vector block for this head size (one of `VECTOR_HEAD_DIMS`), scaled where
        `per_token`."""
        if per_token:
            if k.shape[1] == 64:
                scaled_scores_8_64(q0, q1, k, t, k_scale, s0, s1, tops)
            else:
                scaled_scores_8_16(q0, q1, k, t, k_scale, s0, s1, tops)
        elif k.shape[1] == 64:
            pair_scores_8_64(q0, q1, k, t, k_scale, s0, s1, tops)
        else:
            pair_scores_8_16(q0, q1, k, t, k_scale, s0, s1, tops)

    @numba.njit(inline="always")
    def _pair_values_dh(v, first, stop, p0, p1, o0, o1):
        """The V pass as vector code for this head size (one of `VECTOR_HEAD_DIMS`)."""
        if v.shape[1] == 64:
            pair_values_64(v, first, stop, p0, p1, o0, o1)
        else:
            pair_values_16(v, first, stop, p0, p1, o0, o1)

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
                    prefetch_row(k, min(t + ahead + distance, n - 1))
                _pair_scores_8(q0, q1, k, t, per_token, k_scale, s0, s1, tops)
                t += 8
            for j in range(8):
                top0, top1 = max(top0, tops[j]), max(top1, tops[8 + j])
        while t + 4 <= n:
            for ahead in range(4):
                prefetch_row(k, min(t + ahead + distance, n - 1))
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
                prefetch_row(v, min(t + ahead + distance, n - 1))
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
        if attended_in_integers(q, k, v, k_scale, v_scale, k_scale_all, v_scale_all, n, out):
            return
        s0, s1 = np.empty(n, np.float32), np.empty(n, np.float32)
        top0, top1 = _pair_scores(q[0], q[1], k, n, per_token, k_scale, s0, s1)  # int8: each key's scale in
        total0, total1 = pair_numerators(s0, s1, n, k_scale_all, top0, top1)
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
            prefetch_row(k, min(t + distance, n - 1))
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
            prefetch_row(v, min(t + distance, n - 1))
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

    keep_builds_current(globals())
