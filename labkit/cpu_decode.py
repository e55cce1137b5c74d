"""The CPU decode step in numpy: the same layers as `model.Llama.decode_layers`, with fewer, cheaper calls.

Why it exists: a decode step of the lab's CPU model is 17 small matrix-vector products and ~200
elementwise operations on vectors of a few hundred numbers, and each torch call costs far more
in dispatch and OpenMP wake-ups than a numpy call on the same arrays, so at small batches the
fixed cost of torch's calls is a large part of the step (at large batches the products dominate
and the two steps take the same time).

Nothing is copied: the weights are numpy views of the model's tensors. An fp32 cache at equal
lengths is written and read here through numpy views of its own buffers; over a large cache
every core attends for a share of the (row, kv head) pairs, each with BLAS's gemv (see
`_attend`). A compact cache or mixed lengths go through `KVCache.update` (which quantises) and
the model's torch attention, on views of the same arrays. `tests/test_model.py` holds this step
to the torch step for every cache dtype and each of these branches.

Shapes: tokens [B]; x [B, d]; qkv [B, H + 2 Hkv, dh]; K, V [B, Hkv, S, dh]; logits [B, V] fp32.
"""
from __future__ import annotations

import numpy as np
import torch

from .cpu_blas import CORES, blas_matmul, on_every_core

ATTENTION_SPLIT_MIN_BYTES = 2 << 20  # K+V a step reads in one layer from which every core attends


def applies(model) -> tuple[bool, str]:
    """(use the numpy step?, why): only for fp32 on the CPU with the torch ops (numpy has no
    bf16, and the Triton path is what the CUDA model and the interpreter tests run)."""
    if model.device.type != "cpu":
        return False, "not on the CPU"
    if model.compute_dtype != "fp32":
        return False, f"compute dtype {model.compute_dtype} (numpy has fp32 only)"
    if model.ops.name != "torch":
        return False, f"{model.ops.name} kernels asked for"
    return True, "CPU, fp32: numpy decode step"


