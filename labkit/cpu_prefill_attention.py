"""Causal prefill attention on an AMD CPU, as blocks of queries through oneDNN's linear.

Why it exists: torch's SDPA on the CPU multiplies its fp32 tiles with torch's BLAS, MKL, which on
an AMD CPU runs its AVX2 kernels at half the cores' rate (`calibrate.CPU_FP32_PATHS`). oneDNN's
linear, also in torch, runs AVX-512 there. So on an AMD CPU (`ops.onednn_for_many_rows`) a prefill
attends a block of `BLOCK_QUERIES` queries at a time: the scores of the block's queries (every
query head of one KV head stacked) against the keys they can see, one oneDNN product; the causal
mask on the block's own diagonal only (the keys before it are all visible, the keys after it are
never read); torch's softmax; one oneDNN product with V. The same arithmetic as SDPA's, in the
order a plain softmax takes (SDPA's online softmax rounds differently: ~5e-7 apart, tested
against `sdpa_prefill_attention`, the CPU path's prefill attention everywhere else).

Measured on a 2-core AMD EPYC VM (Zen 5, cpu family 26), lab-cpu's shapes (4 heads, 2 KV heads,
dh = 64), one layer, fastest of 5: P = 1,024 3.4 ms against SDPA's 4.7-5.0, P = 2,048 10.5-11.1
against 15.5-16.2, P = 4,096 37.4-39.9 against 58.0-58.7 (blocks of 256 queries; 96: 43.7, 512:
70.9, 1,024: 101.7 at P = 4,096, where each block's scores no longer stay in the caches).

Shapes: q [B, H, P, dh], the last P of S positions; k, v [B, Hkv, S, dh]; out [B, H, P, dh] fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_QUERIES = 256


def blocked_prefill_attention(q, k, v, block: int = BLOCK_QUERIES):
    """Causal attention of q (query i at position S - P + i) over k, v -> [B, H, P, dh], by blocks
    of `block` queries; each of a KV head's H / Hkv query heads reads that head's keys (GQA)."""
    B, H, P, dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group, offset = H // Hkv, S - P
    out = torch.empty_like(q)
    linear = torch.ops.mkldnn._linear_pointwise
    for b in range(B):
        for h in range(Hkv):
            # [S, dh], rows adjacent: the model's k and v are views with other strides, which
            # oneDNN multiplied by a slow generic path (a P = 1,024 layer took seconds)
            keys, values = k[b, h].contiguous(), v[b, h].contiguous()
            for first in range(0, P, block):
                stop = min(P, first + block)
                rows, seen = stop - first, offset + stop  # queries in the block; keys they can see
                queries = q[b, h * group:(h + 1) * group, first:stop].reshape(group * rows, dh)
                scores = linear(queries, keys[:seen], None, "none", [], "").view(group, rows, seen)
                above = torch.ones(rows, rows, dtype=torch.bool).triu_(1)  # query i sees keys up to its own
                scores[:, :, offset + first:seen].masked_fill_(above, float("-inf"))
                weights = torch.softmax(scores.mul_(dh ** -0.5), dim=-1).view(group * rows, seen)
                # values[:seen].t() is a [dh, seen] view: oneDNN's linear takes it as the weight
                attended = linear(weights, values[:seen].t(), None, "none", [], "")  # [group * rows, dh]
                out[b, h * group:(h + 1) * group, first:stop] = attended.view(group, rows, dh)
    return out


def sdpa_prefill_attention(q, k, v):
    """The same attention by torch's SDPA: the CPU path's prefill attention elsewhere, and
    `blocked_prefill_attention`'s reference. q [B, H, P, dh], the last P of S positions; k, v
    [B, Hkv, S, dh]."""
    P, S = q.shape[2], k.shape[2]
    if P == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # Chunked prefill: query i sits at position S - P + i. SDPA's is_causal aligns top-left.
    visible = torch.arange(S, device=q.device)[None, :] <= torch.arange(S - P, S, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
