"""The elementwise math of a Llama layer in torch: RMSNorm, rotary embeddings (RoPE), SwiGLU.

What the model and the CPU ops call between the products (`model`, `ops.TorchOps`); the lab's
Triton path fuses some of it (kernels/add_rms_norm.py, kernels/rope_store.py) and checks itself
against these. The CPU decode step has its own numpy and numba forms (`cpu_decode`,
`cpu_kernels.elementwise`), tested against these too.

Shapes: x [..., d]; q/k/v heads [B, T, heads, dh]; cos, sin from `rope_angles`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    """x / rms(x) * weight, computed in fp32 (as Llama does) and cast back. In fp32, and on a GPU
    in any dtype the weight shares, this is torch's rms_norm: one op instead of six, which counts
    in a decode step of ~100 ops (on CUDA one fused kernel that accumulates in fp32 and casts
    once, after the weight, as the formula below). In the 8B's decode step on an H200 the
    profile's twenty busiest kernels went from 1,331 launches a step to 784 with it (and one split-K
    change; data/recordings/gpu-tune-h200-20261204-1742.json and -1751.json). The Triton path
    has since folded the residual add before each norm into one kernel with it
    (kernels/add_rms_norm.py); this stays TorchOps' norm and the one that kernel is tested against."""
    if weight.dtype == x.dtype and (x.dtype == torch.float32 or x.is_cuda):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_inverse_frequencies(head_dim, theta, device="cpu"):
    """theta ** (-2i / dh) for i < dh/2, fp32 [dh/2]: the rotation speed of each pair of dims."""
    return theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rope_angles(positions, inv_freq):
    """(cos, sin) of the rotary angles, once per forward pass and shared by every layer.

    positions [T] or [B, T] (absolute, int), inv_freq [dh/2] from `rope_inverse_frequencies` ->
    cos, sin [T, 1, 2, dh/2] or [B, T, 1, 2, dh/2] in fp32, laid out for `apply_rope` on
    x [B, T, heads, dh] viewed as [B, T, heads, 2, dh/2]: cos is (cos, cos) and sin is
    (-sin, +sin) over the two halves."""
    angles = positions.float()[..., None] * inv_freq  # [T, dh/2] or [B, T, dh/2]
    cos, sin = angles.cos()[..., None, None, :], angles.sin()[..., None, None, :]  # [.., T, 1, 1, dh/2]
    return torch.cat((cos, cos), dim=-2), torch.cat((-sin, sin), dim=-2)


def apply_rope(x, cos, sin):
    """Rotary embedding, Hugging Face Llama layout (pairs are (i, i + dh/2)), in fp32:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), i.e. x * (cos, cos) + swap(x) * (-sin, sin)
    with swap(x1, x2) = (x2, x1): three ops for q and k of every head at once.

    x [B, T, heads, dh]; cos, sin from `rope_angles`. Returns a new [B, T, heads, dh] tensor."""
    B, T, n, dh = x.shape
    halves = x.float().reshape(B, T, n, 2, dh // 2)
    out = halves * cos
    # out += swap(x) * sin, a half at a time from views of x: no flipped copy of x (prefill: ~1 ms
    # of a P = 4,096 prefill on a 2-core CPU); the same products and sums, so the same bits
    out[..., 0, :].addcmul_(halves[..., 1, :], sin[..., 0, :])
    out[..., 1, :].addcmul_(halves[..., 0, :], sin[..., 1, :])
    return out.view(B, T, n, dh).to(x.dtype)


def swiglu(gate, up):
    """SwiGLU's gating, silu(gate) * up: gate, up [..., ffn] -> [..., ffn] (the product into silu's
    own output: one tensor of the prefill's largest, P x ffn, fewer to write)."""
    return F.silu(gate).mul_(up)


def rotate_qkv(qkv, n_heads: int, n_kv_heads: int, rope):
    """qkv [B, T, (H + 2 Hkv) dh], the fused projection's output -> q [B, H, T, dh] and k, v
    [B, Hkv, T, dh] (views), with RoPE applied to q and k together (one `apply_rope`)."""
    B, T, width = qkv.shape
    heads = qkv.view(B, T, n_heads + 2 * n_kv_heads, width // (n_heads + 2 * n_kv_heads))
    qk = apply_rope(heads[:, :, :n_heads + n_kv_heads], *rope)  # [B, T, H + Hkv, dh]
    q, k = qk.transpose(1, 2).split([n_heads, n_kv_heads], dim=1)
    return q, k, heads[:, :, n_heads + n_kv_heads:].transpose(1, 2)
