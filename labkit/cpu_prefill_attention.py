"""Causal prefill attention on an AMD CPU, as blocks of queries through oneDNN's linear.

Why it exists: torch's SDPA on the CPU multiplies its fp32 tiles with torch's BLAS, MKL, which on
an AMD CPU runs its AVX2 kernels at half the cores' rate (`calibrate.CPU_FP32_PATHS`). oneDNN's
linear, also in torch, runs AVX-512 there. So on an AMD CPU (`ops.onednn_for_many_rows`) a prefill
attends a block of `BLOCK_QUERIES` queries at a time: the scores of the block's queries (every
query head of one KV head stacked) against the keys they can see, one oneDNN product; the causal
mask on the block's own diagonal only, as a -inf bias (the keys before it are all visible, the
keys after it are never read); torch's softmax, in place; one oneDNN product with V. The same
arithmetic as SDPA's, in the order a plain softmax takes (SDPA's online softmax rounds
differently: ~5e-7 apart, tested against `sdpa_prefill_attention`, the CPU path's prefill
attention everywhere else).

Measured on a 2-core AMD EPYC VM (Zen 5, cpu family 26), lab-cpu's shapes (4 heads, 2 KV heads,
dh = 64, q, k and v strided as the model passes them), one layer, fastest of 3 in each of 5
interleaved rounds, medians: blocks of 128 queries took 3.8 ms at P = 1,024 against SDPA's 4.8,
and 38.4 (36.7-39.7) at P = 4,096 against 57.3. Blocks of 256 then measured 66 ms at P = 4,096:
each block's scores and weights (8 MiB each at 256 queries) were fresh memory faulted in page by
page. With freed memory kept for reuse (`cpu_memory`), the same rounds: blocks of 32 / 64 / 128 /
256 / 512 / 1,024 queries 5.84 / 4.08 / 3.50-3.57 / 3.21-3.25 / 3.89 / 5.54 ms at P = 1,024 and
57.5 / 44.5 / 37.5-39.5 / 36.3-38.2 / 39.8 / 65.1 at P = 4,096. Each block's per-call work made once
a call (the scaled queries' layout, the mask): 38.4 against 40.0 ms at P = 4,096.

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
    linear = torch.ops.mkldnn._linear_pointwise
    # Made once a call, as each block's Python and small torch calls (~10-30 us each) are a large
    # part of a short prefill's attention: the queries scaled (there, not on the scores: group x dh
    # values a query, not seen) and laid out [B, Hkv, P, group, dh], so a block's rows (query,
    # head) are one contiguous run; the causal mask, query i seeing keys up to its own.
    queries = torch.empty(B, Hkv, P, group, dh, dtype=q.dtype)
    torch.mul(q.reshape(B, Hkv, group, P, dh).permute(0, 1, 3, 2, 4), dh ** -0.5, out=queries)
    out = torch.empty_like(queries)
    # The causal mask as a bias, 0 where a query sees the key and -inf where it must not, added to
    # the diagonal's scores: x + 0 is x exactly and x - inf is -inf, as masked_fill would set, at an
    # eighth of its time (11 against 85 us for a block of 256 queries, 2 heads, on the EPYC VM:
    # masked_fill's broadcast mask took its slow path).
    above = torch.zeros(block, 1, block).masked_fill_(
        torch.ones(block, block, dtype=torch.bool).triu_(1)[:, None, :], float("-inf"))  # [query, head (broadcast), key]
    for b in range(B):
        for h in range(Hkv):
            # [S, dh], rows adjacent: the model's k and v are views with other strides, which
            # oneDNN multiplied by a slow generic path (a P = 1,024 layer took seconds)
            keys, values = k[b, h].contiguous(), v[b, h].contiguous()
            for first in range(0, P, block):
                stop = min(P, first + block)
                rows, seen = stop - first, offset + stop  # queries in the block; keys they can see
                scores = linear(queries[b, h, first:stop].view(rows * group, dh), keys[:seen], None, "none", [], "")
                scores = scores.view(rows, group, seen)
                scores[:, :, offset + first:seen].add_(above[:rows, :, :rows])
                # in place: the weights take the scores' memory (8 MiB at 256 queries, 4,096 keys)
                weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores).view(rows * group, seen)
                # values[:seen].t() is a [dh, seen] view: oneDNN's linear takes it as the weight
                out[b, h, first:stop] = linear(weights, values[:seen].t(), None, "none", [], "").view(rows, group, dh)
    return out.permute(0, 1, 3, 2, 4).reshape(B, H, P, dh)  # [B, Hkv, group, P, dh] is [B, H, P, dh]


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