class NumpyDecode:
    """A decode path (see `decode_paths`) for a CPU fp32 `Llama`: `step(tokens, cache, plan)`
    runs the layers as numpy calls on views of the model's weights (see the module docstring)."""

    name = "numpy"

    def __init__(self, model, reason: str = "CPU, fp32: numpy decode step"):
        self.model, self.reason = model, reason
        view = lambda w: w.detach().numpy()  # noqa: E731 — shares memory with the model's tensor
        # [in, out] views of the [out, in] weights: contiguous, as the CPU model stores them
        self.layers = [(view(L.attn_norm), view(L.wqkv).T, view(L.wo).T, view(L.mlp_norm),
                        view(L.w_gate_up).T, view(L.w_down).T) for L in model.layers]
        self.embed, self.norm = view(model.embed), view(model.norm)  # [V, d], [d]
        self.head = view(model.head_weight).T  # [d, V]
        # the torch step's own fp32 frequencies, so the angles match it bit for bit
        self.inv_freq = model.rope_inv_freq.numpy()  # [dh/2]

    def release(self):
        """Nothing to drop: the step holds no state tied to a cache."""

    def step(self, tokens, cache, plan) -> torch.Tensor:
        """tokens [B] -> logits [B, V] fp32, writing each row's K/V into `cache` as `plan` says
        (`KVCache.decode_plan`); the cache's lengths are the caller's to advance."""
        model, spec = self.model, self.model.spec
        positions, max_length, mixed = plan
        B, H, Hkv, dh = tokens.shape[0], spec.n_heads, spec.n_kv_heads, spec.head_dim
        at = cache.lengths.numpy() if mixed else np.array([positions])  # [B] or [1] new positions
        cos, sin = self._rope(at)  # [B or 1, 1, dh]
        # An fp32 cache at equal lengths: K/V written and read here, through numpy views of the
        # cache's own buffers [L, B, Hkv, T, dh]; otherwise the cache quantises and torch attends.
        here = not mixed and cache.cache_dtype == "fp32"
        if here:
            K_all, V_all = cache.k.numpy(), cache.v.numpy()
        else:
            attend = cache.lengths + 1  # [B] keys each query sees, the new one included
        x = self.embed[tokens.numpy()]  # [B, d]
        for i, (attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down) in enumerate(self.layers):
            qkv = blas_matmul(self._rms(x, attn_norm), wqkv).reshape(B, H + 2 * Hkv, dh)
            qk = self._rotate(qkv[:, :H + Hkv], cos, sin)  # [B, H + Hkv, dh], RoPE on q and k at once
            if here:
                K_all[i, :, :, positions], V_all[i, :, :, positions] = qk[:, H:], qkv[:, H + Hkv:]
                o = self._attention(qk[:, :H], K_all[i, :, :, :max_length], V_all[i, :, :, :max_length])
            else:
                k, v = torch.from_numpy(qk[:, H:, None]), torch.from_numpy(qkv[:, H + Hkv:, None])  # [B, Hkv, 1, dh]
                cache.update(i, k, v, positions)
                o = model.ops.decode_attention(torch.from_numpy(qk[:, :H]), cache, i, attend, max_length,
                                               mixed).numpy()
            x = x + blas_matmul(o.reshape(B, H * dh), wo)
            gate_up = blas_matmul(self._rms(x, mlp_norm), w_gate_up)  # [B, 2 ffn]
            gate, up = gate_up[:, :spec.intermediate_size], gate_up[:, spec.intermediate_size:]
            # silu(g) = g * sigmoid(g), with sigmoid through tanh: no overflow warning for large -g
            x = x + blas_matmul(gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up, w_down)
        return torch.from_numpy(blas_matmul(self._rms(x, self.norm), self.head))

    def _rms(self, x, weight):
        """x / rms(x) * weight over the last axis, fp32, as `model.rms_norm` (the sum of squares by
        a ufunc reduce: np.mean's Python wrapper cost more than the arithmetic at these sizes)."""
        mean_square = np.add.reduce(x * x, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])
        return x * (1.0 / np.sqrt(mean_square + np.float32(self.model.spec.norm_eps))) * weight

    def _rope(self, positions):
        """(cos, sin) [n, 1, dh] for positions [n], laid out as `model.rope_angles`: (cos, cos) and
        (-sin, +sin) over the two halves."""
        angles = positions.astype(np.float32)[:, None] * self.inv_freq  # [n, dh/2]
        cos, sin = np.cos(angles), np.sin(angles)
        return (np.concatenate((cos, cos), axis=-1)[:, None],
                np.concatenate((-sin, sin), axis=-1)[:, None])

    @staticmethod
    def _rotate(x, cos, sin):
        """Rotary embedding, Hugging Face layout: x * (cos, cos) + swap(x) * (-sin, sin), where
        swap exchanges the two halves of the head dimension. x [B, n, dh] -> a new array."""
        half = x.shape[-1] // 2
        return x * cos + np.concatenate((x[..., half:], x[..., :half]), axis=-1) * sin

    def _attention(self, q, K, V):
        """q [B, H, dh] over K, V [B, Hkv, S, dh] (views of an fp32 cache) -> [B, H, dh].

        The work is B * Hkv independent (row, kv head) units, each the G = H / Hkv queries that
        share one kv head. Over a large cache (a layer's K + V >= ATTENTION_SPLIT_MIN_BYTES) the
        units are shared out to every core: numpy loops over stacked products on one thread, and
        one thread reads memory at a fraction of what all cores can. Below it, one thread: the
        hand-off costs more."""
        B, H, dh = q.shape
        Hkv, S = K.shape[1], K.shape[2]
        n, G = B * Hkv, H // Hkv
        # [n, ...] views: rows and kv heads merge because a row's kv heads are adjacent in the cache
        qu, Ku, Vu = q.reshape(n, G, dh), K.reshape(n, S, dh), V.reshape(n, S, dh)
        out = np.empty_like(q)
        ou = out.reshape(n, G, dh)
        if K.nbytes + V.nbytes < ATTENTION_SPLIT_MIN_BYTES or CORES < 2 or n < 2:
            _attend(qu, Ku, Vu, ou)
            return out
        parts = min(n, CORES)
        units = [slice(n * p // parts, n * (p + 1) // parts) for p in range(parts)]
        on_every_core(lambda p: _attend(qu[units[p]], Ku[units[p]], Vu[units[p]], ou[units[p]]), parts)
        return out


def _attend(q, K, V, out):
    """out[:] = softmax(q K^T / sqrt(dh)) V for q, out [n, G, dh] and K, V [n, S, dh].

    Both products are written as matrix @ column, K [S, dh] @ q_g [dh, 1] and V^T [dh, S] @ p_g
    [S, 1], so numpy calls BLAS's gemv once per query head: gemv streams K and V at close to the
    read rate, where the [G, dh] @ [dh, S] gemm form spends its time packing the tiny operand.
    The G heads of a kv head read it back-to-back, the second from cache."""
    dh = q.shape[-1]
    scores = np.matmul(K[:, None], (q * np.float32(dh ** -0.5))[..., None])[..., 0]  # [n, G, S]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out[:] = np.matmul(V.transpose(0, 2, 1)[:, None], scores[..., None])[..., 0]  # [n, G, dh]
